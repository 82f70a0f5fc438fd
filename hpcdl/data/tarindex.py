"""The shards of a tar data set and what one shard holds (hpcdl.data.tarshards builds the index).

A shard is read with seeks: each member's header is parsed (hpcdl.data.tarheaders: ustar, GNU
long names, pax) and its data skipped. Only the label members and the first bytes of each
image (its header: a JPEG's frame header found by hand, anything else parsed by Pillow) are
read. WebDataset's rule groups the members
into samples: the key is the member's path up to the first dot of its base name, the extension
the rest ("a/x.seg.png": key "a/x", extension "seg.png").
"""

from __future__ import annotations

import io
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hpcdl.data.dataset import DataError, check_entries, check_link_inside
from hpcdl.data.image_file import (
    GREY_MODES,
    MAX_IMAGE_PIXELS,
    ImageTooLarge,
    check_pixels,
    open_image,
)
from hpcdl.data.tarheaders import ShardWindow, tar_members

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
LABEL_EXTENSIONS = ("cls", "json", "txt")  # the first one a sample has is its label
COMPRESSED_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst")
_COMPRESSED_MAGIC = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ", b"\x28\xb5\x2f\xfd")
_BRACE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_GLOB = re.compile(r"[*?[]|\{[^{}]*,[^{}]*\}")  # a shell glob or a {a,b} list
_LIST = re.compile(r"[,\s]")  # paths joined by commas or spaces
# A pattern names at most this many shards (ImageNet's WebDataset: 1,024 to 147,000): past it a
# typed digit too many would stat every name (two million: 15 s, 330 MB) before any error.
MAX_PATTERN_NAMES = 1_000_000
# Bytes of an image read for its header, each tried in turn until it parses (then all of it).
_HEADER_PREFIXES = (1 << 12, 1 << 16, 1 << 62)

# Why a sample cannot be read (the index's "flaws" column); 0: readable.
TRUNCATED, NO_LABEL, TWO_IMAGES, BAD_LABEL, LABEL_RANGE, BAD_IMAGE, TOO_LARGE = 1, 2, 3, 4, 5, 6, 7
FLAW_REASONS = {
    TRUNCATED: "the shard ends inside this sample's members (truncated); restore the shard",
    NO_LABEL: "the sample has an image but no label member (.cls, .json or .txt)",
    TWO_IMAGES: "two image members share this sample's key; give each image its own key",
    BAD_LABEL: "its label member holds no usable label (.cls: an integer; .txt: a class name; "
    '.json: {"label": ...} or {"cls": ...})',
    LABEL_RANGE: "its label is outside the data set's classes",
    BAD_IMAGE: "its image header cannot be parsed (not a JPEG, PNG or WebP image)",
    TOO_LARGE: f"its image has more than {MAX_IMAGE_PIXELS} pixels, more than hpcdl decodes "
    "(Pillow's limit against decompression bombs); shrink it or remove it",
}


def is_brace_pattern(source: str | Path) -> bool:
    """True for a shard pattern such as shards-{000000..001023}.tar."""
    return _BRACE.search(Path(source).name) is not None


def unsupported_pattern(source: str | Path, lists: bool = True) -> DataError | None:
    """The one line for a --data value that is a pattern hpcdl does not expand (a glob, a
    {a,b} list; with lists, paths joined by commas or spaces), else None; without lists only
    the last name is looked at. For a path that is not there: an existing one may hold these."""
    text = str(source) if lists else Path(source).name
    if not (_GLOB.search(text) or (lists and _LIST.search(text))):
        return None
    return DataError(
        f"{source}: no such file or directory; of shard patterns hpcdl expands only the numeric "
        "range {a..b} (shard-{000000..000099}.tar): globs (*, ?, [...]), {a,b} lists and lists "
        "of paths are not supported; give a directory of shards, one file or such a range"
    )


def shard_names(source: Path) -> list[str]:
    """The shard names a brace pattern stands for, in order; DataError for a range that counts
    down, or more than MAX_PATTERN_NAMES names."""
    total = 1
    for match in _BRACE.finditer(source.name):
        first, last = match.group(1), match.group(2)
        if int(first) > int(last):
            raise DataError(
                f"{source}: the range {{{first}..{last}}} counts down; the shards are read in "
                "the order the pattern names them (the data set's sample order), so write it "
                f"counting up: {{{last}..{first}}}"
            )
        total *= int(last) - int(first) + 1
    if total > MAX_PATTERN_NAMES:
        raise DataError(
            f"{source}: the pattern stands for {total} names, more than the {MAX_PATTERN_NAMES} "
            "shards one pattern may name; check the range's digits"
        )
    return expand_braces(source.name)


