"""hpcdl.nn.threads and the layers that split their passes over it.

With two compute threads every layer must give the one-thread results (elementwise passes
bitwise, per-channel sums to float64 rounding), repeat bitwise run to run, and match central
finite differences in float64. The split threshold is lowered to 1 so that test-sized arrays
split (each test asserts that they do)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from gradcheck import check_layer

from hpcdl import backend
from hpcdl.nn import BatchNorm, Dropout, Linear, MaxPool2d, ReLU, ResidualBlock, threads
from hpcdl.nn.model import bind_flat


@pytest.fixture
def split_all(monkeypatch):
    """Any array splits; compute threads back to 1 afterwards."""
    monkeypatch.setattr(threads, "MIN_SPLIT_ELEMENTS", 1)
    yield
    backend.set_compute_threads(1)


@pytest.mark.parametrize("n,parts", [(7, 2), (64, 2), (5, 3), (2, 2)])
def test_part_ranges_cover_the_range_in_order(n, parts):
    ranges = [threads.part_range(n, parts, part) for part in range(parts)]
    assert ranges[0][0] == 0
    for (first, count), (next_first, _) in zip(ranges, ranges[1:]):
        assert first + count == next_first
    assert sum(count for _, count in ranges) == n
    assert max(c for _, c in ranges) - min(c for _, c in ranges) <= 1


def test_run_split_runs_the_parts_on_two_threads(split_all):
    backend.set_compute_threads(2)
    seen: list[tuple[int, int, int, int]] = []

    def work(first: int, count: int, part: int) -> None:
        time.sleep(0.01)  # both parts are in flight at once
        seen.append((part, first, count, threading.get_ident()))

    assert threads.run_split(9, work, np.zeros(9)) == 2
    assert sorted(s[:3] for s in seen) == [(0, 0, 4), (1, 4, 5)]
    assert len({s[3] for s in seen}) == 2
    assert threading.get_ident() in {s[3] for s in seen}  # part 0 on the caller


def test_run_split_stays_inline_when_small_or_on_one_thread():
    backend.set_compute_threads(2)
    try:
        small = np.zeros(threads.MIN_SPLIT_ELEMENTS - 1)
        seen: list[tuple[int, int, int, int]] = []
        work = lambda f, c, p: seen.append((f, c, p, threading.get_ident()))  # noqa: E731
        assert threads.run_split(len(small), work, small) == 1
        backend.set_compute_threads(1)
        large = np.zeros(threads.MIN_SPLIT_ELEMENTS)
        assert threads.run_split(len(large), work, large) == 1
        me = threading.get_ident()
        assert seen == [(0, len(small), 0, me), (0, len(large), 0, me)]
    finally:
        backend.set_compute_threads(1)


def test_a_failing_part_raises_after_every_part_finished(split_all):
    backend.set_compute_threads(2)
    finished: list[int] = []

    def work(part: int) -> None:
        if part == 1:
            raise ValueError("part 1 failed")
        time.sleep(0.02)
        finished.append(part)

    with pytest.raises(ValueError, match="part 1 failed"):
        threads.run_parts(2, work)
    assert finished == [0]


def _residual_block() -> ResidualBlock:
    return ResidualBlock(4, 6, stride=2)  # option A shortcut: subsample + zero channels


def _sync_bn() -> BatchNorm:
    bn = BatchNorm(5)
    bn.stat_reducer = lambda buf: None  # one rank: the reduction leaves the sums as they are
    return bn


# (name, layer factory, input shape, exact: elementwise only, so bitwise equal across splits)
LAYERS = [
    ("batchnorm_nhwc", lambda: BatchNorm(5), (6, 4, 3, 5), False),
    ("batchnorm_nc", lambda: BatchNorm(7), (9, 7), False),
    ("sync_batchnorm", _sync_bn, (6, 4, 3, 5), False),
    ("relu", ReLU, (5, 4, 3, 2), True),
    ("maxpool_2x2", lambda: MaxPool2d(2), (5, 4, 6, 3), True),
    ("maxpool_3x3_s2_p1", lambda: MaxPool2d(3, 2, 1), (5, 7, 6, 2), True),
    ("dropout", lambda: Dropout(0.3, rng=np.random.default_rng(5)), (7, 4, 3, 2), True),
    ("linear", lambda: Linear(9, 4), (7, 9), False),
    ("residual_block", _residual_block, (5, 6, 6, 4), False),
]


def _step(make, shape: tuple[int, ...], compute_threads: int, train: bool = True) -> list:
    """y, dx, parameter gradients and buffers of a fresh float64 layer's forward + backward."""
    backend.set_compute_threads(compute_threads)
    layer = make()
    _, grads, buffers, _ = bind_flat(layer, np, np.float64, seed=3)
    rng = np.random.default_rng(4)
    x = rng.integers(-3, 4, shape).astype(np.float64)  # ties for max pool and ReLU zeros
    x += 0.01 * rng.standard_normal(shape) * (rng.random(shape) < 0.5)
    y = layer.forward(x.copy(), train).copy()
    dx = layer.backward(rng.standard_normal(y.shape))
    return [y, dx, grads.copy(), buffers.copy()]


@pytest.mark.parametrize("name,make,shape,exact", LAYERS, ids=[c[0] for c in LAYERS])
def test_two_threads_give_the_one_thread_results(split_all, name, make, shape, exact):
    one = _step(make, shape, 1)
    assert threads.split_parts(shape[0], np.zeros(shape)) == 1
    two = _step(make, shape, 2)
    assert threads.split_parts(shape[0], np.zeros(shape)) == 2
    for a, b in zip(one, two):
        if exact:
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,make,shape,exact", LAYERS, ids=[c[0] for c in LAYERS])
def test_two_threads_repeat_bitwise(split_all, name, make, shape, exact):
    first, second = _step(make, shape, 2), _step(make, shape, 2)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


def test_batchnorm_eval_on_two_threads_equals_one(split_all):
    one, two = (_step(lambda: BatchNorm(5), (6, 4, 3, 5), t, train=False) for t in (1, 2))
    for a, b in zip(one[:2], two[:2]):
        np.testing.assert_array_equal(a, b)  # y and dx: elementwise, from running statistics
    np.testing.assert_allclose(one[2], two[2], rtol=1e-12, atol=1e-12)  # summed gradients


@pytest.mark.parametrize(
    "make,shape",
    [
        (lambda: BatchNorm(3), (4, 3, 2, 3)),
        (_sync_bn, (4, 3, 2, 5)),
        (lambda: ReLU(), (4, 3, 2, 2)),
        (lambda: MaxPool2d(3, 2, 1), (3, 5, 4, 2)),
        (lambda: Linear(5, 3), (4, 5)),
        (_residual_block, (3, 4, 4, 4)),
    ],
    ids=["batchnorm", "sync_batchnorm", "relu", "maxpool", "linear", "residual_block"],
)
def test_two_thread_gradients_match_finite_differences(split_all, make, shape):
    backend.set_compute_threads(2)
    check_layer(make(), shape, np, params_checked=40)
