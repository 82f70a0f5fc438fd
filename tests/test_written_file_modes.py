"""Files hpcdl writes for the user (exported weights, checkpoints) get the mode a plain open()
would give them under the umask (0666 & ~umask), as report.png and the metrics file do, so that
colleagues in a shared project directory can read them; still published atomically. Files
hpcdl keeps for itself keep the mode their writer asks for (0600 unless told)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from export_checkpoints import export, hpcdl_ckpt, torch_ckpt

from hpcdl import checkpoint
from hpcdl.atomic import write_atomically, write_bytes_atomically

__all__ = ["hpcdl_ckpt", "torch_ckpt"]  # the fixtures
UMASK = 0o027  # neither 0600 (mkstemp's) nor 0644 (the common umask's): the umask must decide


@pytest.fixture
def umask() -> Iterator[int]:
    old = os.umask(UMASK)
    try:
        yield UMASK
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_mode_none_is_what_open_gives_under_the_umask(umask, tmp_path):
    write_atomically(tmp_path / "a.bin", lambda tmp: Path(tmp).write_bytes(b"x"), mode=None)
    with open(tmp_path / "plain.bin", "wb") as f:
        f.write(b"x")
    assert mode(tmp_path / "a.bin") == mode(tmp_path / "plain.bin") == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "plain.bin"]


def test_a_mode_asked_for_is_kept_whatever_the_umask(umask, tmp_path):
    write_bytes_atomically(tmp_path / "private", b"x")
    write_bytes_atomically(tmp_path / "shared", b"x", mode=0o644)
    assert mode(tmp_path / "private") == 0o600 and mode(tmp_path / "shared") == 0o644


@pytest.mark.parametrize("engine", ["hpcdl", "torch"])
@pytest.mark.parametrize("to", ["torch", "safetensors", "onnx"])
def test_an_export_follows_the_umask(umask, engine, to, request, tmp_path):
    if to == "onnx":
        pytest.importorskip("onnx")
    out = tmp_path / f"m.{to}"
    done = export(request.getfixturevalue(f"{engine}_ckpt"), "--to", to, out)  # inherits umask
    assert done.returncode == 0, done.stderr
    assert mode(out) == 0o640


def test_a_checkpoint_follows_the_umask(umask, hpcdl_ckpt, tmp_path):
    ckpt = checkpoint.load(hpcdl_ckpt)
    written = checkpoint.save(tmp_path / "ck", ckpt)
    assert mode(written) == 0o640 and checkpoint.load(written).global_step == ckpt.global_step
    assert [p.name for p in (tmp_path / "ck").iterdir()] == [written.name]
