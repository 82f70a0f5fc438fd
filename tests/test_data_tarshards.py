"""Issue 62: WebDataset tar shards read in place (hpcdl.data.tarshards), one process."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import tarfile
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
from helpers import make_folder
from tarshards_helpers import jpeg_bytes, make_shards, shards_of_folder, write_tar

from hpcdl.data import BadSample, DataError, Loader, open_dataset, open_listing
from hpcdl.data.augment import parse_augment
from hpcdl.data.batch import BatchBuilder
from hpcdl.data.kinds import kind_of, reopen, reopen_spec
from hpcdl.data.sampler import DistributedSampler
from hpcdl.data.tarshards import TarShardDataset
from hpcdl.data.tarshards_reader import MAX_OPEN_SHARDS


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test its own index cache, so that 'built' and 'cache' are this test's doing."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def image_bytes(ds, index: int) -> bytes:
    with closing(ds.reader()) as reader:
        f, _ = reader._open(index)
        return f.read()


def test_samples_are_keys_in_shard_order_and_the_index_is_cached_outside_the_root(tmp_path):
    data = tmp_path / "data"
    members = make_shards(data, shards=3, per_shard=4)
    before = snapshot(data)
    ds = open_dataset(data)
    assert ds.kind == "tar" and ds.index_source == "built" and len(ds) == 12
    assert [ds.files.relpath(i) for i in range(3)] == ["s-0000.tar", "s-0001.tar", "s-0002.tar"]
    assert ds.files.sizes.tolist() == [
        (data / ds.files.relpath(i)).stat().st_size for i in range(3)
    ]
    assert ds.labels.tolist() == [i % 3 for i in range(12)]
    assert ds.classes == ["0", "1", "2"] and not ds.named_classes
    assert ds.sample_shape == (3, 16, 20)
    assert ds.file_ids([0, 3, 4, 11]).tolist() == [0, 0, 1, 2]
    assert ds.member(5) == "k00005.jpg"
    assert image_bytes(ds, 5) == members[1][2][1]  # shard 1's second sample's image
    assert snapshot(data) == before  # nothing written into the data root
    assert ds.index_path.parent == tmp_path / "cache" / "hpcdl"
    again = open_dataset(data)
    assert again.index_source == "cache" and again.index_path == ds.index_path
    # a loader worker reopens it from the spec and maps the same file; the table pickles small
    worker = reopen(reopen_spec(ds))
    assert worker.index_path == ds.index_path and np.array_equal(worker.labels, ds.labels)
    assert len(pickle.dumps(ds.files)) < 300


def test_a_brace_pattern_names_the_shards_and_a_missing_one_is_one_line(tmp_path):
    make_shards(tmp_path / "d", shards=3, per_shard=2)
    ds = open_dataset(tmp_path / "d" / "s-{0000..0001}.tar")
    assert kind_of(tmp_path / "d" / "s-{0000..0001}.tar") == "tar"
    assert len(ds.files) == 2 and len(ds) == 4 and ds.root == tmp_path / "d"
    with pytest.raises(DataError, match=r"1 of its 4 shards are missing, the first .*s-0003\.tar"):
        open_dataset(tmp_path / "d" / "s-{0000..0003}.tar")


def test_labels_from_txt_json_and_a_classes_file_said_in_one_line(tmp_path):
    j = jpeg_bytes
    write_tar(tmp_path / "a" / "x.tar", [
        ("a.jpg", j(1)), ("a.txt", b"zebra\n"),
        ("b.jpg", j(2)), ("b.json", json.dumps({"label": "ant"}).encode()),
        ("c.jpg", j(3)), ("c.txt", b"cat"),
    ])  # fmt: skip
    ds = open_dataset(tmp_path / "a")
    assert ds.classes == ["ant", "cat", "zebra"] and ds.labels.tolist() == [2, 0, 1]
    assert ds.named_classes
    assert ds.describe() == (f"hpcdl: data: 1 tar shard(s) in {tmp_path / 'a'}, 3 samples, "
                             "3 classes from the labels' sorted names")  # fmt: skip
    (tmp_path / "a" / "classes.json").write_text(json.dumps(["zebra", "cat", "ant", "dog"]))
    ds = open_dataset(tmp_path / "a")  # the classes file is part of the index's key
    assert ds.index_source == "built" and ds.labels.tolist() == [0, 2, 1]
    assert ds.num_classes == 4 and "from " + str(tmp_path / "a" / "classes.json") in ds.describe()
    write_tar(tmp_path / "m" / "x.tar", [("a.jpg", j(1)), ("a.txt", b"cat"),
                                         ("b.jpg", j(2)), ("b.cls", b"1")])  # fmt: skip
    with pytest.raises(DataError, match=r"mix class names .* give .*classes\.json"):
        open_dataset(tmp_path / "m")


def test_long_member_names_in_ustar_gnu_and_pax_headers_are_keys(tmp_path):
    for fmt in (tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        # over the 100 bytes of a plain header's name (ustar: split into its prefix)
        deep = "d" * 120 + "/" + "n" * (60 if fmt == tarfile.USTAR_FORMAT else 110)
        root = tmp_path / str(fmt)
        write_tar(root / "x.tar", [(f"{deep}.jpg", jpeg_bytes(4)), (f"{deep}.cls", b"0")], fmt)
        ds = open_dataset(root)
        assert len(ds) == 1 and ds.member(0) == f"{deep}.jpg"
        assert image_bytes(ds, 0) == jpeg_bytes(4)


def test_compressed_shards_are_one_line_saying_to_decompress(tmp_path):
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "s-0.tar.gz").write_bytes(b"\x1f\x8b" + b"\0" * 600)
    with pytest.raises(DataError, match=r"s-0\.tar\.gz: a compressed tar shard.*gunzip"):
        open_dataset(tmp_path / "z")
    make_shards(tmp_path / "z", shards=1, per_shard=1)  # plain ones beside it: still refused
    with pytest.raises(DataError, match=r"s-0\.tar\.gz: a compressed tar shard"):
        open_dataset(tmp_path / "z")
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "s-0.tar").write_bytes(b"\x1f\x8b" + b"\0" * 600)  # gzip named .tar
    with pytest.raises(DataError, match=r"s-0\.tar: a compressed tar shard"):
        open_dataset(tmp_path / "g")


def test_a_folder_and_its_shards_give_bitwise_the_same_batches(tmp_path):
    make_folder(tmp_path / "f", per_class=5, size=(30, 22), classes=("a", "b", "c"), fmt="jpg")
    shards_of_folder(tmp_path / "f", tmp_path / "t", per_shard=4)
    folder, tar = open_dataset(tmp_path / "f"), open_dataset(tmp_path / "t")
    assert len(folder) == len(tar) and np.array_equal(folder.labels, tar.labels)
    assert np.array_equal(folder.heights, tar.heights) and folder.sample_shape == tar.sample_shape
    for ds_pair_epoch in (0, 1):
        got = []
        for ds in (folder, tar):
            b = BatchBuilder(ds, parse_augment("rrc16+flip"), seed=3)
            idx = DistributedSampler(len(ds), seed=5).batches(ds_pair_epoch, 6)[0]
            x, y = np.empty((6, 3, 16, 16), np.float32), np.empty(6, np.int64)
            b.build(idx, ds_pair_epoch, True, x, y)
            got.append((x, y))
        assert np.array_equal(got[0][0], got[1][0]) and np.array_equal(got[0][1], got[1][1])


def test_loader_workers_read_the_shards_as_the_training_process_does(tmp_path):
    make_shards(tmp_path / "d", shards=4, per_shard=6)
    ds = open_dataset(tmp_path / "d")
    batches = DistributedSampler(len(ds), seed=1).batches(0, 4)
    out = {}
    for workers in (0, 2):
        with Loader(ds, 4, workers=workers, seed=2, augment="rcrop12+flip") as loader:
            out[workers] = [(x.copy(), y.copy()) for x, y in loader.iterate(batches, 0)]
            assert loader.stats()["pfs_reads"] == len(ds)
    assert all(
        np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
        for a, b in zip(out[0], out[2], strict=True)
    )


def test_each_reader_keeps_a_bounded_number_of_shards_open(tmp_path):
    make_shards(tmp_path / "d", shards=MAX_OPEN_SHARDS + 3, per_shard=1)
    ds = open_dataset(tmp_path / "d")
    fds = len(os.listdir("/proc/self/fd"))
    with closing(ds.reader()) as reader:
        for i in range(len(ds)):
            reader._open(i)
        assert len(os.listdir("/proc/self/fd")) - fds == MAX_OPEN_SHARDS
        reader._open(len(ds) - 1)  # an open shard: no new open
        assert len(reader._fds) == MAX_OPEN_SHARDS
    assert len(os.listdir("/proc/self/fd")) == fds


def test_a_stage_listing_of_shards_lists_them_as_the_files(tmp_path):
    make_shards(tmp_path / "d", shards=2, per_shard=3)
    listing = open_listing(tmp_path / "d")
    assert len(listing.files) == 2 and len(listing) == 6
    assert listing.file_ids([0, 5]).tolist() == [0, 1]
    assert isinstance(listing, TarShardDataset)


# --- bad input: one line naming the shard and the member ---------------------------------------


def bad_shards(tmp_path: Path) -> Path:
    """d/a.tar: 2 good samples, then one per flaw; d/b.tar cut inside its last image."""
    j = jpeg_bytes
    write_tar(tmp_path / "d" / "a.tar", [
        ("g0.jpg", j(0)), ("g0.cls", b"0"), ("g1.jpg", j(1)), ("g1.cls", b"1"),
        ("nolabel.jpg", j(2)),
        ("twice.jpg", j(3)), ("twice.png", j(4)), ("twice.cls", b"0"),
        ("range.jpg", j(5)), ("range.cls", b"-1"),
        ("junk.jpg", b"not an image"), ("junk.cls", b"1"),
        ("word.jpg", j(6)), ("word.cls", b"one"),
    ])  # fmt: skip
    b = write_tar(tmp_path / "d" / "b.tar", [("h0.jpg", j(7)), ("h0.cls", b"1"),
                                             ("cut.jpg", j(8)), ("cut.cls", b"0")])  # fmt: skip
    with tarfile.open(b) as tar:
        cut = tar.getmember("cut.jpg")
    os.truncate(b, cut.offset_data + cut.size // 2)
    return tmp_path / "d"


@pytest.mark.parametrize(
    ("member", "reason"),
    [
        ("nolabel.jpg", "no label member (.cls, .json or .txt)"),
        ("twice.png", "two image members share this sample's key"),
        ("range.jpg", "its label is outside the data set's classes (2 classes, from the labels"),
        ("junk.jpg", "its image header cannot be parsed"),
        ("word.jpg", "its label member holds no usable label"),
        ("cut.jpg", "the shard ends inside this sample's members (truncated)"),
    ],
)
def test_a_bad_sample_is_one_line_naming_the_shard_and_member(member, reason, tmp_path, capsys):
    ds = open_dataset(bad_shards(tmp_path))
    shard = "b.tar" if member == "cut.jpg" else "a.tar"
    index = [ds.member(i) for i in range(len(ds))].index(member)
    with closing(ds.reader()) as reader, pytest.raises(BadSample) as err:
        reader._open(index)
    line = str(err.value)
    assert "\n" not in line and f"{tmp_path / 'd' / shard} (member {member})" in line
    assert reason in line and "--skip-bad-samples" in line
    assert "truncated or damaged" not in capsys.readouterr().err  # cut in a member, not a header


def test_bad_samples_are_skipped_with_skip_bad_samples(tmp_path):
    ds = open_dataset(bad_shards(tmp_path))
    good = [i for i in range(len(ds)) if ds.member(i)[0] in "gh"]
    b = BatchBuilder(ds, parse_augment("rcrop12"), seed=0, skip_bad=True)
    idx = np.arange(len(ds))
    x, y = np.empty((len(ds), 3, 12, 12), np.float32), np.empty(len(ds), np.int64)
    b.build(idx, 0, True, x, y)
    assert b.counts.bad == len(ds) - len(good) == 6 and b.counts.pfs == len(good)
    with pytest.raises(BadSample):
        BatchBuilder(ds, parse_augment("rcrop12"), seed=0).build(idx, 0, True, x, y)


def test_a_shard_changed_after_indexing_is_a_bad_sample_naming_it(tmp_path):
    make_shards(tmp_path / "d", shards=2, per_shard=3)
    ds = open_dataset(tmp_path / "d")
    shard = tmp_path / "d" / "s-0001.tar"
    os.utime(shard, ns=(0, shard.stat().st_mtime_ns + 10**9))  # rewritten in place
    with closing(ds.reader()) as reader:
        reader._open(0)  # the other shard is as indexed
        with pytest.raises(BadSample, match=r"s-0001\.tar \(member k00003\.jpg\).*changed since"):
            reader._open(3)
    os.truncate(shard, 2048)
    with closing(ds.reader()) as reader, pytest.raises(BadSample, match="changed since"):
        reader._open(5)
    assert open_dataset(tmp_path / "d").index_source == "built"  # a new run indexes it again


def test_a_shard_cut_inside_a_header_is_one_warning_and_its_whole_members_are_read(
    tmp_path, capsys
):
    make_shards(tmp_path / "d", shards=1, per_shard=3)
    shard = tmp_path / "d" / "s-0000.tar"
    with tarfile.open(shard) as tar:
        third = tar.getmember("k00002.jpg")
    os.truncate(shard, third.offset + 100)  # inside the third image's header
    ds = open_dataset(tmp_path / "d")
    assert len(ds) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(lines) == 1 and "s-0000.tar is truncated or damaged at byte" in lines[0]


@pytest.mark.parametrize("pad", range(40, 140))
def test_an_index_file_whose_header_grows_a_digit_still_maps_its_columns(pad):
    """The bug the tar index met first: index_bytes settled its layout in two passes, so a
    header that grew across a 64-byte boundary in the second pass (an offset gaining a digit)
    shifted every column by the overrun (a name read as '}x.ta')."""
    from hpcdl.data.indexfile import index_bytes, parse_index  # noqa: PLC0415

    columns = {"a": np.arange(3), "b": np.frombuffer(b"x.tar", np.uint8)}
    found, meta = parse_index(index_bytes(columns, {"pad": "x" * pad}))
    assert bytes(found["b"]) == b"x.tar" and found["a"].tolist() == [0, 1, 2]
    assert meta == {"pad": "x" * pad}


def test_decode_gpu_reads_each_members_bytes_and_yields_the_folders_batches(tmp_path):
    """--decode gpu on tar shards (issue 62 item 2): the workers move each sample's image member
    (one pread), a byte slot holds the largest member, not a shard; the rank's decode then
    gives the folder's batches bit for bit (Pillow here; nvImageCodec on a GPU)."""
    from hpcdl.data.file_bytes import FileBytesReader, byte_capacity  # noqa: PLC0415

    make_folder(tmp_path / "f", per_class=5, size=(30, 22), classes=("a", "b", "c"), fmt="jpg")
    shards_of_folder(tmp_path / "f", tmp_path / "t", per_shard=4)
    folder, tar = open_dataset(tmp_path / "f"), open_dataset(tmp_path / "t")
    assert byte_capacity(tar, 3) == byte_capacity(folder, 3)  # the largest member
    indices = np.array([14, 0, 5, 9])
    offsets, labels = np.empty(5, np.int64), np.empty(4, np.int64)
    data = np.empty(byte_capacity(tar, 4), np.uint8)
    FileBytesReader(tar).read(indices, labels, offsets, data)
    for i, index in enumerate(indices):
        want = (tmp_path / "f" / folder.files.relpath(int(index))).read_bytes()
        assert bytes(data[offsets[i] : offsets[i + 1]]) == want
    assert np.array_equal(labels, folder.labels[indices])
    order = [np.arange(k, k + 5) for k in range(0, 15, 5)]
    got = []
    for ds, workers in ((folder, 0), (tar, 2)):
        with Loader(ds, 5, workers=workers, seed=3, augment="rrc16+flip", decode="gpu") as loader:
            got.append([(x.copy(), y.copy()) for x, y in loader.iterate(order, 1)])
    assert len(got[0]) == len(got[1]) == 3
    for (x, y), (tx, ty) in zip(*got):
        assert np.array_equal(x, tx) and np.array_equal(y, ty)


