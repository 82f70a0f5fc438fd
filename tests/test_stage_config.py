"""`python -m hpcdl.stage --config job.toml`: the TOML values are checked as hpcdl.train checks
them (hpcdl.config), each wrong one a line naming the key and the file, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import make_tree, stage_cli


@pytest.mark.parametrize(
    "line,says",
    [
        ('data = ["a.tar", "b.tar"]', "--data (CONFIG) must be a string, got ['a.tar', 'b.tar']"),
        ("stage_dir = 5", "--stage-dir (CONFIG) must be a string, got 5"),
        ('batch_size = "x"', "--batch-size (CONFIG) must be an integer, got 'x'"),
        ("epochs = 2.5", "--epochs (CONFIG) must be an integer, got 2.5"),
        ('stage_verify = "yes"', "--stage-verify (CONFIG) must be true or false, got 'yes'"),
        ('pfs_bandwidth = "fast"', "--pfs-bandwidth (CONFIG) must be a number, got 'fast'"),
        ("write_plans = 3", "--write-plans (CONFIG) must be a string, got 3"),
    ],
)
@pytest.mark.parametrize("mode", ["--dry-run", "--quiet"])  # --quiet: a stage-only run
def test_a_value_of_the_wrong_type_is_one_line_naming_the_key(tmp_path, line, says, mode):
    ds = make_tree(tmp_path / "data", 4, 100)
    config = tmp_path / "job.toml"
    data = "" if line.startswith("data ") else f'data = "{ds.root}"\n'
    config.write_text(f"{data}files_only = true\n{line}\n")
    out = stage_cli(mode, "--config", config, "--stage-dir", tmp_path / "stage")
    assert out.returncode == 2, out.stderr
    assert out.stderr == f"hpcdl.stage: error: {says.replace('CONFIG', str(config))}\n"
    assert not (tmp_path / "stage").exists()


def test_the_stager_and_the_trainer_say_the_same_of_one_job_file(tmp_path):
    config = tmp_path / "list.toml"
    config.write_text('data = ["a.tar", "b.tar"]\n')
    stage = stage_cli("--dry-run", "--config", config)
    train = subprocess.run(
        [sys.executable, "-m", "hpcdl.train", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (stage.returncode, train.returncode) == (2, 2), (stage.stderr, train.stderr)
    said = stage.stderr.removeprefix("hpcdl.stage: error: ")
    assert said == train.stderr.removeprefix("hpcdl.train: error: ")
    assert said.startswith(f"--data ({config}) must be a string")


def test_the_training_job_file_still_serves_with_its_own_keys_and_dashes(tmp_path):
    ds = make_tree(tmp_path / "data", 12, 100)
    config = tmp_path / "job.toml"
    config.write_text(
        f'data = "{ds.root}"\nfiles_only = true\nmodel = "mlp"\nlr = 0.1\n'
        "batch-size = 3\nnodes = 2\nstage_nice = 5\n"
    )
    out = stage_cli("--dry-run", "--config", config, "--epochs", 1, "--json")
    assert out.returncode == 0, out.stderr
    assert "staging plan: 2 nodes x 1 ranks (block placement), batch 3," in out.stdout
    nodes = json.loads(out.stdout.splitlines()[-1])["nodes"]
    assert sum(n["files"] for n in nodes) == 12  # 6 samples per rank, 2 steps of 3
