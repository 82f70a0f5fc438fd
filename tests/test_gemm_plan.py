"""hpcdl.nn.kernels.gemm: the cuBLAS arguments gemm_plan gives, run through a NumPy model of
cublasGemmStridedBatchedEx (column-major operands at their leading dimensions and batch
strides, read from the operands' own memory), equal np.matmul on every layout the layers pass:
contiguous, transposed views, row and column slices, 3-D against 2-D (batch stride 0), strided
outputs; marked gpu: the ctypes call itself against CuPy's matmul."""

import ml_dtypes
import numpy as np
import pytest

from hpcdl.backend import cupy_or_none, gpu_available
from hpcdl.nn import kernels
from hpcdl.nn.kernels import gemm
from hpcdl.nn.kernels.gemm import OP_N, NeedsCopy, find_library, gemm_plan


def column_major(base, offset, rows, cols, ld):
    """The rows x cols column-major matrix at element `offset` of the flat buffer `base`."""
    size = base.itemsize
    return np.lib.stride_tricks.as_strided(
        base[offset:], (rows, cols), (size, ld * size), writeable=True
    )


def offset_in(x, base):
    return (x.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // x.itemsize


def run_cublas_model(plan, a, b, out, bases):
    """What cublasGemmStridedBatchedEx does with the plan: its A is our b, its B our a."""
    a_base, b_base, out_base = bases
    for i in range(plan.batch):
        rows_a, cols_a = (plan.m, plan.k) if plan.trans_a == OP_N else (plan.k, plan.m)
        rows_b, cols_b = (plan.k, plan.n) if plan.trans_b == OP_N else (plan.n, plan.k)
        cu_a = column_major(b_base, offset_in(b, b_base) + i * plan.stride_a, rows_a, cols_a,
                            plan.lda)  # fmt: skip
        cu_b = column_major(a_base, offset_in(a, a_base) + i * plan.stride_b, rows_b, cols_b,
                            plan.ldb)  # fmt: skip
        op_a = cu_a if plan.trans_a == OP_N else cu_a.T
        op_b = cu_b if plan.trans_b == OP_N else cu_b.T
        c = column_major(out_base, offset_in(out, out_base) + i * plan.stride_c, plan.m, plan.n,
                         plan.ldc)  # fmt: skip
        c[...] = op_a.astype(np.float64) @ op_b.astype(np.float64)


def flat(n, seed):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def layouts():
    """(name, a, b, out): each array a view of a flat buffer."""
    buffers = flat(4096, 0), flat(4096, 1), np.zeros(4096, np.float32)

    def of(which, *shape):  # the first elements of buffer `which` as `shape`
        return buffers[which][: int(np.prod(shape))].reshape(shape)

    yield "contiguous", of(0, 5, 3), of(1, 3, 7), of(2, 5, 7)
    yield "a transposed", of(0, 3, 5).T, of(1, 3, 7), of(2, 5, 7)
    yield "b transposed", of(0, 5, 3), of(1, 7, 3).T, of(2, 5, 7)
    yield "both transposed", of(0, 3, 5).T, of(1, 7, 3).T, of(2, 5, 7)
    yield "column slice", of(0, 5, 10)[:, 2:5], of(1, 3, 7), of(2, 5, 7)
    yield "x[:, inputs].T", of(0, 8, 5)[:, 1:4].T, of(1, 8, 7), of(2, 3, 7)
    yield "strided out rows", of(0, 5, 3), of(1, 3, 7), of(2, 5, 20)[:, 4:11]
    yield "3-D a, 2-D b (stacked blocks)", of(0, 4, 5, 3), of(1, 3, 7), of(2, 4, 5, 7)
    yield "2-D a, 3-D b", of(0, 5, 3), of(1, 4, 3, 7), of(2, 4, 5, 7)
    yield "3-D transposed a (cols_t)", of(0, 4, 3, 5).transpose(0, 2, 1), of(1, 4, 3, 7), (
        of(2, 4, 5, 7))  # fmt: skip
    yield "one row", of(0, 1, 3), of(1, 3, 7), of(2, 1, 7)
    yield "ones @ rows (BatchNorm's sums)", np.ones((1, 9), np.float32), of(1, 9, 7), of(2, 1, 7)
    yield "one column", of(0, 5, 3), of(1, 3, 3)[:, :1], of(2, 5, 1)
    yield "vector @ matrix (a GEMV)", of(0, 9), of(1, 9, 7), of(2, 7)
    yield "matrix @ vector", of(0, 5, 3), of(1, 3), of(2, 5)


def buffer_of(x):
    """The array that owns x's memory."""
    while x.base is not None:
        x = x.base
    return x


class ModelCublas:
    """Cublas with the NumPy model of its call in place of the library; counts its calls."""

    calls = 0

    def gemm(self, a, b, out, plan):
        ModelCublas.calls += 1
        run_cublas_model(plan, a, b, out, tuple(buffer_of(x) for x in (a, b, out)))


@pytest.mark.parametrize("case", list(layouts()), ids=lambda case: case[0])
def test_the_plan_run_as_cublas_runs_it_is_matmul(case):
    _, a, b, out = case
    out[...] = np.nan
    plan = gemm_plan(*gemm._as_matrices(a, b, out))
    bases = tuple(buffer_of(x) for x in (a, b, out))
    run_cublas_model(plan, *gemm._as_matrices(a, b, out), bases)
    expected = np.matmul(a.astype(np.float64), b.astype(np.float64))
    np.testing.assert_allclose(out, np.broadcast_to(expected, out.shape), rtol=1e-6, atol=1e-6)


def test_device_matmul_copies_what_cublas_cannot_read_and_skips_empty_products(monkeypatch):
    """device_matmul end to end with the model for the library, NumPy for CuPy: an operand of
    another layout is copied, a column-major out is written through a copy, an empty product
    asks cuBLAS nothing, and shapes that do not multiply are left to the caller's matmul."""
    monkeypatch.setattr(gemm, "_CUBLAS", [ModelCublas()])
    rng = np.random.default_rng(3)
    a = rng.standard_normal((12, 16)).astype(np.float32)[::2, ::2]  # neither unit stride
    b = rng.standard_normal((8, 5)).astype(np.float32)
    out = np.empty((6, 5), np.float32, order="F")
    assert gemm.device_matmul(np, a, b, out)
    np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-5)
    before = ModelCublas.calls
    empty = np.full((0, 5), np.nan, np.float32)
    assert gemm.device_matmul(np, np.ones((0, 3), np.float32), np.ones((3, 5), np.float32), empty)
    no_k = np.full((2, 5), np.nan, np.float32)
    assert gemm.device_matmul(np, np.ones((2, 0), np.float32), np.ones((0, 5), np.float32), no_k)
    assert ModelCublas.calls == before and (no_k == 0).all()
    assert not gemm.device_matmul(np, np.ones((2, 3)), np.ones((4, 5)), np.empty((2, 5)))


