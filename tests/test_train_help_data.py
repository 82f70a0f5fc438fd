"""hpcdl.train --help names every kind --data takes: HDF5, tar shards (a directory or a
{a..b} pattern) and image folders."""

from __future__ import annotations

from hpcdl.config import build_parser


def test_the_data_flags_help_names_tar_shards_and_the_pattern():
    (action,) = [a for a in build_parser()._actions if "--data" in a.option_strings]
    assert "HDF5" in action.help and "image folder" in action.help
    assert "tar shards" in action.help and "{000000..000099}" in action.help
    assert build_parser().format_help().count("tar shards") >= 1
