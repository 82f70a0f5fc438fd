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


def default_locate(root: Path, files: list[FileEntry]) -> Locate:
    """The PFS path of each file: root / relpath."""

    def locate(file_id: int) -> Path:
        return root / files[file_id].relpath

    return locate


def file_ids_from_offsets(offsets: np.ndarray, indices, n: int) -> np.ndarray:
    """File id of each sample index, given each file's first sample index (sorted)."""
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise IndexError(f"sample index out of range 0..{n - 1}")
    return np.searchsorted(offsets, idx, side="right").astype(np.int64) - 1
