"""hpcdl.doctor's own flags: a bad value is one line and exit status 2, before anything runs;
batch slots that /dev/shm cannot hold are the error hpcdl.train would stop with (docs/doctor.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import mpi_env, one_line_error

from hpcdl.data.slots import SlotLayout, free_bytes, shm_dir


def doctor(*args: str) -> subprocess.CompletedProcess:
    env = {**mpi_env(), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "hpcdl.doctor", *args], capture_output=True,
                          text=True, env=env, timeout=120)  # fmt: skip


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--prefetch", "abc"], "--prefetch"),
        (["--prefetch", "0"], "--prefetch"),
        (["--sample-shape", "3,x"], "--sample-shape"),
        (["--sample-shape", "3,224"], "--sample-shape"),
        (["--sample-shape", "3,0,224"], "--sample-shape"),
        (["--workers", "-1"], "--workers"),
        (["--batch-size", "0"], "--batch-size"),
    ],
)
def test_a_bad_flag_value_is_one_line_and_exit_2(args, flag):
    line = one_line_error(doctor(*args))
    assert line.startswith(f"hpcdl.doctor: error: {flag} "), line


def test_slots_that_shared_memory_cannot_hold_are_an_error_as_in_training():
    slot = SlotLayout(1, 1024, (3, 224, 224)).slot_bytes
    assert 400 * slot > free_bytes(shm_dir())  # the case: 400 slots of 588 MiB
    done = doctor("--prefetch", "400", "--batch-size", "1024")
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stdout.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, done.stdout
    assert "MiB of shared memory" in errors[0] and "--prefetch" in errors[0], errors
