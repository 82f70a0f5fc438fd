"""Users' own models (`--model package.module:function` / `file.py:function`): the builder
contract (a Model, or a list of layers wrapped into one) and one clear error for each way it
can go wrong. The builders live in this file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hpcdl import nn
from hpcdl.backend import array_module, to_host

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


def returns_layers(input_shape, num_classes):
    """A user's model as the issue has it: (input_shape, num_classes) -> a list of layers."""
    c = input_shape[0]
    return [
        nn.Conv2d(c, 4, 3, padding=1, bias=False),
        nn.BatchNorm(4),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Flatten(),
        nn.Linear(4 * input_shape[1] * input_shape[2], num_classes),
    ]


KEYWORDS_SEEN: list[dict] = []


def takes_any_keywords(input_shape, num_classes, **keywords):
    KEYWORDS_SEEN.append(keywords)
    return tuple(returns_layers(input_shape, num_classes))


def ignores_its_arguments(input_shape, num_classes, seed=0, xp=np, dtype=np.float32):
    return small_convnet((1, 8, 8), 10, seed=seed, xp=xp, dtype=dtype)


def ignores_dtype(input_shape, num_classes, seed=0, xp=np, dtype=np.float32):
    return small_convnet(input_shape, num_classes, seed=seed, xp=xp, dtype=np.float64)


def raises(input_shape, num_classes, seed=0, xp=np, dtype=np.float32):
    raise RuntimeError("out of ideas")


def raises_over_lines(input_shape, num_classes):
    raise RuntimeError("no such layer\nsee above")


def takes_no_keywords(input_shape, num_classes):
    return small_convnet(input_shape, num_classes)


def returns_none(input_shape, num_classes):
    return None


def returns_empty(input_shape, num_classes):
    return []


def returns_a_non_layer(input_shape, num_classes):
    return [nn.Flatten(), "relu", nn.Linear(int(np.prod(input_shape)), num_classes)]


def ends_with_three_outputs(input_shape, num_classes):
    return [nn.Flatten(), nn.Linear(int(np.prod(input_shape)), 3)]


def misjudges_its_input(input_shape, num_classes):
    return [nn.Flatten(), nn.Linear(7, num_classes)]


def ends_with_a_feature_map(input_shape, num_classes):
    return [nn.Conv2d(input_shape[0], num_classes, 1)]


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


@pytest.mark.parametrize(
    "spec", ["test_nn_user_models:returns_layers", f"{THIS_FILE}:returns_layers"]
)
def test_a_list_of_layers_becomes_a_model_initialised_like_the_built_in_ones(spec):
    model = nn.build_model(spec, (3, 6, 5), 4, seed=3, dtype=np.float64)
    by_hand = nn.Model("x", returns_layers((3, 6, 5), 4), (3, 6, 5), 4, seed=3, dtype=np.float64)
    assert model.name == "test_nn_user_models:returns_layers"  # the same for module and file
    assert model.layout() == by_hand.layout()
    np.testing.assert_array_equal(model.params, by_hand.params)  # drawn from seed as Model does
    other_seed = nn.build_model(spec, (3, 6, 5), 4, seed=4, dtype=np.float64)
    assert not np.array_equal(model.params, other_seed.params)
    np.testing.assert_array_equal(model.buffers, by_hand.buffers)  # BN (0, 1): the check ran
    x = np.random.default_rng(0).standard_normal((2, 3, 6, 5))  # in eval mode, changing nothing
    _, d = nn.softmax_cross_entropy(model.forward(x), np.array([0, 3]))
    model.backward(d)
    assert model.forward(x).shape == (2, 4) and np.abs(model.grads).max() > 0


def test_a_list_of_layers_is_built_and_checked_on_the_requested_backend(xp):
    model = nn.build_model("test_nn_user_models:returns_layers", (3, 6, 5), 4, seed=3, xp=xp)
    assert array_module(model.params) is xp and array_module(model.buffers) is xp
    x = xp.asarray(np.random.default_rng(0).standard_normal((2, 3, 6, 5)))
    assert model.forward(x, train=False).shape == (2, 4)
    host = nn.build_model("test_nn_user_models:returns_layers", (3, 6, 5), 4, seed=3)
    np.testing.assert_array_equal(to_host(model.params), host.params)


def test_the_builder_gets_only_the_keywords_its_signature_takes():
    KEYWORDS_SEEN.clear()
    model = nn.build_model("test_nn_user_models:takes_any_keywords", (2, 3, 3), 5, seed=7)
    assert KEYWORDS_SEEN == [{"seed": 7, "xp": np, "dtype": np.float32}]
    assert model.num_params == 2 * 9 * 4 + 8 + 4 * 9 * 5 + 5
    # returns_layers takes (input_shape, num_classes) only: build_model's keywords are not passed
    assert nn.build_model("test_nn_user_models:returns_layers", (2, 3, 3), 5).num_classes == 5


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
        ("test_nn_user_models:returns_none", r"returned a NoneType; it must be a function\("),
        ("test_nn_user_models:returns_empty", r"returned an empty list"),
        (
            "test_nn_user_models:returns_a_non_layer",
            r"item 1 of the list the builder returned is a str, not an hpcdl.nn layer",
        ),
        (
            "test_nn_user_models:ends_with_three_outputs",
            r"for input \(3, 6, 5\) the last layer, 1.Linear, gives \(3,\) per sample, not "
            r"\(4,\) logits; end the model with",
        ),
        (
            "test_nn_user_models:ends_with_a_feature_map",
            r"the last layer, 0.Conv2d, gives \(4, 6, 5\) per sample, not \(4,\) logits",
        ),
        (
            "test_nn_user_models:misjudges_its_input",
            r"for input \(3, 6, 5\), layer 1.Linear cannot take input \(90,\): ValueError: ",
        ),
        (
            "test_nn_user_models:ignores_dtype",
            r"returned a float64 model on numpy, asked for float32 on numpy; pass its xp=",
        ),
        (
            "test_nn_user_models:ignores_its_arguments",
            r"model for input \(1, 8, 8\) and 10 classes, asked for \(3, 6, 5\) and 4",
        ),
        ("test_nn_user_models:raises", r"the builder raised RuntimeError: out of ideas"),
        ("test_nn_user_models:raises_over_lines", r"raised RuntimeError: no such layer$"),
        (
            "test_nn_user_models:takes_no_keywords",
            r"returns an hpcdl.nn.Model but does not take seed=, xp=, dtype=; take",
        ),
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
