"""A conversion's output directory: an OUT that is a file, and an OUT (or OUT/train) that
already holds what a reader would take in with the new data, are one line and rc 2, with
nothing written; the directory of a conversion that was killed is removed by the next
conversion into OUT, once its process is gone (hpcdl.data.convert_output)."""

from __future__ import annotations

import pickle
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hpcdl.data import open_dataset
from hpcdl.data.__main__ import main
from hpcdl.data.convert_output import HOST_FILE


@pytest.fixture
def sources(tmp_path) -> dict[str, Path]:
    """One small source per converter: an image folder, CIFAR-10 batches, an .npz."""
    from helpers import make_folder

    rng = np.random.default_rng(0)
    make_folder(tmp_path / "imgs", per_class=4, fmt="jpg")
    cifar = tmp_path / "cifar"
    cifar.mkdir()
    for name in ("data_batch_1", "test_batch"):
        with open(cifar / name, "wb") as f:
            data = rng.integers(0, 256, (4, 3 * 32 * 32), dtype=np.uint8)
            pickle.dump({b"data": data, b"labels": [0, 1, 0, 1]}, f)
    images = rng.integers(0, 256, (6, 5, 4, 3), dtype=np.uint8)
    np.savez(tmp_path / "a.npz", images=images, labels=np.arange(6) % 2)
    return {"folder": tmp_path / "imgs", "cifar": cifar, "npz": tmp_path / "a.npz"}


CONVERTERS = [
    ("digits",),
    ("folder",),
    ("folder", "--encoded"),
    ("folder", "--to", "tar"),
    ("cifar",),
    ("npz",),
]


def convert_args(sources: dict[str, Path], kind_and_flags: tuple[str, ...], out: Path):
    kind, *flags = kind_and_flags
    src = [] if kind == "digits" else [str(sources[kind])]
    return ["convert", kind, *src, str(out), *flags]


