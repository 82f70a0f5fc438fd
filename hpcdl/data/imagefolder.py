"""Image folder data set: root/<class>/<file> with JPEG or PNG files, decoded by Pillow.

NOTE [the index]. Data sets live on read-only, high-latency parallel file systems, where an open
costs milliseconds and N ranks opening every file is a metadata storm. So:

- What is indexed, and why up front: relative path and label (from the directory listing), byte
  size (fstat of the open file: the stager plans by bytes), height and width (the crop box of
  every sample is computed from them before the file is opened, and sample_shape is the smallest
  of them), and whether every image is greyscale (C = 1). All of it comes from the header, so
  every file is opened exactly once, by one process of the job, and read only as far as Pillow
  needs to parse its header (the kernel reads ahead up to a page cluster, not the whole file).
- How: one pass. The root and each class directory are listed once (names and d_type from
  scandir; a stat only where the file system gives no type); then INDEX_THREADS threads each
  open a file, fstat it and parse its header, so that the open latencies overlap: the index
  costs about files x latency / INDEX_THREADS. A live progress line shows on a terminal.
- What it is: columns, no per-file Python object (ImageNet's 1.28 M tuples cost 400-800 MB in
  every rank and loader worker): the relative paths as one UTF-8 blob with int64 offsets, and
  int64 labels, sizes, heights and widths (FileTable, ds.labels, ...), plus a JSON header of
  the classes, greyscale and the smallest height and width (FolderIndex). They are one
  uncompressed, read-only file (hpcdl.data.indexfile) that every process maps, so the kernel
  holds its pages once per node whatever the ranks x workers; ds.files pickles as the file's
  path, so a loader worker maps it rather than receiving a copy.
- Who: `hpcdl.startup.open_datasets` opens the data set on rank 0 only (built, or mapped from
  the cache) and sends the other ranks the file's path and key; they map it
  (ImageFolderDataset.from_index_file). A node that cannot see that path gets the file's bytes
  from rank 0, and its first rank writes them into the node's cache (startup.share_index).
  Loader workers reopen the data set from its path and map the cached file.
- Where it is cached: not in the data root, which is the user's (shared data sets are often
  group-writable; no other loader writes there): $XDG_CACHE_HOME/hpcdl (default ~/.cache/hpcdl),
  then $TMPDIR/hpcdl-<uid>, as index-<hash of the root>.hpcdl-index, mode 0444, directories
  0700, written through a temporary file and a rename (a failed write leaves nothing behind and
  raises nothing). root/.hpcdl-index only with --index-in-data-root. Read first, wherever it
  is: root/.hpcdl-index, the caches, and root/.hpcdl-index.npz of hpcdl before the mapped
  format (converted into the cache, the root left alone).
- When it is rebuilt: the cache key is the root's real path plus the name and mtime of every
  class directory: adding, removing or renaming a file changes its directory's mtime. (A file
  rewritten in place under the same name is not noticed; delete the cache file after such edits.)
- Stage-only runs do not build it: FolderListing gives the names and sizes without opening an
  image (the copy opens each file once).

sample_shape is (C, min height, min width) over the tree; C = 1 when every image is greyscale,
else 3. Pixel statistics default to ImageNet's mean/std (0..255 units).
"""

from __future__ import annotations

import hashlib
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
    BadSample,
    DataError,
    FileTable,
    Locate,
    SourceReader,
    check_entries,
    check_link_inside,
    check_table,
    names_end_at_newlines,
)
from hpcdl.data.image_file import BadSampleAt, decode_image, image_header
from hpcdl.data.indexfile import index_bytes, map_index_file, write_index_file
from hpcdl.data.pfs import open_source

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
INDEX_NAME = ".hpcdl-index"  # in the data root: written only with --index-in-data-root
LEGACY_INDEX_NAME = ".hpcdl-index.npz"  # format 2, read (never written) in the data root
# 3: a mapped columnar file (hpcdl.data.indexfile); 2: an .npz each process copied;
# 1: built without the name and symlink checks.
_INDEX_VERSION = 3
# Header reads in flight: hides open latency (32 x 1 / 5 ms = 6,400 files/s on a 5 ms file
# system) while Pillow's header parsing, which holds the GIL, stays far below one core.
INDEX_THREADS = 32
IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)
_HEADER_CHUNK = 4096


