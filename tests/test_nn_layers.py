"""Every layer and the loss against central finite differences in float64 (numpy; cupy if a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import EPS, TOL, check_layer, rel_error

from hpcdl.backend import to_host
from hpcdl.nn import (
    BatchNorm,
    BottleneckBlock,
    Conv2d,
    Dropout,
    Flatten,
    GlobalAvgPool,
    Linear,
    MaxPool2d,
    ReLU,
    ResidualBlock,
    Sequential,
    accuracy_count,
    softmax_cross_entropy,
)
from hpcdl.nn.blocks import OptionAShortcut
from hpcdl.nn.model import bind_flat


@pytest.mark.parametrize("n_in,n_out,batch", [(5, 3, 4), (1, 7, 1), (12, 2, 6)])
def test_linear_gradients(xp, n_in, n_out, batch):
    check_layer(Linear(n_in, n_out), (batch, n_in), xp)


CONV_CASES = [
    # (c_in, c_out, kernel, stride, padding, (N, H, W))
    (2, 3, 3, 1, 1, (2, 5, 5)),
    (3, 2, 3, 1, 0, (2, 6, 7)),
    (2, 2, 3, 2, 1, (2, 7, 6)),  # stride 2, odd size
    (1, 4, 3, 2, 0, (1, 8, 8)),  # stride 2, (H - k) not divisible by the stride
    (3, 2, 1, 2, 0, (2, 5, 5)),  # 1x1 stride 2 (shortcut B)
    (2, 3, (2, 3), (1, 2), (0, 1), (2, 4, 5)),  # rectangular kernel, stride, padding
    (2, 2, 3, 3, 2, (1, 4, 4)),  # stride > 1 with padding wider than the image border
    (1, 2, 5, 1, 2, (2, 3, 3)),  # kernel larger than the input, 'same'
    (2, 3, 3, 1, 1, (1, 1, 1)),  # 1x1 image
]


@pytest.mark.parametrize("c_in,c_out,kernel,stride,padding,nhw", CONV_CASES)
def test_conv2d_gradients(xp, c_in, c_out, kernel, stride, padding, nhw):
    conv = Conv2d(c_in, c_out, kernel, stride=stride, padding=padding)
    n, h, w = nhw
    y = check_layer(conv, (n, h, w, c_in), xp)
    assert y.shape == (n, *conv.output_hw(h, w), c_out)


def test_conv2d_matches_direct_convolution():
    rng = np.random.default_rng(1)
    conv = Conv2d(2, 3, 3, stride=2, padding=1)
    bind_flat(conv, np, np.float64, 1)
    x = rng.standard_normal((2, 5, 6, 2))
    y = conv.forward(x)
    xpad = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    w, b = conv.p["W"], conv.p["b"]
    expected = np.zeros(y.shape)
    for oi in range(y.shape[1]):
        for oj in range(y.shape[2]):
            patch = xpad[:, 2 * oi : 2 * oi + 3, 2 * oj : 2 * oj + 3, :]
            expected[:, oi, oj, :] = np.einsum("nijc,ijcf->nf", patch, w) + b
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)


def test_conv2d_without_bias_and_kernel_that_does_not_fit():
    conv = Conv2d(1, 1, 3, bias=False)
    assert [s.name for s in conv.param_specs] == ["W"]
    bind_flat(conv, np, np.float64)
    with pytest.raises(ValueError, match="does not fit"):
        conv.forward(np.zeros((1, 2, 2, 1)))
    with pytest.raises(ValueError, match="input channels"):
        conv.forward(np.zeros((1, 4, 4, 3)))


@pytest.mark.parametrize(
    "kernel,stride,nhwc", [(2, None, (2, 4, 6, 3)), (2, None, (1, 5, 5, 2)), (3, 2, (2, 7, 7, 2))]
)
def test_maxpool_gradients(xp, kernel, stride, nhwc):
    check_layer(MaxPool2d(kernel, stride), nhwc, xp)


@pytest.mark.parametrize("nhwc", [(2, 7, 7, 2), (2, 6, 5, 3), (1, 1, 1, 2)])
def test_maxpool_with_padding_gradients_and_values(xp, nhwc):
    """ResNet's stem pool: 3x3, stride 2, padding 1 (implicit -inf borders, as PyTorch)."""
    pool = MaxPool2d(3, 2, padding=1)
    check_layer(pool, nhwc, xp)
    x = np.random.default_rng(1).standard_normal(nhwc) - 10.0  # all negative: zero pads would win
    y = to_host(pool.forward(xp.asarray(x)))
    n, h, w, c = nhwc
    assert y.shape == (n, (h - 1) // 2 + 1, (w - 1) // 2 + 1, c)
    for i in range(y.shape[1]):
        for j in range(y.shape[2]):
            window = x[:, max(0, 2 * i - 1) : 2 * i + 2, max(0, 2 * j - 1) : 2 * j + 2]
            np.testing.assert_array_equal(y[:, i, j], window.max(axis=(1, 2)))
    with pytest.raises(ValueError, match="padding 2,2 must be at most half the kernel 3x3"):
        MaxPool2d(3, 2, padding=2)


@pytest.mark.parametrize("kernel,stride", [(2, None), (2, 1)])
def test_maxpool_ties_share_the_gradient(kernel, stride):
    pool = MaxPool2d(kernel, stride)
    x = np.ones((1, 3, 3, 1))
    y = pool.forward(x)
    dx = pool.backward(np.full(y.shape, 3.0))
    assert dx.sum() == pytest.approx(3.0 * y.size)  # each output's gradient is routed once
    if stride is None:  # the last row/column is outside every 2x2 tile
        np.testing.assert_allclose(dx[0, :2, :2, 0], 0.75)
        assert not dx[0, 2, :, 0].any() and not dx[0, :, 2, 0].any()


def test_global_avg_pool_and_relu_and_flatten_gradients(xp):
    check_layer(GlobalAvgPool(), (2, 3, 4, 5), xp)
    check_layer(ReLU(), (3, 7), xp)
    check_layer(Flatten(), (2, 3, 2, 2), xp)


def test_dropout_gradient_with_fixed_mask(xp):
    drop = Dropout(0.4, rng=np.random.default_rng(5))
    state = drop.rng.bit_generator.state

    def reset():
        drop.rng.bit_generator.state = state

    check_layer(drop, (6, 20), xp, reset=reset)


def test_dropout_train_eval_and_seeding():
    x = np.ones((200, 50), dtype=np.float32)
    a = Dropout(0.5, rng=np.random.default_rng(1)).forward(x, train=True)
    b = Dropout(0.5, rng=np.random.default_rng(1)).forward(x, train=True)
    c = Dropout(0.5, rng=np.random.default_rng(2)).forward(x, train=True)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert set(np.unique(a)) == {0.0, 2.0} and a.dtype == np.float32
    assert abs((a == 0).mean() - 0.5) < 0.02
    np.testing.assert_array_equal(Dropout(0.5).forward(x, train=False), x)
    with pytest.raises(ValueError, match="Dropout probability"):
        Dropout(1.0)


@pytest.mark.parametrize("shape", [(8, 3), (2, 3, 4, 5)])
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("sync", [False, True], ids=["local", "sync_one_rank"])
def test_batchnorm_gradients(xp, shape, train, sync):
    """sync: the SyncBatchNorm path (shifted sums, reduced backward terms) with one rank."""
    bn = BatchNorm(shape[-1])
    if sync:
        bn.stat_reducer = lambda buf: None  # the sum over a world of one rank
    _, _, buffers, _ = bind_flat(bn, xp, np.float64)
    buffers[...] = xp.asarray(np.random.default_rng(3).uniform(0.5, 1.5, buffers.size))
    bn.p["gamma"][...] = xp.asarray(np.random.default_rng(4).uniform(0.5, 2.0, shape[-1]))
    rng = np.random.default_rng(0)
    x = xp.asarray(rng.standard_normal(shape))
    dy = xp.asarray(rng.standard_normal(shape))
    bn.forward(x, train)
    dx = bn.backward(dy)
    objective_grads = _numeric_bn(bn, x, dy, train)
    assert rel_error(to_host(dx), objective_grads) < TOL


def _numeric_bn(bn, x, dy, train):
    num = np.zeros(x.size)
    flat = x.reshape(-1)
    for i in range(x.size):
        old = float(flat[i])
        flat[i] = old + EPS
        plus = float((bn.forward(x, train) * dy).sum())
        flat[i] = old - EPS
        minus = float((bn.forward(x, train) * dy).sum())
        flat[i] = old
        num[i] = (plus - minus) / (2 * EPS)
    return num


def test_batchnorm_parameter_gradients_and_running_statistics():
    bn = BatchNorm(4, momentum=0.1)
    params, grads, buffers, _ = bind_flat(bn, np, np.float64)
    rng = np.random.default_rng(0)
    x = rng.normal(3.0, 2.0, (64, 4))
    y = bn.forward(x, train=True)
    np.testing.assert_allclose(y.mean(axis=0), 0, atol=1e-12)
    np.testing.assert_allclose(y.std(axis=0), 1, atol=1e-4)
    np.testing.assert_allclose(bn.b["running_mean"], 0.1 * x.mean(axis=0))
    np.testing.assert_allclose(bn.b["running_var"], 0.9 + 0.1 * x.var(axis=0, ddof=1))
    check_layer(bn, (6, 3, 3, 4), np)
    before = buffers.copy()
    bn.forward(x, train=False)
    np.testing.assert_array_equal(buffers, before)  # evaluation leaves running stats alone


@pytest.mark.parametrize(
    "c_in,c_out,stride,shortcut",
    [(3, 3, 1, "A"), (2, 4, 2, "A"), (2, 4, 2, "B"), (3, 5, 1, "B"), (2, 4, 2, "A")],
)
def test_residual_block_gradients(xp, c_in, c_out, stride, shortcut):
    block = ResidualBlock(c_in, c_out, stride, shortcut=shortcut)
    y = check_layer(block, (2, 5, 5, c_in), xp, params_checked=60)
    assert y.shape == (2, 3 if stride == 2 else 5, 3 if stride == 2 else 5, c_out)


@pytest.mark.parametrize("c_in,width,stride", [(4, 2, 2), (8, 2, 1), (3, 2, 1)])
def test_bottleneck_block_gradients(xp, c_in, width, stride):
    """1x1 -> 3x3 (strided) -> 1x1 x4; projection shortcut unless (c_in, stride) = (4 w, 1)."""
    block = BottleneckBlock(c_in, width, stride)
    assert isinstance(block.shortcut, Sequential)
    assert len(block.shortcut.layers) == (0 if (c_in, stride) == (4 * width, 1) else 2)
    strided = [leaf for leaf in block.branch.leaves() if isinstance(leaf, Conv2d) and leaf.sh > 1]
    assert [(c.kh, c.sh) for c in strided] == ([(3, 2)] if stride == 2 else [])
    y = check_layer(block, (2, 5, 5, c_in), xp, params_checked=60)
    assert y.shape == (2, 3 if stride == 2 else 5, 3 if stride == 2 else 5, 4 * width)


def test_option_a_shortcut_pads_channels_and_subsamples():
    short = OptionAShortcut(2, 4, 2)
    x = np.arange(2 * 4 * 4 * 2, dtype=np.float64).reshape(2, 4, 4, 2)
    y = short.forward(x)
    assert y.shape == (2, 2, 2, 4)
    np.testing.assert_array_equal(y[..., 1:3], x[:, ::2, ::2, :])
    assert not y[..., 0].any() and not y[..., 3].any()
    check_layer(short, (2, 5, 5, 2), np)


def test_sequential_gradients(xp):
    seq = Sequential([Conv2d(2, 3, 3, padding=1), ReLU(), MaxPool2d(2), Flatten(), Linear(12, 4)])
    check_layer(seq, (2, 4, 4, 2), xp, params_checked=60)


@pytest.mark.parametrize("n,k", [(1, 2), (5, 3), (16, 10)])
def test_softmax_cross_entropy_gradient_and_value(xp, n, k):
    rng = np.random.default_rng(n * k)
    logits = xp.asarray(rng.standard_normal((n, k)) * 3)
    labels = xp.asarray(rng.integers(0, k, n))
    loss, d = softmax_cross_entropy(logits, labels)
    host = to_host(logits)
    lab = to_host(labels)
    log_softmax = host - np.log(np.exp(host).sum(axis=1, keepdims=True))
    assert abs(float(loss) + log_softmax[np.arange(n), lab].mean()) < 1e-12
    num = np.zeros(host.size)
    flat = logits.reshape(-1)
    for i in range(host.size):
        old = float(flat[i])
        flat[i] = old + EPS
        plus = float(softmax_cross_entropy(logits, labels)[0])
        flat[i] = old - EPS
        minus = float(softmax_cross_entropy(logits, labels)[0])
        flat[i] = old
        num[i] = (plus - minus) / (2 * EPS)
    assert rel_error(to_host(d), num) < TOL


def test_softmax_cross_entropy_is_stable_for_huge_logits():
    logits = np.array([[1000.0, 0.0], [-1000.0, 1000.0]], dtype=np.float32)
    loss, d = softmax_cross_entropy(logits, np.array([0, 0]))
    assert np.isfinite(loss) and np.isfinite(d).all()
    assert float(loss) == pytest.approx(1000.0)
    assert accuracy_count(logits, np.array([0, 0])) == 1


def test_softmax_cross_entropy_rejects_mismatched_labels():
    with pytest.raises(ValueError, match="labels"):
        softmax_cross_entropy(np.zeros((3, 2)), np.zeros(4, dtype=np.int64))