def test_a_product_cublas_refuses_goes_to_cupys_matmul_said_once(monkeypatch, capsys):
    class Refusing:
        def gemm(self, a, b, out, plan):
            raise RuntimeError("cublasGemmStridedBatchedEx returned cuBLAS status 15")

    monkeypatch.setattr(gemm, "_CUBLAS", [Refusing()])
    monkeypatch.setattr(kernels, "_said", set())
    a, b = np.ones((2, 3), np.float32), np.ones((3, 4), np.float32)
    for _ in range(2):
        assert not gemm.device_matmul(np, a, b, np.empty((2, 4), np.float32))
    assert capsys.readouterr().err.count("cuBLAS status 15); CuPy's matmul runs it") == 1


def test_layouts_cublas_cannot_read_are_named_for_a_copy():
    a = np.ones((6, 8), np.float32)[::2, ::2]  # neither unit stride
    with pytest.raises(NeedsCopy) as raised:
        gemm_plan(a, np.ones((4, 2), np.float32), np.empty((3, 2), np.float32))
    assert raised.value.operand == "a"
    out = np.empty((2, 3), np.float32, order="F")  # a column-major output
    with pytest.raises(NeedsCopy) as raised:
        gemm_plan(np.ones((2, 4), np.float32), np.ones((4, 3), np.float32), out)
    assert raised.value.operand == "out"
    with pytest.raises(ValueError, match="matmul of"):
        gemm_plan(np.ones((2, 4)), np.ones((5, 3)), np.empty((2, 3)))


