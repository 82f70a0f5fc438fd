"""GEMMs a CUDA graph can capture: cuBLAS called through ctypes on a handle of our own, since
CuPy's own cuBLAS calls refuse a capturing stream (--gpu-kernels, on CuPy).

NOTE [capturable GEMM]
Every CuPy cuBLAS wrapper first sets the handle's stream to the current one and raises
"calling cuBLAS API during stream capture is currently unsupported" when that stream is
capturing (the H100 run of bd800bf found it: the step graph's capture failed at the first
matmul). cuBLAS itself captures GEMMs (its documentation: CUDA graphs support), as PyTorch's
captured steps show. So with --gpu-kernels every GEMM of a step (hpcdl.nn.dtypes.matmul) goes
through `device_matmul`: cublasGemmStridedBatchedEx on a cuBLAS handle this module creates, with
a fixed workspace of its own (allocated once, outside any capture, so a capture allocates
nothing in cuBLAS), the stream set to CuPy's current one before each call, host-pointer alpha
and beta (1 and 0, captured by value). Plain and captured steps make the same calls, so they
give the same bits.

Row-major C = A @ B is column-major C^T = B^T A^T, which is how the operands are handed over:
`gemm_plan` reads each operand's strides (row-major with unit column stride, or a transposed
view with unit row stride: no copy either way) and gives the cuBLAS arguments, or names the
operand that must be copied first (another layout). A 2-D operand against a 3-D one repeats
with batch stride 0. Half operands multiply with float32 sums (CUBLAS_COMPUTE_32F) and may
write float32 directly (weight gradients); float32 operands compute in IEEE float32, on TF32
tensor cores only with --tf32 (compute_type, NOTE [TF32]); float64 computes in float64.
The plan is pure Python: tests/test_gemm_plan.py runs it through a NumPy model of the
cuBLAS call (column-major, leading dimensions, batch strides) against np.matmul on every
layout the layers pass. A library or call that fails is said once; matmul then falls back to
CuPy's (and a capture with it fails, as before: plain steps).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcdl.nn import kernels
from hpcdl.nn.kernels import say_once

# cuBLAS enums (cublas_api.h, library_types.h)
OP_N, OP_T = 0, 1
CUDA_TYPES = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 14}
COMPUTE_32F, COMPUTE_32F_FAST_TF32, COMPUTE_64F = 68, 77, 70
GEMM_DEFAULT = -1
WORKSPACE_BYTES = 32 << 20  # what PyTorch gives cuBLAS on Hopper (CUBLAS_WORKSPACE_CONFIG)


class NeedsCopy(Exception):
    """An operand's layout cuBLAS cannot read as it is: `operand` ("a", "b" or "out")."""

    def __init__(self, operand: str) -> None:
        super().__init__(operand)
        self.operand = operand


@dataclass(frozen=True)
class GemmPlan:
    """cublasGemmStridedBatchedEx's arguments (column-major: its A is our B, its B our A)."""

    trans_a: int
    trans_b: int
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldc: int
    stride_a: int
    stride_b: int
    stride_c: int
    batch: int


