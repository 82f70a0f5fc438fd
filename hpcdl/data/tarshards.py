"""WebDataset tar shards read in place: `--data DIR` of *.tar, or `shards-{000000..001023}.tar`.

NOTE [tar shards]. A sample is the members of a shard that share a key (hpcdl.data.tarindex):
one image (.jpg, .jpeg, .png, .webp) and a label (.cls: an integer class index; .json: an
object with a "label" or "cls" field, integer or class name; .txt: a class name; the first of
.cls, .json, .txt found is used). Samples are numbered in shard-name order, then in the order of
their first member in the shard: shards written in an image folder's order (sorted classes,
sorted files) give the folder's sample numbers, so its sampler order, bitwise.

- Classes: classes.json beside the shards (a JSON list of names; a label is an index into it,
  or one of its names), else the sorted set of the label names, else (integer labels only)
  "0".."max"; the start says which in one line (describe(), printed by hpcdl.startup).
- The index (what the folder's NOTE [the index] in hpcdl/data/imagefolder.py says of its index
  holds here too: built once per job by rank 0, shared, mapped, cached outside the data root,
  never written into it): per shard its name, size and mtime (the stager stages whole shards:
  ds.files lists them); per sample the image member's name, offset and length, label, height,
  width and flaw; in its meta the warning lines about shards cut inside a tar header or of 0
  bytes, said by every process that opens the shards from their path (rank 0, inspect, the dry
  run), built or mapped from the cache. Built with seeks: tar headers, label members and image
  headers are read, never the image data. The cache key is every shard's name, size and
  mtime and classes.json's.
- Reads (hpcdl.data.tarshards_reader): one pread per sample from the shard's open descriptor,
  a bounded number of descriptors kept open per reading process. A shard whose size or mtime
  is not the index's (staged copies keep the original's mtime; one that does not match is
  passed over for the original), or shorter than a member, is a BadSample naming the shard
  and the member, as is a sample with a flaw: the data-error rules then apply
  (--skip-bad-samples trains on without it).
- Compressed shards (.tar.gz, ...) cannot be read in place: one line says to decompress them.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.data.dataset import (
    DataError,
    FileTable,
    Locate,
    check_table,
    file_ids_from_offsets,
)
from hpcdl.data.imagefolder import IMAGENET_MEAN, IMAGENET_STD, INDEX_THREADS
from hpcdl.data.indexfile import index_bytes, map_index_file, write_index_file
from hpcdl.data.tarindex import (
    LABEL_RANGE,
    ShardContents,
    list_shards,
    read_shard,
    shard_root,
)
from hpcdl.data.tarshards_reader import TarShardReader

BULK_FILE_IDS = 1 << 16  # file_ids of at least this many indices: the table lookup
CLASSES_NAME = "classes.json"
_INDEX_VERSION = 2  # 2: meta['warnings'] and meta['beyond']
_SAMPLE_COLUMNS = ("labels", "heights", "widths", "flaws", "data_at", "data_len")


@dataclass(frozen=True)
class TarIndex:
    """A tar data set's index: columns (mapped when path is set) and meta."""

    columns: dict[str, np.ndarray]
    meta: dict[str, Any]
    path: Path | None = None

    def to_bytes(self) -> bytes:
        return index_bytes(self.columns, self.meta)


def _classes_file(source: Path) -> Path:
    return shard_root(source) / CLASSES_NAME