def test_decode_gpu_on_a_flawed_member_follows_the_bad_sample_rules(tmp_path):
    ds = open_dataset(bad_shards(tmp_path))
    bad = [ds.member(i) for i in range(len(ds))].index("range.jpg")
    good = next(i for i in range(len(ds)) if ds.member(i)[0] in "gh")
    with Loader(ds, 1, workers=1, seed=0, augment="rcrop12", decode="gpu") as loader:
        with pytest.raises(DataError, match=r"\(member range\.jpg\) cannot be read: its label"):
            list(loader.iterate([np.array([bad])], 0))
    with Loader(
        ds, 2, workers=1, seed=0, augment="rcrop12", decode="gpu", skip_bad_samples=True
    ) as loader:
        assert len(list(loader.iterate([np.array([bad, good])], 0))) == 1
        assert loader.stats()["bad_samples"] == 1


def test_a_damaged_header_is_one_warning_and_a_non_tar_is_one_error(tmp_path, capsys):
    make_shards(tmp_path / "d", shards=1, per_shard=3)
    shard = tmp_path / "d" / "s-0000.tar"
    with tarfile.open(shard) as tar:
        second = tar.getmember("k00001.jpg")
    with open(shard, "r+b") as f:  # one byte of the second image's header name
        f.seek(second.offset + 3)
        f.write(b"#")
    ds = open_dataset(tmp_path / "d")
    assert len(ds) == 1 and ds.member(0) == "k00000.jpg"
    err = capsys.readouterr().err
    assert f"{shard} is truncated or damaged at byte {second.offset}" in err
    (tmp_path / "n").mkdir()
    (tmp_path / "n" / "x.tar").write_bytes(b"just some text" * 100)
    with pytest.raises(DataError, match=r"x\.tar: not a tar file"):
        open_dataset(tmp_path / "n")


