"""`bench calibrate` on a data set of fewer files than its reader-thread sweep has steps (the
digits set is one HDF5 file; the default --threads 8 sweeps 1, 2, 4 and 8 threads): the sweep
stops at the thread count the files allow and says so, instead of a StatisticsError traceback
from the empty groups."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hpcdl.bench.calibrate_pfs import measure_pfs

REPO = Path(__file__).resolve().parents[1]


def files(root: Path, count: int) -> Path:
    root.mkdir()
    for i in range(count):
        (root / f"f{i}.bin").write_bytes(bytes(1000 + i))
    return root


def test_the_sweep_goes_only_as_far_as_the_files_reach(tmp_path):
    figures, rows = measure_pfs(files(tmp_path / "one", 1), max_threads=8, per_count=4)
    assert [(r["threads"], r["files"]) for r in rows] == [(1, 1)]
    assert figures.open_latency_s > 0 and figures.thread_bandwidth_Bps > 0
    _, rows = measure_pfs(files(tmp_path / "three", 3), max_threads=8, per_count=4)
    assert [r["threads"] for r in rows] == [1, 2, 4] and all(r["files"] == 1 for r in rows)


def test_calibrate_on_a_one_file_data_set_ends_without_a_traceback(tmp_path):
    data = tmp_path / "digits"
    subprocess.run([sys.executable, "-m", "hpcdl.data", "convert", "digits", str(data)],
                   check=True, capture_output=True, cwd=tmp_path)  # fmt: skip
    cmd = [sys.executable, "-m", "hpcdl.bench", "calibrate", "--model", "mlp",
           "--data", data / "train", "--stage-dir", tmp_path / "stage", "--steps", 5,
           "--repeats", 1, "--local-mb", 1, "--out", tmp_path / "cal.toml"]  # fmt: skip
    done = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert (tmp_path / "cal.toml").exists()
    assert "1 file" in done.stdout and "thread sweep" in done.stdout, done.stdout
