"""The b / v0 + t fit: recovers known values from noisy synthetic timings; clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.clustermodel import speed
from hpcdl.clustermodel.speed import ScalingFitError


@pytest.mark.parametrize(
    ("v0", "t"),
    [(258.1, 0.054), (513.8, 0.15), (2000.0, 0.004)],  # the source's 1- and 2-GPU fits; a fast CPU
)
def test_fit_recovers_v0_and_t_from_noisy_timings(v0, t):
    rng = np.random.default_rng(7)
    batches = np.repeat([8, 16, 32, 64, 128, 256], 5).astype(float)
    seconds = batches / v0 + t
    seconds *= 1.0 + 0.02 * rng.standard_normal(seconds.size)  # 2% timing noise
    fit = speed.fit(batches, seconds)
    assert fit.v0 == pytest.approx(v0, rel=0.05)
    assert fit.t == pytest.approx(t, rel=0.05)
    assert fit.r2 > 0.95
    assert fit.points == batches.size


def test_exact_timings_give_exact_fit_and_speed():
    batches = [8, 16, 32, 64]
    fit = speed.fit(batches, [b / 400.0 + 0.02 for b in batches])
    assert fit.v0 == pytest.approx(400.0)
    assert fit.t == pytest.approx(0.02)
    assert fit.r2 == pytest.approx(1.0)
    assert fit.speed(32) == pytest.approx(32 / (32 / 400.0 + 0.02))


def test_a_negative_overhead_is_held_at_zero_and_said():
    """Under load a 2-rank fit once gave t = -0.3 ms: not a physical answer."""
    batches = [8.0, 16.0, 32.0, 64.0]
    seconds = [b / 1000.0 - 0.0003 for b in batches]  # what an unconstrained fit reads as t < 0
    fit = speed.fit(batches, seconds)
    assert fit.t == 0.0 and not fit.separable
    assert fit.v0 == pytest.approx(1 / np.mean(np.array(seconds) / np.array(batches)), rel=0.02)
    assert "cannot separate v0 from t" in fit.note and "t >= 0" in fit.note


def test_a_fixed_cost_within_the_noise_is_said_to_be_inseparable():
    rng = np.random.default_rng(3)
    batches = np.repeat([8.0, 16.0, 32.0], 3)
    seconds = (batches / 500.0 + 0.0005) * (1.0 + 0.05 * rng.standard_normal(batches.size))
    fit = speed.fit(batches, seconds)
    assert fit.t >= 0.0 and not fit.separable
    assert "cannot separate v0 from t" in fit.note


def test_a_clear_fixed_cost_is_separable_and_has_no_note():
    batches = [8, 16, 32, 64]
    fit = speed.fit(batches, [b / 400.0 + 0.02 for b in batches])
    assert fit.separable and fit.note == ""


def test_batch_for_fraction_reaches_that_fraction_of_v0():
    v0, t = 513.8, 0.15
    b90 = speed.batch_for_fraction(v0, t, 0.9)
    assert b90 == pytest.approx(0.9 * v0 * t / 0.1)
    assert speed.speed(b90, v0, t) == pytest.approx(0.9 * v0)
    assert speed.speed(b90 * 0.99, v0, t) < 0.9 * v0
    assert speed.batch_for_fraction(v0, -0.001) == 0.0
    with pytest.raises(ValueError, match="fraction"):
        speed.batch_for_fraction(v0, t, 1.0)


@pytest.mark.parametrize(
    ("batches", "seconds", "message"),
    [
        ([32], [0.1], "two or more different batch sizes"),
        ([32, 32, 32], [0.1, 0.11, 0.09], "two or more different batch sizes"),
        ([], [], "two or more different batch sizes"),
        ([8, 16], [0.1], "equally long"),
        ([8, 16, 32], [0.1, -0.2, 0.3], "positive"),
        ([8, 16, 32], [0.1, float("nan"), 0.3], "finite"),
        ([8, 16, 32], [0.3, 0.2, 0.1], "does not grow"),
    ],
)
def test_unfittable_input_gives_clear_error(batches, seconds, message):
    with pytest.raises(ScalingFitError, match=message):
        speed.fit(batches, seconds)


def test_benchmark_fits_each_rank_count_on_the_global_batch():
    """hpcdl.bench.scaling: per-rank batches in, the job's images/s as v0 out (docs/report.md)."""
    from hpcdl.bench.scaling import analyse  # noqa: PLC0415

    def record(ranks, v0, t):
        points = [{"batch": b, "seconds_per_step": ranks * b / v0 + t} for b in (8, 16, 32, 64)]
        return {"ranks": ranks, "points": points}

    fits, points = analyse([record(1, 258.1, 0.054), record(2, 513.8, 0.15), record(4, 1e3, 0.0)])
    one, two, four = fits
    assert (one["ranks"], two["ranks"]) == (1, 2)
    assert one["v0"] == pytest.approx(258.1) and one["t"] == pytest.approx(0.054)
    assert two["v0"] == pytest.approx(513.8) and two["t"] == pytest.approx(0.15)
    assert two["b90"] == pytest.approx(9 * 513.8 * 0.15)
    assert two["b90_per_rank"] == pytest.approx(two["b90"] / 2)
    assert four["t"] == pytest.approx(0.0, abs=1e-12) and four["t"] >= 0.0
    assert one["separable"] and two["separable"] and one["note"] == ""
    p = next(p for p in points if p["ranks"] == 2 and p["batch"] == 32)
    assert p["global_batch"] == 64
    assert p["images_per_s"] == pytest.approx(64 / (64 / 513.8 + 0.15))
    assert p["images_per_s_fit"] == pytest.approx(p["images_per_s"])
