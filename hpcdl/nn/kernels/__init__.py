"""The seam for fast kernels: one module per op family, a kernel chosen per op.

NOTE [fast kernels]
The NumPy code in the layers is the reference and stays the default. A fast kernel (cuDNN
graphs, CuPy ElementwiseKernels, counter-based dropout) lives in the module of its op family
here: `conv`, `batchnorm`, `pool`, `dropout`, `optimizer`. Each module lists its kernels in
`KERNELS`, best first; a kernel has the shape of hpcdl.nn.conv_winograd's path:
- `applies(layer, x)`: whether it takes this op (backend, shape, dtype, what it was built for);
- `forward(layer, x, train)` -> y, and `backward(layer, dy)` -> dx (or None where the layer
  computes no input gradient), writing the parameter gradients into `layer.g` as the reference
  does (the optimizer family has `step(optimizer, lr)` instead).
A layer holds a `Seam` for its family and asks it first; when no kernel applies it runs its own
NumPy/CuPy code, so a layer never learns which kernel ran, and a kernel that refuses a shape
(cuDNN has no plan for it, say) falls back by not applying, saying so once (`say_once`).

Kernels are opt-in (`--gpu-kernels`, or HPCDL_GPU_KERNELS=1) until a recorded GPU run shows
one correct and faster (issue 47); with them off every family's choice is the reference.

NOTE [TF32]
float32 means IEEE float32 in every kernel unless TF32 is allowed (`--tf32`, or HPCDL_TF32=1):
then cuDNN's float32 convolutions may run on TF32 tensor cores (products of 10-bit mantissas,
float32 sums) and so may hpcdl's float32 GEMMs (CUBLAS_COMPUTE_32F_FAST_TF32, NOTE [capturable
GEMM] in gemm.py). Left alone, cuDNN's heuristics pick TF32 engines for float32 convolutions on
Ampere and later (its default math), so a float32 graph deselects the engines cuDNN notes as
TENSOR_CORE or DOWN_CONVERT_INPUTS (as PyTorch does when TF32 is off); a half format's graphs
keep theirs. The default is strict because hpcdl's CPU engine, its reference layers and CuPy's
matmul compute IEEE float32, and the GPU tests check float32 against them at float32's
tolerance. PyTorch's own default differs (TF32 convolutions, IEEE matmuls:
torch.backends.cudnn.conv.fp32_precision "tf32", cuda.matmul "ieee"), so `bench compute` sets
PyTorch to hpcdl's arithmetic, either way, and says so in its row ("tf32"). Set it before the
first plan is built: plans are cached per process.

NOTE [deterministic engines]
cuDNN's heuristics may pick engines that sum with atomics (cuDNN notes them NONDETERMINISTIC,
typically weight gradients and BatchNorm's statistics): their sums come out in another order
on each run, so the same step gives other low bits each time. SGD keeps such differences
small; Adam divides each update by the gradient's own size, so where a gradient is a sum that
nearly cancels, noise in its last bits moves the parameter by a sizeable part of the learning
rate (the H200 run of 2026-11-29: graph and plain Adam steps 1.2e-4 apart on 79 of 269,722
parameters, SGD's within 1e-6). HPCDL_DETERMINISTIC=1 (`kernels.make_deterministic`) leaves
those engines out of every graph, in plans of their own (PyTorch's
torch.backends.cudnn.deterministic), so a step's bits repeat: a CUDA graph replay and a plain
step, two runs, a resumed run. Off by default, as in PyTorch: the engines left out may be the
fastest, and no recorded GPU run has timed the difference yet. hpcdl's own kernels, cuBLAS on
its fixed workspace (NOTE [capturable GEMM]) and CuPy's reductions repeat their bits either way.

NOTE [engine autotuning]
A cuDNN plan runs the first engine of cuDNN's heuristics (mode A, then FALLBACK) that builds,
as PyTorch does with torch.backends.cudnn.benchmark off. HPCDL_CUDNN_AUTOTUNE=K (`set_autotune`;
PyTorch's benchmark mode) builds the first K engines that build for each convolution plan and,
the first time the plan runs outside a CUDA graph capture (the step graph's warm-up is such a
run), times each on the real arrays with CUDA events (the best of 3 runs) and keeps the fastest
(cudnn_graphs.Runtime.tune). Only convolutions: their outputs are overwritten and their inputs
only read, so running one several times changes nothing; BatchNorm's training graph updates the
running statistics in place. An engine needing more than TUNE_WORKSPACE_BYTES of workspace is
not timed. The choice depends on timings, so two runs may choose other engines and differ in
their low bits, as with PyTorch's benchmark mode; with HPCDL_DETERMINISTIC the engines timed are
the deterministic ones. Off by default until a recorded GPU run shows what it buys.

NOTE [half weight gradients]
In bf16/fp16 a convolution's weight gradient graph writes float32 (sums_dtype): the sums are
float32 in the engine either way, and the result lands in the float32 gradient buffer without
a rounding. PyTorch's autocast computes it in the format instead (the gradient of the
format's copy of the weight), then widens it. HPCDL_HALF_WGRAD=1 (`set_half_wgrad`) does the
same: the graph writes the format and the transpose into the gradient buffer widens it, so
each weight gradient is rounded to the format once, as PyTorch's. cuDNN may have faster
engines for a weight gradient written in the format; the 2026-11-29 lend's profile put
resnet50 bf16's convolution backward at twice PyTorch's. Off by default (no GPU has timed it);
float32 and float64 keep their own.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Protocol

FAMILIES = ("conv", "batchnorm", "pool", "dropout", "optimizer")
ENV = "HPCDL_GPU_KERNELS"
TF32_ENV = "HPCDL_TF32"
DETERMINISTIC_ENV = "HPCDL_DETERMINISTIC"
AUTOTUNE_ENV = "HPCDL_CUDNN_AUTOTUNE"
HALF_WGRAD_ENV = "HPCDL_HALF_WGRAD"

_enabled = os.environ.get(ENV, "") not in ("", "0")
_tf32 = os.environ.get(TF32_ENV, "") not in ("", "0")
_deterministic = os.environ.get(DETERMINISTIC_ENV, "") not in ("", "0")
_said: set[str] = set()
_autotune: int | None = None  # engines timed per convolution plan; None: not read from ENV yet
_half_wgrad = os.environ.get(HALF_WGRAD_ENV, "") not in ("", "0")


class Kernel(Protocol):
    """A fast kernel for one op family (NOTE [fast kernels])."""

    name: str

    def applies(self, layer: Any, x: Any) -> bool: ...
    def forward(self, layer: Any, x: Any, train: bool) -> Any: ...
    def backward(self, layer: Any, dy: Any) -> Any: ...


def enable(on: bool) -> None:
    """Turn the fast kernels on or off for this process (--gpu-kernels)."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    return _enabled


