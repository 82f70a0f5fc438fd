"""Image folder data sets: index cache, re-indexing, decoded reads equal direct Pillow reads."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import make_folder, run_train, torchvision_eval
from PIL import Image

from hpcdl.data import BadSample, DataError, Loader, open_dataset
from hpcdl.staging.plan import PlanError, check_relpath


def test_index_is_built_once_cached_and_rebuilt_when_the_tree_changes(tmp_path):
    images = make_folder(tmp_path / "data")
    ds = open_dataset(tmp_path / "data")
    assert ds.kind == "folder" and len(ds) == 6 and ds.classes == ["cat", "dog"]
    assert ds.sample_shape == (3, 16, 20)
    assert [f.relpath for f in ds.files] == sorted(images)
    assert ds.labels.tolist() == [0, 0, 0, 1, 1, 1]
    assert ds.index_path.parent == Path(os.environ["XDG_CACHE_HOME"]) / "hpcdl"
    assert ds.index_path.stat().st_mode & 0o777 == 0o444
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["cat", "dog"]
    assert ds.file_ids([5, 0]).tolist() == [5, 0]
    mtime = ds.index_path.stat().st_mtime_ns
    assert len(open_dataset(tmp_path / "data")) == 6
    assert ds.index_path.stat().st_mtime_ns == mtime  # cache hit, not rewritten
    Image.fromarray(np.zeros((16, 20, 3), np.uint8)).save(tmp_path / "data" / "dog" / "new.png")
    assert len(open_dataset(tmp_path / "data")) == 7


def test_unwritable_user_cache_falls_back_to_the_nodes_temporary_dir(tmp_path, monkeypatch):
    make_folder(tmp_path / "data")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "cache").write_text("a file where the cache dir should be (even root fails)")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    ds = open_dataset(tmp_path / "data")
    assert ds.index_path.parent == tmp_path / "tmp" / f"hpcdl-{os.getuid()}"
    assert ds.index_path.parent.stat().st_mode & 0o777 == 0o700


def test_an_npz_index_in_the_data_root_is_read_and_left_alone(tmp_path):
    from hpcdl.data.imagefolder import _class_dirs, _tree_key  # noqa: PLC0415

    root = tmp_path / "data"
    make_folder(root)
    built = open_dataset(root)
    relpaths = [f.relpath for f in built.files]
    np.savez(  # what hpcdl wrote into data roots before format 3
        root / ".hpcdl-index.npz",
        key=np.array(_tree_key(root, _class_dirs(root), 2)),
        paths=np.frombuffer("\n".join(relpaths).encode(), np.uint8),
        classes=np.frombuffer(b"cat\ndog", np.uint8),
        labels=np.asarray(built.labels, np.int32),
        sizes=np.asarray(built.files.sizes),
        heights=np.asarray(built.heights),
        widths=np.asarray(built.widths),
        grey=np.array(False),
    )
    built.index_path.unlink()
    listing = sorted((p.name, p.stat().st_mtime_ns) for p in root.iterdir())
    ds = open_dataset(root)
    assert ds.index_source == "cache" and [f.relpath for f in ds.files] == relpaths
    assert ds.sample_shape == built.sample_shape and ds.labels.tolist() == built.labels.tolist()
    assert ds.index_path == built.index_path  # converted into the user's cache, mapped there
    assert sorted((p.name, p.stat().st_mtime_ns) for p in root.iterdir()) == listing


READ_ONLY_PROBE = """
import errno, json, sys
from hpcdl.data import open_dataset
root = sys.argv[1]
try:
    open(root + "/probe", "w")
    erofs = False
except OSError as exc:
    erofs = exc.errno == errno.EROFS
first, again = open_dataset(root), open_dataset(root)
print(json.dumps(dict(erofs=erofs, n=len(first), index=str(first.index_path),
                      again=str(again.index_path))))