def assert_one_error_line(capsys, *words: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith("hpcdl.data: error: ") and err.count("\n") == 1, err
    for word in words:
        assert word in err, err
    return err


@pytest.mark.parametrize("kind_and_flags", CONVERTERS, ids=" ".join)
def test_an_out_that_is_a_file_is_one_line_and_the_file_is_untouched(
    sources, tmp_path, capsys, kind_and_flags
):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for out in (afile, afile / "sub"):
        capsys.readouterr()
        assert main(convert_args(sources, kind_and_flags, out)) == 2
        assert_one_error_line(capsys, str(out))
        assert afile.is_file() and afile.read_text() == "mine"
    assert main(convert_args(sources, kind_and_flags, afile)) == 2
    assert "is a file, not a directory" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_out_where_nothing_can_be_written_is_one_line(capsys):
    """/proc: a directory that exists, can be listed, and takes no new directory."""
    assert main(["convert", "digits", "/proc"]) == 2
    assert_one_error_line(capsys, "/proc: cannot write the output there")


@pytest.mark.parametrize("other", ["other.tar", "OTHER.TAR", "other.tar.gz", "x.h5", "y.hdf5"])
def test_tar_output_into_a_directory_holding_other_shards_is_refused(
    sources, tmp_path, capsys, other
):
    """--data OUT would read the new shards and the other file together (or, for an HDF5
    file, read that file alone): the conversion names it and writes nothing."""
    out = tmp_path / "out"
    assert main(convert_args(sources, ("folder", "--to", "tar"), tmp_path / "first")) == 0
    out.mkdir()
    (out / other).write_bytes((tmp_path / "first" / "shard-000000.tar").read_bytes())
    before = sorted(out.iterdir())
    capsys.readouterr()
    assert main(convert_args(sources, ("folder", "--to", "tar"), out)) == 2
    assert_one_error_line(capsys, str(out), other, f"--data {out}")
    assert sorted(out.iterdir()) == before
    (out / other).unlink()
    (out / "notes.txt").write_text("kept")  # a file no reader takes is fine beside the shards
    assert main(convert_args(sources, ("folder", "--to", "tar"), out)) == 0
    assert len(open_dataset(out)) == 8 and (out / "notes.txt").read_text() == "kept"


@pytest.mark.parametrize("kind_and_flags", [("folder",), ("folder", "--encoded")], ids=" ".join)
def test_hdf5_output_into_a_split_directory_holding_a_file_names_it(
    sources, tmp_path, capsys, kind_and_flags
):
    """OUT/train is the data set HDF5 outputs are read from: anything in it is refused, by
    name; an HDF5 file beside OUT/train is not read with it and stays."""
    out = tmp_path / "out"
    (out / "train").mkdir(parents=True)
    (out / "train" / "other.h5").write_bytes(b"not mine to touch")
    assert main(convert_args(sources, kind_and_flags, out)) == 2
    assert_one_error_line(capsys, str(out / "train"), "other.h5")
    assert sorted(p.name for p in out.rglob("*")) == ["other.h5", "train"]
    (out / "train" / "other.h5").rename(out / "other.h5")
    assert main(convert_args(sources, kind_and_flags, out)) == 0
    assert len(open_dataset(out / "train")) == 8
    assert (out / "other.h5").read_bytes() == b"not mine to touch"


# A conversion that stops inside converted_into, after writing 1 MiB, until it is killed: the
# real code path of every converter, in its own process, so SIGKILL ends it at a known point.
_KILLED_DRIVER = """
import sys, time
from pathlib import Path
from hpcdl.data.convert_output import converted_into
with converted_into(Path(sys.argv[1]), ["train"]) as tmp:
    (tmp / "train").mkdir()
    (tmp / "train" / "part-00000.h5").write_bytes(bytes(1 << 20))
    print(tmp.name, flush=True)
    time.sleep(600)
"""


def converting(out: Path) -> tuple[subprocess.Popen, Path]:
    """A conversion into out stopped half way: (its process, its temporary directory)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_DRIVER, str(out)], stdout=subprocess.PIPE, text=True
    )
    name = proc.stdout.readline().strip()
    assert name == f".hpcdl-convert-{proc.pid}", name
    return proc, out / name


def killed(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    return proc.pid


@pytest.mark.parametrize("flags", [("--to", "tar"), ("--encoded",)], ids=" ".join)
def test_a_killed_conversions_directory_is_removed_by_the_next_one(
    sources, tmp_path, capsys, flags
):
    out = tmp_path / "out"
    proc, leftover = converting(out)
    pid = killed(proc)
    assert (leftover / "train" / "part-00000.h5").stat().st_size == 1 << 20  # left behind
    assert main(convert_args(sources, ("folder", *flags), out)) == 0
    err = capsys.readouterr().err
    assert not leftover.exists() and not list(out.glob(".hpcdl-convert-*"))
    assert err.count("\n") == 1 and f"removed {leftover}" in err and f"process {pid}" in err
    assert len(open_dataset(out if flags[0] == "--to" else out / "train")) == 8


def test_only_dead_conversions_directories_on_this_host_are_removed(sources, tmp_path, capsys):
    """A running conversion's directory, one made on another host (its pid means nothing
    here), and entries that only look like leftovers are kept as they are."""
    out = tmp_path / "out"
    running, live_dir = converting(out)
    try:
        elsewhere_proc, elsewhere = converting(out)
        dead = killed(elsewhere_proc)
        (elsewhere / HOST_FILE).write_text("node-elsewhere\n")
        (tmp_path / "mine").mkdir()
        (tmp_path / "mine" / "data").write_text("mine")
        (out / f".hpcdl-convert-{dead + 1}").symlink_to(tmp_path / "mine")
        (out / f".hpcdl-convert-{dead}-old").mkdir()
        (out / ".hpcdl-convert-12ab").mkdir()
        (out / ".hpcdl-convert-999999999").write_text("a file, not a directory")
        unproven = out / f".hpcdl-convert-{dead + 2}"  # the name, but not hpcdl's host file
        unproven.mkdir()
        (unproven / "data").write_text("mine too")
        before = sorted(out.rglob("*"))
        assert main(convert_args(sources, ("folder", "--encoded"), out)) == 0
        err = capsys.readouterr().err
        assert sorted(out.rglob("*")) == sorted(
            before + [out / "train"] + list((out / "train").iterdir())
        )
        assert (tmp_path / "mine" / "data").read_text() == "mine"
        assert "removed" not in err and err.count("\n") == 2, err
        assert f"{elsewhere}" in err and "node-elsewhere" in err
        assert f"{unproven}/ holds no {HOST_FILE}" in err
        assert running.poll() is None and live_dir.is_dir()
    finally:
        killed(running)
