"""The data root is the user's (issue 29): runs, dry runs and stage-only runs leave it as it was.

The index cache goes to the user's cache directory unless --index-in-data-root asks for the
data root; an index someone already put there is read."""

import os
from pathlib import Path

from helpers import make_folder, mpi_env, read_events, run_train, stage_cli


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """(mtime_ns, mode) of the root and of everything under it, by relative path."""
    out = {".": (root.stat().st_mtime_ns, root.stat().st_mode)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = (p.lstat().st_mtime_ns, p.lstat().st_mode)
    return out


def stage(*args):
    return stage_cli(*args, env=mpi_env(), timeout=300)


def test_train_dry_run_and_stage_only_leave_the_data_root_as_it_was(tmp_path):
    data = tmp_path / "data"
    make_folder(data, per_class=4)
    before = snapshot(data)
    common = ("--data", data, "--batch-size", 2)
    dry = stage("--dry-run", *common)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert snapshot(data) == before
    only = stage(*common, "--stage-dir", tmp_path / "stage-only")
    assert only.returncode == 0, only.stderr[-3000:]
    assert snapshot(data) == before
    train = ("--model", "mlp", "--epochs", 1, "--workers", 1, "--quiet")
    proc = run_train(1, *common, *train, "--stage-dir", tmp_path / "stage")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert snapshot(data) == before


def test_index_in_data_root_writes_there_only_when_asked_and_an_existing_one_is_read(tmp_path):
    data = tmp_path / "data"
    make_folder(data, per_class=4)
    metrics = tmp_path / "m.jsonl"
    args = ("--data", data, "--model", "mlp", "--epochs", 1, "--batch-size", 2, "--quiet")
    args += ("--workers", 0, "--metrics", metrics)
    proc = run_train(1, *args, "--index-in-data-root")
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = [p.name for p in data.iterdir() if p.name.startswith(".hpcdl-index")]
    assert written == [".hpcdl-index"]
    assert (data / ".hpcdl-index").stat().st_mode & 0o777 == 0o444
    assert read_events(metrics, "index")[-1]["train"]["source"] == "built"
    before = snapshot(data)
    proc = run_train(1, *args)  # without the flag: the index found in the root is read
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_events(metrics, "index")[-1]["train"]["source"] == "cache"
    assert snapshot(data) == before
