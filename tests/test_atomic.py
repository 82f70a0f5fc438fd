"""hpcdl.atomic.write_atomically, the one atomic writer, and the six writers built on it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hpcdl.atomic import write_atomically, write_bytes_atomically
from hpcdl.clustermodel import calibration
from hpcdl.data.indexfile import FILE_MODE, write_index_file
from hpcdl.data.sampler import SamplerSpec
from hpcdl.nn.weights_io import write_new_file
from hpcdl.staging.plan import FileTreeDataset, plan_for_node, write_plan


def leftovers(directory: Path) -> list[str]:
    """Hidden files: a temporary file of any writer (`.<name>.<random>.tmp` here)."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_publishes_the_contents_with_the_mode_asked_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "out.bin"
    write_bytes_atomically(target, b"new", mode=0o640)
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    write_bytes_atomically(target, b"newer")  # replace=True: the old contents go
    assert target.read_bytes() == b"newer" and leftovers(tmp_path) == []


def test_an_error_while_writing_removes_the_temporary_and_keeps_the_old_file(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")

    def half_then_fail(tmp: str) -> None:
        Path(tmp).write_bytes(b"half")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        write_atomically(target, half_then_fail)
    assert target.read_bytes() == b"old" and leftovers(tmp_path) == []


def test_an_error_while_publishing_removes_the_temporary(tmp_path):
    target = tmp_path / "a-directory"
    target.mkdir()
    with pytest.raises(OSError):
        write_bytes_atomically(target, b"x")  # rename over a directory fails
    assert target.is_dir() and leftovers(tmp_path) == []


def test_never_replace_refuses_an_existing_file_and_removes_the_temporary(tmp_path):
    target = tmp_path / "model.pth"
    target.write_bytes(b"the user's")
    with pytest.raises(FileExistsError):
        write_bytes_atomically(target, b"ours", replace=False)
    assert target.read_bytes() == b"the user's" and leftovers(tmp_path) == []
    fresh = tmp_path / "fresh.pth"
    write_bytes_atomically(fresh, b"ours", replace=False)
    assert fresh.read_bytes() == b"ours" and fresh.stat().st_nlink == 1


def test_exported_weights_never_replace_a_file_that_appears_meanwhile(tmp_path):
    target = tmp_path / "w.safetensors"

    def someone_else_writes_first(tmp: str) -> None:
        Path(tmp).write_bytes(b"ours")
        target.write_bytes(b"theirs")  # appears after the existence check

    with pytest.raises(ValueError, match="exists; give a new file name"):
        write_new_file(target, someone_else_writes_first)
    assert target.read_bytes() == b"theirs" and leftovers(tmp_path) == []


def test_calibration_save_cleans_up_on_error(tmp_path):
    from hpcdl.clustermodel.calibration import (  # noqa: PLC0415
        Calibration,
        ComputeFigures,
        LocalFigures,
        NetworkFigures,
        PfsFigures,
    )

    cal = Calibration(
        pfs=PfsFigures(open_latency_s=0.01, thread_bandwidth_Bps=1e8),
        local=LocalFigures(write_bandwidth_Bps=1e9),
        network=NetworkFigures(1e-5, 1e-9, 1e-4, 1e-8, "hierarchical"),
        compute=ComputeFigures(
            "mlp", 8, v0=800.0, t=0.01, backward_fraction=0.5, gradient_bytes=4_000_000
        ),  # fmt: skip
    )
    good = tmp_path / "c.toml"
    calibration.save(good, cal)
    assert calibration.load(good) == cal and stat.S_IMODE(good.stat().st_mode) == 0o644
    blocked = tmp_path / "blocked.toml"
    blocked.mkdir()
    with pytest.raises(OSError):
        calibration.save(blocked, cal)
    assert leftovers(tmp_path) == []


def test_index_file_write_fails_softly_and_leaves_nothing(tmp_path):
    blocked = tmp_path / "index"
    blocked.mkdir()
    assert write_index_file(blocked, b"HPCDLIX3") is False
    assert leftovers(tmp_path) == []
    good = tmp_path / "cache" / "index"
    assert write_index_file(good, b"HPCDLIX3") is True
    assert stat.S_IMODE(good.stat().st_mode) == FILE_MODE and leftovers(good.parent) == []


def test_plan_is_written_0600_without_leftovers(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(4):
        (data / f"f{i}").write_bytes(bytes(10 + i))
    ds = FileTreeDataset(data)
    spec = SamplerSpec(num_samples=len(ds), world_size=1, seed=0, shuffle="global")
    plan = plan_for_node(ds, spec, batch_size=2, epochs=(0, 1), ranks=(0,))
    old = os.umask(0)
    try:
        write_plan(tmp_path / "plan", plan, ds)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "plan").stat().st_mode) == 0o600
    assert (tmp_path / "plan").read_text().startswith("hpcdl-plan ")
    assert leftovers(tmp_path) == []