def test_the_library_is_the_mapped_libcublas_not_cublaslt():
    maps = (
        "7f00-7f10 r-xp 0 08:01 1 /venv/nvidia/cu13/lib/libcublasLt.so.13\n"
        "7f20-7f30 r-xp 0 08:01 2 /venv/nvidia/cu13/lib/libcublas.so.13\n"
        "7f40-7f50 rw-p 0 00:00 0\n"
    )
    assert find_library(maps) == "/venv/nvidia/cu13/lib/libcublas.so.13"
    assert find_library("7f40-7f50 rw-p 0 00:00 0 [heap]\n") is None


def test_it_takes_cublas_dtypes_and_half_into_float32():
    f32, bf16 = np.zeros((2, 2), np.float32), np.zeros((2, 2), ml_dtypes.bfloat16)
    assert gemm.takes(f32, f32, f32)
    assert gemm.takes(bf16, bf16, bf16) and gemm.takes(bf16, bf16, f32)
    assert not gemm.takes(f32, f32, bf16)  # a narrowing output: CuPy's matmul and a cast
    assert not gemm.takes(f32, bf16, f32)
    assert not gemm.takes(np.zeros((2, 2), np.int32), np.zeros((2, 2), np.int32), f32)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("case", list(layouts()), ids=lambda case: case[0])
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_the_ctypes_gemm_is_cupys_matmul_on_the_gpu(case, dtype):
    cp = cupy_or_none()
    _, a, b, out = case
    dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    a, b = cp.asarray(np.ascontiguousarray(a).astype(dtype)), cp.asarray(b.astype(dtype))
    out_dtype = np.float32 if dtype.itemsize == 2 else dtype
    got = cp.zeros(out.shape, out_dtype)
    assert gemm.device_matmul(cp, a, b, got)
    expected = cp.matmul(a.astype(out_dtype), b.astype(out_dtype))
    tolerance = 1e-2 if dtype.itemsize == 2 else 1e-5
    np.testing.assert_allclose(cp.asnumpy(got), cp.asnumpy(cp.broadcast_to(expected, out.shape)),
                               rtol=tolerance, atol=tolerance)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a GPU")
def test_the_ctypes_gemm_is_captured_in_a_cuda_graph():
    cp = cupy_or_none()
    a = cp.asarray(np.random.default_rng(0).standard_normal((64, 32)), cp.float32)
    b = cp.asarray(np.random.default_rng(1).standard_normal((32, 16)), cp.float32)
    out = cp.zeros((64, 16), cp.float32)
    assert gemm.device_matmul(cp, a, b, out)  # the handle and its workspace, outside capture
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        gemm.device_matmul(cp, a, b, out)
        graph = stream.end_capture()
    out[...] = 0
    a *= 2
    graph.launch(stream=stream)
    stream.synchronize()
    np.testing.assert_allclose(cp.asnumpy(out), cp.asnumpy(a @ b), rtol=1e-5, atol=1e-5)


def test_float32_gemms_are_ieee_unless_tf32_is_allowed(monkeypatch):
    """NOTE [TF32]: cuBLAS's compute type per operand dtype: IEEE float32 for float32 (TF32
    tensor cores only with --tf32), float32 sums for halves whatever --tf32 says, float64 for
    a float64 result."""
    bf16 = np.dtype(ml_dtypes.bfloat16)
    types = [(np.float32, np.float32), (np.float16, np.float32), (bf16, bf16),
             (np.float64, np.float64)]  # fmt: skip
    assert [gemm.compute_type(a, out) for a, out in types] == [68, 68, 68, 70]
    monkeypatch.setattr(kernels, "_tf32", True)
    assert [gemm.compute_type(a, out) for a, out in types] == [77, 68, 68, 70]
