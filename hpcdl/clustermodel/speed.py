"""Training speed vs batch size: seconds per step = b / v0 + t, fitted by least squares.

v0 is the ideal speed (images/s of the part of a step that grows with the batch) and t the
fixed cost of a step (gradient allreduce, optimizer update, launch overheads), in seconds.
The speed at batch b is then v(b) = b / (b / v0 + t): it approaches v0 as b grows, and reaches a
fraction f of v0 at b = f * v0 * t / (1 - f).

A fixed cost is never negative: the fit is constrained to t >= 0 (a negative t, which load
on a shared machine can produce, is refitted with t = 0). When the timings cannot tell v0 and t
apart (t held at 0, or t within two standard errors of 0), the fit says so (`separable`,
`note`) instead of reporting a t that is noise.

Units are whatever the caller uses consistently; hpcdl.bench.scaling passes the GLOBAL batch
(per-rank batch x ranks) and so gets the job's images/s as v0 (docs/report.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np


class ScalingFitError(ValueError):
    """The timings cannot be fitted by b / v0 + t (too few points, bad values, no growth)."""


@dataclass(frozen=True)
class ScalingFit:
    v0: float  # images/s in the limit of large batches
    t: float  # seconds of fixed cost per step
    r2: float  # coefficient of determination of the seconds-per-step fit
    points: int  # number of (batch, seconds) pairs used
    separable: bool = True  # False: the timings cannot tell v0 from t (see note)
    note: str = ""  # one line for the user when not separable

    def speed(self, batch: float | np.ndarray) -> float | np.ndarray:
        """Images/s predicted at this batch size."""
        return speed(batch, self.v0, self.t)

    def batch_for_fraction(self, fraction: float = 0.9) -> float:
        """Smallest batch whose predicted speed is `fraction` of v0."""
        return batch_for_fraction(self.v0, self.t, fraction)

    def to_json(self) -> dict[str, float]:
        return asdict(self)


def speed(batch: float | np.ndarray, v0: float, t: float) -> float | np.ndarray:
    """v(b) = b / (b / v0 + t), images/s."""
    return batch / (batch / v0 + t)


def batch_for_fraction(v0: float, t: float, fraction: float = 0.9) -> float:
    """Batch size b with v(b) = fraction * v0, i.e. b = f * v0 * t / (1 - f).

    A fixed cost t <= 0 (possible from a noisy fit) means every batch already runs at v0: 0.
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}")
    if not (np.isfinite(v0) and v0 > 0):
        raise ValueError(f"v0 must be a positive number of images/s, got {v0}")
    return max(0.0, fraction * v0 * t / (1.0 - fraction))


def fit(batch_sizes: Sequence[float], seconds_per_step: Sequence[float]) -> ScalingFit:
    """Least-squares fit of seconds_per_step = batch / v0 + t, minimising relative residuals.

    r2 is the ordinary coefficient of determination of the fitted seconds per step. Needs at
    least two distinct batch sizes (three or more for a meaningful r2) and positive, finite
    timings. Raises ScalingFitError when time does not grow with the batch (v0 undefined).
    """
    b = np.asarray(batch_sizes, dtype=np.float64)
    s = np.asarray(seconds_per_step, dtype=np.float64)
    if b.shape != s.shape or b.ndim != 1:
        raise ScalingFitError(
            f"need two equally long lists, got {b.shape[0] if b.ndim else 0} batch sizes "
            f"and {s.shape[0] if s.ndim else 0} timings"
        )
    if not (np.all(np.isfinite(b)) and np.all(np.isfinite(s))):
        raise ScalingFitError("batch sizes and timings must be finite numbers")
    if np.any(b <= 0) or np.any(s <= 0):
        raise ScalingFitError("batch sizes and seconds per step must be positive")
    if np.unique(b).size < 2:
        raise ScalingFitError(
            f"need timings at two or more different batch sizes to fit v0 and t, "
            f"got {np.unique(b).size} ({sorted(set(b.tolist()))})"
        )
    design = np.stack([b, np.ones_like(b)], axis=1)  # (n, 2): [batch, 1]
    # Relative residuals: timing noise scales with the step time, and unweighted residuals
    # would let the largest batches decide t, the small part of their step.
    weighted = design / s[:, None]
    (slope, intercept), *_ = np.linalg.lstsq(weighted, np.ones_like(s), rcond=None)
    t_error = _intercept_error(weighted, np.array([slope, intercept]))
    held = intercept < 0
    if held:  # t >= 0: the best fit on the boundary, seconds = batch / v0
        x = weighted[:, 0]
        slope, intercept = float(x.sum() / (x @ x)), 0.0
    if slope <= 0:
        raise ScalingFitError(
            f"seconds per step does not grow with the batch size (slope {slope:.3g} s/image): "
            "v0 is undefined; time more steps or use larger batches"
        )
    residual = s - design @ np.array([slope, intercept])
    total = np.sum((s - s.mean()) ** 2)
    r2 = 1.0 - float(np.sum(residual**2) / total) if total > 0 else 1.0
    note = _inseparable_note(held, float(intercept), t_error)
    return ScalingFit(
        v0=float(1.0 / slope), t=float(intercept), r2=r2, points=int(b.size),
        separable=not note, note=note,
    )  # fmt: skip


def _intercept_error(weighted: np.ndarray, coef: np.ndarray) -> float | None:
    """Standard error of the unconstrained t (relative-residual least squares); None with no
    degree of freedom left (two points fit exactly, whatever their noise)."""
    dof = weighted.shape[0] - 2
    if dof <= 0:
        return None
    rss = float(np.sum((weighted @ coef - 1.0) ** 2))
    covariance = np.linalg.pinv(weighted.T @ weighted) * rss / dof
    return float(np.sqrt(max(covariance[1, 1], 0.0)))


def _inseparable_note(held: bool, t: float, t_error: float | None) -> str:
    """'' when t is told apart from 0; else one line saying why v0 and t cannot be separated."""
    if held:
        return (
            "the timings cannot separate v0 from t: the best fit had t < 0, so t is held at 0 "
            "(t >= 0) and v0 is the mean speed; time more steps, or on a quieter machine"
        )
    if t_error is not None and t > 0 and t <= 2 * t_error:
        return (
            f"the timings cannot separate v0 from t: t = {t * 1e3:.3g} ms is within two "
            f"standard errors ({2 * t_error * 1e3:.2g} ms) of 0; time more steps or a wider "
            "range of batch sizes"
        )
    return ""
