"""Initialisers against their formulas, and each built-in model against its reference framework.

Statistics are of seeded draws, so the tolerances cannot flake: 5 standard errors of the sample
mean and variance (a normal's sample variance has relative standard error sqrt(2/n), a
uniform's sqrt(0.8/n)).
"""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl import nn
from hpcdl.nn.init import INITIALISERS, initial_values
from hpcdl.nn.layers import ParamSpec
from hpcdl.nn.model import bind_flat

FAN_IN, FAN_OUT = 3 * 3 * 64, 3 * 3 * 128
SHAPE = (3, 3, 64, 128)  # 73,728 draws

# name -> (variance formula, distribution)
FORMULAS = {
    "glorot_uniform": (2.0 / (FAN_IN + FAN_OUT), "uniform"),  # Keras default kernel
    "he_normal": (2.0 / FAN_IN, "normal"),  # torch kaiming_normal_(mode="fan_in")
    "kaiming_normal_fan_out": (2.0 / FAN_OUT, "normal"),  # torchvision ResNet convolutions
    "torch_default": (1.0 / (3 * FAN_IN), "uniform"),  # nn.Linear / nn.Conv2d weight and bias
}


def draw(name, shape=SHAPE, seed=0):
    return initial_values(np.random.default_rng(seed), ParamSpec("W", shape, name, FAN_IN, FAN_OUT))


def check_stats(w, var, dist):
    n = w.size
    assert abs(w.mean()) < 5 * np.sqrt(var / n), (w.mean(), var)
    rel = 5 * np.sqrt((2.0 if dist == "normal" else 0.8) / n)
    assert abs(w.var() / var - 1) < rel, (w.var(), var)
    kurtosis = ((w - w.mean()) ** 4).mean() / w.var() ** 2
    assert abs(kurtosis - (3.0 if dist == "normal" else 1.8)) < 0.1, kurtosis
    if dist == "uniform":  # bounded by sqrt(3 var), and the bound is reached
        limit = np.sqrt(3 * var)
        assert np.abs(w).max() <= limit and np.abs(w).max() > 0.999 * limit


@pytest.mark.parametrize("name", sorted(FORMULAS))
def test_initialiser_matches_its_formula(name):
    check_stats(draw(name), *FORMULAS[name])


def test_every_initialiser_is_tested_and_constants_are_constant():
    assert set(INITIALISERS) == set(FORMULAS) | {"zeros", "ones"}
    assert not draw("zeros").any() and (draw("ones") == 1).all()


def test_unknown_initialiser_is_a_clear_error_when_the_layer_is_built():
    with pytest.raises(ValueError, match=r"unknown initialiser 'xavier'; choose one of .*"):
        nn.Linear(4, 3, init="xavier")
    with pytest.raises(ValueError, match=r"unknown initialiser 'one'"):
        nn.Conv2d(1, 2, 3, bias_init="one")


def test_own_layers_choose_their_initialiser_per_layer():
    wide = nn.Linear(2000, 1000, init="glorot_uniform", bias_init="zeros")
    bind_flat(wide, np, np.float64, seed=0)
    check_stats(wide.p["W"], 2.0 / 3000, "uniform")
    assert not wide.p["b"].any()
    default = nn.Conv2d(64, 100, 3)  # PyTorch's nn.Conv2d default: U(+-1/sqrt(fan_in)) for both
    bind_flat(default, np, np.float64, seed=0)
    check_stats(default.p["W"], 1.0 / (3 * 576), "uniform")
    assert 0 < np.abs(default.p["b"]).max() <= 1 / np.sqrt(576)


def leaves(model, cls):
    return [leaf for leaf in model.body.leaves() if isinstance(leaf, cls)]


def pooled(arrays_and_scales):
    """Concatenate W / scale over layers: one standardised sample from many small layers."""
    return np.concatenate([np.asarray(w).ravel() / s for w, s in arrays_and_scales])


@pytest.mark.parametrize("name", ["cnn", "mlp"])
def test_keras_models_have_glorot_uniform_kernels_and_zero_biases(name):
    """cnn is Keras cifar10_cnn, mlp its Dense defaults: glorot_uniform kernels, zero biases."""
    model = nn.build_model(name, (3, 32, 32), 10, seed=0, dtype=np.float64)
    convs, dense = leaves(model, nn.Conv2d), leaves(model, nn.Linear)
    assert len(dense) == 2 and len(convs) == (4 if name == "cnn" else 0)
    scaled = [(c.p["W"], np.sqrt(6 / (c.kh * c.kw * (c.c_in + c.c_out)))) for c in convs]
    scaled += [(d.p["W"], np.sqrt(6 / (d.n_in + d.n_out))) for d in dense]
    u = pooled(scaled)  # U(-1, 1): variance 1/3
    check_stats(u, 1.0 / 3, "uniform")
    for layer in convs + dense:
        assert not layer.p["b"].any()


@pytest.mark.parametrize("name,convs,features", [("resnet20", 19, 64), ("resnet18", 20, 512)])
def test_resnets_initialise_as_torchvision(name, convs, features):
    """Kaiming-normal fan_out convolutions, BatchNorm 1 and 0, nn.Linear's default classifier."""
    model = nn.build_model(name, (3, 32, 32), 10, seed=0, dtype=np.float64)
    conv_layers = leaves(model, nn.Conv2d)
    assert len(conv_layers) == convs and not any(c.has_bias for c in conv_layers)
    z = pooled([(c.p["W"], np.sqrt(2 / (c.kh * c.kw * c.c_out))) for c in conv_layers])  # N(0, 1)
    check_stats(z, 1.0, "normal")
    for bn in leaves(model, nn.BatchNorm):
        assert (bn.p["gamma"] == 1).all() and not bn.p["beta"].any()
    (fc,) = leaves(model, nn.Linear)
    bound = 1 / np.sqrt(features)
    assert 0.9 * bound < np.abs(fc.p["W"]).max() <= bound
    assert 0 < np.abs(fc.p["b"]).max() <= bound
    assert abs(fc.p["W"].var() * 3 * features - 1) < 0.2  # 10 x features draws of U(-b, b)


def test_resnet50_declares_torchvisions_initialisers():
    """The same rules on resnet50, read from the layers' declarations (no 25M-value draw)."""
    from hpcdl.nn.models import _resnet50

    layers = _resnet50(3, 224, 224, 1000)
    specs = [s for layer in layers for leaf in layer.leaves() for s in leaf.param_specs]
    by_init = {}
    for s in specs:
        by_init.setdefault(s.init, []).append(s)
    assert {len(s.shape) for s in by_init["kaiming_normal_fan_out"]} == {4}  # every conv
    assert len(by_init["kaiming_normal_fan_out"]) == 53
    assert sorted(s.name for s in by_init["torch_default"]) == ["W", "b"]  # the classifier
    assert {s.name for s in by_init["ones"]} == {"gamma"}
    assert {s.name for s in by_init["zeros"]} == {"beta"}