def _matrix(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int, name: str):
    """(rows, cols, row stride, col stride, batch, batch stride) in elements of a 2-D or 3-D
    operand; a dimension of size 1 takes whatever stride keeps it valid."""
    if any(s % itemsize for s in strides) or any(s < 0 for s in strides):
        raise NeedsCopy(name)
    elements = [s // itemsize for s in strides]
    batch, batch_stride = (shape[0], elements[0]) if len(shape) == 3 else (1, 0)
    rows, cols = shape[-2:]
    row_stride, col_stride = elements[-2:]
    if cols == 1:
        col_stride = 1
    if rows == 1:
        row_stride = max(cols, 1) if col_stride == 1 else 1
    if batch == 1:
        batch_stride = 0
    return rows, cols, row_stride, col_stride, batch, batch_stride


def _operand(rows: int, cols: int, row_stride: int, col_stride: int, name: str):
    """A row-major rows x cols operand as cuBLAS sees it: (op, leading dimension) of its
    column-major transpose (op N), or of itself read transposed (op T)."""
    if col_stride == 1 and row_stride >= max(cols, 1):
        return OP_N, row_stride
    if row_stride == 1 and col_stride >= max(rows, 1):
        return OP_T, col_stride
    raise NeedsCopy(name)


def gemm_plan(a: Any, b: Any, out: Any) -> GemmPlan:
    """The cuBLAS call that writes a @ b into out (2-D or 3-D; NumPy or CuPy arrays, read for
    shape, strides and itemsize only). Raises NeedsCopy for an operand to copy first."""
    m, k, a_rs, a_cs, a_batch, a_bs = _matrix(a.shape, a.strides, a.itemsize, "a")
    k_b, n, b_rs, b_cs, b_batch, b_bs = _matrix(b.shape, b.strides, b.itemsize, "b")
    out_m, out_n, c_rs, c_cs, c_batch, c_bs = _matrix(out.shape, out.strides, out.itemsize, "out")
    batch = max(a_batch, b_batch)
    if k != k_b or (out_m, out_n) != (m, n) or c_batch != batch or 1 < a_batch != b_batch > 1:
        raise ValueError(f"matmul of {a.shape} and {b.shape} into {out.shape}")
    if c_cs != 1 or c_rs < max(n, 1):
        raise NeedsCopy("out")
    op_b, ld_b = _operand(k, n, b_rs, b_cs, "b")
    op_a, ld_a = _operand(m, k, a_rs, a_cs, "a")
    return GemmPlan(op_b, op_a, n, m, k, ld_b, ld_a, c_rs, b_bs, a_bs, c_bs, batch)


def find_library(maps: str) -> str | None:
    """The path of the libcublas (not libcublasLt) this process has mapped, from the text of
    /proc/self/maps; None if none is."""
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        name = path.rsplit("/", 1)[-1]
        if name.startswith("libcublas.so"):
            return path
    return None


class Cublas:
    """A cuBLAS handle of our own with its workspace, called through ctypes."""

    def __init__(self, cp: Any) -> None:
        if not cp.cuda.get_current_stream().is_capturing():  # CuPy loads libcublas on first use
            cp.matmul(cp.ones((1, 1), np.float32), cp.ones((1, 1), np.float32))
        with open("/proc/self/maps") as maps:
            path = find_library(maps.read()) or ctypes.util.find_library("cublas")
        if path is None:
            raise OSError("libcublas is not loaded and not found")
        self.lib = ctypes.CDLL(path)
        self.cp = cp
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        # its own cudaMalloc, kept while the handle lives: not from whichever memory pool is
        # CuPy's allocator now (a step graph's, during its warm-up)
        self.workspace = cp.cuda.Memory(WORKSPACE_BYTES)
        space = ctypes.c_void_p(self.workspace.ptr), ctypes.c_size_t(WORKSPACE_BYTES)
        self._check(self.lib.cublasSetWorkspace_v2(self.handle, *space), "cublasSetWorkspace")

    @staticmethod
    def _check(status: int, call: str) -> None:
        if status != 0:
            raise RuntimeError(f"{call} returned cuBLAS status {status}")

    def gemm(self, a: Any, b: Any, out: Any, plan: GemmPlan) -> None:
        """out = a @ b by the plan, on CuPy's current stream."""
        stream = ctypes.c_void_p(self.cp.cuda.get_current_stream().ptr)
        self._check(self.lib.cublasSetStream_v2(self.handle, stream), "cublasSetStream")
        wide = out.dtype == np.float64
        scalar = ctypes.c_double if wide else ctypes.c_float
        alpha, beta = scalar(1.0), scalar(0.0)
        p = plan
        status = self.lib.cublasGemmStridedBatchedEx(
            self.handle, p.trans_a, p.trans_b, p.m, p.n, p.k, ctypes.byref(alpha),
            *_matrix_args(b, p.lda, p.stride_a), *_matrix_args(a, p.ldb, p.stride_b),
            ctypes.byref(beta), *_matrix_args(out, p.ldc, p.stride_c),
            p.batch, compute_type(a.dtype, out.dtype), GEMM_DEFAULT,
        )  # fmt: skip
        self._check(status, "cublasGemmStridedBatchedEx")


def compute_type(operands: Any, out: Any) -> int:
    """cuBLAS's compute type for operands of dtype `operands` into `out`: float64 sums for a
    float64 result; float32 operands in IEEE float32, or on TF32 tensor cores where --tf32
    allows it (NOTE [TF32] in hpcdl/nn/kernels/__init__.py); half operands with float32 sums."""
    if np.dtype(out) == np.float64:
        return COMPUTE_64F
    if np.dtype(operands) == np.float32 and kernels.tf32():
        return COMPUTE_32F_FAST_TF32
    return COMPUTE_32F


def _matrix_args(x: Any, ld: int, stride: int) -> tuple[Any, ...]:
    """(pointer, cudaDataType, leading dimension, batch stride) of one operand."""
    return ctypes.c_void_p(x.data.ptr), CUDA_TYPES[x.dtype.name], ld, ctypes.c_longlong(stride)


_CUBLAS: list[Any] = []  # [Cublas] once made; [None] when it could not be


def _cublas(cp: Any) -> Any:
    if not _CUBLAS:
        try:
            _CUBLAS.append(Cublas(cp))
        except Exception as exc:  # noqa: BLE001 - any failure: CuPy's matmul, said once
            _CUBLAS.append(None)
            say_once("gemm", f"capturable GEMMs off ({exc}); CuPy's matmul runs, outside graphs")
    return _CUBLAS[0]


def takes(a: Any, b: Any, out: Any) -> bool:
    """Whether device_matmul can run this product: dtypes cuBLAS takes, 2-D or 3-D."""
    names = {a.dtype.name, b.dtype.name, out.dtype.name}
    two_or_three = all(x.ndim in (2, 3) for x in (a, b, out))
    half = {"float16", "bfloat16"}
    kinds_fit = a.dtype == b.dtype and (out.dtype == a.dtype or a.dtype.name in half)
    return two_or_three and kinds_fit and names <= set(CUDA_TYPES)


def _as_matrices(a: Any, b: Any, out: Any) -> tuple[Any, Any, Any]:
    """A vector operand as a one-row (a) or one-column (b) matrix, out to match."""
    if a.ndim == 1 and b.ndim == 2 and out.ndim == 1:
        return a[None, :], b, out[None, :]
    if a.ndim == 2 and b.ndim == 1 and out.ndim == 1:
        return a, b[:, None], out[:, None]
    return a, b, out


def device_matmul(cp: Any, a: Any, b: Any, out: Any) -> bool:
    """out = a @ b through our cuBLAS handle (capturable); False when it cannot run here (the
    caller uses CuPy's matmul)."""
    a, b, out = _as_matrices(a, b, out)
    if not takes(a, b, out):
        return False
    cublas = _cublas(cp)
    if cublas is None:
        return False
    if out.size == 0 or a.shape[-1] == 0:  # nothing to multiply: cuBLAS is not asked
        out.fill(0)
        return True
    target = out
    for _ in range(3):  # each operand is copied at most once
        try:
            plan = gemm_plan(a, b, target)
            break
        except ValueError:  # shapes that do not multiply: CuPy's matmul says so
            return False
        except NeedsCopy as copy:
            if copy.operand == "a":
                a = cp.ascontiguousarray(a)
            elif copy.operand == "b":
                b = cp.ascontiguousarray(b)
            else:
                target = cp.empty(out.shape, out.dtype)
    else:
        return False
    try:
        cublas.gemm(a, b, target, plan)
    except RuntimeError as exc:  # a status cuBLAS refuses this product with: CuPy's matmul
        say_once(f"gemm:{exc}", f"a capturable GEMM failed ({exc}); CuPy's matmul runs it")
        return False
    if target is not out:
        out[...] = target
    return True
