"""A TOML config's values keep their TOML types: a number written as a string and one setting
given twice (dashed and underscored) are refused in one line, as docs/training.md promises for
wrong types (both were taken silently: "32" as 32, the later of the two keys)."""

from __future__ import annotations

import pytest

from hpcdl.config import ConfigError, parse_args


@pytest.mark.parametrize(
    ("line", "said"),
    [
        (
            'batch_size = "32"',
            "--batch-size (config file {path}) must be an integer, not the string '32'",
        ),
        ('lr = "0.1"', "--lr (config file {path}) must be a number, not the string '0.1'"),
        (
            'max-steps = "5"',
            "--max-steps (config file {path}) must be an integer, not the string '5'",
        ),
    ],
)
def test_a_number_written_as_a_string_is_refused(tmp_path, line, said):
    path = tmp_path / "job.toml"
    path.write_text(f'data = "d"\n{line}\n')
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", str(path)])
    assert str(err.value).startswith(said.format(path=path)), str(err.value)


def test_numbers_and_words_of_their_own_type_are_taken(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('data = "d"\nbatch_size = 32\nlr = 1\nprefetch = "4"\nstage-nice = 10\n')
    cfg = parse_args(["--config", str(path)])
    assert (cfg.batch_size, cfg.lr, cfg.prefetch, cfg.stage_nice) == (32, 1.0, "4", "10")


def test_one_setting_under_both_spellings_is_refused_naming_both(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('data = "d"\nbatch-size = 16\nbatch_size = 8\n')
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", str(path)])
    assert str(err.value) == (
        f"config file {path}: batch-size and batch_size are the same setting (--batch-size); "
        "keep one"
    )
