"""Image-folder layout mistakes are said, not skipped: an empty class directory is refused in
one line naming it (it used to count as a class), and images in subdirectories of a class
directory, which are not read, are named once in a warning line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hpcdl.data import open_dataset
from hpcdl.data.__main__ import main
from hpcdl.data.dataset import DataError
from hpcdl.data.imagefolder import FolderListing


@pytest.fixture
def f10(tmp_path):
    from helpers import make_folder

    make_folder(tmp_path / "f10", per_class=6, size=(16, 16), classes=("a",))
    (tmp_path / "f10" / "zz_empty").mkdir()
    return tmp_path / "f10"


def test_an_empty_class_directory_is_refused(f10, tmp_path, capsys):
    for opens in (open_dataset, FolderListing):
        with pytest.raises(DataError, match="zz_empty: a class directory with no images"):
            opens(f10)
    assert main(["convert", "folder", str(f10), str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "zz_empty" in err, err


def test_training_refuses_it(f10, tmp_path):
    from helpers import one_line_error

    cmd = [sys.executable, "-m", "hpcdl.train", "--data", str(f10), "--model", "mlp"]
    cmd += ["--batch-size", "6", "--epochs", "1", "--checkpoint-dir", str(tmp_path / "ck")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert "zz_empty: a class directory with no images" in one_line_error(done, None)


def test_nested_images_are_named_once(tmp_path, capsys):
    from helpers import make_folder

    make_folder(tmp_path / "f", per_class=3, size=(16, 16))
    for sub in ("cat/nested", "cat/other", "dog/more", "dog/.hidden"):
        (tmp_path / "f" / sub).mkdir()
        (tmp_path / "f" / sub / "deep.png").write_bytes((tmp_path / "f/cat/0.png").read_bytes())
    ds = open_dataset(tmp_path / "f")
    assert len(ds) == 6 and ds.classes == ["cat", "dog"]
    err = capsys.readouterr().err
    assert err.count("warning") == 1, err
    assert "3 subdirectories of class directories were not read" in err, err
    assert "the first: cat/nested/" in err, err
    assert len(FolderListing(tmp_path / "f")) == 6
    assert "cat/nested/" in capsys.readouterr().err


def test_an_index_cached_with_an_empty_class_is_refused(f10):
    from hpcdl.data.imagefolder import ImageFolderDataset, _folder_index

    relpaths = sorted(f"a/{p.name}" for p in (f10 / "a").iterdir())
    n = len(relpaths)  # what an older hpcdl cached: classes a and zz_empty
    older = _folder_index("k", ["a", "zz_empty"], relpaths, [0] * n, [1] * n, [16] * n,
                          [16] * n, False)  # fmt: skip
    with pytest.raises(DataError, match="zz_empty: a class directory with no images"):
        ImageFolderDataset(f10, index=older)


@pytest.mark.parametrize("flags", [[], ["--encoded"], ["--to", "tar"]])
def test_convert_folder_says_it_once(tmp_path, capsys, flags):
    from helpers import make_folder

    make_folder(tmp_path / "f", per_class=3, size=(16, 16))
    (tmp_path / "f" / "cat" / "nested").mkdir()
    assert main(["convert", "folder", str(tmp_path / "f"), str(tmp_path / "o"), *flags]) == 0
    assert capsys.readouterr().err.count("cat/nested/") == 1
