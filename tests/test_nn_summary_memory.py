"""`python -m hpcdl.nn summary` of an input whose activations cannot be allocated: one line saying
how many GiB they would need, exit status 2, not numpy's _ArrayMemoryError traceback."""

from __future__ import annotations

import subprocess
import sys

from helpers import one_line_error


def test_an_input_too_large_to_allocate_is_one_line_naming_the_gib():
    """11 TiB for the input sample alone: no machine allocates that, whatever its memory."""
    done = subprocess.run(
        [sys.executable, "-m", "hpcdl.nn", "summary", "resnet18", "--input-shape",
         "3,999999,999999", "--num-classes", "10"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    line = one_line_error(done)
    assert line.startswith("python -m hpcdl.nn summary: error: model 'resnet18': "), line
    assert "for input (3, 999999, 999999)" in line and "11175.8 GiB" in line, line
    assert "--input-shape" in line and done.stdout == "", line
