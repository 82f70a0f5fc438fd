"""Array backend: NumPy on CPU, CuPy on GPU, chosen once per process.

Layers never ask which backend is active: they take the array module of their inputs
(`array_module(x)`). Only process setup (device binding) and data movement live here.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import numpy as np

_DEVICES = ("cpu", "gpu")


class BackendError(RuntimeError):
    """The requested device cannot be used (no CuPy, no GPU)."""


def cupy_or_none() -> ModuleType | None:
    """Return the cupy module when it imports and sees at least one GPU, else None."""
    try:
        import cupy  # noqa: PLC0415
    except ImportError:
        return None
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
    except Exception:  # driver missing or broken: treat as no GPU
        return None
    return cupy


def gpu_available() -> bool:
    return cupy_or_none() is not None


def select(device: str, local_rank: int = 0) -> ModuleType:
    """numpy for 'cpu'; for 'gpu' bind to GPU (local_rank % visible GPUs) and return cupy.

    CUDA_VISIBLE_DEVICES is respected because CuPy only enumerates the visible devices.
    """
    if device not in _DEVICES:
        raise BackendError(f"device must be one of {_DEVICES}, got {device!r}")
    if device == "cpu":
        return np
    cp = cupy_or_none()
    if cp is None:
        raise BackendError(f"--device gpu needs CuPy and an NVIDIA GPU: {_no_gpu_reason()}")
    count = cp.cuda.runtime.getDeviceCount()
    cp.cuda.Device(local_rank % count).use()
    return cp


def try_select(device: str, local_rank: int = 0) -> tuple[ModuleType | None, str | None]:
    """select() that returns (module, None), or (None, why) instead of raising BackendError.

    For start-up code that must agree across ranks before stopping: a rank on a node without a
    GPU must not leave the others waiting in a collective."""
    try:
        return select(device, local_rank), None
    except BackendError as exc:
        return None, str(exc)


def _no_gpu_reason() -> str:
    """Why cupy_or_none() found nothing, and what to do, for the --device gpu error."""
    try:
        import cupy  # noqa: F401, PLC0415
    except ImportError:
        return (
            "CuPy is not installed; install the 'gpu' extra (pip install 'hpcdl[gpu]') "
            "or run with --device cpu"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})"
    return f"CuPy sees no GPU{where}; run on a node with a GPU or with --device cpu"


def array_module(x: Any) -> ModuleType:
    """The array module (numpy or cupy) that owns x."""
    if isinstance(x, np.ndarray) or np.isscalar(x):
        return np
    mod = type(x).__module__.split(".")[0]
    if mod == "cupy":
        import cupy  # noqa: PLC0415

        return cupy
    return np


def is_device_array(x: Any) -> bool:
    return array_module(x) is not np


def to_host(x: Any) -> np.ndarray:
    """Copy a device array to a NumPy array (no copy for NumPy input)."""
    if is_device_array(x):
        return x.get()
    return np.asarray(x)


def to_device(x: np.ndarray, xp: ModuleType) -> Any:
    """Move a host array to the backend xp (no copy when xp is numpy)."""
    if xp is np:
        return x
    return xp.asarray(x)


def synchronize(xp: ModuleType) -> None:
    """Wait for queued device work (no-op for numpy); used where a step is timed."""
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def pinned_empty(shape: tuple[int, ...] | int, dtype: Any = np.float32) -> np.ndarray:
    """A NumPy array backed by page-locked host memory when CuPy is present, else ordinary memory.

    Pinned memory lets device<->host copies run asynchronously on a CUDA stream. The returned
    array keeps the pinned allocation alive through its base.
    """
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dtype = np.dtype(dtype)
    cp = cupy_or_none()
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if cp is None or nbytes == 0:
        return np.empty(shape, dtype)
    mem = cp.cuda.alloc_pinned_memory(nbytes)
    return np.frombuffer(mem, dtype, int(np.prod(shape))).reshape(shape)


def visible_gpu_count() -> int:
    cp = cupy_or_none()
    return 0 if cp is None else int(cp.cuda.runtime.getDeviceCount())


def cpu_threads_hint() -> int:
    """Cores usable by this process (affinity-aware)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# The BLAS threads NumPy runs in this process, as hpcdl.comm.blas_threads.apply() set them;
# None until something sets them (NumPy's default: one per core). Layers read it to choose
# between one whole-batch GEMM and chunked ones (hpcdl.nn.conv) without asking threadpoolctl
# on every call.
_blas_threads: int | None = None


def set_blas_threads(threads: int | None) -> None:
    """Record the BLAS threads NumPy now runs (None: unknown, NumPy's default)."""
    global _blas_threads
    _blas_threads = threads


def blas_threads() -> int | None:
    """The BLAS threads recorded by set_blas_threads(), or None when never set."""
    return _blas_threads


# Threads that layers run their CPU chunks on (hpcdl.nn.conv), each calling a one-thread BLAS.
_compute_threads = 1


def set_compute_threads(threads: int) -> None:
    """Run chunked layer work on `threads` threads (1: in the calling thread)."""
    global _compute_threads
    _compute_threads = max(1, threads)


def compute_threads() -> int:
    """The threads set by set_compute_threads() (default 1)."""
    return _compute_threads
