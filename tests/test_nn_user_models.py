"""Users' own models (`--model package.module:function` / `file.py:function`): the builder
contract and one clear error for each way it can go wrong. The builders live in this file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hpcdl import nn

THIS_FILE = Path(__file__).resolve()
NOT_CALLABLE = 42


def small_convnet(input_shape, num_classes, seed=0, xp=np, dtype=np.float32):
    """A user's model: conv -> BN -> relu -> global pool -> dense, from hpcdl.nn layers."""
    c = input_shape[0]
    layers = [
        nn.Conv2d(c, 8, 3, padding=1, bias=False),
        nn.BatchNorm(8),
        nn.ReLU(),
        nn.GlobalAvgPool(),
        nn.Linear(8, num_classes),
    ]
    return nn.Model(
        "small_convnet", layers, input_shape, num_classes, seed=seed, xp=xp, dtype=dtype
    )


def returns_layers(input_shape, num_classes, seed=0, xp=np, dtype=np.float32):
    return [nn.Flatten(), nn.Linear(int(np.prod(input_shape)), num_classes)]


def ignores_its_arguments(input_shape, num_classes, seed=0, xp=np, dtype=np.float32):
    return small_convnet((1, 8, 8), 10, seed=seed, xp=xp, dtype=dtype)


def raises(input_shape, num_classes, seed=0, xp=np, dtype=np.float32):
    raise RuntimeError("out of ideas")


def takes_no_keywords(input_shape, num_classes):
    return small_convnet(input_shape, num_classes)


@pytest.mark.parametrize(
    "spec", ["test_nn_user_models:small_convnet", f"{THIS_FILE}:small_convnet"]
)
def test_a_builder_named_by_module_or_file_builds_a_model_that_trains(spec):
    model = nn.build_model(spec, (3, 6, 5), 4, seed=3, dtype=np.float64)
    assert model.input_shape == (3, 6, 5) and model.num_classes == 4
    assert model.params.dtype == np.float64
    again = nn.build_model(spec, (3, 6, 5), 4, seed=3, dtype=np.float64)
    np.testing.assert_array_equal(model.params, again.params)  # deterministic in seed
    x = np.random.default_rng(0).standard_normal((2, 3, 6, 5))
    _, d = nn.softmax_cross_entropy(model.forward(x), np.array([0, 3]))
    model.backward(d)
    assert np.abs(model.grads).max() > 0


def test_a_file_given_by_relative_path_is_loaded_once(monkeypatch):
    monkeypatch.chdir(THIS_FILE.parent.parent)
    spec = f"tests/{THIS_FILE.name}:small_convnet"
    a = nn.build_model(spec, (1, 4, 4), 2)
    b = nn.build_model(spec, (1, 4, 4), 2)
    assert type(a.body.layers[0]) is type(b.body.layers[0])


@pytest.mark.parametrize(
    "spec,message",
    [
        ("no_such_module_xyz:build", r"cannot import no_such_module_xyz \(No module named"),
        ("missing_file.py:build", r"missing_file.py is not a file"),
        ("test_nn_user_models:absent", r"test_nn_user_models has no attribute 'absent'"),
        ("test_nn_user_models:NOT_CALLABLE", r"NOT_CALLABLE is a int, not a function"),
        ("test_nn_user_models:returns_layers", r"returned a list, not an hpcdl.nn.Model"),
        (
            "test_nn_user_models:ignores_its_arguments",
            r"model for input \(1, 8, 8\) and 10 classes, asked for \(3, 6, 5\) and 4",
        ),
        ("test_nn_user_models:raises", r"the builder raised RuntimeError: out of ideas"),
        ("test_nn_user_models:takes_no_keywords", r"the builder raised TypeError: .*seed"),
        (":build", r"expected package.module:function or path/to/file.py:function"),
        ("test_nn_user_models:", r"expected package.module:function"),
    ],
)
def test_each_wrong_builder_is_one_clear_error(spec, message):
    with pytest.raises(ValueError, match=message) as info:
        nn.build_model(spec, (3, 6, 5), 4)
    assert str(info.value).startswith(f"model {spec!r}: ") and "\n" not in str(info.value)


def test_a_file_that_fails_to_load_names_the_file(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import numpy\nraise SystemError('half written')\n")
    with pytest.raises(ValueError, match=r"loading .*broken.py raised SystemError: half written"):
        nn.build_model(f"{bad}:build", (3, 6, 5), 4)
