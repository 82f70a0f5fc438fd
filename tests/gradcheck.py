"""Gradient checks the nn tests share: a layer's backward against central finite differences
(float64), and one conv forward/backward compared bit for bit between two code paths."""

from __future__ import annotations

import numpy as np

from hpcdl import backend
from hpcdl.backend import to_host
from hpcdl.nn.model import bind_flat

TOL = 1e-6


EPS = 1e-6


def rel_error(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    scale = max(np.linalg.norm(a), np.linalg.norm(b), 1e-12)
    return float(np.linalg.norm(a - b) / scale)


def check_layer(layer, x_shape, xp, seed=0, train=True, params_checked=40, reset=None):
    """Compare backward's dx and parameter gradients with central differences of sum(y * r)."""
    rng = np.random.default_rng(seed)
    params, grads, _, _ = bind_flat(layer, xp, np.float64, seed)
    x = xp.asarray(rng.standard_normal(x_shape))

    def forward():
        if reset:
            reset()
        return layer.forward(x, train)

    y = forward()
    r = xp.asarray(rng.standard_normal(y.shape))

    def objective() -> float:
        return float((forward() * r).sum())

    forward()
    grads[...] = np.nan  # every gradient entry must be written by backward
    dx = layer.backward(r.copy())
    assert dx.shape == x.shape
    num_dx = np.zeros(x.size)
    flat_x = x.reshape(-1)
    for i in range(x.size):
        old = float(flat_x[i])
        flat_x[i] = old + EPS
        plus = objective()
        flat_x[i] = old - EPS
        minus = objective()
        flat_x[i] = old
        num_dx[i] = (plus - minus) / (2 * EPS)
    assert rel_error(to_host(dx), num_dx) < TOL, "input gradient"
    if params.size:
        assert not np.isnan(to_host(grads)).any(), "backward left gradient entries unwritten"
        idx = rng.choice(params.size, min(params_checked, params.size), replace=False)
        num = []
        for i in idx:
            old = float(params[i])
            params[i] = old + EPS
            plus = objective()
            params[i] = old - EPS
            minus = objective()
            params[i] = old
            num.append((plus - minus) / (2 * EPS))
        assert rel_error(to_host(grads)[idx], num) < TOL, "parameter gradient"
    return y


def conv_step(layer, x, dy, blas_threads, seen="chunk"):
    """(layer.<seen> after forward, y, dx, gradients) of one forward and backward."""
    backend.set_blas_threads(blas_threads)
    y = layer.forward(x).copy()
    path = getattr(layer, seen)
    layer.g["W"][...] = np.nan  # every entry must be written
    dx = layer.backward(dy).copy()
    return path, y, dx, {name: g.copy() for name, g in layer.g.items()}


def assert_same_step(first, second) -> None:
    """Two conv_step results hold the same bits (y, dx and every gradient)."""
    for a, b in zip(first[1:3], second[1:3]):
        assert np.array_equal(a, b)
    assert all(np.array_equal(first[3][k], second[3][k]) for k in first[3])