def test_jpeg_frames_parsed_by_hand_are_what_pillow_reads(tmp_path):
    from PIL import Image  # noqa: PLC0415

    from hpcdl.data.tarindex import jpeg_frame  # noqa: PLC0415

    for size, grey in (((20, 16), False), ((33, 7), True), ((300, 200), False)):
        data = jpeg_bytes(1, size, grey)
        with Image.open(io.BytesIO(data)) as im:
            assert jpeg_frame(data) == (im.height, im.width, im.mode == "L")
    assert jpeg_frame(b"\x89PNG\r\n") is None and jpeg_frame(jpeg_bytes(2)[:40]) is None


def test_a_staged_copy_evicted_while_open_is_closed_at_the_next_sweep(tmp_path):
    """An open descriptor keeps an evicted copy's blocks on the stage disk: the reader lets go
    of it within SWEEP_EVERY shard opens, and reads that shard from the PFS again."""
    from hpcdl.data.tarshards_reader import SWEEP_EVERY  # noqa: PLC0415

    make_shards(tmp_path / "d", shards=SWEEP_EVERY + 2, per_shard=1)
    ds = open_dataset(tmp_path / "d")
    staged = tmp_path / "stage" / "s-0000.tar"
    staged.parent.mkdir()
    shutil.copy2(tmp_path / "d" / "s-0000.tar", staged)  # bytes and mtime, as the stager copies
    evicted = set()

    def locate(fid: int) -> Path:
        return staged if fid == 0 and not evicted else ds.root / ds.files.relpath(fid)

    def held_deleted() -> list[str]:
        held = []
        for n in os.listdir("/proc/self/fd"):
            try:
                held.append(os.readlink(f"/proc/self/fd/{n}"))
            except FileNotFoundError:
                continue  # the listing's own descriptor, closed by now
        return [link for link in held if link.startswith(str(staged))]

    with closing(ds.reader(locate)) as reader:
        reader._open(0)
        assert reader.counts.local == 1
        staged.unlink()
        evicted.add(0)
        assert held_deleted() != []
        for i in range(1, SWEEP_EVERY + 1):
            reader._open(i)
        assert held_deleted() == []
        reader._open(0)
        assert reader.counts.pfs == SWEEP_EVERY + 1


