"""The fused and rewritten layer paths against their plain forms and finite differences (float64).

Conv2d's two input-gradient forms (col2im, dilated), ReLU working in place after a fresh output,
BatchNorm's fewer-pass forward and backward, and MaxPool2d's window-view passes."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check_layer

from hpcdl.backend import to_host
from hpcdl.nn import BatchNorm, Conv2d, Dropout, Linear, MaxPool2d, ReLU, Sequential
from hpcdl.nn.model import bind_flat

CONV_CASES = [
    # (c_in, c_out, kernel, stride, padding, (N, H, W))
    (3, 3, 3, 1, 1, (2, 6, 5)),  # 'same', resnet's stride-1 layers
    (3, 2, 3, 1, 0, (2, 6, 7)),  # 'valid', cnn's second layers
    (2, 4, 3, 2, 1, (2, 7, 6)),  # stride 2, odd size
    (2, 3, (2, 3), (1, 2), (0, 1), (2, 4, 5)),  # rectangular kernel, stride, padding
    (2, 2, 3, 3, 2, (1, 4, 4)),  # padding wider than the image border
    (3, 2, 1, 2, 0, (2, 5, 5)),  # 1x1 stride 2 (shortcut B)
    (1, 2, 5, 1, 2, (2, 3, 3)),  # kernel larger than the input
]


@pytest.mark.parametrize("c_in,c_out,kernel,stride,padding,nhw", CONV_CASES)
def test_conv_input_gradient_forms_agree(xp, c_in, c_out, kernel, stride, padding, nhw):
    conv = Conv2d(c_in, c_out, kernel, stride=stride, padding=padding)
    bind_flat(conv, xp, np.float64, seed=2)
    rng = np.random.default_rng(0)
    x = xp.asarray(rng.standard_normal((*nhw, c_in)))
    y = conv.forward(x)
    dy = xp.asarray(rng.standard_normal(y.shape))
    grads = {}
    for col2im in (True, False):
        conv.col2im_input_grad = col2im
        grads[col2im] = to_host(conv.backward(dy))
    assert grads[True].shape == (*nhw, c_in)
    np.testing.assert_allclose(grads[True], grads[False], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("col2im", [True, False], ids=["col2im", "dilated"])
@pytest.mark.parametrize("c_in,c_out,kernel,stride,padding,nhw", CONV_CASES[:4])
def test_each_conv_input_gradient_form_matches_finite_differences(
    xp, col2im, c_in, c_out, kernel, stride, padding, nhw
):
    conv = Conv2d(c_in, c_out, kernel, stride=stride, padding=padding)
    conv.col2im_input_grad = col2im
    check_layer(conv, (*nhw, c_in), xp)


def test_conv_picks_col2im_for_strided_or_widening_layers():
    assert Conv2d(16, 32, 3, stride=2, padding=1).col2im_input_grad
    assert Conv2d(32, 64, 3, padding=1).col2im_input_grad
    assert not Conv2d(16, 16, 3, padding=1).col2im_input_grad
    assert not Conv2d(32, 32, 3).col2im_input_grad


@pytest.mark.parametrize(
    "make,shape",
    [
        (lambda: Conv2d(2, 3, 3, padding=1), (2, 4, 4, 2)),  # conv + bias + ReLU
        (lambda: Linear(5, 4), (3, 5)),
        (lambda: BatchNorm(3), (2, 3, 3, 3)),
    ],
    ids=["conv", "linear", "batchnorm"],
)
def test_relu_in_place_after_a_fresh_output_equals_the_plain_relu(xp, make, shape):
    fused = Sequential([make(), ReLU()])
    assert fused.layers[1].inplace
    check_layer(fused, shape, xp, params_checked=30)
    plain = Sequential([make(), ReLU()])
    plain.layers[1].inplace = False
    rng = np.random.default_rng(1)
    x = xp.asarray(rng.standard_normal(shape))
    outs = []
    for seq in (fused, plain):
        _, grads, _, _ = bind_flat(seq, xp, np.float64, seed=3)
        y = seq.forward(x)
        dx = seq.backward(xp.asarray(np.random.default_rng(2).standard_normal(y.shape)))
        outs.append((to_host(y), to_host(dx), to_host(grads).copy()))
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)


def test_relu_stays_out_of_place_after_layers_that_keep_or_pass_their_output():
    seq = Sequential([ReLU(), Dropout(0.5), ReLU(), MaxPool2d(2), ReLU()])
    assert not any(layer.inplace for layer in seq.layers if isinstance(layer, ReLU))
    x = -np.ones((1, 2, 2, 1))
    ReLU().forward(x)
    assert (x == -1).all()  # a standalone ReLU leaves its input alone


def _textbook_bn(x, dy, gamma, beta, mean, var, eps, train):
    """y and dx of batch normalisation over the last axis, written as the textbook does."""
    c = x.shape[-1]
    x2, dy2 = x.reshape(-1, c), dy.reshape(-1, c)
    xhat = (x2 - mean) / np.sqrt(var + eps)
    y = xhat * gamma + beta
    dxhat = dy2 * gamma
    if not train:
        return y.reshape(x.shape), (dxhat / np.sqrt(var + eps)).reshape(x.shape)
    m = x2.shape[0]
    dx = (dxhat - dxhat.mean(0) - xhat * (dxhat * xhat).mean(0)) / np.sqrt(var + eps)
    assert m > 1
    return y.reshape(x.shape), dx.reshape(x.shape)


@pytest.mark.parametrize("shape", [(16, 5), (3, 4, 5, 6)])
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("sync", [False, True], ids=["local", "sync_one_rank"])
def test_batchnorm_matches_the_textbook_formulas(xp, shape, train, sync):
    c = shape[-1]
    rng = np.random.default_rng(7)
    bn = BatchNorm(c)
    if sync:
        bn.stat_reducer = lambda buf: None
    params, grads, buffers, _ = bind_flat(bn, xp, np.float64)
    params[...] = xp.asarray(rng.uniform(0.5, 2.0, params.size))
    buffers[...] = xp.asarray(rng.uniform(0.5, 1.5, buffers.size))
    running = to_host(buffers).copy()
    x = rng.normal(2.0, 3.0, shape)
    dy = rng.standard_normal(shape)
    y = to_host(bn.forward(xp.asarray(x), train))
    dx = to_host(bn.backward(xp.asarray(dy)))
    x2 = x.reshape(-1, c)
    mean, var = (x2.mean(0), x2.var(0)) if train else (running[:c], running[c:])
    gamma, beta = to_host(bn.p["gamma"]), to_host(bn.p["beta"])
    y_ref, dx_ref = _textbook_bn(x, dy, gamma, beta, mean, var, bn.eps, train)
    np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-10, atol=1e-12)
    xhat = (x2 - mean) / np.sqrt(var + bn.eps)
    np.testing.assert_allclose(to_host(bn.g["beta"]), dy.reshape(-1, c).sum(0), rtol=1e-12)
    np.testing.assert_allclose(
        to_host(bn.g["gamma"]), (dy.reshape(-1, c) * xhat).sum(0), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("nhwc", [(2, 6, 6, 3), (2, 7, 5, 2)])
def test_maxpool_window_views_equal_the_tile_reduction(nhwc):
    """Bitwise the values and ties-shared gradients of a (N, Ho, 2, Wo, 2, C) reduction."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 3, nhwc).astype(np.float32)  # many ties
    pool = MaxPool2d(2)
    y = pool.forward(x)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dx = pool.backward(dy)
    n, h, w, c = nhwc
    ho, wo = h // 2, w // 2
    tiles = x[:, : 2 * ho, : 2 * wo].reshape(n, ho, 2, wo, 2, c)
    y_ref = tiles.max(axis=(2, 4))
    hit = tiles == y_ref[:, :, None, :, None, :]
    share = dy / hit.sum(axis=(2, 4), dtype=np.float32)
    dx_ref = np.zeros_like(x)
    dx_ref[:, : 2 * ho, : 2 * wo] = (hit * share[:, :, None, :, None, :]).reshape(
        n, 2 * ho, 2 * wo, c
    )
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(dx, dx_ref)
