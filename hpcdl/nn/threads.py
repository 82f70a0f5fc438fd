"""The compute threads of the CPU layers: one shared pool, and a batch split over it.

A process that owns T cores (hpcdl.backend.compute_threads() = T, set with a one-thread BLAS by
hpcdl.comm.blas_threads.use_layer_threads) runs each layer's work on T threads: NumPy releases
the GIL in ufunc loops, copies and BLAS calls on large arrays, and a one-thread OpenBLAS may be
called from several threads at once. Convolutions split their image chunks (hpcdl.nn.conv); the
other layers split [0, n) of the batch axis, or of rows, into T contiguous parts with
`run_split`.

Determinism: the split depends only on n and T, and a layer that sums over parts adds the
per-part sums in part order, so the same thread count gives bitwise the same step every time.
Elementwise work gives the same bits with any split.

A split pays a thread hand-off (tens of microseconds), so it is taken only for arrays of at
least MIN_SPLIT_ELEMENTS; on the GPU (CuPy arrays) or with T = 1 the work runs once, inline.
Work must not call run_split or run_parts itself: the pool has T threads and a nested wait on
it could deadlock.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hpcdl import backend
from hpcdl.backend import array_module

# Elements below which a layer's pass stays on the calling thread. Measured on the shared 2-core
# EPYC (docs/bench-scripts/issue12/elemthreads_layers.py: one-thread BLAS, float32, batch 64,
# forward + backward, ms on one thread -> two with every pass split, load 0.9): ReLU 256K 0.21 ->
# 0.26, 512K 0.41 -> 0.38, 1M 0.90-0.96 -> 0.63-0.71; BatchNorm (5 passes) 256K 0.53 -> 0.75,
# 512K 0.97 -> 1.00-1.06, 1M 1.95-2.02 -> 1.65-1.77; max pool 2x2 on 2M 4.5-5.2 -> 2.4-2.6;
# Linear 4096x512 10.0 -> 6.2.
MIN_SPLIT_ELEMENTS = 1 << 19

_POOL: dict[int, ThreadPoolExecutor] = {}  # compute threads by count, shared by all layers


def thread_pool(threads: int) -> ThreadPoolExecutor:
    """The process's pool of `threads` compute threads, started on first use."""
    if threads not in _POOL:
        _POOL[threads] = ThreadPoolExecutor(threads, thread_name_prefix="hpcdl-compute")
    return _POOL[threads]


def run_parts(parts: int, work: Callable[[int], None]) -> None:
    """work(part) for part in [0, parts), on the pool; returns when all are done.

    Part 0 runs on the calling thread (it would only wait otherwise); an exception in any part
    is raised here after every part has finished.
    """
    if parts <= 1:
        work(0)
        return
    futures = [thread_pool(parts).submit(work, part) for part in range(1, parts)]
    try:
        work(0)
    finally:
        for future in futures:
            future.exception()  # wait for every part before a buffer may be reused
    for future in futures:
        future.result()


def split_parts(n: int, like: Any) -> int:
    """How many parts run_split(n, ..., like) uses: compute_threads() for a large NumPy array
    `like` (the array the work passes over), else 1; never more than n."""
    threads = backend.compute_threads()
    if threads == 1 or backend.is_device_array(like) or like.size < MIN_SPLIT_ELEMENTS:
        return 1
    return max(1, min(threads, n))


def part_range(n: int, parts: int, part: int) -> tuple[int, int]:
    """(first, count) of part `part` of [0, n) cut into `parts` contiguous, near-equal parts."""
    first = n * part // parts
    return first, n * (part + 1) // parts - first


def run_split(n: int, work: Callable[[int, int, int], None], like: Any) -> int:
    """work(first, count, part) over contiguous parts of [0, n); returns the parts used.

    `like` is the array the work passes over: it decides whether to split (split_parts).
    Parts are numbered in index order, so sums added in part order repeat bitwise.
    """
    parts = split_parts(n, like)
    run_parts(parts, lambda part: work(*part_range(n, parts, part), part))
    return parts


def split_multiply(a: Any, b: Any) -> Any:
    """a * b in a new array of a's dtype, split over the compute threads by the first axis."""
    xp = array_module(a)
    out = xp.empty(a.shape, dtype=a.dtype)

    def multiply(first: int, count: int, part: int) -> None:
        rows = slice(first, first + count)
        xp.multiply(a[rows], b[rows], out=out[rows], dtype=a.dtype)

    run_split(len(a), multiply, a)
    return out
