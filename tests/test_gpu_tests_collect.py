"""The GPU tests collect where no stager was built: `pytest -m gpu tests` imports every test
module, and one that asked the stager for its status codes at import stopped the whole
collection (the H200 call of 2026-11-29 without a stager: "Interrupted: 2 errors during
collection"), so scripts/gpu-check.sh's GPU tests would not run at all where the stager's build
failed. HPCDL_STAGE_BIN naming no file stands in for a machine without one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_test_module_collects_without_a_stager(tmp_path):
    env = {**os.environ, "HPCDL_STAGE_BIN": str(tmp_path / "no-stager")}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
                           "-p", "no:cacheprovider", "tests"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "error" not in done.stdout.lower().splitlines()[-1], done.stdout[-3000:]
    assert "tests/test_gpu_path.py::" in done.stdout
