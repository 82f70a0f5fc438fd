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
from hpcdl.nn import kernels
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
    so scaling and unscaling are exact.

    NOTE [device loss scale]
    On the host the rule reads the overflow flag, one sync per step. `unscale_on_device`
    applies the same rule to device scalars (the scale a float32, the good-step and skipped
    counts integers, all 0-d arrays on the gradients' backend) and returns the 0-d "apply"
    flag the optimizer masks its update with (SGD.step's `apply`): no host read, so the step
    can be a CUDA graph. `scale`, `good_steps` and `skipped` stay host numbers to their readers
    (the metrics record, the checkpoint); with the device state they read it then, as the
    step's loss is read (NOTE [device scalars] in hpcdl/nn/step.py). The float32 scale holds
    every power of two in [2**-149, 2**127] exactly: the host's float64 differs only after
    some 165 overflows in a row from 2**16, when both scale every gradient to 0 or inf.
    `on_device`: None decides with --gpu-kernels (hpcdl.nn.kernels.enabled()), where the
    captured step needs it; the host rule stays the default, the one a CPU run has always run.
    """

    def __init__(
        self,
        any_rank: Callable[[bool], bool] | None = None,
        init_scale: float = INIT_SCALE,
        growth_interval: int = GROWTH_INTERVAL,
        on_device: bool | None = None,
    ) -> None:
        self._scale = init_scale
        self.growth_interval = growth_interval
        self._good_steps = 0  # applied steps since the scale last changed
        self._skipped = 0  # steps skipped in this run
        # any_rank(flag) -> flag of any rank; collective (None: one rank)
        self.any_rank = any_rank
        self.on_device = on_device
        self._device: dict[str, Any] | None = None  # scale, good_steps, skipped as 0-d arrays

    @property
    def scale(self) -> float:
        """The loss scale (with the device state: a host read of it)."""
        return float(self._device["scale"]) if self._device else self._scale

    @property
    def good_steps(self) -> int:
        return int(self._device["good_steps"]) if self._device else self._good_steps

    @property
    def skipped(self) -> int:
        return int(self._device["skipped"]) if self._device else self._skipped

    def decides_on_device(self, agreed: bool) -> bool:
        """Whether this step's rule runs on the device: asked for (or --gpu-kernels), and no
        host collective is needed (one rank, or the reducer carried every rank's flags)."""
        wanted = kernels.enabled() if self.on_device is None else self.on_device
        return wanted and (self.any_rank is None or agreed)

    def scale_for(self, xp: Any, divisor: int) -> Any:
        """scale / divisor as the loss gradient's factor on the device: a float32 0-d array,
        the value the host's float64 scale / divisor rounds to."""
        scale = self._device_state(xp)["scale"]
        return (scale.astype(xp.float64) / divisor).astype(xp.float32)

    def unscale(self, grads: Any, overflows: Any = None, agreed: bool = False) -> bool:
        """Divide grads by the scale if every rank's are finite; True when the step applies.

        overflows: a device scalar counting this rank's non-finite gradient ranges (the step's
        OverflowCheck), or, when `agreed`, every rank's (summed by the gradient allreduce, so
        no collective is needed); None: look at grads here. Reading it is this step's one host
        sync with fp16, for the host decides whether the update runs."""
        self._to_host()
        if overflows is None:
            overflows = ~array_module(grads).isfinite(grads).all()
        overflow = bool(overflows)
        if self.any_rank is not None and not agreed:
            overflow = self.any_rank(overflow)
        if overflow:
            self._scale *= BACKOFF_FACTOR
            self._good_steps, self._skipped = 0, self._skipped + 1
            return False
        grads *= 1.0 / self._scale
        self._good_steps += 1
        if self._good_steps == self.growth_interval:
            self._scale *= GROWTH_FACTOR
            self._good_steps = 0
        return True

    def unscale_on_device(self, grads: Any, overflows: Any = None) -> Any:
        """unscale's rule on device scalars (NOTE [device loss scale]); returns the 0-d bool
        "apply" flag. overflows: as unscale's, every rank's (agreed) or one rank's; the grads
        of a skipped step are left as they were. No host read."""
        xp = array_module(grads)
        state = self._device_state(xp)
        if overflows is None:
            overflows = ~xp.isfinite(grads).all()
        overflow = xp.asarray(overflows).reshape(()) > 0
        apply = xp.asarray(~overflow)  # 0-d on NumPy too, where ~ gives a scalar
        factor = xp.where(overflow, 1.0, 1.0 / state["scale"])  # 1/scale: float32, exact
        grads *= factor.astype(grads.dtype)
        good = xp.where(overflow, 0, state["good_steps"] + 1)
        grow = good == self.growth_interval
        change = xp.where(overflow, BACKOFF_FACTOR, xp.where(grow, GROWTH_FACTOR, 1.0))
        state["scale"] *= change.astype(xp.float32)
        state["good_steps"][...] = xp.where(grow, 0, good)
        state["skipped"] += overflow
        return apply

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        scale, good = float(state["scale"]), int(state["good_steps"])
        if not (scale > 0 and np.isfinite(scale)) or not 0 <= good < self.growth_interval:
            raise ValueError(f"loss scale state {state!r} is out of range")
        self._scale, self._good_steps = scale, good
        if self._device is not None:  # in place: a captured step holds these arrays
            self._device["scale"][...] = scale
            self._device["good_steps"][...] = good

    def _device_state(self, xp: Any) -> dict[str, Any]:
        """The device scalars, made from the host numbers on first use; their arrays stay put
        (a captured step reads and writes them in place)."""
        if self._device is None:
            self._device = {
                "scale": xp.asarray(self._scale, dtype=xp.float32),
                "good_steps": xp.asarray(self._good_steps, dtype=xp.int64),
                "skipped": xp.asarray(self._skipped, dtype=xp.int64),
            }
        return self._device

    def _to_host(self) -> None:
        """Back to the host numbers (a host step, or a loaded state): one read, then the
        device state is made afresh when next needed."""
        if self._device is not None:
            self._scale, self._good_steps = self.scale, self.good_steps
            self._skipped, self._device = self.skipped, None
