"""PyTorch's `.pth`/`.pt` state-dict files, read and written without importing PyTorch.

PyTorch is imported only by hpcdl.torch and the benchmarks (docs/internals.md, "Layers"), yet
`--init-from model.pth` and `python -m hpcdl.export --to torch` sit below them. So this
module knows the file format itself, as hpcdl.data knows HDF5's layout through h5py and not
through a framework. The format (torch.save since PyTorch 1.6, "version 3"):
- an uncompressed zip whose records sit under one top directory `<name>/`;
- `<name>/data.pkl`: a pickle (protocol 2) of the state dict; each tensor is
  `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks)`, each
  storage a persistent id `('storage', torch.<Type>Storage, key, location, numel)`;
- `<name>/data/<key>`: that storage's raw bytes; `<name>/byteorder` ("little"), `<name>/version`.
Reading is restricted as `torch.load(weights_only=True)` is: besides plain containers and
numbers, the pickle may name only tensors, storages, parameters and OrderedDict; anything else
refuses the file (PthError, one line), so a file never runs code. PyTorch's older format (before
1.6, a pickle that starts with torch's magic number) is refused with a line saying how to
re-save it; a file cut short or damaged, an empty one and anything else each get their own
line, and a tensor is never read past the end of its record.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import struct
import zipfile
from typing import Any

import numpy as np

# torch.<name> storage class -> NumPy dtype of its elements (bfloat16: raw uint16, widened)
STORAGE_DTYPES = {
    "FloatStorage": np.float32,
    "DoubleStorage": np.float64,
    "HalfStorage": np.float16,
    "BFloat16Storage": np.uint16,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}
STORAGE_OF = {np.dtype(v): k for k, v in STORAGE_DTYPES.items() if k != "BFloat16Storage"}
ARCHIVE = "archive"  # the top directory torch.save uses when it writes to a stream
ZIP_MAGIC = b"PK\x03\x04"  # a zip's first local header
# torch.save before 1.6: PROTO n, then the magic number 0x1950a86a20f9469cfc6c as LONG1
LEGACY_MAGIC = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)[2:-1]


class PthError(ValueError):
    """The file is not a state dict in PyTorch's zip format: one line saying why."""


class _Storage:
    """A storage class named by the pickle (torch.FloatStorage, ...)."""

    def __init__(self, name: str) -> None:
        self.name = name


def _rebuild_tensor(storage, offset, size, stride, requires_grad=False, hooks=None, meta=None):
    """The array a tensor views: `size` elements at `stride` from `offset` in the storage."""
    itemsize = storage.dtype.itemsize
    extent = 0 if 0 in size else offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1
    if offset < 0 or min(stride, default=0) < 0 or extent > storage.size:
        raise pickle.UnpicklingError(
            f"a tensor of shape {tuple(size)} needs {extent * itemsize} bytes of its storage "
            f"record, which has {storage.size * itemsize}: the file is truncated or damaged"
        )
    view = np.lib.stride_tricks.as_strided(
        storage[offset:], shape=tuple(size), strides=tuple(s * itemsize for s in stride)
    )
    return np.array(view)  # a copy: the storage's buffer belongs to the zip reader


def _rebuild_parameter(data, requires_grad=False, hooks=None):
    return data


_ALLOWED = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
}