def expand_braces(name: str) -> list[str]:
    """Every name a pattern stands for, in order; {a..b} keeps a's zero padding (a <= b:
    shard_names checks)."""
    match = _BRACE.search(name)
    if match is None:
        return [name]
    first, last = match.group(1), match.group(2)
    width = len(first) if first.startswith("0") else 0
    head, tail = name[: match.start()], name[match.end() :]
    return [
        f"{head}{i:0{width}d}{rest}"
        for i in range(int(first), int(last) + 1)
        for rest in expand_braces(tail)
    ]


def is_compressed_name(name: str) -> bool:
    return name.lower().endswith(COMPRESSED_SUFFIXES)


def recompress_error(path: Path | str) -> DataError:
    return DataError(
        f"{path}: a compressed tar shard; hpcdl reads samples in place from plain .tar files: "
        "decompress the shards (gunzip, bunzip2, unxz or unzstd each one) and pass their directory"
    )


def shard_root(source: str | Path) -> Path:
    """The directory the shards of source (a directory, a .tar or a pattern) are in."""
    source = Path(source)
    return source if source.is_dir() and not is_brace_pattern(source) else source.parent


def list_shards(source: str | Path) -> tuple[Path, list[str]]:
    """(root, shard names relative to it) of a directory of *.tar, one .tar file or a brace
    pattern; DataError when none is there, one is missing or compressed."""
    source = Path(source)
    if is_brace_pattern(source):
        root, names = source.parent, shard_names(source)
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            unexpanded = unsupported_pattern(source, lists=False)  # a glob beside the range
            if unexpanded is not None:
                raise unexpanded
            raise DataError(
                f"{source}: {len(missing)} of its {len(names)} shards are missing, the first "
                f"{root / missing[0]}; fix the pattern or restore them"
            )
    elif source.is_dir():
        root = source
        entries = sorted(e.name for e in os.scandir(root) if e.is_file())
        names = [n for n in entries if n.lower().endswith(".tar")]
        compressed = [n for n in entries if is_compressed_name(n)]
        if compressed:  # beside plain ones too: its samples would be left out unsaid
            raise recompress_error(root / compressed[0])
        if not names:
            raise DataError(f"{root}: no tar shards (*.tar) in this directory")
    else:
        root, names = source.parent, [source.name]
    if any(is_compressed_name(n) for n in names):
        raise recompress_error(root / next(n for n in names if is_compressed_name(n)))
    check_entries(root, names)
    real_root = Path(os.path.realpath(root))
    for name in names:
        if (root / name).is_symlink():
            check_link_inside(root, name, real_root)
    return root, names


@dataclass
class ShardSample:
    """One key's members in a shard while the shard is read: the image (name, offset, length),
    its label members {extension: (offset, length)} and flaw."""

    image: tuple[str, int, int] | None = None
    label_members: dict[str, tuple[int, int]] = field(default_factory=dict)
    flaw: int = 0


@dataclass
class ShardContents:
    """What one shard holds: its byte size and mtime, per sample the image member's name and
    raw label (int: a class index; str: a class name; None: see flaws), and the columns
    data_at, data_len, heights, widths (int64) and flaws (int8); whether every readable image
    is greyscale; a warning line or ""."""

    size: int
    mtime_ns: int
    images: list[str]
    labels: list[int | str | None]
    columns: dict[str, np.ndarray]
    grey: bool
    warning: str = ""


def split_member(name: str) -> tuple[str, str]:
    """(key, extension in lower case) of a member path (WebDataset's rule)."""
    head, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{head}/{stem}" if head else stem), ext.lower()


def read_shard(path: Path) -> ShardContents:
    """The samples of one shard (see the module docstring); DataError when it is not a tar or
    cannot be read."""
    try:
        return _read_shard(path)
    except OSError as exc:
        raise DataError(f"{path}: cannot be read to index it ({exc.strerror or exc})") from None


def _read_shard(path: Path) -> ShardContents:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if os.pread(fd, 4, 0).startswith(_COMPRESSED_MAGIC):
            raise recompress_error(path)
        window = ShardWindow(fd, keep=_HEADER_PREFIXES[0])  # labels and image heads
        members, cut = tar_members(fd, st.st_size, window)
        if cut == 0:
            raise DataError(f"{path}: not a tar file (no valid header at its start)")
        samples = _group(members, st.st_size)
        n = len(samples)
        columns = {name: np.zeros(n, np.int64) for name in ("data_at", "data_len")}
        columns.update(heights=np.zeros(n, np.int64), widths=np.zeros(n, np.int64))
        columns["flaws"] = np.zeros(n, np.int8)
        labels, grey = [], True
        for i, sample in enumerate(samples):
            label, (h, w, g) = _read_sample(window, sample)
            _, columns["data_at"][i], columns["data_len"][i] = sample.image
            columns["heights"][i], columns["widths"][i] = h, w
            columns["flaws"][i] = sample.flaw
            labels.append(label)
            grey = grey and (g or sample.flaw != 0)
    finally:
        os.close(fd)
    warning = ""
    if st.st_size == 0:  # the typical failed copy
        warning = f"{path} is empty (0 bytes: a failed copy?), so it has no samples; restore it"
    elif cut is not None:
        warning = (
            f"{path} is truncated or damaged at byte {cut} ({st.st_size} bytes): the members "
            "after it are not in the index; restore the shard"
        )
    images = [s.image[0] for s in samples]
    return ShardContents(st.st_size, st.st_mtime_ns, images, labels, columns, grey, warning)


