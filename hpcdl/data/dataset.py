"""What every data set offers the loader and the stager (hpcdl.data.kinds picks the kind).

A data set is a list of files under one root (the unit the stager copies) and a map from sample
index to file id. Samples are read through a `SampleReader` made inside the process that reads
(never shared across a fork): `ds.reader(locate)`.

Every file entry is a plain relative path that stays under the root, and no name holds a control
character: the image-folder index and the stager's plan are line and tab based, so a newline or
tab in a name would shift entries. Both kinds of data set refuse such names when they are opened,
so staged and unstaged runs accept the same data (`check_entries`, shared with
`hpcdl.staging.plan.check_relpath`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from hpcdl.data.pfs import PfsEmulation

Locate = Callable[[int], Path]


class DataError(ValueError):
    """Unusable input data; the message names the file (and field or sample) that is wrong."""


class BadSample(DataError):
    """One sample could not be read or decoded."""

    def __init__(self, path: Path | str, index: int, reason: str) -> None:
        super().__init__(
            f"sample {index} in {path} cannot be read: {reason}; fix or remove the file, or "
            "pass --skip-bad-samples to train on without it"
        )
        self.path, self.index = str(path), index


class FileEntry(NamedTuple):
    """One data set file, the unit the stager copies; its index in ds.files is its file id."""

    relpath: str  # relative to the data set root, '/'-separated
    size: int  # bytes


class FileTable(Sequence):
    """The files of a data set as columns: `table[i]` is FileEntry i, made on demand.

    names: the relative paths as UTF-8, joined by newlines (uint8); starts: (N + 1,) int64, the
    offset of each name and, last, len(names) + 1; sizes: (N,) int64 bytes. The arrays may be
    views of a mapped index file (hpcdl.data.indexfile), shared by every process of the node;
    no per-file Python object is kept. Use relpath(i) and `sizes` on hot paths.

    mapped_from: (index file, key) when the arrays are views of that file: the table then
    pickles as that reference (a loader worker maps the file, sharing its pages, instead of
    unpickling a private copy)."""

    def __init__(
        self,
        names: np.ndarray,
        starts: np.ndarray,
        sizes: np.ndarray,
        mapped_from: tuple[Path, str] | None = None,
    ) -> None:
        if len(starts) != len(sizes) + 1:
            raise ValueError(f"{len(starts)} name offsets for {len(sizes)} files")
        self.names, self.starts, self.sizes = names, starts, sizes
        self.mapped_from = mapped_from

    def __reduce__(self):
        if self.mapped_from is None:
            return FileTable, (self.names, self.starts, self.sizes)
        return _map_file_table, self.mapped_from

    @classmethod
    def from_entries(cls, relpaths: Sequence[str], sizes: Sequence[int]) -> FileTable:
        """A table of names and sizes (held by this process, not mapped)."""
        encoded = [r.encode() for r in relpaths]
        starts = np.zeros(len(encoded) + 1, np.int64)
        np.cumsum([len(e) + 1 for e in encoded], out=starts[1:])
        names = np.frombuffer(b"\n".join(encoded), np.uint8)
        return cls(names, starts, np.asarray(sizes, np.int64).reshape(len(encoded)))

    def __len__(self) -> int:
        return len(self.sizes)

    def relpath(self, i: int) -> str:
        return bytes(self.names[self.starts[i] : self.starts[i + 1] - 1]).decode()

    def relpaths(self, ids: np.ndarray) -> list[str]:
        """relpath of each of the given file ids, in their order, without building a FileEntry
        per file (a staging plan names a node's hundred thousand files every epoch)."""
        ids = np.asarray(ids, np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
            raise IndexError(f"file ids outside 0..{len(self) - 1}")
        names = memoryview(self.names).cast("B")
        begins, ends = self.starts[ids].tolist(), (self.starts[ids + 1] - 1).tolist()
        return [str(names[a:b], "utf-8") for a, b in zip(begins, ends)]

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = int(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"file id {i} out of range 0..{len(self) - 1}")
        return FileEntry(self.relpath(i), int(self.sizes[i]))

    def joined(self) -> bytes:
        """Every relative path, newline-separated (one copy: for checks, not for hot paths)."""
        return bytes(self.names)


def _map_file_table(path: Path, key: str) -> FileTable:
    """The FileTable of the index file at path (a pickled, mapped FileTable)."""
    from hpcdl.data.indexfile import map_index_file  # noqa: PLC0415

    found = map_index_file(path)
    if found is None or found[1].get("key") != key:
        raise DataError(
            f"{path}: the data set's index changed or vanished while the job ran; "
            "start the job again"
        )
    cols = found[0]
    return FileTable(cols["names"], cols["starts"], cols["sizes"], (Path(path), key))


class ReadCounts:
    """Samples read from a staged (local) copy vs the parallel file system, and bad ones."""

    def __init__(self) -> None:
        self.local = 0
        self.pfs = 0
        self.bad = 0


class SourceReader:
    """What every reader shares: where file i is now (staged copy or PFS), the PFS emulation
    (HPCDL_STAGE_EMULATE_PFS slows PFS reads only) and the read counts."""

    def __init__(self, ds: Any, locate: Locate | None) -> None:
        self.ds = ds
        self.pfs = default_locate(ds.root, ds.files)
        self.locate = locate or self.pfs
        self.emulation = PfsEmulation.from_env()
        self.counts = ReadCounts()


_CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")
_CONTROL_BUT_NEWLINE = re.compile(r"[\x00-\x09\x0b-\x1f\x7f]")
# In '\n'-joined entries: an empty component, or one that starts with '.' (maybe '.' or '..').
_EMPTY_OR_DOT_COMPONENT = re.compile(r"[/\n][/\n.]")


def has_control_character(name: str) -> bool:
    """True when name holds a control character (below 0x20, or DEL): newline, tab, ..."""
    return _CONTROL_CHARACTER.search(name) is not None


def is_plain_relpath(relpath: str) -> bool:
    """True for a relative '/'-separated path without empty, '.' or '..' components."""
    if not relpath or relpath.startswith("/") or os.path.isabs(relpath):
        return False
    return {"", ".", ".."}.isdisjoint(relpath.split("/"))


def check_entries(root: Path, relpaths: Sequence[str], listed_in: Path | None = None) -> None:
    """DataError naming the first entry with a control character or not a plain path under root.

    listed_in: the index file the entries were read from, named in the message. Two regular
    expression passes over all entries joined (0.4 s for ImageNet's 1.28M names); the loop
    over single entries runs only when they find something suspect."""
    text = "\n".join(relpaths)
    suspect = (
        not text
        or text.count("\n") != len(relpaths) - 1
        or text.startswith(("/", ".", "\n"))
        or text.endswith(("/", "\n"))
        or _CONTROL_BUT_NEWLINE.search(text)
        or _EMPTY_OR_DOT_COMPONENT.search(text)
    )
    if not suspect:
        return
    for rel in relpaths:
        if has_control_character(rel):
            raise DataError(
                f"data set file {str(Path(root) / rel)!r} has a control character (newline, "
                "tab, ...) in its name; rename it"
            )
        if not is_plain_relpath(rel):
            where = f"{listed_in}: entry" if listed_in else "data set entry"
            fix = f"; delete {listed_in} to rebuild it" if listed_in else ""
            raise DataError(
                f"{where} {rel!r} is not a path inside {root} (absolute, or with '..', '.' or "
                f"empty components){fix}"
            )


_CONTROL_BUT_NEWLINE_BYTES = re.compile(rb"[\x00-\x09\x0b-\x1f\x7f]")
_EMPTY_OR_DOT_COMPONENT_BYTES = re.compile(rb"[/\n][/\n.]")


def check_table(root: Path, table: FileTable, listed_in: Path | None = None) -> None:
    """check_entries for a FileTable, run on its joined names where they lie (a mapped file is
    read, not copied); the entries are decoded only when the scan finds something suspect."""
    names = memoryview(table.names)
    suspect = (
        len(table) == 0
        or len(names) == 0
        or names[0] in b"/.\n"
        or names[-1] in b"/\n"
        or not names_end_at_newlines(table.names, table.starts)
        or _CONTROL_BUT_NEWLINE_BYTES.search(names) is not None
        or _EMPTY_OR_DOT_COMPONENT_BYTES.search(names) is not None
    )
    if suspect:
        check_entries(root, table.joined().decode().split("\n"), listed_in)


def names_end_at_newlines(names: np.ndarray, starts: np.ndarray, chunk: int = 1 << 16) -> bool:
    """True when every name but the last ends with a newline where the next one starts.

    In chunks: temporaries of a few hundred KB that the allocator gives back, where one pass
    would leave tens of MB in every loader worker's heap for ImageNet's 1.28 M names."""
    for begin in range(1, len(starts) - 1, chunk):
        ends = starts[begin : min(begin + chunk, len(starts) - 1)] - 1
        if not np.all(names[ends] == ord("\n")):
            return False
    return True


def check_link_inside(root: Path, relpath: str, real_root: Path | None = None) -> None:
    """DataError when root/relpath is a symbolic link that resolves outside root."""
    real_root = real_root or Path(os.path.realpath(root))
    target = Path(os.path.realpath(Path(root) / relpath))
    if not target.is_relative_to(real_root):
        raise DataError(
            f"data set entry {relpath!r} in {root} is a symbolic link to {target}, outside the "
            f"data set; copy it into {root} instead of linking it"
        )


def align_classes(val_ds: Any, train_ds: Any) -> None:
    """Relabel val_ds in place so that its labels index train_ds.classes.

    When val_ds names its classes (image folders: directory names; HDF5: the `classes`
    attribute) they are matched by name; an HDF5 set without names holds training class
    indices, which are range-checked. DataError names the class or file that does not fit.
    Afterwards val_ds.classes is train_ds.classes."""
    if val_ds.named_classes:
        position = {name: i for i, name in enumerate(train_ds.classes)}
        for label in np.unique(val_ds.labels).tolist():
            name = val_ds.classes[label]
            if name not in position:
                raise DataError(
                    f"class {name!r} of the validation data {val_ds.source} is not one of the "
                    f"{len(position)} classes of the training data {train_ds.source} "
                    f"({_preview(train_ds.classes)}); rename or remove it"
                )
        lookup = np.array([position.get(name, -1) for name in val_ds.classes], np.int64)
        val_ds.labels = lookup[val_ds.labels]
    else:
        val_ds.check_labels(len(train_ds.classes), f"of the training data {train_ds.source}")
    val_ds.classes = list(train_ds.classes)


def _preview(names: list[str], limit: int = 8) -> str:
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(map(repr, names[:limit])) + more


def index_record(train_ds: Any, val_ds: Any | None) -> dict[str, dict | None]:
    """The metrics "index" event: per data set that keeps an index (image folders), its root,
    file count, where the index came from ("built", "cache", "given": received from rank 0)
    and the seconds it took; None for kinds without one (HDF5) and for no --val-data."""

    def one(ds: Any | None) -> dict | None:
        if ds is None or not hasattr(ds, "index_seconds"):
            return None
        return {
            "root": str(ds.root),
            "files": len(ds.files),
            "source": ds.index_source,
            "seconds": round(ds.index_seconds, 4),
        }

    return {"train": one(train_ds), "val": one(val_ds)}


def default_locate(root: Path, files: FileTable) -> Locate:
    """The PFS path of each file: root / relpath."""

    def locate(file_id: int) -> Path:
        return root / files.relpath(file_id)

    return locate


def file_ids_from_offsets(offsets: np.ndarray, indices, n: int) -> np.ndarray:
    """File id of each sample index, given each file's first sample index (sorted)."""
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise IndexError(f"sample index out of range 0..{n - 1}")
    return np.searchsorted(offsets, idx, side="right").astype(np.int64) - 1