def test_validation_shards_take_the_training_classes_by_name_or_index(tmp_path):
    from hpcdl.data.dataset import align_classes  # noqa: PLC0415

    make_folder(tmp_path / "train", per_class=2, classes=("cat", "dog", "emu"))
    j = jpeg_bytes
    write_tar(tmp_path / "named" / "v.tar", [("a.jpg", j(1)), ("a.txt", b"emu"),
                                             ("b.jpg", j(2)), ("b.txt", b"cat")])  # fmt: skip
    train, val = open_dataset(tmp_path / "train"), open_dataset(tmp_path / "named")
    align_classes(val, train)
    assert val.labels.tolist() == [2, 0] and val.classes == ["cat", "dog", "emu"]
    write_tar(tmp_path / "ints" / "v.tar", [("a.jpg", j(1)), ("a.cls", b"1"),
                                            ("b.jpg", j(2)), ("b.cls", b"3")])  # fmt: skip
    with pytest.raises(DataError, match=r"v\.tar \(member b\.jpg\): label 3 is outside 0\.\.2"):
        align_classes(open_dataset(tmp_path / "ints"), train)


def test_loader_workers_map_the_tar_index_shared_not_copied(tmp_path):
    from tools.bench.memory import mapping  # noqa: PLC0415

    make_shards(tmp_path / "d", shards=4, per_shard=50)
    ds = open_dataset(tmp_path / "d")
    with Loader(ds, 8, workers=2, augment="rcrop12") as loader:
        batches = [np.arange(i, 200, 25) for i in range(4)]
        assert sum(len(y) for _, y in loader.iterate(batches, 0)) == 32
        for pid in [os.getpid(), *loader.worker_pids]:
            m = mapping(pid, str(ds.index_path))
            assert m is not None, f"process {pid} does not map {ds.index_path}"
            assert m["Rss"] > 0 and m["Private_Dirty"] == 0 and m["Anonymous"] == 0


