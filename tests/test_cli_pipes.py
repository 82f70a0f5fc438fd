"""A user-facing CLI writing into a pipe whose reader has gone (`... | head -1`) ends quietly
with status 141, as a tool killed by SIGPIPE does, instead of a BrokenPipeError traceback.
(argparse's --help output already ends quietly on its own.)"""

import os
import subprocess
import sys

import pytest

# {digits}: the session's digits data set (conftest.digits_dir)
CLIS = {
    "nn summary": "hpcdl.nn summary mlp --input-shape 1,8,8 --num-classes 10",
    "data inspect": "hpcdl.data inspect {digits}/train",
    "stage --dry-run": "hpcdl.stage --data {digits}/train --dry-run",
    "jobs sites": "hpcdl.jobs sites",
    "doctor": "hpcdl.doctor",
}


@pytest.mark.parametrize("name", list(CLIS))
def test_a_closed_pipe_ends_the_cli_quietly(name, digits_dir):
    argv = CLIS[name].format(digits=digits_dir).split()
    read_end, write_end = os.pipe()
    os.close(read_end)  # closed before the program writes its first byte
    try:
        proc = subprocess.run(
            [sys.executable, "-m", *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    assert proc.returncode == 141, proc.stderr
