"""Build hpcdl-stage once with ASan/UBSan and run its unit tests and a real staging run."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from test_staging_helpers import make_tree

from hpcdl.staging import StagingSession
from hpcdl.staging.status import StatusView

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake and a C++17 compiler")
def test_sanitizer_build_runs_clean(tmp_path, monkeypatch):
    build = tmp_path / "build"
    cfg = [
        "cmake",
        "-S",
        REPO,
        "-B",
        build,
        "-DHPCDL_SANITIZE=ON",
        "-DHPCDL_STAGE_TESTS=ON",
        "-DCMAKE_BUILD_TYPE=Debug",
    ]
    subprocess.run(cfg, check=True, capture_output=True, timeout=120)
    made = subprocess.run(
        ["cmake", "--build", build, "-j2"], capture_output=True, text=True, timeout=300
    )
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    assert "warning" not in made.stdout + made.stderr
    env = dict(
        os.environ,
        ASAN_OPTIONS="detect_leaks=1:abort_on_error=1",
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
    )
    unit = subprocess.run(
        [build / "hpcdl-stage-tests", tmp_path / "scratch"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unit.returncode == 0, unit.stdout + unit.stderr

    ds = make_tree(tmp_path / "pfs", 40, 2000)
    monkeypatch.setenv("HPCDL_STAGE_BIN", str(build / "hpcdl-stage"))
    monkeypatch.setenv("ASAN_OPTIONS", env["ASAN_OPTIONS"])
    args = dict(num_samples=40, world_size=1, seed=0, shuffle="global", ranks_per_node=1)
    session = StagingSession.start(
        None, ds, args, 4, (0, 3), tmp_path / "stage", 4, 30_000, False, True
    )
    status = StatusView(tmp_path / "stage" / ".hpcdl" / "status")
    for epoch in range(3):
        for step in range(10):
            session.consumed(epoch, step + 1)
            time.sleep(0.01)
    staged = status.field("files_staged")
    proc = session.proc
    session.close()
    assert proc.returncode == 0, "sanitized stager did not exit cleanly"
    assert staged > 14  # more than fits at once: files were evicted and others copied
