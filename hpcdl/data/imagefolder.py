"""Image folder data set: root/<class>/<file> with JPEG or PNG files, decoded by Pillow.

The index (relative paths, labels, byte sizes, image heights and widths) is built once by
walking the tree and reading each image header, then cached in root/.hpcdl-index.npz, or in
$XDG_CACHE_HOME/hpcdl (default ~/.cache/hpcdl) when root is not writable. The cache key is the
root's real path plus the name and mtime of every class directory: adding, removing or renaming
a file changes its directory's mtime and triggers a re-index. (A file rewritten in place under
the same name is not noticed; delete the cache file after such edits.)

sample_shape is (C, min height, min width) over the tree; C = 1 when every image is greyscale,
else 3. Pixel statistics default to ImageNet's mean/std (0..255 units).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from hpcdl.data.dataset import (
    BadSample,
    DataError,
    FileEntry,
    Locate,
    SourceReader,
)
from hpcdl.data.pfs import open_source

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
INDEX_NAME = ".hpcdl-index.npz"
_INDEX_VERSION = 1
IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)


def scan_folder(root: Path) -> tuple[list[str], list[int], list[str]]:
    """(relative paths, labels, class names) of root/<class>/<image>, sorted; DataError if none."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: not a directory (expected root/<class>/<image files>)")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    relpaths, labels = [], []
    for label, name in enumerate(classes):
        files = sorted(
            e.name
            for e in os.scandir(root / name)
            if e.is_file() and os.path.splitext(e.name)[1].lower() in IMAGE_SUFFIXES
        )
        relpaths += [f"{name}/{f}" for f in files]
        labels += [label] * len(files)
    if not relpaths:
        raise DataError(
            f"{root}: no images found (expected root/<class>/<file> with "
            f"{', '.join(IMAGE_SUFFIXES)} files)"
        )
    return relpaths, labels, classes


def _tree_key(root: Path) -> str:
    h = hashlib.sha256(f"{_INDEX_VERSION}:{root.resolve()}".encode())
    for e in sorted(os.scandir(root), key=lambda e: e.name):
        if e.is_dir() and not e.name.startswith("."):
            h.update(f"\n{e.name}:{e.stat().st_mtime_ns}".encode())
    return h.hexdigest()


def _cache_paths(root: Path) -> list[Path]:
    user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpcdl"
    name = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
    return [root / INDEX_NAME, user / f"index-{name}.npz"]


class ImageFolderDataset:
    kind = "folder"
    layout = "HWC"
    dtype = np.uint8

    def __init__(self, root: str | Path) -> None:
        self.root = self.source = Path(root)
        self.index_path: Path | None = None
        key = _tree_key(self.root)
        index = self._load_index(key) or self._build_index(key)
        names = bytes(index["paths"]).decode().split("\n")
        self.classes = [str(c) for c in bytes(index["classes"]).decode().split("\n")]
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

    def _load_index(self, key: str):
        for path in _cache_paths(self.root):
            try:
                with np.load(path, allow_pickle=False) as z:
                    if str(z["key"]) == key:
                        self.index_path = path
                        return {k: z[k] for k in z.files}
            except (OSError, KeyError, ValueError):
                continue
        return None

    def _build_index(self, key: str) -> dict:
        from PIL import Image  # noqa: PLC0415

        relpaths, labels, classes = scan_folder(self.root)
        n = len(relpaths)
        sizes, hs, ws = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64)
        grey = True
        for i, rel in enumerate(relpaths):
            path = self.root / rel
            sizes[i] = path.stat().st_size
            try:
                with Image.open(path) as im:  # header only
                    ws[i], hs[i] = im.size
                    grey = grey and im.mode in ("L", "1", "I;16")
            except (OSError, SyntaxError, ValueError):
                pass  # height 0 marks it unreadable; reading it raises BadSample
        index = {
            "key": np.array(key),
            "paths": np.frombuffer("\n".join(relpaths).encode(), np.uint8),
            "classes": np.frombuffer("\n".join(classes).encode(), np.uint8),
            "labels": np.asarray(labels, np.int32),
            "sizes": sizes,
            "heights": hs,
            "widths": ws,
            "grey": np.array(grey),
        }
        for path in _cache_paths(self.root):
            if _write_atomically(path, index):
                self.index_path = path
                break
        return index

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


def _write_atomically(path: Path, arrays: dict) -> bool:
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
        tmp.unlink(missing_ok=True)
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
