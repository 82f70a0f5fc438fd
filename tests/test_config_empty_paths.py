"""A path flag given as "" is an error, not "no path": `--stage-dir "$LOCAL_SCRATCH"` with the
variable unset ran without staging and exited 0 (metrics: "staging": null), `--val-data ""`
without validation. hpcdl.train and hpcdl.stage say so in one line, exit 2, on the command line
and in a job file alike."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import mpi_env, one_line_error, stage_cli

from hpcdl.config import PATH_KEYS, ConfigError, parse_args


def train(*flags, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcdl.train", "--model", "mlp", "--epochs", "1", *map(str, flags)],
        capture_output=True, text=True, env=mpi_env(), timeout=300, cwd=cwd,
    )  # fmt: skip


@pytest.mark.parametrize("flag", ["--stage-dir", "--val-data"])
def test_training_refuses_an_empty_path_flag(digits_dir, tmp_path, flag):
    done = train("--data", digits_dir / "train", flag, "", "--metrics", tmp_path / "m.jsonl")
    what = "a directory" if flag == "--stage-dir" else "the validation data's path"
    assert one_line_error(done) == (
        f"hpcdl.train: error: {flag} is empty (an unset variable?); give {what} or leave the "
        "flag out"
    )
    assert not (tmp_path / "m.jsonl").exists()


@pytest.mark.parametrize("key", [*PATH_KEYS, "config"])
def test_every_path_flag_given_empty_is_refused(key):
    flag = "--" + key.replace("_", "-")
    argv = ["--data", "x", flag, ""] if key != "data" else ["--data", ""]
    with pytest.raises(ConfigError, match=f"^{flag} is empty \\(an unset variable\\?\\); give "):
        parse_args(argv)


def test_an_empty_path_in_the_job_file_is_refused(digits_dir, tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(f'data = "{digits_dir / "train"}"\nstage_dir = ""\n')
    assert one_line_error(train("--config", job)) == (
        f"hpcdl.train: error: --stage-dir ({job}) is empty; give a directory or leave the key out"
    )


@pytest.mark.parametrize("dry_run", [True, False])
def test_hpcdl_stage_refuses_an_empty_stage_dir(digits_dir, tmp_path, dry_run):
    dry = ("--dry-run",) if dry_run else ()
    done = stage_cli(*dry, "--data", digits_dir / "train", "--stage-dir", "", cwd=tmp_path)
    assert one_line_error(done) == (
        "hpcdl.stage: error: --stage-dir is empty (an unset variable?); give a directory or "
        "leave the flag out"
    )
    assert list(tmp_path.iterdir()) == []


def test_hpcdl_stage_refuses_an_empty_path_in_the_job_file(digits_dir, tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(f'data = "{digits_dir / "train"}"\nstage_dir = "s"\nwrite_plans = ""\n')
    done = stage_cli("--dry-run", "--config", job)
    assert one_line_error(done) == (
        f"hpcdl.stage: error: --write-plans ({job}) is empty; give a directory or leave the key out"
    )