"""


def run_on_readonly_mount(root, argv: list, env: dict | None = None):
    """Run argv with root bind-mounted read-only onto itself in a private mount namespace;
    skips (one reason) where that cannot be done. The mount ends with the process."""
    mount = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", mount, str(root)]
    try:
        probe = subprocess.run([*cmd, "true"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError as exc:
        pytest.skip(f"cannot make a read-only bind mount: {exc}")
    if probe.returncode != 0:
        pytest.skip(f"cannot make a read-only bind mount (needs root): {probe.stderr.strip()}")
    return subprocess.run(
        [*cmd, *map(str, argv)], capture_output=True, text=True, env=env, timeout=120
    )


def test_read_only_root_caches_the_index_in_the_user_cache_dir(tmp_path):
    make_folder(tmp_path / "data")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    proc = run_on_readonly_mount(
        tmp_path / "data", [sys.executable, "-c", READ_ONLY_PROBE, tmp_path / "data"], env
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # no warning, no second exception
    result = json.loads(proc.stdout)
    assert result["erofs"], "the mount was not read-only"
    assert result["n"] == 6
    assert Path(result["index"]).parent == tmp_path / "cache" / "hpcdl"
    assert result["again"] == result["index"]  # the second open loads the cache
    assert not (tmp_path / "data" / ".hpcdl-index.npz").exists()
    assert [p.name for p in (tmp_path / "cache" / "hpcdl").iterdir()] == [
        Path(result["index"]).name
    ]  # no temporary file left behind


def test_reads_equal_direct_decodes(tmp_path):
    images = make_folder(tmp_path / "d", fmt="jpg")
    ds = open_dataset(tmp_path / "d")
    idx = np.array([4, 0, 5])
    for workers in (0, 2):
        with Loader(ds, 3, workers=workers) as loader:
            ((x, y),) = list(loader.iterate([idx], 0, train=False))
            want = np.stack([images[ds.files[i].relpath] for i in idx]).astype(np.float32)
            want = (want - ds.mean) / ds.std
            np.testing.assert_allclose(x, want.transpose(0, 3, 1, 2), rtol=1e-5, atol=1e-5)
            assert y.tolist() == [1, 0, 1]


def test_mixed_sizes_centre_crop_to_the_smallest(tmp_path):
    make_folder(tmp_path / "d", size=(20, 16), classes=("a",))
    make_folder(tmp_path / "d", size=(11, 30), classes=("b",), seed=1)
    ds = open_dataset(tmp_path / "d")
    assert ds.sample_shape == (3, 16, 11)
    ((x, _),) = list(Loader(ds, 6).iterate([np.arange(6)], 0, train=False))
    assert x.shape == (6, 3, 16, 11)


@pytest.mark.parametrize("workers,fmt", [(0, "png"), (1, "png"), (0, "jpg")])
@pytest.mark.parametrize("spec,resize", [("rrc24+flip", 27), ("rcrop24", None)])
def test_validation_crops_are_torchvisions_resize_and_centre_crop(
    tmp_path, spec, resize, workers, fmt
):
    """Validation of rrcS: shorter side to int(S / 0.875), centre S x S; of rcropS: centre S x S.

    The JPEGs are over twice the resized size: a draft (DCT-scaled) decode would not match."""
    images = make_folder(tmp_path / "d", per_class=1, size=(114, 80), classes=("a",), fmt=fmt)
    images.update(
        make_folder(tmp_path / "d", per_class=2, size=(63, 100), classes=("b",), seed=1, fmt=fmt)
    )
    ds = open_dataset(tmp_path / "d")
    idx = np.arange(3)
    with Loader(ds, 3, workers=workers, augment=spec) as loader:
        assert loader.sample_shape == (3, 24, 24)
        x = next(iter(loader.iterate([idx], 0, train=False)))[0].copy()  # the slot is unmapped
    want = np.stack([torchvision_eval(images[ds.files[i].relpath], 24, resize) for i in idx])
    want = (want.astype(np.float32) - ds.mean) / ds.std
    np.testing.assert_allclose(x, want.transpose(0, 3, 1, 2), rtol=1e-5, atol=1e-5)


def write_corrupt_jpeg(path):
    arr = np.random.default_rng(0).integers(0, 256, (16, 20, 3), dtype=np.uint8)
    Image.fromarray(arr).save(path, quality=95)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # header intact, entropy-coded data cut


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("augment,train", [("none", True), ("rrc8", False)])
def test_corrupt_jpeg_names_file_and_index_or_is_skipped_and_counted(
    tmp_path, workers, augment, train
):
    make_folder(tmp_path / "d", fmt="jpg")
    write_corrupt_jpeg(tmp_path / "d" / "cat" / "1.jpg")
    ds = open_dataset(tmp_path / "d")
    bad = [f.relpath for f in ds.files].index("cat/1.jpg")
    with Loader(ds, 6, workers=workers, augment=augment) as loader:
        with pytest.raises(DataError, match=rf"sample {bad} in .*cat/1.jpg"):
            list(loader.iterate([np.arange(6)], 0, train=train))
    with Loader(ds, 6, workers=workers, augment=augment, skip_bad_samples=True) as loader:
        batches = loader.iterate([np.arange(6)], 0, train=train)
        ((x, y),) = [(a.copy(), b.copy()) for a, b in batches]
        assert loader.stats()["bad_samples"] == 1
    np.testing.assert_array_equal(x[bad], x[bad - 1])  # the previous good sample stands in
    assert y[bad] == y[bad - 1]


def test_empty_folder_and_unreadable_header(tmp_path):
    (tmp_path / "e" / "cls").mkdir(parents=True)
    with pytest.raises(DataError, match="no images found"):
        open_dataset(tmp_path / "e")
    make_folder(tmp_path / "g", per_class=1, classes=("a",))
    (tmp_path / "g" / "a" / "junk.png").write_bytes(b"not an image")
    ds = open_dataset(tmp_path / "g")
    with pytest.raises(BadSample, match="junk.png"):
        ds.reader().decode([f.relpath for f in ds.files].index("a/junk.png"))
    assert ds.index_path.exists() and not (tmp_path / "g" / ".hpcdl-index").exists()


@pytest.mark.parametrize("char", ["\n", "\t", "\x01", "\x7f"])
def test_control_character_in_a_file_name_is_refused_like_the_stager_does(tmp_path, char):
    make_folder(tmp_path / "d")
    name = f"cat/a{char}b.png"
    Image.fromarray(np.zeros((16, 20, 3), np.uint8)).save(tmp_path / "d" / name)
    with pytest.raises(DataError, match="control character.*rename") as info:
        open_dataset(tmp_path / "d")
    assert repr(name)[1:-1] in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(PlanError):  # a staged run refuses the same name
        check_relpath(name)


def test_names_refused_by_the_data_sets_are_exactly_those_the_stager_refuses():
    from hpcdl.data.dataset import has_control_character  # noqa: PLC0415

    for code in range(0x80):
        name = f"cat/a{chr(code)}b.png"
        try:
            check_relpath(name)
            staged = True
        except PlanError:
            staged = False
        assert staged == (not has_control_character(name)), repr(name)


def _rewrite_index(ds, paths):
    """Replace the relative paths in ds's cached index file by paths; the file's path."""
    from hpcdl.data.dataset import FileTable  # noqa: PLC0415
    from hpcdl.data.indexfile import index_bytes, write_index_file  # noqa: PLC0415

    columns = dict(ds.index.columns)
    table = FileTable.from_entries(paths, np.zeros(len(paths), np.int64))
    columns["names"], columns["starts"] = table.names, table.starts
    assert write_index_file(ds.index_path, index_bytes(columns, ds.index.meta))
    return ds.index_path


@pytest.mark.parametrize("entry", ["../outside.png", "/tmp/outside.png", "cat/../../outside.png"])
def test_index_entry_outside_the_root_is_refused(tmp_path, entry):
    make_folder(tmp_path / "d")
    Image.fromarray(np.zeros((16, 20, 3), np.uint8)).save(tmp_path / "outside.png")
    ds = open_dataset(tmp_path / "d")
    index = _rewrite_index(ds, [*[f.relpath for f in ds.files][:-1], entry])
    with pytest.raises(DataError) as info:
        open_dataset(tmp_path / "d")
    assert repr(entry) in str(info.value) and str(index) in str(info.value)


def test_symlinks_escaping_the_root_are_refused_and_those_inside_it_kept(tmp_path):
    make_folder(tmp_path / "d")
    make_folder(tmp_path / "elsewhere", classes=("cow",))
    (tmp_path / "d" / "dog" / "inside.png").symlink_to(tmp_path / "d" / "cat" / "0.png")
    assert len(open_dataset(tmp_path / "d")) == 7
    (tmp_path / "d" / "cat" / "link.png").symlink_to(tmp_path / "elsewhere" / "cow" / "0.png")
    with pytest.raises(DataError, match=r"'cat/link.png'.*outside"):
        open_dataset(tmp_path / "d")
    (tmp_path / "d" / "cat" / "link.png").unlink()
    (tmp_path / "d" / "cow").symlink_to(tmp_path / "elsewhere" / "cow")
    with pytest.raises(DataError, match=r"'cow'.*outside"):
        open_dataset(tmp_path / "d")


def test_a_tab_in_a_name_fails_staged_and_unstaged_runs_alike_at_startup(tmp_path):
    make_folder(tmp_path / "d", per_class=4)
    Image.fromarray(np.zeros((16, 20, 3), np.uint8)).save(tmp_path / "d" / "cat" / "a\tb.png")
    common = ("--data", tmp_path / "d", "--model", "mlp", "--epochs", 1, "--batch-size", 2)
    common += ("--workers", 0, "--checkpoint-dir", tmp_path / "ckpt")
    for extra in ((), ("--stage-dir", tmp_path / "stage")):
        proc = run_train(2, *common, *extra)
        assert proc.returncode == 2, proc.stderr[-3000:]
        (line,) = [line for line in proc.stderr.splitlines() if "error" in line]
        assert line.startswith("hpcdl.train: error: ") and "cat/a\\tb.png" in line
        assert "rename" in line


def test_an_index_whose_fields_disagree_in_length_is_rebuilt(tmp_path):
    make_folder(tmp_path / "d")
    first = open_dataset(tmp_path / "d")
    paths = [f.relpath for f in first.files]
    _rewrite_index(first, paths[:-1])  # what a newline in a name did to version 1
    ds = open_dataset(tmp_path / "d")
    assert [f.relpath for f in ds.files] == paths and len(ds.labels) == 6


def test_index_time_and_source_go_into_the_metrics(tmp_path):
    import subprocess
    import sys

    from helpers import read_events

    make_folder(tmp_path / "d", per_class=8)
    metrics = tmp_path / "m.jsonl"
    args = ["--data", tmp_path / "d", "--val-data", tmp_path / "d", "--model", "mlp"]
    args += ["--epochs", 1, "--batch-size", 4, "--workers", 0, "--quiet", "--metrics", metrics]
    for source in ("built", "cache"):
        proc = subprocess.run(
            [sys.executable, "-m", "hpcdl.train", *map(str, args)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        record = read_events(metrics, "index")[-1]
        train = record["train"]
        assert train["source"] == source and train["files"] == 16, record
        assert 0 <= train["seconds"] < 60 and train["root"] == str(tmp_path / "d")
        assert record["val"]["source"] == "cache"  # the training run's index, read again


def test_hdf5_data_has_no_index_record(digits_dir):
    from hpcdl.data.dataset import index_record

    ds = open_dataset(digits_dir / "train")
    assert index_record(ds, None) == {"train": None, "val": None}


@pytest.mark.parametrize("change", ["added", "removed"])
def test_loader_workers_read_the_index_the_data_set_was_opened_with(tmp_path, change):
    """A folder that changes after the run opened it (a copy still arriving, a file removed) is
    read through the index the run opened, in the workers too: sample i is the same file in the
    training process and in every worker, never a neighbour's pixels under another label."""
    make_folder(tmp_path / "d", per_class=4)
    ds = open_dataset(tmp_path / "d")
    order = [np.arange(len(ds))]
    with Loader(ds, len(ds), workers=0, augment="none") as loader:
        want = [(x.copy(), y.copy()) for x, y in loader.iterate(order, 0, train=False)]
    if change == "added":  # sorted between cat/0 and cat/1: every later index would move
        Image.fromarray(np.zeros((16, 20, 3), np.uint8)).save(tmp_path / "d" / "cat" / "0a.png")
    else:
        (tmp_path / "d" / "cat" / "3.png").rename(tmp_path / "elsewhere.png")
    with Loader(ds, len(ds), workers=2, augment="none") as loader:
        if change == "removed":  # the file the index names is gone: that sample is bad
            with pytest.raises(DataError, match=r"sample 3 in .*cat/3\.png"):
                list(loader.iterate(order, 0, train=False))
            return
        got = [(x.copy(), y.copy()) for x, y in loader.iterate(order, 0, train=False)]
    np.testing.assert_array_equal(got[0][1], want[0][1])
    np.testing.assert_array_equal(got[0][0], want[0][0])


def test_a_folder_changed_after_its_index_was_removed_stops_the_workers_with_a_clear_error(
    tmp_path,
):
    make_folder(tmp_path / "d", per_class=4)
    ds = open_dataset(tmp_path / "d")
    ds.index_path.unlink()  # a cache cleaned while the run reads (this process keeps its map)
    Image.fromarray(np.zeros((16, 20, 3), np.uint8)).save(tmp_path / "d" / "cat" / "0a.png")
    with Loader(ds, len(ds), workers=2, augment="none") as loader:
        with pytest.raises(DataError, match=r"/d: the folder changed .* start the run again"):
            list(loader.iterate([np.arange(len(ds))], 0, train=False))
