"""bf16 and fp16 as the bits a CUDA kernel reads and writes (uint16), converted to and from
float32 in the kernel itself, so a kernel over half arrays needs no half type from CuPy.

NOTE [half bits]
A kernel takes a bf16 or fp16 array as a uint16 view, loads each value as float32 (exact: both
formats are subsets of float32), computes in float32, and rounds each result to the format
(to nearest, ties to even, as a cast does; NaN stays NaN, overflow goes to infinity, fp16's
subnormals are kept) before it is used again, which is what NumPy (and ml_dtypes) do for one
operation on half arrays: compute in float32, round once. Since float32 has more than twice the
formats' precision plus two bits, that one rounding of an exact float32 result (an add, a
multiply, a divide) gives the correctly rounded half result, so the kernel's bits are the
reference's.

The conversions are plain C over 32-bit integers, written once (CONVERSIONS) and used twice:
in the kernels' preamble, with CUDA's bit casts (`preamble`), and compiled on the CPU by the
tests with memcpy casts (tests/cuda_on_cpu.py): tests/test_half_bits.py checks them against
NumPy and ml_dtypes on every half value and on float32 values around every rounding boundary,
and the kernels' own source runs on the CPU through them (tests/test_pool_kernel.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

# The two bit casts and the functions' qualifier, as CUDA (NVRTC) has them.
DEVICE_SHIMS = """
#define HPCDL_FN __device__ __forceinline__
HPCDL_FN unsigned int hpcdl_f2u(float f) { return __float_as_uint(f); }
HPCDL_FN float hpcdl_u2f(unsigned int u) { return __uint_as_float(u); }
"""

# float32 <-> bf16 / fp16 bits; needs HPCDL_FN, hpcdl_f2u and hpcdl_u2f.
CONVERSIONS = """
HPCDL_FN float hpcdl_bf16_load(unsigned short b) { return hpcdl_u2f(((unsigned int)b) << 16); }

HPCDL_FN unsigned short hpcdl_bf16_store(float f) {
    unsigned int u = hpcdl_f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

HPCDL_FN float hpcdl_fp16_load(unsigned short h) {
    unsigned int sign = ((unsigned int)h & 0x8000u) << 16;
    unsigned int e = ((unsigned int)h >> 10) & 0x1fu, m = (unsigned int)h & 0x3ffu;
    if (e == 0x1fu) return hpcdl_u2f(sign | 0x7f800000u | (m << 13));
    if (e == 0u) {  /* zero or subnormal: m units of 2^-24, exact in float32 */
        float f = (float)m * 5.9604644775390625e-08f;
        return sign ? -f : f;
    }
    return hpcdl_u2f(sign | ((e + 112u) << 23) | (m << 13));
}

HPCDL_FN unsigned short hpcdl_fp16_store(float f) {
    unsigned int u = hpcdl_f2u(f);
    unsigned int sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (unsigned short)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  /* 65520 and up: inf */
    if (a < 0x38800000u) {  /* below 2^-14: units of 2^-24, rounded to even */
        unsigned int e = a >> 23;
        if (e < 101u) return (unsigned short)sign;
        unsigned int m = (a & 0x7fffffu) | 0x800000u, shift = 126u - e;
        unsigned int q = m >> shift, rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rest > half || (rest == half && (q & 1u))) q += 1u;
        return (unsigned short)(sign | q);
    }
    unsigned int r = a - 0x38000000u;  /* exponent bias 127 -> 15 */
    r += 0xfffu + ((r >> 13) & 1u);
    return (unsigned short)(sign | (r >> 13));
}
"""

FORMATS = ("bf16", "fp16")


def format_of(dtype: Any) -> str | None:
    """'bf16' or 'fp16' for a half dtype, None for any other."""
    dtype = np.dtype(dtype)
    if dtype == np.float16:
        return "fp16"
    return "bf16" if dtype.name == "bfloat16" else None


def macros(fmt: str | None) -> str:
    """HPCDL_LOAD(bits) -> float, HPCDL_STORE(float) -> bits and HPCDL_ROUND(float) -> float
    (the value rounded to the format), over CONVERSIONS; fmt None: float32, where all three
    are the identity."""
    if fmt is None:
        return "#define HPCDL_LOAD(v) (v)\n#define HPCDL_STORE(f) (f)\n#define HPCDL_ROUND(f) (f)\n"
    if fmt not in FORMATS:
        raise ValueError(f"no half format {fmt!r}; one of {', '.join(FORMATS)}")
    return (
        f"#define HPCDL_LOAD(b) hpcdl_{fmt}_load(b)\n"
        f"#define HPCDL_STORE(f) hpcdl_{fmt}_store(f)\n"
        f"#define HPCDL_ROUND(f) hpcdl_{fmt}_load(hpcdl_{fmt}_store(f))\n"
    )


def preamble(fmt: str | None) -> str:
    """What a CUDA kernel over `fmt`'s bits (None: float32) is built with: the conversions
    and the macros."""
    return macros(None) if fmt is None else DEVICE_SHIMS + CONVERSIONS + macros(fmt)


def bits(array: Any) -> Any:
    """A half array's uint16 view (what a kernel built with `preamble` reads and writes)."""
    return array.view(np.uint16)
