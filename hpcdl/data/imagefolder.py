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
- Who: `hpcdl.startup.open_datasets` opens the data set on rank 0 only (built, or loaded from
  the cache) and broadcasts the index; the other ranks build their data set from it
  (`ImageFolderDataset(root, index=...)`). Loader workers reopen the data set from its path and
  find the cache.
- Where it is cached: root/.hpcdl-index.npz; when that cannot be written (any OSError: read-only
  file system, permissions, quota), $XDG_CACHE_HOME/hpcdl (default ~/.cache/hpcdl); then
  $TMPDIR/hpcdl-<uid>. A failed write leaves nothing behind and raises nothing.
- When it is rebuilt: the cache key is the root's real path plus the name and mtime of every
  class directory: adding, removing or renaming a file changes its directory's mtime. (A file
  rewritten in place under the same name is not noticed; delete the cache file after such edits.)

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
from pathlib import Path

import numpy as np

from hpcdl.data.dataset import (
    BadSample,
    DataError,
    FileEntry,
    Locate,
    SourceReader,
    check_entries,
    check_link_inside,
)
from hpcdl.data.pfs import open_source

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
INDEX_NAME = ".hpcdl-index.npz"
_INDEX_VERSION = 2  # 2: indexes of 1 were built without the name and symlink checks
# Header reads in flight: hides open latency (32 x 1 / 5 ms = 6,400 files/s on a 5 ms file
# system) while Pillow's header parsing, which holds the GIL, stays far below one core.
INDEX_THREADS = 32
IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)
_GREY_MODES = ("L", "1", "I;16")
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

    Lists each directory once and opens no file. Names with control characters and symbolic
    links that lead outside root are refused."""
    root = Path(root)
    dirs = _class_dirs(root) if dirs is None else dirs
    classes = [e.name for e in dirs]
    links = [e.name for e in dirs if e.is_symlink()]
    relpaths, labels = [], []
    for label, name in enumerate(classes):
        images = [
            e
            for e in os.scandir(root / name)
            if e.is_file() and os.path.splitext(e.name)[1].lower() in IMAGE_SUFFIXES
        ]
        links += [f"{name}/{e.name}" for e in images if e.is_symlink()]
        relpaths += [f"{name}/{f}" for f in sorted(e.name for e in images)]
        labels += [label] * len(images)
    check_entries(root, classes + relpaths)
    real_root = Path(os.path.realpath(root))
    for rel in links:
        check_link_inside(root, rel, real_root)
    if not relpaths:
        raise DataError(
            f"{root}: no images found (expected root/<class>/<file> with "
            f"{', '.join(IMAGE_SUFFIXES)} files)"
        )
    return relpaths, labels, classes


def _tree_key(root: Path, dirs: list[os.DirEntry]) -> str:
    h = hashlib.sha256(f"{_INDEX_VERSION}:{root.resolve()}".encode())
    for e in dirs:
        h.update(f"\n{e.name}:{e.stat().st_mtime_ns}".encode())
    return h.hexdigest()


def _cache_paths(root: Path) -> list[Path]:
    """Where the index may be cached, in the order tried: the root, the user's, /tmp."""
    user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpcdl"
    node = Path(tempfile.gettempdir()) / f"hpcdl-{os.getuid()}"
    name = f"index-{hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]}.npz"
    return [root / INDEX_NAME, user / name, node / name]


def _read_header(path: Path) -> tuple[int, int, int, bool]:
    """(bytes, height, width, greyscale) from one open; height 0 when the header is unreadable."""
    from PIL import Image  # noqa: PLC0415

    try:
        with open_source(path) as f:
            size = os.fstat(f.fileno()).st_size
            try:
                with Image.open(f) as im:  # parses the header only
                    return size, im.height, im.width, im.mode in _GREY_MODES
            except (OSError, SyntaxError, ValueError):
                return size, 0, 0, True  # reading it raises BadSample
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


def build_index(root: Path, key: str, dirs: list[os.DirEntry]) -> dict[str, np.ndarray]:
    """The index arrays of root (see NOTE [the index]); opens every image once."""
    relpaths, labels, classes = scan_folder(root, dirs)
    sizes, heights, widths, grey = read_headers(root, relpaths)
    return {
        "key": np.array(key),
        "paths": np.frombuffer("\n".join(relpaths).encode(), np.uint8),
        "classes": np.frombuffer("\n".join(classes).encode(), np.uint8),
        "labels": np.asarray(labels, np.int32),
        "sizes": sizes,
        "heights": heights,
        "widths": widths,
        "grey": np.array(grey),
    }


def load_index(root: Path, key: str) -> tuple[dict[str, np.ndarray], Path] | None:
    """The cached index of root with this key, and where it was found; None when there is none."""
    for path in _cache_paths(root):
        try:
            with np.load(path, allow_pickle=False) as z:
                if str(z["key"]) == key and _consistent(z):
                    return {k: z[k] for k in z.files}, path
        except (OSError, KeyError, ValueError):
            continue
    return None