def _group(members: list[tuple[str, int, int]], size: int) -> list[ShardSample]:
    """Samples in order of their first member; keys without an image are not samples."""
    by_key: dict[str, ShardSample] = {}
    for name, offset, length in members:
        key, ext = split_member(name)
        if key.rpartition("/")[2] == "":
            continue  # a hidden file (".x"): no key
        sample = by_key.get(key)
        if sample is None:
            sample = by_key[key] = ShardSample()
        if offset + length > size:
            sample.flaw = sample.flaw or TRUNCATED
        if ext in IMAGE_EXTENSIONS:
            if sample.image is not None:
                sample.flaw = sample.flaw or TWO_IMAGES
            sample.image = (name, offset, length)
        elif ext in LABEL_EXTENSIONS:
            sample.label_members[ext] = (offset, length)
    return [s for s in by_key.values() if s.image is not None]


def _read_sample(
    window: ShardWindow, sample: ShardSample
) -> tuple[int | str | None, tuple[int, int, bool]]:
    """(label, (height, width, greyscale)) of a sample; sets its flaw where it has one. Read
    through the shard's window: the label and the image's head were kept while its headers
    were read, where the window held them."""
    none = (0, 0, True)
    if sample.flaw:
        return None, none
    ext = next((e for e in LABEL_EXTENSIONS if e in sample.label_members), None)
    if ext is None:
        sample.flaw = NO_LABEL
        return None, none
    offset, length = sample.label_members[ext]
    label = parse_label(ext, window.read(length, offset))
    if label is None:
        sample.flaw = BAD_LABEL
        return None, none
    _, offset, length = sample.image
    header = None
    for prefix in _HEADER_PREFIXES:  # a few KB, past a camera's EXIF block, the whole image
        try:
            header = image_header(window.read(min(length, prefix), offset))
        except ImageTooLarge:
            sample.flaw = TOO_LARGE
            return label, none
        if header is not None or length <= prefix:
            break
    if header is None:
        sample.flaw = BAD_IMAGE
        return label, none
    return label, header


def parse_label(ext: str, data: bytes) -> int | str | None:
    """A label member's class index (int) or class name (str); None when it holds neither.

    .cls: a decimal integer; .txt: a class name (its text, stripped); .json: an object whose
    "label" (else "cls") field is an integer or a class name."""
    try:
        text = data.decode().strip()
        if ext == "cls":
            return int(text)
        if ext == "txt":
            return text or None
        value = json.loads(text)
        value = value.get("label", value.get("cls")) if isinstance(value, dict) else None
    except (UnicodeDecodeError, ValueError):
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        return None
    return value


def image_header(data: bytes) -> tuple[int, int, bool] | None:
    """(height, width, greyscale) of an image's first bytes, as Pillow opens it (greyscale:
    mode L, 1 or I;16); None when it cannot be parsed, ImageTooLarge over
    image_file.MAX_IMAGE_PIXELS. A JPEG's frame header is found by hand
    (a tenth of Pillow's cost); anything else is Pillow's."""
    found = jpeg_frame(data)
    if found is not None:
        check_pixels(found[0], found[1])
        return found
    try:
        with open_image(io.BytesIO(data)) as im:
            return im.height, im.width, im.mode in GREY_MODES
    except ImageTooLarge:
        raise
    except (OSError, SyntaxError, ValueError):
        return None


def jpeg_frame(data: bytes) -> tuple[int, int, bool] | None:
    """(height, width, one component) from a JPEG's start-of-frame marker; None when data is
    not a JPEG whose frame header lies within it (Pillow then decides)."""
    if data[:2] != b"\xff\xd8":
        return None
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            i += 2
            continue
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            frame = data[i + 4 : i + 10]  # precision, height, width, components
            if len(frame) < 6 or frame[1:3] == b"\0\0":
                return None
            height, width = int.from_bytes(frame[1:3], "big"), int.from_bytes(frame[3:5], "big")
            return height, width, frame[5] == 1
        i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
    return None
