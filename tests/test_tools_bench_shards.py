"""`python -m tools.bench shards` (issue 62): it runs on a tiny data set and reports its ratios.

No timing is asserted: the figures are docs/PERFORMANCE.md's, from the full-size run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tools.bench import REPO, shards
from tools.bench.slowfs import unavailable

TINY = ["--synthetic", "16", "--shards", "2", "--jpeg-size", "48x32", "--batch-size", "4",
        "--workers", "1", "--json"]  # fmt: skip


def run_harness(tmp_path, *extra: str) -> dict:
    env = dict(os.environ, TMPDIR=str(tmp_path))
    cmd = [sys.executable, "-m", "tools.bench", "shards", *TINY, *extra]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_local_part_reports_images_per_s_of_both_layouts_in_alternated_rounds(tmp_path):
    out = run_harness(tmp_path, "--parts", "local", "--rounds", "2")
    assert out["data"]["images"] == 16 and out["data"]["shards"] == 2
    rates = out["local"]["images_per_s"]
    assert len(rates["folder"]) == len(rates["tar"]) == 2
    assert all(r > 0 for r in rates["folder"] + rates["tar"])
    assert len(out["local"]["tar_over_folder"]["values"]) == 2
    for peer in ("webloader", "wids"):  # webdataset's loaders: reported, or skipped without them
        if all(rates[peer]):
            assert len(out["local"][f"tar_over_{peer}"]["values"]) == 2


@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_the_slow_fs_parts_report_the_training_and_stage_only_ratios(tmp_path):
    out = run_harness(tmp_path, "--parts", "train,stage", "--rounds", "1", "--ranks", "1",
                      "--epochs", "2")  # fmt: skip
    train = out["train"]
    assert [len(train["runs"][k]) for k in ("folder", "tar")] == [1, 1]
    assert len(train["runs"]["tar"][0]["epoch_seconds"]) == 2
    assert train["tar_over_folder_total"]["min"] > 0
    assert train["tar_over_folder_epoch1"]["min"] > 0
    assert out["stage"]["cp_over_stage"]["min"] > 0


def test_bad_options_are_one_line_each(tmp_path, capsys):
    with pytest.raises(SystemExit):
        shards.parse_args(["--jpeg-size", "big"])
    with pytest.raises(SystemExit):
        shards.parse_args(["--dir", str(tmp_path / "missing")])
    assert "--dir" in capsys.readouterr().err
    assert not (tmp_path / "missing").exists()