def _class_dirs(root: Path) -> list[os.DirEntry]:
    if not root.is_dir():
        raise DataError(f"{root}: not a directory (expected root/<class>/<image files>)")
    dirs = [e for e in os.scandir(root) if e.is_dir() and not e.name.startswith(".")]
    return sorted(dirs, key=lambda e: e.name)


def scan_folder(
    root: Path, dirs: list[os.DirEntry] | None = None
) -> tuple[list[str], list[int], list[str]]:
    """(relative paths, labels, class names) of root/<class>/<image>, sorted; DataError if none.

    Lists each directory once and opens no file. Names with control characters, symbolic
    links that lead outside root and class directories without images are refused; images in
    subdirectories of a class directory are not read, which one warning line says."""
    root = Path(root)
    dirs = _class_dirs(root) if dirs is None else dirs
    classes = [e.name for e in dirs]
    links = [e.name for e in dirs if e.is_symlink()]
    relpaths, labels, nested, empty = [], [], [], []
    for label, name in enumerate(classes):
        images, subdirs = _class_entries(root, name)
        if not images:
            empty.append((name, subdirs))
        links += [f"{name}/{e.name}" for e in images if e.is_symlink()]
        relpaths += [f"{name}/{f}" for f in sorted(e.name for e in images)]
        labels += [label] * len(images)
        nested += [f"{name}/{d}/" for d in subdirs]
    check_entries(root, classes + relpaths)
    real_root = Path(os.path.realpath(root))
    for rel in links:
        check_link_inside(root, rel, real_root)
    if not relpaths:
        raise DataError(
            f"{root}: no images found (expected root/<class>/<file> with "
            f"{', '.join(IMAGE_SUFFIXES)} files)"
        )
    if empty:
        raise _empty_class(root, *empty[0])
    if nested:
        print(
            f"hpcdl: warning: {root}: {len(nested)} subdirectories of class directories were "
            f"not read (the first: {min(nested)}); an image folder's images lie directly in "
            "root/<class>/: move them up, or make them classes of their own",
            file=sys.stderr,
        )
    return relpaths, labels, classes


def _class_entries(root: Path, name: str) -> tuple[list[os.DirEntry], list[str]]:
    """(image entries, names of subdirectories not hidden) of root/name."""
    images, subdirs = [], []
    for e in os.scandir(root / name):
        if e.is_file():  # the file type scandir saw: a stat only where it saw none
            if os.path.splitext(e.name)[1].lower() in IMAGE_SUFFIXES:
                images.append(e)
        elif e.is_dir() and not e.name.startswith("."):
            subdirs.append(e.name)
    return images, subdirs


def _empty_class(root: Path, name: str, subdirs: list[str]) -> DataError:
    """The error for root/name, a class directory without images, which holds subdirs."""
    first = min(subdirs, default="")
    held = f" (only subdirectories, such as {first}/, which are not read)" if first else ""
    return DataError(
        f"{root / name}: a class directory with no images ({', '.join(IMAGE_SUFFIXES)})"
        f"{held}; remove it, or put its images in it (torchvision's ImageFolder refuses it too)"
    )


def _tree_key(root: Path, dirs: list[os.DirEntry], version: int = _INDEX_VERSION) -> str:
    h = hashlib.sha256(f"{version}:{root.resolve()}".encode())
    for e in dirs:
        h.update(f"\n{e.name}:{e.stat().st_mtime_ns}".encode())
    return h.hexdigest()