def test_shards_without_samples_are_one_line_saying_what_a_sample_is(tmp_path):
    write_tar(tmp_path / "d" / "x.tar", [("a.txt", b"a caption"), ("b.json", b"{}")])
    with pytest.raises(DataError, match=r"no samples in its 1 tar shard\(s\) \(a sample is an"):
        open_dataset(tmp_path / "d")
    write_tar(tmp_path / "e" / "x.tar", [("a.jpg", b"junk"), ("a.cls", b"0")])
    with pytest.raises(DataError, match=r"none of the 1 samples can be read"):
        open_dataset(tmp_path / "e")


def test_a_staged_copy_that_is_not_the_indexed_shard_is_passed_over_for_the_original(tmp_path):
    """Same size, other bytes and mtime (the shard was rewritten, then staged, then restored):
    the stager keeps the source's mtime on its copies, so the copy is not the indexed shard."""
    members = make_shards(tmp_path / "d", shards=1, per_shard=2)
    ds = open_dataset(tmp_path / "d")
    staged = tmp_path / "stage" / "s-0000.tar"
    staged.parent.mkdir()
    original = (tmp_path / "d" / "s-0000.tar").read_bytes()
    at = int(ds.index.columns["data_at"][0]) + 200
    staged.write_bytes(original[:at] + bytes([original[at] ^ 0xFF]) + original[at + 1 :])
    with closing(ds.reader(lambda fid: staged)) as reader:
        f, _ = reader._open(0)
        assert f.read() == members[0][0][1] and reader.counts.pfs == 1
    os.utime(staged, ns=(0, (tmp_path / "d" / "s-0000.tar").stat().st_mtime_ns))
    with closing(ds.reader(lambda fid: staged)) as reader:
        reader._open(0)
        assert reader.counts.local == 1  # the stager's copy, as the stager leaves it


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_tar_headers_parsed_by_hand_list_what_tarfile_lists(fmt, tmp_path):
    """Directories, links, long and non-ASCII names, empty and multi-block members."""
    from hpcdl.data.tarheaders import tar_members  # noqa: PLC0415

    rng = np.random.default_rng(fmt)
    path = tmp_path / "x.tar"
    with tarfile.open(path, "w", format=fmt) as tar:
        for i in range(40):
            if i % 7 == 3:
                info = tarfile.TarInfo(f"dir{i}")
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
                continue
            if i % 11 == 5:
                info = tarfile.TarInfo(f"link{i}")
                info.type, info.linkname = (
                    tarfile.SYMTYPE,
                    "x" * (40 if fmt == tarfile.USTAR_FORMAT else 120),
                )
                tar.addfile(info)
                continue
            stem = ("ü" if fmt != tarfile.USTAR_FORMAT else "u") + "n" * int(rng.integers(1, 90))
            name = f"{'d' * int(rng.integers(0, 60))}/{stem}.{i}.jpg".lstrip("/")
            data = bytes(rng.integers(0, 256, int(rng.integers(0, 3000)), dtype=np.uint8))
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with tarfile.open(path) as tar:
        want = [(m.name, m.offset_data, m.size) for m in tar.getmembers() if m.isfile()]
    fd = os.open(path, os.O_RDONLY)
    try:
        assert tar_members(fd, os.fstat(fd).st_size) == (want, None)
    finally:
        os.close(fd)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_a_shard_that_cannot_be_read_is_one_line_naming_it(tmp_path):
    make_shards(tmp_path / "d", shards=2, per_shard=1)
    (tmp_path / "d" / "s-0001.tar").chmod(0)
    with pytest.raises(DataError, match=r"s-0001\.tar: cannot be read to index it"):
        open_dataset(tmp_path / "d")


