"""Models: flat buffers, back-to-front layout, whole-model gradients, shapes and bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hpcdl import nn
from hpcdl.backend import to_host


def batch(shape, n=4, classes=5, seed=0, xp=np, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = xp.asarray(rng.standard_normal((n, *shape)).astype(dtype))
    y = xp.asarray(rng.integers(0, classes, n))
    return x, y


@pytest.mark.parametrize(
    "name,shape",
    [
        ("mlp", (2, 4, 3)),
        ("cnn", (1, 8, 8)),
        ("cnn", (2, 5, 7)),
        ("resnet20", (3, 6, 5)),
        ("resnet18", (3, 16, 16)),
    ],
)
def test_model_gradient_matches_finite_differences(xp, name, shape):
    """Every parameter array of the model, sampled, in float64 (train mode, fixed dropout).

    resnet18 on 16x16: stem 8x8, pool 4x4, ..., 1x1 in stage 4 (1 entry per array)."""
    model = nn.build_model(name, shape, 5, seed=1, xp=xp, dtype=np.float64)
    x, y = batch(shape, xp=xp, dtype=np.float64)
    state = model.get_rng_state()

    def loss_and_grad():
        model.set_rng_state(state)
        loss, d = nn.softmax_cross_entropy(model.forward(x, train=True), y)
        return float(loss), d

    _, d = loss_and_grad()
    model.backward(d)
    analytic = to_host(model.grads).copy()
    rng = np.random.default_rng(0)
    per_array = 1 if len(model.layout()) > 50 else 4  # resnet18: 62 arrays, ~50 ms a forward
    idx = np.concatenate(
        [
            off + rng.choice(int(np.prod(s)), min(per_array, int(np.prod(s))), replace=False)
            for _, s, off in model.layout()
        ]
    )
    eps, numeric = 1e-6, []
    for i in idx:
        old = float(model.params[i])
        model.params[i] = old + eps
        plus = loss_and_grad()[0]
        model.params[i] = old - eps
        minus = loss_and_grad()[0]
        model.params[i] = old
        numeric.append((plus - minus) / (2 * eps))
    numeric = np.array(numeric)
    err = np.linalg.norm(analytic[idx] - numeric) / max(np.linalg.norm(numeric), 1e-12)
    assert err < 1e-6, f"{name}: relative gradient error {err:.2e}"
    assert np.abs(numeric).max() > 0  # the check is not vacuous


@pytest.mark.parametrize("name", nn.MODELS)
def test_params_and_grads_are_views_of_one_flat_buffer(name):
    model = nn.build_model(name, (3, 8, 8), 7, seed=0)
    assert model.name == name
    assert model.params.dtype == np.float32 and model.params.flags.c_contiguous
    assert model.grads.shape == model.params.shape and model.grads.flags.c_contiguous
    layout = model.layout()
    assert sum(int(np.prod(s)) for _, s, _ in layout) == model.params.size
    offsets = [off for _, _, off in layout]
    assert offsets == sorted(offsets) and offsets[0] == 0
    for leaf in model.body.leaves():
        for key, view in leaf.p.items():
            assert np.shares_memory(view, model.params), key
            assert np.shares_memory(leaf.g[key], model.grads), key
        for key, view in leaf.b.items():
            assert np.shares_memory(view, model.buffers), key
    # Writes through the flat buffer are seen by the layers, and the other way round.
    model.params[...] = 0.0
    x, _ = batch((3, 8, 8))
    logits = model.forward(x, train=False)
    assert logits.shape == (4, 7) and logits.dtype == np.float32
    np.testing.assert_array_equal(logits, 0.0)
    last = [leaf for leaf in model.body.leaves() if leaf.param_specs][0]
    last.p["b"][...] = 1.5
    assert model.params[0] == 1.5  # the last layer sits at offset 0


@pytest.mark.parametrize("name", nn.MODELS)
def test_grad_ready_is_back_to_front_monotone_and_ends_at_p(name):
    model = nn.build_model(name, (1, 8, 8), 10, seed=0)
    x, y = batch((1, 8, 8), n=6, classes=10)
    _, d = nn.softmax_cross_entropy(model.forward(x), y)
    model.grads[...] = np.nan
    seen = []

    def ready(n):
        assert not np.isnan(model.grads[:n]).any(), "grads[:n] reported final but not written"
        seen.append(n)

    model.backward(d, grad_ready=ready)
    assert seen == sorted(set(seen)) and seen[-1] == model.params.size
    param_layers = [leaf for leaf in model.body.leaves() if leaf.param_specs]
    assert len(seen) == len(param_layers)
    assert not np.isnan(model.grads).any()


def test_layout_names_are_stable_and_cover_the_buffer():
    model = nn.build_model("resnet20", (3, 32, 32), 10)
    layout = model.layout()
    names = [name for name, _, _ in layout]
    assert len(set(names)) == len(names)
    assert names[0] == "13.Linear.b" and names[-1].startswith("0.Conv2d")
    assert model.buffers.size == 2 * sum(s[0] for n, s, _ in layout if n.endswith("gamma"))


def test_cnn_is_the_keras_cifar10_network_on_32x32():
    model = nn.build_model("cnn", (3, 32, 32), 10)
    assert model.params.size == 1_250_858  # Keras model.summary() total
    shapes = [s for _, s, _ in reversed(model.layout())]
    assert (3, 3, 3, 32) in shapes and (2304, 512) in shapes and (512, 10) in shapes


@pytest.mark.parametrize(
    "name,params,convs,blocks",
    [
        ("resnet18", 11_689_512, 20, nn.ResidualBlock),
        ("resnet50", 25_557_032, 53, nn.BottleneckBlock),
    ],
)
def test_imagenet_resnets_have_torchvisions_parameter_counts(name, params, convs, blocks):
    """torchvision.models.resnet18/50(num_classes=1000): sum(p.numel() for p in parameters())."""
    model = nn.build_model(name, (3, 224, 224), 1000)
    assert model.num_params == params
    bns = [leaf for leaf in model.body.leaves() if isinstance(leaf, nn.BatchNorm)]
    assert model.buffers.size == 2 * sum(bn.channels for bn in bns)  # running stats: buffers
    assert len([leaf for leaf in model.body.leaves() if isinstance(leaf, nn.Conv2d)]) == convs
    assert sum(isinstance(layer, blocks) for layer in model.body.layers) == (
        8 if convs == 20 else 16
    )
    (pool,) = [leaf for leaf in model.body.leaves() if isinstance(leaf, nn.MaxPool2d)]
    assert (pool.kh, pool.sh, pool.ph) == (3, 2, 1)


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_imagenet_resnets_downsample_32_times(name):
    model = nn.build_model(name, (3, 64, 64), 4, seed=0)
    x, y = batch((3, 64, 64), n=2, classes=4)
    shapes = []
    h = x.transpose(0, 2, 3, 1).copy()
    for layer in model.body.layers:
        h = layer.forward(h, train=True)
        shapes.append(h.shape)
    width = 512 if name == "resnet18" else 2048
    assert shapes[0] == (2, 32, 32, 64) and shapes[3] == (2, 16, 16, 64)  # stem, max pool
    assert shapes[-3] == (2, 2, 2, width) and shapes[-1] == (2, 4)


def test_resnet20_has_the_published_parameter_count():
    model = nn.build_model("resnet20", (3, 32, 32), 10)
    # convs 432 + 13,824 + 50,688 + 202,752; BN 2 x 688; dense 650 (He et al.: "0.27M")
    assert model.params.size == 269_722


SHAPES = [(1, 1, 1), (3, 2, 9), (2, 8, 8), (1, 17, 13)]


# resnet50 (25M parameters: seconds to build) at one shape; resnet18 shares its stem and stages
@pytest.mark.parametrize(
    "name,shape",
    [(n, s) for n in nn.MODELS for s in SHAPES if n != "resnet50" or s == (1, 17, 13)],
)
def test_any_input_shape_and_class_count_works(name, shape):
    model = nn.build_model(name, shape, 3, seed=0)
    x, y = batch(shape, n=2, classes=3)
    logits = model.forward(x, train=True)
    assert logits.shape == (2, 3) and np.isfinite(logits).all()
    _, d = nn.softmax_cross_entropy(logits, y)
    model.backward(d)
    assert np.isfinite(model.grads).all()


def test_same_seed_same_model_and_different_seed_different_model():
    a = nn.build_model("cnn", (1, 8, 8), 10, seed=4)
    b = nn.build_model("cnn", (1, 8, 8), 10, seed=4)
    c = nn.build_model("cnn", (1, 8, 8), 10, seed=5)
    np.testing.assert_array_equal(a.params, b.params)
    assert not np.array_equal(a.params, c.params)
    f64 = nn.build_model("cnn", (1, 8, 8), 10, seed=4, dtype=np.float64)
    assert f64.params.dtype == np.float64
    np.testing.assert_allclose(f64.params, a.params, rtol=1e-6)


def test_rng_state_round_trips_through_json_and_fixes_dropout():
    model = nn.build_model("mlp", (1, 8, 8), 10, seed=0)
    x, _ = batch((1, 8, 8))
    model.set_rng_state(nn.rank_rng_state(7, 1))
    state = json.loads(json.dumps(model.get_rng_state()))
    first = model.forward(x, train=True)
    model.set_rng_state(state)
    np.testing.assert_array_equal(model.forward(x, train=True), first)
    assert not np.array_equal(model.forward(x, train=True), first)  # the RNG advanced
    assert nn.rank_rng_state(7, 0) != nn.rank_rng_state(7, 1)
    np.testing.assert_array_equal(model.forward(x, train=False), model.forward(x, train=False))


def test_batchnorm_running_stats_update_in_train_mode_only():
    model = nn.build_model("resnet20", (1, 8, 8), 10)
    x, _ = batch((1, 8, 8), n=8)
    before = model.buffers.copy()
    model.forward(x, train=False)
    np.testing.assert_array_equal(model.buffers, before)
    model.forward(x, train=True)
    assert not np.array_equal(model.buffers, before)


def test_unknown_model_name_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown model 'vgg'; choose one of mlp, cnn, resnet20"):
        nn.build_model("vgg", (3, 32, 32), 10)


@pytest.mark.parametrize("shape", [(3, 32), (0, 8, 8), (3, -1, 4), "3,32,32"])
def test_impossible_input_shape_is_a_clear_error(shape):
    with pytest.raises(ValueError, match=r"model 'cnn' needs input_shape \(C, H, W\)"):
        nn.build_model("cnn", shape, 10)


def test_bad_class_count_is_a_clear_error():
    with pytest.raises(ValueError, match="num_classes >= 2"):
        nn.build_model("mlp", (1, 8, 8), 1)


@pytest.mark.parametrize("bad", [(4, 3, 8, 8), (4, 1, 8), (4, 1, 8, 9)])
def test_forward_with_the_wrong_input_shape_names_expected_and_got(bad):
    model = nn.build_model("cnn", (1, 8, 8), 10)
    with pytest.raises(ValueError, match=r"expects input of shape \(N, 1, 8, 8\), got"):
        model.forward(np.zeros(bad, dtype=np.float32))