def _cache_paths(root: Path, in_data_root: bool = False) -> list[Path]:
    """Where the index may be written, in the order tried: the data root (only when asked),
    the user's cache, this node's temporary directory."""
    user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpcdl"
    node = Path(tempfile.gettempdir()) / f"hpcdl-{os.getuid()}"
    name = f"index-{hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]}.hpcdl-index"
    return [root / INDEX_NAME] * in_data_root + [user / name, node / name]


def _read_header(path: Path) -> tuple[int, int, int, bool]:
    """(bytes, height, width, greyscale) from one open; height 0 when the header is unreadable."""
    try:
        with open_source(path) as f:
            return os.fstat(f.fileno()).st_size, *image_header(f)
    except OSError:
        return 0, 0, 0, True


def read_headers(
    root: Path, relpaths: list[str], threads: int = INDEX_THREADS
) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """(sizes, heights, widths) (N,) int64 and whether every readable image is greyscale.

    Each file is opened once, by one of `threads` threads; a progress line on a terminal."""
    n = len(relpaths)
    out = np.zeros((3, n), np.int64)
    grey = True
    show = sys.stderr.isatty()
    shown = time.monotonic()
    with ThreadPoolExecutor(max(1, min(threads, n))) as pool:
        for begin in range(0, n, _HEADER_CHUNK):  # bounded: no million futures at once
            paths = [root / r for r in relpaths[begin : begin + _HEADER_CHUNK]]
            for i, (size, h, w, g) in enumerate(pool.map(_read_header, paths), begin):
                out[:, i] = size, h, w
                grey = grey and g
            if show and time.monotonic() - shown > 0.5:
                shown = time.monotonic()
                print(f"\rindexing {root}: {i + 1}/{n} image headers", end="", file=sys.stderr)
    if show:
        print(f"\rindexing {root}: {n}/{n} image headers", file=sys.stderr)
    return out[0], out[1], out[2], grey


@dataclass(frozen=True)
class FolderIndex:
    """An image folder's index: columns (hpcdl.data.indexfile; mapped when path is set) and
    meta (key, classes, grey, min_hw, readable)."""

    columns: dict[str, np.ndarray]
    meta: dict[str, Any]
    path: Path | None = None

    def to_bytes(self) -> bytes:
        return index_bytes(self.columns, self.meta)


def build_index(root: Path, key: str, dirs: list[os.DirEntry]) -> FolderIndex:
    """The index of root (see NOTE [the index]); opens every image once."""
    relpaths, labels, classes = scan_folder(root, dirs)
    sizes, heights, widths, grey = read_headers(root, relpaths)
    return _folder_index(key, classes, relpaths, labels, sizes, heights, widths, grey)


def _folder_index(
    key: str,
    classes: list[str],
    relpaths: list[str],
    labels: Any,
    sizes: Any,
    heights: Any,
    widths: Any,
    grey: bool,
) -> FolderIndex:
    """The columns and meta of an index (labels, sizes, heights, widths: array-likes in file
    order, like relpaths)."""
    table = FileTable.from_entries(relpaths, sizes)
    heights, widths = np.asarray(heights, np.int64), np.asarray(widths, np.int64)
    readable = heights > 0
    min_hw = [int(heights[readable].min()), int(widths[readable].min())] if readable.any() else []
    columns = {
        "names": table.names,
        "starts": table.starts,
        "labels": np.asarray(labels, np.int64),
        "sizes": table.sizes,
        "heights": heights,
        "widths": widths,
    }
    meta = dict(
        key=key, classes=list(classes), grey=bool(grey), min_hw=min_hw, readable=int(readable.sum())
    )
    return FolderIndex(columns, meta)


def map_index(path: Path, key: str) -> FolderIndex | None:
    """The index file at path, mapped, when it holds this key and its columns agree."""
    found = map_index_file(path)
    if found is None or found[1].get("key") != key or not _consistent(found[0]):
        return None
    return FolderIndex(*found, path=path)