class _Unpickler(pickle.Unpickler):
    """A pickle that may build tensors, storages and dicts only; storages come from the zip."""

    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str, order: str) -> None:
        super().__init__(io.BytesIO(data))
        self.archive, self.prefix, self.order = archive, prefix, "<" if order == "little" else ">"
        self.storages: dict[str, np.ndarray] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and name in STORAGE_DTYPES:
            return _Storage(name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, not a tensor or a dict")

    def persistent_load(self, pid: Any) -> np.ndarray:
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage" and len(pid) >= 3):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        kind, key = pid[1], str(pid[2])
        if not isinstance(kind, _Storage):
            raise pickle.UnpicklingError(f"storage of unknown type {kind!r}")
        if key not in self.storages:
            raw = self.archive.read(f"{self.prefix}data/{key}")
            dtype = np.dtype(STORAGE_DTYPES[kind.name]).newbyteorder(self.order)
            array = np.frombuffer(raw, dtype=dtype)
            if kind.name == "BFloat16Storage":  # the upper half of a float32
                array = (array.astype(np.uint32) << 16).view(np.float32)
            self.storages[key] = array
        return self.storages[key]


def read_pth(path: str | os.PathLike) -> Any:
    """The object torch.save wrote to path (a state dict: names -> NumPy arrays); PthError."""
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise _not_a_zip(path) from None
    with archive:
        pickles = [n for n in archive.namelist() if n.rpartition("/")[2] == "data.pkl"]
        if len(pickles) != 1:
            raise PthError(f"a zip with {len(pickles)} data.pkl records, not one")
        prefix = pickles[0][: -len("data.pkl")]
        names = set(archive.namelist())
        order = "little"
        if prefix + "byteorder" in names:
            order = archive.read(prefix + "byteorder").decode().strip()
        try:
            return _Unpickler(archive.read(pickles[0]), archive, prefix, order).load()
        except zipfile.BadZipFile as exc:  # a record's checksum or header
            raise PthError(f"a damaged zip ({exc}): copy or save the file again") from None
        except (pickle.UnpicklingError, KeyError, ValueError, TypeError, EOFError) as exc:
            raise PthError(str(exc).strip("'\"").splitlines()[0] or type(exc).__name__) from None


def _not_a_zip(path: str | os.PathLike) -> PthError:
    """Why a file zipfile cannot open is no state dict: empty, cut short, PyTorch's format
    before 1.6 (its pickle starts with torch's magic number), or something else."""
    with open(path, "rb") as f:
        head = f.read(len(LEGACY_MAGIC) + 2)
    if not head:
        return PthError("an empty file; save the state dict again")
    if head.startswith(ZIP_MAGIC):
        return PthError(
            "truncated or damaged: a zip without its directory at the end (a save or a copy "
            "cut short); copy or save the file again"
        )
    if head[:1] == b"\x80" and head[2:] == LEGACY_MAGIC:
        return PthError(
            "PyTorch's format before 1.6 is not read; re-save it with "
            "torch.save(torch.load(f), f) under PyTorch 1.6 or later"
        )
    return PthError(
        "not a PyTorch file (torch.save writes a zip; this is none, nor PyTorch's older "
        "pickle); give a state dict saved by torch.save"
    )


def write_pth(state: dict[str, np.ndarray], path: str | os.PathLike) -> None:
    """Write state (names -> arrays) as torch.save would; torch.load(weights_only=True) reads
    it back as a dict of tensors."""
    arrays = [np.asarray(v, order="C") for v in state.values()]  # keeps 0-d arrays 0-d
    for key, array in zip(state, arrays):
        if array.dtype not in STORAGE_OF:
            raise PthError(f"{key}: dtype {array.dtype} has no PyTorch storage type")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(f"{ARCHIVE}/data.pkl", _pickle(list(state), arrays))
        archive.writestr(f"{ARCHIVE}/byteorder", "little")
        for i, array in enumerate(arrays):
            little = array.astype(array.dtype.newbyteorder("<"))
            archive.writestr(f"{ARCHIVE}/data/{i}", little.tobytes())
        archive.writestr(f"{ARCHIVE}/version", "3\n")


def _pickle(keys: list[str], arrays: list[np.ndarray]) -> bytes:
    """data.pkl: OrderedDict(key -> _rebuild_tensor_v2(storage i, 0, shape, strides, False,
    OrderedDict())), in pickle protocol 2 opcodes (pickle itself would import torch to check
    the names it writes)."""
    out = bytearray(b"\x80\x02")  # PROTO 2
    out += _global("collections", "OrderedDict") + b")R("  # OrderedDict(); MARK
    for i, (key, array) in enumerate(zip(keys, arrays)):
        strides = [s // array.itemsize for s in array.strides]
        out += _text(key) + _global("torch._utils", "_rebuild_tensor_v2") + b"("  # MARK args
        out += b"(" + _text("storage") + _global("torch", STORAGE_OF[array.dtype])
        out += _text(str(i)) + _text("cpu") + _int(array.size) + b"tQ"  # TUPLE BINPERSID
        out += _int(0) + _tuple(array.shape) + _tuple(strides) + b"\x89"  # offset... NEWFALSE
        out += _global("collections", "OrderedDict") + b")R" + b"tR"  # hooks; TUPLE REDUCE
    return bytes(out + b"u.")  # SETITEMS STOP


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _text(value: str) -> bytes:
    data = value.encode()
    return b"X" + struct.pack("<I", len(data)) + data  # BINUNICODE


def _int(value: int) -> bytes:
    if -(2**31) <= value < 2**31:
        return b"J" + struct.pack("<i", value)  # BININT
    data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(data)]) + data  # LONG1


def _tuple(values: Any) -> bytes:
    return b"(" + b"".join(_int(int(v)) for v in values) + b"t"
