"""The CUDA text of hpcdl's CuPy ElementwiseKernels, compiled and run on the CPU.

An ElementwiseKernel's body is C++ over `i` (the element), its elementwise parameters (values
in, references out) and its raw ones (arrays indexed freely). Wrapped in a loop over `i` and
built with g++ beside host versions of the CUDA intrinsics the bodies use (each rounding as the
device's: `__fadd_rn` is one IEEE float add, with -ffp-contract=off so nothing becomes an FMA),
the same text runs here on NumPy arrays through ctypes. So a CPU test checks the kernel a GPU
compiles, not a transcription of it: a typo or a wrong index fails here, not on a lent device.
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
from pathlib import Path

import numpy as np

from hpcdl.nn.kernels.half_bits import CONVERSIONS, macros

HOST_SHIMS = """
#include <algorithm>
#include <cmath>
#include <cstring>
#define HPCDL_FN static inline
#define __device__
#define __forceinline__ inline
HPCDL_FN unsigned int hpcdl_f2u(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
HPCDL_FN float hpcdl_u2f(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
HPCDL_FN float __int_as_float(int v) { return hpcdl_u2f((unsigned int)v); }
HPCDL_FN float __uint_as_float(unsigned int v) { return hpcdl_u2f(v); }
HPCDL_FN unsigned int __float_as_uint(float f) { return hpcdl_f2u(f); }
HPCDL_FN float __fadd_rn(float a, float b) { return a + b; }
HPCDL_FN float __fsub_rn(float a, float b) { return a - b; }
HPCDL_FN float __fmul_rn(float a, float b) { return a * b; }
HPCDL_FN float __fdiv_rn(float a, float b) { return a / b; }
HPCDL_FN float __fsqrt_rn(float a) { return std::sqrt(a); }
using std::isnan;
using std::min;
using std::max;
"""

# CuPy's parameter types as C++
C_TYPES = {"float32": "float", "float64": "double", "uint16": "unsigned short",
           "uint32": "unsigned int", "int32": "int", "int64": "long long",
           "bool": "bool"}  # fmt: skip
CTYPES = {"float": ctypes.c_float, "double": ctypes.c_double, "int": ctypes.c_int,
          "long long": ctypes.c_longlong, "bool": ctypes.c_bool,
          "unsigned short": ctypes.c_ushort, "unsigned int": ctypes.c_uint}  # fmt: skip


def host_preamble(fmt: str | None) -> str:
    """hpcdl.nn.kernels.half_bits.preamble(fmt) for the CPU: the same conversions and macros,
    over HOST_SHIMS' bit casts in place of CUDA's."""
    return CONVERSIONS + macros(fmt)


def _params(spec: str, types: dict[str, str]) -> list[tuple[bool, str, str]]:
    """(raw, C type, name) of each parameter of an ElementwiseKernel's in or out list; a type
    placeholder (T) is given its CuPy type by `types`."""
    found = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        words = part.split()
        found.append((words[0] == "raw", C_TYPES[types.get(words[-2], words[-2])], words[-1]))
    return found


class CpuKernel:
    """An ElementwiseKernel's (in_params, out_params, body) as a function over NumPy arrays:
    `kernel(*ins, *outs, size=n)` runs the body for i in [0, n): each elementwise parameter
    indexed by i, except those named in `scalars` (passed by value, as CuPy broadcasts a
    scalar), each raw one as a pointer; `types` binds the type placeholders (T: "float32"), as
    CuPy does from the arguments' dtypes."""

    def __init__(
        self, in_params: str, out_params: str, body: str, preamble: str, folder: Path,
        scalars: frozenset[str] = frozenset(), types: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        types = types or {}
        n_in = len(_params(in_params, types))
        self.params = _params(in_params, types) + _params(out_params, types)
        args = []
        setup = [f"typedef {C_TYPES[cupy]} {name};" for name, cupy in types.items()]
        for k, (raw, ctype, name) in enumerate(self.params):
            if raw:
                args.append(f"{ctype} *{name}")
            elif name in scalars:
                args.append(f"{ctype} {name}")
            elif k >= n_in:  # an output, elementwise: a reference to element i
                args.append(f"{ctype} *{name}_all")
                setup.append(f"{ctype} &{name} = {name}_all[i];")
            else:
                args.append(f"const {ctype} *{name}_all")
                setup.append(f"{ctype} {name} = {name}_all[i];")
        source = (
            HOST_SHIMS + preamble + f'extern "C" void run({", ".join(args)}, long long n) {{\n'
            f"for (long long i = 0; i < n; ++i) {{  /* CuPy's i: a ptrdiff_t */\n"
            f"{' '.join(setup)}\n{body}\n}}\n}}\n"
        )
        self.library = ctypes.CDLL(str(_build(source, folder)))

    def __call__(self, *values: object, size: int) -> None:
        c_args = []
        for (_, ctype, _), value in zip(self.params, values, strict=True):
            if isinstance(value, np.ndarray):
                c_args.append(value.ctypes.data_as(ctypes.c_void_p))
            else:
                c_args.append(CTYPES[ctype](value))
        self.library.run(*c_args, ctypes.c_longlong(size))


def _build(source: str, folder: Path) -> Path:
    """A shared library of `source` in `folder`, built once per distinct source."""
    compiler = shutil.which("c++") or shutil.which("g++")
    assert compiler, "no C++ compiler: the stager's build needs one too"
    name = hashlib.sha256(source.encode()).hexdigest()[:16]
    library = folder / f"kernel_{name}.so"
    if not library.exists():
        (folder / f"kernel_{name}.cpp").write_text(source)
        flags = ["-O1", "-ffp-contract=off", "-fPIC", "-shared", "-std=c++17"]
        built = subprocess.run(
            [compiler, *flags, "-o", str(library), str(folder / f"kernel_{name}.cpp")],
            capture_output=True, text=True,
        )  # fmt: skip
        assert built.returncode == 0, f"the kernel's source does not compile:\n{built.stderr}"
    return library