@pytest.mark.parametrize("label_first", [False, True])
def test_indexing_reads_a_shard_with_one_pread_a_sample(label_first, tmp_path, monkeypatch):
    """Each pread is a request to the parallel file system: a sample's headers, its label and
    its image's head lie within a few KB, and the index reads them through one window
    (hpcdl.data.tarheaders.ShardWindow), whichever order the writer put the members in (hpcdl's
    convert writes the image first, webdataset's TarWriter the label). The columns are what
    tarfile lists."""
    from hpcdl.data import tarheaders  # noqa: PLC0415
    from hpcdl.data.tarindex import read_shard  # noqa: PLC0415

    rng = np.random.default_rng(1)
    members, widths = [], []
    for i in range(60):
        widths.append(int(rng.integers(40, 90)))
        image = (f"k{i:03d}.jpg", jpeg_bytes(i, (widths[-1], 30)) + bytes(30000))
        label = (f"k{i:03d}.cls", b"%d" % (i % 4))
        members += [label, image] if label_first else [image, label]
    shard = write_tar(tmp_path / "s.tar", members)
    with tarfile.open(shard) as tar:
        images = [(m.offset_data, m.size) for m in tar.getmembers() if m.name.endswith(".jpg")]
    calls = []
    real = os.pread

    def counted(fd, n, at):
        calls.append((n, at))
        return real(fd, n, at)

    monkeypatch.setattr(tarheaders.os, "pread", counted)
    monkeypatch.setattr("hpcdl.data.tarindex.os.pread", counted)
    got = read_shard(shard)
    assert len(calls) <= 60 + 2, f"{len(calls)} preads for 60 samples"
    assert got.labels == [i % 4 for i in range(60)]
    assert list(zip(got.columns["data_at"].tolist(), got.columns["data_len"].tolist())) == images
    assert got.columns["widths"].tolist() == widths and (got.columns["heights"] == 30).all()
    assert (got.columns["flaws"] == 0).all()