def load_index(root: Path, dirs: list[os.DirEntry]) -> FolderIndex | None:
    """The cached index of root, mapped where it was found; None when there is none. An .npz
    index (format 2) found in the data root is converted into the cache."""
    key = _tree_key(root, dirs)
    for path in [root / INDEX_NAME, *_cache_paths(root)]:
        found = map_index(path, key)
        if found is not None:
            return found
    legacy = _load_npz(root / LEGACY_INDEX_NAME, _tree_key(root, dirs, 2), key)
    return None if legacy is None else save_index(root, legacy)


def save_index(root: Path, index: FolderIndex, in_data_root: bool = False) -> FolderIndex:
    """The index written to the first place that takes it (see NOTE [the index]) and mapped
    from there; the index as it was (held by this process) when no place does."""
    data = index.to_bytes()
    for path in _cache_paths(root, in_data_root):
        if write_index_file(path, data):
            mapped = map_index(path, index.meta["key"])
            if mapped is not None:
                return mapped
    return index


class ImageFolderDataset:
    kind = "folder"
    layout = "HWC"
    dtype = np.uint8
    named_classes = True  # class = directory name

    def __init__(
        self, root: str | Path, index_in_data_root: bool = False, index: FolderIndex | None = None
    ) -> None:
        """Open root: map the cached index or build it (and cache it: in the data root only
        with index_in_data_root). `index` (FolderIndex) is taken as it is, without touching the
        file system."""
        self.root = self.source = Path(root)
        self.index_source = "given"  # or "cache", "built"
        t0 = time.perf_counter()
        if index is None:
            index = self._load_or_build(index_in_data_root)
        self.index = index
        self.index_path = index.path
        cols, meta = index.columns, index.meta
        mapped = None if index.path is None else (index.path, meta["key"])
        self.files = FileTable(cols["names"], cols["starts"], cols["sizes"], mapped)
        self.classes = list(meta["classes"])
        check_entries(self.root, self.classes, self.index_path)
        check_table(self.root, self.files, self.index_path)
        self.labels, self.heights, self.widths = cols["labels"], cols["heights"], cols["widths"]
        if not meta["readable"]:
            raise DataError(f"{self.root}: none of the {len(self.files)} images can be read")
        counts = np.bincount(self.labels, minlength=len(self.classes))
        if not counts.all():  # an index cached before empty classes were refused
            raise _empty_class(self.root, self.classes[int(np.argmin(counts))], [])
        self.index_seconds = time.perf_counter() - t0
        channels = 1 if meta["grey"] else 3
        self.min_hw = (int(meta["min_hw"][0]), int(meta["min_hw"][1]))
        self._shape = (channels, *self.min_hw)
        self.mean = np.array(IMAGENET_MEAN[:channels] if channels == 3 else [127.5], np.float32)
        self.std = np.array(IMAGENET_STD[:channels] if channels == 3 else [127.5], np.float32)

    @classmethod
    def from_index_file(cls, root: str | Path, path: Path, key: str) -> ImageFolderDataset | None:
        """The data set whose index another rank cached at path; None when this process cannot
        map it there (another node's cache) or it no longer holds key."""
        index = map_index(Path(path), key)
        return None if index is None else cls(root, index=index)

    def _load_or_build(self, in_data_root: bool) -> FolderIndex:
        dirs = _class_dirs(self.root)
        found = load_index(self.root, dirs)
        if found is not None:
            self.index_source = "cache"
            return found
        self.index_source = "built"
        index = build_index(self.root, _tree_key(self.root, dirs), dirs)
        return save_index(self.root, index, in_data_root)

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        return self._shape

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def file_ids(self, indices) -> np.ndarray:
        return _file_ids(indices, len(self))

    def reader(self, locate: Locate | None = None) -> ImageFolderReader:
        return ImageFolderReader(self, locate)


