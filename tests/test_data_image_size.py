"""Images over Pillow's decompression-bomb limit (hpcdl.data.image_file, NOTE [image files]):
`convert` refuses them in one line naming the file and the pixel count, `inspect` counts them
as unreadable, the index takes them as images whose header cannot be read, so reading one is a
bad sample that --skip-bad-samples skips, and Pillow's warning never shows."""

from __future__ import annotations

import struct
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest

from hpcdl.data import Loader, open_dataset
from hpcdl.data.__main__ import main
from hpcdl.data.dataset import BadSample
from hpcdl.data.image_file import MAX_IMAGE_PIXELS


def png_header(width: int, height: int) -> bytes:
    """A PNG of width x height 8-bit grey pixels: its header only (Pillow opens it lazily)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


@pytest.fixture(params=[14000, 10000], ids=["over-twice-the-limit", "over-the-limit"])
def side(request) -> int:
    """Pillow refuses 14000 x 14000 (196 M pixels) and only warns at 10000 x 10000 (100 M)."""
    return request.param


@pytest.fixture
def folder(tmp_path, side) -> Path:
    from helpers import make_folder

    make_folder(tmp_path / "f3", per_class=6, size=(16, 16))
    (tmp_path / "f3" / "cat" / "huge.png").write_bytes(png_header(side, side))
    return tmp_path / "f3"


@pytest.mark.parametrize("resize", [[], ["--resize", "16"]])
def test_convert_refuses_the_image_in_one_line(folder, side, tmp_path, capsys, resize):
    assert main(["convert", "folder", str(folder), str(tmp_path / "o3"), *resize]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hpcdl.data: error: "), err
    assert f"huge.png: the image has {side * side} pixels" in err, err
    assert str(MAX_IMAGE_PIXELS) in err and "Warning" not in err, err
    assert not (tmp_path / "o3" / "train").exists()


def test_inspect_counts_it_as_unreadable(folder, capsys):
    assert main(["inspect", str(folder)]) == 0
    out, err = capsys.readouterr()
    assert "unreadable:   1 image(s)" in out and "cat/huge.png" in out, out
    assert "cat: 7, dog: 6" in out and "(3, 16, 16)" in out, out
    assert "Warning" not in err, err


def test_reading_it_is_a_bad_sample_naming_the_pixels(folder, side):
    ds = open_dataset(folder)
    huge = next(i for i in range(len(ds)) if ds.files.relpath(i) == "cat/huge.png")
    assert ds.heights[huge] == 0 and ds.sample_shape == (3, 16, 16)
    with pytest.raises(BadSample, match=f"huge.png cannot be read: the image has {side * side}"):
        ds.reader().decode(huge)
    with Loader(ds, batch_size=len(ds), workers=0, skip_bad_samples=True) as loader:
        [(images, _)] = list(loader.iterate([np.arange(len(ds))], 0, train=False))
        assert images.shape == (len(ds), 3, 16, 16) and loader.stats()["bad_samples"] == 1


def test_tar_and_encoded_shards_flag_it(folder, side, tmp_path, capsys):
    assert main(["convert", "folder", str(folder), str(tmp_path / "tar"), "--to", "tar"]) == 0
    with tarfile.open(tmp_path / "tar" / "shard-000000.tar") as tar:
        assert len(tar.getnames()) == 26
    assert main(["inspect", str(tmp_path / "tar")]) == 0
    assert "unreadable:   1 samples" in capsys.readouterr().out
    ds = open_dataset(tmp_path / "tar")
    with pytest.raises(BadSample, match=f"more than {MAX_IMAGE_PIXELS} pixels"):
        ds.reader().decode(int(np.flatnonzero(~ds.readable)[0]))
    assert main(["convert", "folder", str(folder), str(tmp_path / "enc"), "--encoded"]) == 0
    enc = open_dataset(tmp_path / "enc" / "train")
    with pytest.raises(BadSample, match=f"the image has {side * side} pixels"):
        enc.reader().decode(int(np.flatnonzero(enc.heights == 0)[0]))


def test_training_skips_it_with_skip_bad_samples(tmp_path):
    from helpers import make_folder, one_line_error

    make_folder(tmp_path / "f3", per_class=6, size=(16, 16))
    (tmp_path / "f3" / "cat" / "huge.png").write_bytes(png_header(14000, 14000))
    cmd = [sys.executable, "-m", "hpcdl.train", "--data", str(tmp_path / "f3"), "--model", "mlp"]
    cmd += ["--augment", "rcrop16", "--batch-size", "13", "--epochs", "1", "--workers", "0"]
    skip = ["--skip-bad-samples", "--checkpoint-dir", str(tmp_path / "ck")]
    done = subprocess.run([*cmd, *skip], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "Warning" not in done.stderr, done.stderr
    done = subprocess.run([*cmd, "--checkpoint-dir", str(tmp_path / "ck2")], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    line = one_line_error(done, None)
    assert "huge.png cannot be read: the image has 196000000 pixels" in line, line


class DecodesAnything:
    """A decoder that decodes every image it is given (as nvImageCodec may a huge PNG)."""

    name = "anything"

    def decode(self, blobs, stream=None):
        return [np.zeros((16, 16, 3), np.uint8) if len(b) else None for b in blobs]


def test_decode_gpu_takes_it_as_a_bad_sample_whatever_the_decoder(folder, side):
    from hpcdl.data.augment import parse_augment
    from hpcdl.data.file_bytes import FileBytesReader, byte_capacity
    from hpcdl.data.gpu_decode import GpuBatchDecoder

    ds = open_dataset(folder)
    indices = np.arange(len(ds))
    offsets = np.empty(len(ds) + 1, np.int64)
    data = np.empty(byte_capacity(ds, len(ds)), np.uint8)
    labels = np.empty(len(ds), np.int64)
    FileBytesReader(ds).read(indices, labels, offsets, data)
    aug = parse_augment("rcrop16")
    decoder = GpuBatchDecoder(ds, aug, 0, np, DecodesAnything())
    with pytest.raises(BadSample, match=f"huge.png cannot be read: .*{MAX_IMAGE_PIXELS} pixels"):
        decoder.build(indices, offsets, data, labels, 0)
    skipping = GpuBatchDecoder(ds, aug, 0, np, DecodesAnything(), skip_bad=True)
    images, _ = skipping.build(indices, offsets, data, labels, 0)
    assert images.shape == (len(ds), 3, 16, 16) and skipping.bad == 1
