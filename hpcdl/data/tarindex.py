"""The shards of a tar data set and what one shard holds (hpcdl.data.tarshards builds the index).

A shard is read with seeks: Python's tarfile parses each member's header (GNU long names and pax
headers included) and seeks over its data. Only the label members and the first bytes of each
image (enough for Pillow to parse its header) are read. WebDataset's rule groups the members
into samples: the key is the member's path up to the first dot of its base name, the extension
the rest ("a/x.seg.png": key "a/x", extension "seg.png").
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from hpcdl.data.dataset import DataError, check_entries, check_link_inside

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
LABEL_EXTENSIONS = ("cls", "json", "txt")  # the first one a sample has is its label
COMPRESSED_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst")
_COMPRESSED_MAGIC = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ", b"\x28\xb5\x2f\xfd")
_BRACE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_HEADER_PREFIX = 1 << 16  # bytes of an image read for its header (all of it when that fails)
_GREY_MODES = ("L", "1", "I;16")

# Why a sample cannot be read (the index's "flaws" column); 0: readable.
TRUNCATED, NO_LABEL, TWO_IMAGES, BAD_LABEL, LABEL_RANGE, BAD_IMAGE = 1, 2, 3, 4, 5, 6
FLAW_REASONS = {
    TRUNCATED: "the shard ends inside this sample's members (truncated); restore the shard",
    NO_LABEL: "the sample has an image but no label member (.cls, .json or .txt)",
    TWO_IMAGES: "two image members share this sample's key; give each image its own key",
    BAD_LABEL: "its label member holds no usable label (.cls: an integer; .txt: a class name; "
    '.json: {"label": ...} or {"cls": ...})',
    LABEL_RANGE: "its label is outside the data set's classes",
    BAD_IMAGE: "its image header cannot be parsed (not a JPEG, PNG or WebP image)",
}


def is_brace_pattern(source: str | Path) -> bool:
    """True for a shard pattern such as shards-{000000..001023}.tar."""
    return _BRACE.search(Path(source).name) is not None


def expand_braces(name: str) -> list[str]:
    """Every name a pattern stands for, in order; {a..b} keeps a's zero padding."""
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
        root, names = source.parent, expand_braces(source.name)
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            raise DataError(
                f"{source}: {len(missing)} of its {len(names)} shards are missing, the first "
                f"{root / missing[0]}; fix the pattern or restore them"
            )
    elif source.is_dir():
        root = source
        entries = sorted(e.name for e in os.scandir(root) if e.is_file())
        names = [n for n in entries if n.lower().endswith(".tar")]
        if not names:
            compressed = [n for n in entries if is_compressed_name(n)]
            if compressed:
                raise recompress_error(root / compressed[0])
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
    """One key's members in a shard: the image (name, offset, length), its label or flaw."""

    key: str
    image: tuple[str, int, int] | None = None
    label: int | str | None = None  # int: a class index; str: a class name
    flaw: int = 0
    height: int = 0
    width: int = 0
    grey: bool = True
    label_members: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass
class ShardContents:
    """What one shard holds: its byte size, mtime, samples in order, and a warning if any."""

    size: int
    mtime_ns: int
    samples: list[ShardSample]
    warning: str = ""


def split_member(name: str) -> tuple[str, str]:
    """(key, extension in lower case) of a member path (WebDataset's rule)."""
    head, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{head}/{stem}" if head else stem), ext.lower()


def read_shard(path: Path) -> ShardContents:
    """The samples of one shard (see the module docstring); DataError when it is not a tar."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        members, cut = _members(f, path, st.st_size)
        samples = _group(members, st.st_size)
        for sample in samples:
            _read_sample(f.fileno(), sample)
    warning = ""
    if cut is not None and cut < st.st_size:  # else a member was cut: its sample is flawed
        warning = (
            f"{path} is truncated or damaged at byte {cut} ({st.st_size} bytes): the members "
            "after it are not in the index; restore the shard"
        )
    return ShardContents(st.st_size, st.st_mtime_ns, samples, warning)


def _members(f, path: Path, size: int) -> tuple[list[tuple[str, int, int]], int | None]:
    """([(name, data offset, length)] of the regular members, byte where parsing stopped early
    or None)."""
    if f.read(4).startswith(_COMPRESSED_MAGIC):
        raise recompress_error(path)
    f.seek(0)
    try:
        tar = tarfile.open(fileobj=f, mode="r:")
    except tarfile.TarError as exc:
        raise DataError(f"{path}: not a tar file ({exc}); give plain .tar shards") from None
    out: list[tuple[str, int, int]] = []
    cut = None
    while True:
        try:
            info = tar.next()
        except tarfile.TarError:
            cut = tar.offset
            break
        if info is None:
            break
        tar.members.clear()  # the list of TarInfo is not needed: keep memory flat
        if info.isfile():
            out.append((info.name, info.offset_data, info.size))
    if cut is None and size > tar.offset:
        f.seek(tar.offset)
        rest = f.read(512)
        cut = tar.offset if rest.strip(b"\0") else None
    return out, cut


def _group(members: list[tuple[str, int, int]], size: int) -> list[ShardSample]:
    """Samples in order of their first member; keys without an image are not samples."""
    by_key: dict[str, ShardSample] = {}
    for name, offset, length in members:
        key, ext = split_member(name)
        if not key or key.rpartition("/")[2] == "":
            continue  # a hidden file (".x"): no key
        sample = by_key.setdefault(key, ShardSample(key))
        if offset + length > size:
            sample.flaw = sample.flaw or TRUNCATED
        if ext in IMAGE_EXTENSIONS:
            if sample.image is not None:
                sample.flaw = sample.flaw or TWO_IMAGES
            sample.image = (name, offset, length)
        elif ext in LABEL_EXTENSIONS:
            sample.label_members[ext] = (offset, length)
    return [s for s in by_key.values() if s.image is not None]


def _read_sample(fd: int, sample: ShardSample) -> None:
    """Fill the sample's label and image header (or its flaw)."""
    if sample.flaw:
        return
    ext = next((e for e in LABEL_EXTENSIONS if e in sample.label_members), None)
    if ext is None:
        sample.flaw = NO_LABEL
        return
    offset, length = sample.label_members[ext]
    sample.label = parse_label(ext, os.pread(fd, length, offset))
    if sample.label is None:
        sample.flaw = BAD_LABEL
        return
    _, offset, length = sample.image
    header = _image_header(os.pread(fd, min(length, _HEADER_PREFIX), offset))
    if header is None and length > _HEADER_PREFIX:
        header = _image_header(os.pread(fd, length, offset))
    if header is None:
        sample.flaw = BAD_IMAGE
        return
    sample.height, sample.width, sample.grey = header


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


def _image_header(data: bytes) -> tuple[int, int, bool] | None:
    """(height, width, greyscale) of an image's first bytes; None when Pillow cannot parse it."""
    from PIL import Image  # noqa: PLC0415

    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.height, im.width, im.mode in _GREY_MODES
    except (OSError, SyntaxError, ValueError):
        return None