def allow_tf32(on: bool) -> None:
    """Let float32 convolutions and GEMMs use TF32 tensor cores, or not (--tf32, NOTE [TF32])."""
    global _tf32
    _tf32 = bool(on)


def tf32() -> bool:
    """Whether float32 convolutions and GEMMs may use TF32 tensor cores (NOTE [TF32])."""
    return _tf32


def make_deterministic(on: bool) -> None:
    """Leave cuDNN's nondeterministic engines out of every plan, or not (NOTE [deterministic
    engines]); set it before the first plan is built, as --tf32."""
    global _deterministic
    _deterministic = bool(on)


def deterministic() -> bool:
    """Whether cuDNN plans leave out engines cuDNN notes as NONDETERMINISTIC."""
    return _deterministic


def set_autotune(engines: int) -> None:
    """Time the first `engines` engines of each convolution plan and keep the fastest (NOTE
    [engine autotuning]); 0 or 1: the heuristics' first. Set it before the first plan is built."""
    global _autotune
    _autotune = max(0, int(engines))


def autotune() -> int:
    """Engines timed per convolution plan (NOTE [engine autotuning]); 0 or 1: none timed. Read
    from HPCDL_CUDNN_AUTOTUNE once; a value that is no count is said once and taken as 0."""
    global _autotune
    if _autotune is None:
        raw = os.environ.get(AUTOTUNE_ENV, "").strip()
        try:
            _autotune = max(0, int(raw or 0))
        except ValueError:
            _autotune = 0
            say_once(AUTOTUNE_ENV, f"{AUTOTUNE_ENV}={raw!r} is no count of engines to time "
                     "(e.g. 8); cuDNN's heuristics choose")  # fmt: skip
    return _autotune


def set_half_wgrad(on: bool) -> None:
    """Write a bf16/fp16 convolution's weight gradient in the format, or in float32 (NOTE
    [half weight gradients]); set it before the first plan is built."""
    global _half_wgrad
    _half_wgrad = bool(on)


def half_wgrad() -> bool:
    """Whether a bf16/fp16 convolution's weight gradient comes out in the format."""
    return _half_wgrad


def candidates(family: str) -> list[Any]:
    """The kernels of an op family, best first (its module's KERNELS)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown op family {family!r}; one of {', '.join(FAMILIES)}")
    return importlib.import_module(f"hpcdl.nn.kernels.{family}").KERNELS


def choose(family: str, layer: Any, x: Any) -> Any:
    """The first kernel of `family` that applies to (layer, x), or None: the reference runs."""
    if not _enabled:
        return None
    return next((k for k in candidates(family) if k.applies(layer, x)), None)


def say_once(key: str, line: str) -> None:
    """One line on stderr per key and process: a fallback is said once, not every step."""
    if key not in _said:
        _said.add(key)
        print(f"hpcdl: {line}", file=sys.stderr, flush=True)


class Seam:
    """A layer's door to its family's kernels; remembers forward's kernel for backward."""

    def __init__(self, family: str) -> None:
        candidates(family)  # a misspelt family fails when the layer is built
        self.family = family
        self.kernel: Any = None  # the kernel of the last forward; None: the reference ran

    def take(self, layer: Any, x: Any) -> bool:
        """Choose for this forward; True when a kernel runs it (then call .kernel)."""
        self.kernel = choose(self.family, layer, x)
        return self.kernel is not None