def index_key(source: Path, root: Path, names: list[str]) -> str:
    """Every shard's name, size and mtime and classes.json's: any change makes a new index."""
    h = hashlib.sha256(f"tar{_INDEX_VERSION}:{Path(os.path.realpath(source))}".encode())
    for path in [*(root / n for n in names), _classes_file(source)]:
        try:
            st = os.stat(path)
            h.update(f"\n{path.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        except OSError:
            h.update(f"\n{path.name}:-".encode())
    return h.hexdigest()


def cache_paths(source: Path) -> list[Path]:
    """Where the index is cached, in the order tried: the user's cache, the node's temporary
    directory (never the data root)."""
    user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpcdl"
    node = Path(tempfile.gettempdir()) / f"hpcdl-{os.getuid()}"
    digest = hashlib.sha256(str(Path(os.path.realpath(source))).encode()).hexdigest()[:16]
    name = f"tar-index-{digest}.hpcdl-index"
    return [user / name, node / name]


def map_tar_index(path: Path, key: str) -> TarIndex | None:
    """The index file at path, mapped, when it is a tar index holding key."""
    found = map_index_file(path)
    if found is None or found[1].get("key") != key or found[1].get("kind") != "tar":
        return None
    columns = found[0]
    n = len(columns.get("labels", ()))
    if any(len(columns.get(c, ())) != n for c in _SAMPLE_COLUMNS):
        return None
    return TarIndex(columns, found[1], path)


def save_tar_index(source: Path, index: TarIndex) -> TarIndex:
    """The index written to the first cache that takes it and mapped from there; as it was
    (held by this process) when none does."""
    data = index.to_bytes()
    for path in cache_paths(source):
        if write_index_file(path, data):
            mapped = map_tar_index(path, index.meta["key"])
            if mapped is not None:
                return mapped
    return index


def build_tar_index(source: Path, root: Path, names: list[str], key: str) -> TarIndex:
    """Read every shard (INDEX_THREADS at a time) and resolve the labels into classes."""
    with ThreadPoolExecutor(max(1, min(INDEX_THREADS, len(names)))) as pool:
        shards = list(pool.map(read_shard, (root / n for n in names)))
    table = FileTable.from_entries(names, [s.size for s in shards])
    members = FileTable.from_entries(
        [name for s in shards for name in s.images], np.zeros(sum(len(s.images) for s in shards))
    )
    columns = {
        "names": table.names,
        "starts": table.starts,
        "sizes": table.sizes,
        "mtimes": np.array([s.mtime_ns for s in shards], np.int64),
        "first_sample": np.cumsum([0] + [len(s.images) for s in shards[:-1]]).astype(np.int64),
        "member_names": members.names,
        "member_starts": members.starts,
    }
    for name in ("data_at", "data_len", "heights", "widths", "flaws"):
        columns[name] = np.concatenate([s.columns[name] for s in shards])
    for shard in shards:
        shard.columns = {}  # copied into columns: freed before the labels are resolved
    classes, named, origin, beyond = resolve_classes(source, names, shards, columns)
    readable = columns["flaws"] == 0
    heights, widths = columns["heights"][readable], columns["widths"][readable]
    meta = dict(
        kind="tar", key=key, classes=classes, named_classes=named, classes_from=origin,
        grey=all(s.grey for s in shards), readable=int(readable.sum()),
        warnings=[s.warning for s in shards if s.warning], beyond=beyond,
        min_hw=[int(heights.min()), int(widths.min())] if readable.any() else [],
    )  # fmt: skip
    return TarIndex(columns, meta)


def resolve_classes(
    source: Path, names: list[str], shards: list[ShardContents], columns: dict[str, np.ndarray]
) -> tuple[list[str], bool, str, dict[str, Any]]:
    """(classes, named, where they came from, the labels classes.json lacks: _beyond); sets
    columns["labels"] and flags the labels outside the classes in columns["flaws"]."""
    raw = [label for shard in shards for label in shard.labels]
    classes_file = _classes_file(source)
    if classes_file.is_file():
        classes = _read_classes_file(classes_file)
        named, origin = True, str(classes_file)
    else:
        texts = sorted({v for v in raw if isinstance(v, str)})
        top = max((v for v in raw if isinstance(v, int)), default=None)
        if texts and top is not None:
            i = next(i for i, v in enumerate(raw) if isinstance(v, int))
            fid = int(np.searchsorted(columns["first_sample"], i, side="right")) - 1
            raise DataError(
                f"{source}: labels mix class names (.txt, .json strings) and class indices "
                f"(.cls, .json integers), e.g. {names[fid]} member {_member(columns, i)}; "
                f"give {classes_file} (a JSON list of class names) to relate them"
            )
        named = bool(texts)
        classes = texts if named else [str(i) for i in range((top if top is not None else -1) + 1)]
        origin = "the labels' sorted names" if named else "the labels' integers"
    position = {name: i for i, name in enumerate(classes)}
    labels, flaws = np.zeros(len(raw), np.int64), columns["flaws"]
    beyond = []  # classes.json lacks their labels: an index past its end, a name not in it
    for i, value in enumerate(raw):
        if flaws[i]:
            continue
        index = position.get(value, len(classes)) if isinstance(value, str) else int(value)
        if 0 <= index < len(classes):
            labels[i] = index
        else:
            flaws[i] = LABEL_RANGE
            if index >= len(classes):
                beyond.append(i)
    columns["labels"] = labels
    return classes, named, origin, _beyond(raw, beyond)


def _beyond(raw: list[int | str | None], samples: list[int]) -> dict[str, Any]:
    """What the start-up check and inspect say of the labels classes.json lacks ({} when it
    names them all): how many samples, the largest index, the first few names, the first
    sample."""
    if not samples:
        return {}
    ints = [v for v in (raw[i] for i in samples) if isinstance(v, int)]
    names = sorted({v for v in (raw[i] for i in samples) if isinstance(v, str)})
    return dict(count=len(samples), largest=max(ints, default=None), names=names[:3],
                more_names=len(names) > 3, first=samples[0])  # fmt: skip


def _member(columns: dict[str, np.ndarray], index: int) -> str:
    """The image member name of sample index in an index's columns."""
    begin, end = columns["member_starts"][index], columns["member_starts"][index + 1] - 1
    return bytes(columns["member_names"][begin:end]).decode()


def _read_classes_file(path: Path) -> list[str]:
    try:
        classes = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: not a readable JSON list of class names ({exc})") from None
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise DataError(f"{path}: must be a JSON list of class names (strings)")
    if len(set(classes)) != len(classes) or not classes:
        raise DataError(f"{path}: class names must be distinct, and at least one")
    return classes


class TarShardDataset:
    kind = "tar"
    layout = "HWC"
    dtype = np.uint8

    def __init__(self, source: str | Path, index: TarIndex | None = None) -> None:
        """Open the shards at source: map the cached index or build and cache it. `index` is
        taken as it is. describe() is the start's line about them."""
        self.source = Path(source)
        self.index_source = "given"  # or "cache", "built"
        t0 = time.perf_counter()
        self.root = shard_root(self.source)
        if index is None:
            index = self._load_or_build()
            for line in index.meta["warnings"]:  # every run, not only the one that indexed
                print(f"hpcdl: warning: {line}", file=sys.stderr)
        self.index, self.index_path = index, index.path
        cols, meta = index.columns, index.meta
        mapped = None if index.path is None else (index.path, meta["key"])
        self.files = FileTable(cols["names"], cols["starts"], cols["sizes"], mapped)
        check_table(self.root, self.files, self.index_path)
        self.offsets = cols["first_sample"]
        self._shard_of_sample: np.ndarray | None = None  # file_ids' table, built on first use
        self.labels, self.heights, self.widths = cols["labels"], cols["heights"], cols["widths"]
        self.classes = list(meta["classes"])
        self.named_classes = bool(meta["named_classes"])
        if not len(self):
            raise DataError(
                f"{self.source}: no samples in its {len(self.files)} tar shard(s) (a sample is an "
                "image member, .jpg, .jpeg, .png or .webp, with a label member of the same key)"
            )
        if not meta["readable"]:
            raise DataError(f"{self.source}: none of the {len(self)} samples can be read")
        self.index_seconds = time.perf_counter() - t0
        channels = 1 if meta["grey"] else 3
        self.min_hw = (int(meta["min_hw"][0]), int(meta["min_hw"][1]))
        self._shape = (channels, *self.min_hw)
        self.mean = np.array(IMAGENET_MEAN[:channels] if channels == 3 else [127.5], np.float32)
        self.std = np.array(IMAGENET_STD[:channels] if channels == 3 else [127.5], np.float32)

    def describe(self) -> str:
        """The start's line about the shards and where their classes came from."""
        return (
            f"hpcdl: data: {len(self.files)} tar shard(s) in {self.root}, {len(self)} samples, "
            f"{len(self.classes)} classes from {self.index.meta['classes_from']}"
        )

    @classmethod
    def from_index_file(cls, source: str | Path, path: Path, key: str) -> TarShardDataset | None:
        """The data set whose index another process cached at path; None when it cannot be
        mapped here or no longer holds key."""
        index = map_tar_index(Path(path), key)
        return None if index is None else cls(source, index=index)

    def _load_or_build(self) -> TarIndex:
        _, names = list_shards(self.source)
        key = index_key(self.source, self.root, names)
        for path in cache_paths(self.source):
            found = map_tar_index(path, key)
            if found is not None:
                self.index_source = "cache"
                return found
        self.index_source = "built"
        return save_tar_index(self.source, build_tar_index(self.source, self.root, names, key))

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        return self._shape

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def readable(self) -> np.ndarray:
        """(N,) bool: the samples without a flaw; only their labels are classes."""
        return self.index.columns["flaws"] == 0

    @property
    def classes_from(self) -> str:
        """Where the classes came from: classes.json's path, or the labels (names, integers)."""
        return str(self.index.meta["classes_from"])

    @property
    def largest_sample_bytes(self) -> int:
        """The largest image member's bytes: what a --decode gpu byte slot holds per sample
        (hpcdl.data.file_bytes), not a shard."""
        lengths = self.index.columns["data_len"]
        return int(lengths.max()) if len(lengths) else 0

    def file_ids(self, indices) -> np.ndarray:
        """Shard id of each sample index. Whole epochs (the planner, the dry run: 90 epochs of
        1.28 M indices at ImageNet scale) look up a sample -> shard table, built on first use
        (int32, 4 bytes a sample) and several times faster than a search per index; batches
        (loader workers) search, and hold no table."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size < BULK_FILE_IDS:
            return file_ids_from_offsets(self.offsets, idx, len(self))
        if idx.min() < 0 or idx.max() >= len(self):
            raise IndexError(f"sample index out of range 0..{len(self) - 1}")
        if self._shard_of_sample is None:
            counts = np.diff(np.append(np.asarray(self.offsets, np.int64), len(self)))
            self._shard_of_sample = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
        return self._shard_of_sample.take(idx).astype(np.int64)

    def member(self, index: int) -> str:
        """The image member of sample index, as the shard names it."""
        return _member(self.index.columns, index)

    def where(self, index: int, shard: Path | None = None) -> str:
        """'<shard> (member <name>)' of a sample, for messages."""
        fid = int(self.file_ids([index])[0])
        return f"{shard or self.root / self.files.relpath(fid)} (member {self.member(index)})"

    def check_labels(self, num_classes: int, whose: str = "") -> None:
        """DataError naming the shard and member of the first label outside 0..num_classes-1."""
        ok = self.index.columns["flaws"] == 0
        bad = np.nonzero(ok & ((self.labels < 0) | (self.labels >= num_classes)))[0]
        if bad.size:
            raise DataError(
                f"{self.where(int(bad[0]))}: label {self.labels[bad[0]]} is outside "
                f"0..{num_classes - 1} ({num_classes} classes{' ' + whose if whose else ''})"
            )

    def labels_beyond(self) -> str:
        """What the labels classes.json lacks are, for a message; "" when it names them all."""
        beyond = self.index.meta.get("beyond")
        if not beyond:
            return ""
        lacks = []
        if beyond["largest"] is not None:
            last = len(self.classes) - 1
            lacks.append(f"indices up to {beyond['largest']}, and its last index is {last}")
        if beyond["names"]:
            more = ", ..." if beyond["more_names"] else ""
            lacks.append("names it lacks: " + ", ".join(map(repr, beyond["names"])) + more)
        return (
            f"{self.index.meta['classes_from']} names {len(self.classes)} classes, but "
            f"{beyond['count']} samples have labels outside them ({'; '.join(lacks)}), the "
            f"first {self.where(beyond['first'])}"
        )

    def check_classes(self) -> None:
        """DataError when classes.json does not name every label: the index knows them all, so
        a run stops at its start, not at the first such sample (--skip-bad-samples or not)."""
        beyond = self.labels_beyond()
        if beyond:
            raise DataError(f"{beyond}; add the missing class names to {CLASSES_NAME}")

    def reader(self, locate: Locate | None = None) -> TarShardReader:
        return TarShardReader(self, locate)
