"""hpcdl.nn.pth on files that are not a whole PyTorch state dict: a truncated or damaged
torch.save file, an empty file, garbage and PyTorch's legacy format each get their own line
(PthError), and no record is read past its end."""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest

from hpcdl.nn.pth import PthError, read_pth, write_pth

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # what torch.save wrote first before PyTorch 1.6


@pytest.fixture
def whole(tmp_path) -> Path:
    path = tmp_path / "whole.pth"
    write_pth({"w": np.arange(4096, dtype=np.float32), "b": np.zeros(3, np.float32)}, path)
    return path


def test_a_truncated_file_is_said_to_be_truncated(whole, tmp_path):
    data = whole.read_bytes()
    cut = tmp_path / "trunc.pth"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(PthError, match="truncated") as caught:
        read_pth(cut)
    assert "1.6" not in str(caught.value)


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"", "an empty file"),
        (b"hello, this is not a model\n" * 10, "not a PyTorch file"),
        (b"\x80\x02legacy-looking pickle, no magic", "not a PyTorch file"),
    ],
)
def test_empty_files_and_garbage_are_not_called_an_old_format(tmp_path, content, said):
    path = tmp_path / "bad.pth"
    path.write_bytes(content)
    with pytest.raises(PthError, match=said) as caught:
        read_pth(path)
    assert "1.6" not in str(caught.value)


def test_only_the_legacy_pickle_magic_is_called_the_format_before_1_6(tmp_path):
    path = tmp_path / "old.pth"
    path.write_bytes(pickle.dumps(LEGACY_MAGIC, protocol=2)[:-1] + b"\x8a\x0a" + b"\0" * 32)
    with pytest.raises(PthError, match="PyTorch's format before 1.6"):
        read_pth(path)


def test_the_legacy_format_torch_writes_is_recognised(tmp_path):
    torch = pytest.importorskip("torch")
    path = tmp_path / "legacy.pth"
    torch.save({"w": torch.zeros(2)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(PthError, match="PyTorch's format before 1.6"):
        read_pth(path)


def test_a_damaged_record_is_one_line(whole, tmp_path):
    """A byte flipped inside a tensor's record: zip's checksum fails, said as damage."""
    data = bytearray(whole.read_bytes())
    with zipfile.ZipFile(whole) as z:
        info = z.getinfo("archive/data/0")
    data[info.header_offset + 30 + len(info.filename) + 100] ^= 0xFF  # inside the stored bytes
    damaged = tmp_path / "damaged.pth"
    damaged.write_bytes(bytes(data))
    with pytest.raises(PthError, match="damaged"):
        read_pth(damaged)


def test_a_record_shorter_than_its_tensor_is_refused(whole, tmp_path):
    """data/0 holds 16 bytes but the pickle asks for 4096 float32: refused, never read past."""
    short = tmp_path / "short.pth"
    with zipfile.ZipFile(whole) as src, zipfile.ZipFile(short, "w") as dst:
        for name in src.namelist():
            raw = src.read(name)
            dst.writestr(name, raw[:16] if name == "archive/data/0" else raw)
    with pytest.raises(PthError, match="needs 16384 bytes.*has 16: the file is truncated"):
        read_pth(short)
