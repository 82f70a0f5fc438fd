"""Reduced precision (--precision bf16|fp16): rounding of activations and gradients, and the
dynamic loss scaler of fp16.

What a step computes with --precision P (the numerics of PyTorch's autocast with P):
- the parameters stay float32 in the model's flat buffer (the "master weights" the optimizer
  updates, allreduces and checkpoints); each forward uses a copy rounded to P;
- the model's input, every layer's output and every layer's input gradient are rounded to P,
  so each GEMM multiplies P-representable operands with a float32 sum, as tensor cores do;
- BatchNorm statistics, the softmax cross-entropy, the weight gradients and the optimizer
  stay float32 (autocast keeps the loss and the statistics in float32; its weight gradients
  are rounded to P before they are added into float32, ours are not).
fp16 also scales the loss (LossScaler): its 5 exponent bits underflow small gradients
without it, and a scale too large overflows; an overflow skips the optimizer step on every
rank together and halves the scale.

The arrays stay float32 and the rounding is done in place (round_in_place), on NumPy and CuPy
alike. This reproduces the formats' numerics (tested in tests/test_precision.py); it does not
make the step faster: the GEMMs still run in float32 (docs/precision.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hpcdl.backend import array_module
from hpcdl.nn.threads import run_split

PRECISIONS = ("fp32", "bf16", "fp16")

# PyTorch's torch.amp.GradScaler defaults.
INIT_SCALE = 2.0**16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000

_BF16_KEEP = np.uint32(0xFFFF0000)  # bfloat16 is the top 16 bits of a float32
_BF16_HALF = np.uint32(0x7FFF)  # with the kept part's lowest bit: round to nearest, ties even


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")


def rounding(precision: str) -> Callable[[Any], None] | None:
    """The in-place rounding of a float32 array to `precision`; None for fp32."""
    check_precision(precision)
    if precision == "fp32":
        return None
    return lambda x: round_in_place(x, precision)


def round_in_place(x: Any, precision: str) -> None:
    """Round the float32 array x (NumPy or CuPy) to the nearest bf16 or fp16 value, in place.

    Ties go to even; values beyond the format's range become +-inf (fp16: |x| >= 65520), NaN
    stays NaN, fp16's subnormals are kept. The work is split over the compute threads."""
    if x.dtype != np.float32:
        raise ValueError(f"{precision} rounding needs float32 arrays, got {x.dtype}")
    if x.ndim == 0 or not x.size:
        return
    one_part = _round_bf16 if precision == "bf16" else _round_fp16

    def part(first: int, count: int, _part: int) -> None:
        one_part(x[first : first + count])

    run_split(len(x), part, x)


def _round_bf16(x: Any) -> None:
    xp = array_module(x)
    nan = xp.isnan(x)  # a NaN whose payload carries into the sign or exponent would change
    bits = x.view(xp.uint32)
    carry = bits >> np.uint32(16)  # uint32 scalars: no promotion to int64 on any backend
    carry &= np.uint32(1)
    carry += _BF16_HALF
    bits += carry
    bits &= _BF16_KEEP
    xp.copyto(x, xp.float32(xp.nan), where=nan)


def _round_fp16(x: Any) -> None:
    xp = array_module(x)
    with np.errstate(over="ignore"):  # beyond fp16's range is inf: what the scaler looks for
        x[...] = x.astype(xp.float16)


class LossScaler:
    """Dynamic loss scaling (fp16), the rule of PyTorch's GradScaler.

    The loss gradient is multiplied by `scale` before backward. After the gradients are
    averaged, `unscale(grads)` divides them by the scale and says whether the step may be
    applied: not when any rank saw an inf or NaN gradient, in which case the scale is halved;
    after growth_interval applied steps in a row it is doubled. The scale is a power of two,
    so scaling and unscaling are exact."""

    def __init__(
        self,
        any_rank: Callable[[bool], bool] | None = None,
        init_scale: float = INIT_SCALE,
        growth_interval: int = GROWTH_INTERVAL,
    ) -> None:
        self.scale = init_scale
        self.growth_interval = growth_interval
        self.good_steps = 0  # applied steps since the scale last changed
        self.skipped = 0  # steps skipped in this run
        # any_rank(flag) -> flag of any rank; collective (None: one rank)
        self.any_rank = any_rank

    def unscale(self, grads: Any, overflows: Any = None, agreed: bool = False) -> bool:
        """Divide grads by the scale if every rank's are finite; True when the step applies.

        overflows: a device scalar counting this rank's non-finite gradient ranges (the step's
        OverflowCheck), or, when `agreed`, every rank's (summed by the gradient allreduce, so
        no collective is needed); None: look at grads here. Reading it is this step's one host
        sync with fp16, for the host decides whether the update runs."""
        if overflows is None:
            overflows = ~array_module(grads).isfinite(grads).all()
        overflow = bool(overflows)
        if self.any_rank is not None and not agreed:
            overflow = self.any_rank(overflow)
        if overflow:
            self.scale *= BACKOFF_FACTOR
            self.good_steps, self.skipped = 0, self.skipped + 1
            return False
        grads *= 1.0 / self.scale
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= GROWTH_FACTOR
            self.good_steps = 0
        return True

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        scale, good = float(state["scale"]), int(state["good_steps"])
        if not (scale > 0 and np.isfinite(scale)) or not 0 <= good < self.growth_interval:
            raise ValueError(f"loss scale state {state!r} is out of range")
        self.scale, self.good_steps = scale, good