def save_index(root: Path, index: dict[str, np.ndarray]) -> Path | None:
    """Cache index in the first place that takes it (see NOTE [the index]); None if none does."""
    for path in _cache_paths(root):
        if _write_atomically(path, index):
            return path
    return None


class ImageFolderDataset:
    kind = "folder"
    layout = "HWC"
    dtype = np.uint8
    named_classes = True  # class = directory name

    def __init__(self, root: str | Path, index: dict[str, np.ndarray] | None = None) -> None:
        """Open root: load the cached index or build it; `index` (another rank's
        `self.index`) is taken as it is, without touching the file system."""
        self.root = self.source = Path(root)
        self.index_path: Path | None = None
        self.index_source = "given"  # or "cache", "built"
        t0 = time.perf_counter()
        if index is None:
            index = self._load_or_build()
        self.index = index
        self.index_seconds = time.perf_counter() - t0
        names = _split(index["paths"])
        self.classes = _split(index["classes"])
        check_entries(self.root, self.classes + names, self.index_path)
        self.labels = index["labels"].astype(np.int64)
        self.heights = index["heights"].astype(np.int64)
        self.widths = index["widths"].astype(np.int64)
        self.files = [FileEntry(p, int(s)) for p, s in zip(names, index["sizes"].tolist())]
        readable = self.heights > 0
        if not readable.any():
            raise DataError(f"{self.root}: none of the {len(names)} images can be read")
        channels = 1 if bool(index["grey"]) else 3
        self.min_hw = (int(self.heights[readable].min()), int(self.widths[readable].min()))
        self._shape = (channels, *self.min_hw)
        self.mean = np.array(IMAGENET_MEAN[:channels] if channels == 3 else [127.5], np.float32)
        self.std = np.array(IMAGENET_STD[:channels] if channels == 3 else [127.5], np.float32)

    def _load_or_build(self) -> dict[str, np.ndarray]:
        dirs = _class_dirs(self.root)
        key = _tree_key(self.root, dirs)
        found = load_index(self.root, key)
        if found is not None:
            self.index_source = "cache"
            index, self.index_path = found
            return index
        self.index_source = "built"
        index = build_index(self.root, key, dirs)
        self.index_path = save_index(self.root, index)
        return index

    def ensure_cached(self, path: Path | None) -> None:
        """Make the index that another rank found at `path` findable here too (loader workers
        reopen the data set from its path): write it to this node's cache when `path` is not
        there with the same key. Touches only the cache's file system."""
        if path is not None and _cached_key(path) == str(self.index["key"]):
            self.index_path = path
            return
        self.index_path = save_index(self.root, self.index)

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        return self._shape

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def file_ids(self, indices) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"sample index out of range 0..{len(self) - 1}")
        return idx.copy()

    def reader(self, locate: Locate | None = None) -> ImageFolderReader:
        return ImageFolderReader(self, locate)


def _split(joined: np.ndarray) -> list[str]:
    """The names of an index field: UTF-8 text, one name a line (names hold no newline)."""
    return bytes(joined).decode().split("\n")


def _consistent(z) -> bool:
    """True when an index holds as many paths as labels, sizes and image shapes (else rebuild)."""
    n = int(np.count_nonzero(z["paths"] == ord("\n"))) + 1
    return all(len(z[k]) == n for k in ("labels", "sizes", "heights", "widths"))


def _cached_key(path: Path) -> str | None:
    try:
        with np.load(path, allow_pickle=False) as z:
            return str(z["key"])
    except (OSError, KeyError, ValueError):
        return None


def _write_atomically(path: Path, arrays: dict) -> bool:
    """Write path through a temporary file and a rename. False on any OSError, leaving nothing:
    on a read-only file system even the clean-up fails, and that is not an error either."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # nothing was created (EROFS, EACCES): nothing to remove
        return False


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
        """(image (h, w, C) uint8, (h / indexed h, w / indexed w)).

        draft = (w, h) the decoder may shrink a JPEG to (Pillow draft mode: DCT scaling by 1/2,
        1/4, 1/8); box = (y0, x0, h, w) in indexed pixels: return only that region (cropped by
        Pillow before the copy to NumPy)."""
        from PIL import Image  # noqa: PLC0415

        h, w = int(self.ds.heights[index]), int(self.ds.widths[index])
        f, path = self._open(index)
        try:
            with f, Image.open(f) as im:
                if draft and im.format == "JPEG":
                    im.draft(self.mode, draft)
                if im.mode != self.mode:
                    im = im.convert(self.mode)
                if h <= 0:
                    raise OSError("image header was unreadable when the index was built")
                scale = (im.height / h, im.width / w)
                if box is not None:
                    y0, x0, bh, bw = box
                    top, left = int(y0 * scale[0]), int(x0 * scale[1])
                    bottom = top + max(1, round(bh * scale[0]))
                    right = left + max(1, round(bw * scale[1]))
                    im = im.crop((left, top, right, bottom))
                arr = np.asarray(im)
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
            raise BadSample(path, index, str(exc)) from None
        if arr.ndim == 2:
            arr = arr[:, :, None]
        return arr, scale

    def close(self) -> None:
        pass
