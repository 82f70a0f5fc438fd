"""The stager's ranges (--stage-threads 1..1024, a --stage-capacity its 64-bit integer holds, a
percentage up to 100%) are checked where hpcdl.train, hpcdl.stage and its dry run start, in one
line, exit 2, with nothing created. They passed before and failed late: the stager's usage text
and a run that read everything from the PFS (exit 0), a traceback with a stage dir left behind,
or a dry run that called 5000 threads fine while the real run stopped."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import mpi_env, one_line_error, stage_cli

from hpcdl.stage_flags import MAX_CAPACITY, MAX_THREADS, parse_capacity_flag, stage_threads_error
from hpcdl.staging.binary import find_stager_binary

THREADS_ERROR = f"--stage-threads must be 1..{MAX_THREADS} (the stager's copy threads), got"


def stager(tmp_path, *flags) -> subprocess.CompletedProcess:
    """hpcdl-stage with flags, in its mode that reads every option and then only removes a
    session's temporaries: a refused option exits 2, an accepted one 0."""
    (tmp_path / "sd" / ".hpcdl" / "sessions" / "s").mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [find_stager_binary(), "--stage-dir", tmp_path / "sd", "--session", "s", *map(str, flags),
         "--remove-temporaries"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_python_and_the_stager_agree_on_the_ranges(tmp_path):
    for threads in (1, MAX_THREADS, MAX_THREADS + 1, 0):
        python_takes = stage_threads_error(threads) is None
        assert (stager(tmp_path, "--threads", threads).returncode == 0) == python_takes, threads
    for nbytes in (0, MAX_CAPACITY, MAX_CAPACITY + 1):
        try:
            python_takes = parse_capacity_flag(str(nbytes)).nbytes == nbytes
        except ValueError:
            python_takes = False
        assert (stager(tmp_path, "--capacity", nbytes).returncode == 0) == python_takes, nbytes
    assert stage_threads_error(MAX_THREADS) is None
    assert stage_threads_error(MAX_THREADS + 1) is not None


def test_capacities_in_every_spelling():
    assert parse_capacity_flag("200G").nbytes == 200 * 2**30
    assert parse_capacity_flag("1.5TiB").nbytes == 3 * 2**39
    assert parse_capacity_flag(str(MAX_CAPACITY)).nbytes == MAX_CAPACITY  # exact, not a float's
    assert parse_capacity_flag("80%").resolve(1000) == 800
    assert parse_capacity_flag("100%").resolve(1000) == 1000
    for bad in ("150%", "99999999999999999999T", "lots", "16384P"):
        with pytest.raises(ValueError, match="--stage-capacity"):
            parse_capacity_flag(bad)


@pytest.mark.parametrize(
    "flags,error",
    [
        (("--stage-threads", "100000"), f"{THREADS_ERROR} 100000"),
        (("--stage-capacity", "99999999999999999999T"), "--stage-capacity 99999999999999999999T "
         f"is outside what the stager takes: 0 to {MAX_CAPACITY} bytes (16 EiB); give bytes such "
         "as 200G, or a percentage such as 80%"),
        (("--stage-capacity", "150%"), "--stage-capacity 150%: a percentage must be at most 100%"),
    ],
)  # fmt: skip
def test_training_refuses_them_before_anything_is_created(digits_dir, tmp_path, flags, error):
    stage = tmp_path / "sty"
    done = subprocess.run(
        [sys.executable, "-m", "hpcdl.train", "--data", digits_dir / "train", "--model", "mlp",
         "--epochs", "1", "--stage-dir", stage, *flags],
        capture_output=True, text=True, env=mpi_env(), timeout=120,
    )  # fmt: skip
    assert one_line_error(done) == f"hpcdl.train: error: {error}"
    assert not stage.exists()


@pytest.mark.parametrize("dry_run", [True, False])
@pytest.mark.parametrize(
    "flags,error",
    [
        (("--stage-threads", 5000), f"{THREADS_ERROR} 5000"),
        (("--stage-capacity", "150%"), "--stage-capacity 150%: a percentage must be at most 100%"),
    ],
)  # fmt: skip
def test_hpcdl_stage_and_its_dry_run_refuse_them_alike(digits_dir, tmp_path, flags, error, dry_run):
    stage = tmp_path / "sty"
    dry = ("--dry-run",) if dry_run else ()
    done = stage_cli(*dry, "--data", digits_dir / "train", "--stage-dir", stage, *flags)
    assert one_line_error(done) == f"hpcdl.stage: error: {error}"
    assert not stage.exists()


def test_hpcdl_stage_refuses_them_from_the_job_file(digits_dir, tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(f'data = "{digits_dir / "train"}"\nstage_dir = "sty"\nstage_threads = 5000\n')
    done = stage_cli("--config", job)
    assert one_line_error(done) == f"hpcdl.stage: error: {THREADS_ERROR} 5000"
    assert not (tmp_path / "sty").exists()