class FolderListing:
    """What staging needs of an image folder, without opening an image: the names, labels and
    byte sizes (one stat per file, INDEX_THREADS at a time), in the index's order, so plans are
    the training run's. A stage-only run uses it: heights and widths, which only the loader
    needs, cost an open and a header read per file on the PFS, as much as the copy."""

    kind = "folder"

    def __init__(self, root: str | Path) -> None:
        self.root = self.source = Path(root)
        relpaths, labels, self.classes = scan_folder(self.root)
        with ThreadPoolExecutor(INDEX_THREADS) as pool:
            sizes = list(pool.map(_size, (self.root / r for r in relpaths), chunksize=256))
        self.files = FileTable.from_entries(relpaths, sizes)
        self.labels = np.asarray(labels, np.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def file_ids(self, indices) -> np.ndarray:
        return _file_ids(indices, len(self))


def _size(path: Path) -> int:
    """Bytes of path (0 when it cannot be stat-ed: the stager reports the file)."""
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _file_ids(indices, n: int) -> np.ndarray:
    """File id of each sample index: an image folder holds one sample per file."""
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise IndexError(f"sample index out of range 0..{n - 1}")
    return idx.copy()


def _consistent(columns: dict[str, np.ndarray]) -> bool:
    """True when an index holds one name per label, size and image shape, each name ending
    where the next one starts (else it is rebuilt)."""
    try:
        names, starts = columns["names"], columns["starts"]
        n = len(starts) - 1
        if n < 1 or starts[0] != 0 or starts[-1] != len(names) + 1:
            return False
        if not all(len(columns[k]) == n for k in ("labels", "sizes", "heights", "widths")):
            return False
        return names_end_at_newlines(names, starts)
    except (KeyError, IndexError):
        return False


def _load_npz(path: Path, npz_key: str, key: str) -> FolderIndex | None:
    """An index of format 2 (.npz, in the data root) holding npz_key, as columns with key;
    None when there is none or it does not fit."""
    try:
        with np.load(path, allow_pickle=False) as z:
            if str(z["key"]) != npz_key:
                return None
            arrays = {k: z[k] for k in z.files}
        relpaths = bytes(arrays["paths"]).decode().split("\n")
    except (OSError, KeyError, ValueError):
        return None
    fields = ("labels", "sizes", "heights", "widths")
    if not all(len(arrays[k]) == len(relpaths) for k in fields):
        return None
    classes = bytes(arrays["classes"]).decode().split("\n")
    per_file = [arrays[k] for k in fields]
    return _folder_index(key, classes, relpaths, *per_file, bool(arrays["grey"]))


class ImageFolderReader(SourceReader):
    """Decodes images in the process that owns it."""

    def __init__(self, ds: ImageFolderDataset, locate: Locate | None) -> None:
        super().__init__(ds, locate)
        self.mode = "L" if ds.sample_shape[0] == 1 else "RGB"

    def _open(self, index: int):
        path, pfs = Path(self.locate(index)), self.pfs(index)
        try:
            f = open_source(path, self.emulation) if path == pfs else open(path, "rb")
        except OSError as exc:
            if path == pfs:
                raise BadSample(path, index, exc.strerror or str(exc)) from None
            path = pfs
            try:  # the staged copy is unusable: read the PFS original
                f = open_source(pfs, self.emulation)
            except OSError as exc2:
                raise BadSample(pfs, index, exc2.strerror or str(exc2)) from None
        if path == pfs:
            self.counts.pfs += 1
        else:
            self.counts.local += 1
        return f, path

    def decode(
        self,
        index: int,
        draft: tuple[int, int] | None = None,
        box: tuple[int, int, int, int] | None = None,
    ):
        """(image (h, w, C) uint8, (h / indexed h, w / indexed w)): decode_image of the file."""
        f, path = self._open(index)
        indexed_hw = (int(self.ds.heights[index]), int(self.ds.widths[index]))
        with f:
            return decode_image(f, self.mode, indexed_hw, draft, box, BadSampleAt(path, index))

    def close(self) -> None:
        pass
