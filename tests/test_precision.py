"""--precision bf16|fp16 (hpcdl.nn.precision): rounding against an independent reference, the
model's float32 master weights, and the fp16 loss scaler inside train_step."""

import numpy as np
import pytest

from hpcdl import nn
from hpcdl.nn.precision import LossScaler, round_in_place
from hpcdl.nn.step import StepParts, train_step

# (significant bits, smallest quantum, largest finite value) of each format
FORMATS = {
    "bf16": (8, 2.0**-133, float(np.uint32(0x7F7F0000).view(np.float32))),
    "fp16": (11, 2.0**-24, 65504.0),
}


def reference(x: np.ndarray, precision: str) -> np.ndarray:
    """Nearest value of the format, ties to even, in float64 arithmetic (frexp, not bits)."""
    bits, smallest, largest = FORMATS[precision]
    x64 = x.astype(np.float64)
    _, exp = np.frexp(x64)
    quantum = np.maximum(np.ldexp(1.0, exp - bits), smallest)
    out = np.rint(x64 / quantum) * quantum  # rint: ties to even
    out = np.where(np.abs(out) > largest, np.copysign(np.inf, x64), out)
    out = np.where(np.isfinite(x64), out, x64)
    return out.astype(np.float32)


def from_bits(*words: int) -> np.ndarray:
    return np.array(words, dtype=np.uint32).view(np.float32)


def awkward_values() -> np.ndarray:
    rng = np.random.default_rng(0)
    magnitudes = 10.0 ** rng.uniform(-44, 38.5, 20000)
    spread = (magnitudes * rng.choice([-1, 1], magnitudes.size)).astype(np.float32)
    exact_ties = from_bits(0x3F808000, 0x3F818000, 0xBF808000, 0x3F801000, 0x3F803000)
    edges = from_bits(0x7F7FFFFF, 0x7F7F7FFF, 0x00000001, 0x00008000, 0x80000000, 0x7F800000)
    fp16_edges = np.array([65504, 65519.99, 65520, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 1e-8])
    return np.concatenate([spread, exact_ties, edges, fp16_edges.astype(np.float32)])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_rounding_is_the_nearest_value_ties_to_even(precision):
    x = awkward_values()
    expected = reference(x, precision)
    round_in_place(x, precision)
    np.testing.assert_array_equal(x, expected)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_rounding_on_each_backend_is_the_reference(xp, precision):
    x = awkward_values()
    on_device = xp.asarray(x)
    round_in_place(on_device, precision)
    host = on_device if xp is np else on_device.get()
    np.testing.assert_array_equal(host, reference(x, precision))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_bf16_and_fp16_models_train_a_step_on_each_backend(xp, precision):
    model = nn.build_model("cnn", (1, 8, 8), 10, seed=3, xp=xp)
    model.set_precision(precision)
    opt = nn.make_optimizer("sgd", model.params, model.grads, momentum=0.9)
    scaler = LossScaler() if precision == "fp16" else None
    rng = np.random.default_rng(0)
    x = xp.asarray(rng.standard_normal((16, 1, 8, 8)).astype(np.float32))
    y = xp.asarray(rng.integers(0, 10, 16))
    before = model.params.copy()
    result = train_step(StepParts(model, opt, xp, scaler=scaler), x, y, lr=0.1)
    assert result.applied and np.isfinite(result.loss)
    assert bool((model.params != before).any())


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_rounding_keeps_nan_even_when_its_payload_would_carry(precision):
    x = from_bits(0x7FFFFFFF, 0xFFFFFFFF, 0x7FFF8000, 0x7FC00000, 0x7F800001)
    round_in_place(x, precision)
    assert np.isnan(x).all()


def test_rounding_splits_over_threads_like_one_pass():
    x = np.random.default_rng(1).standard_normal((600, 1000)).astype(np.float32)
    whole = reference(x.ravel(), "bf16").reshape(x.shape)
    round_in_place(x, "bf16")  # 600K elements: split over the compute threads when > 1
    np.testing.assert_array_equal(x, whole)


def test_rounding_refuses_float64():
    with pytest.raises(ValueError, match="float32"):
        round_in_place(np.zeros(3), "bf16")


def model_and_batch(precision="fp32", name="cnn", seed=3):
    model = nn.build_model(name, (1, 8, 8), 10, seed=seed)
    model.set_precision(precision)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 1, 8, 8)).astype(np.float32)
    return model, x, rng.integers(0, 10, 16)


def is_bf16(a) -> bool:
    return not (np.ascontiguousarray(a, dtype=np.float32).view(np.uint32) & 0xFFFF).any()


def test_bf16_model_computes_with_rounded_weights_and_keeps_float32_masters():
    model, x, y = model_and_batch("bf16")
    master = model.params.copy()
    batch = x.copy()
    logits = model.forward(x, train=True)
    assert is_bf16(logits)
    np.testing.assert_array_equal(x, batch)  # the caller's batch is not rounded in place
    np.testing.assert_array_equal(model.params, master)  # the masters are not rounded
    assert not is_bf16(model.params)
    conv = next(leaf for leaf in model.body.leaves() if isinstance(leaf, nn.Conv2d))
    assert is_bf16(conv.p["W"])
    assert not np.shares_memory(conv.p["W"], model.params)


def test_bf16_gradients_are_close_to_fp32_but_not_equal():
    grads = {}
    for precision in ("fp32", "bf16"):
        model, x, y = model_and_batch(precision)
        _, dlogits = nn.softmax_cross_entropy(model.forward(x, train=True), y)
        kept = dlogits.copy()
        model.backward(dlogits)
        np.testing.assert_array_equal(dlogits, kept)  # the caller's gradient is not rounded
        grads[precision] = model.grads.copy()
    # PyTorch's autocast to bf16 on the same architecture at initialisation: 0.2-11% per
    # layer, 2.2% in all (a ReLU whose input changes sign passes another gradient).
    diff = np.linalg.norm(grads["bf16"] - grads["fp32"]) / np.linalg.norm(grads["fp32"])
    assert 1e-4 < diff < 0.25, diff


def test_set_precision_refuses_float64_and_unknown_names():
    model = nn.build_model("mlp", (1, 8, 8), 10, dtype=np.float64)
    with pytest.raises(ValueError, match="float32 model"):
        model.set_precision("bf16")
    with pytest.raises(ValueError, match="fp32, bf16, fp16"):
        nn.build_model("mlp", (1, 8, 8), 10).set_precision("fp8")


def test_loss_scaler_backs_off_on_overflow_and_grows_after_the_interval():
    scaler = LossScaler(init_scale=8.0, growth_interval=3)
    grads = np.array([8.0, 16.0], np.float32)
    assert scaler.unscale(grads) and grads.tolist() == [1.0, 2.0]
    bad = np.array([1.0, np.inf], np.float32)
    assert not scaler.unscale(bad) and bad[0] == 1.0  # left as it was: the step is skipped
    assert (scaler.scale, scaler.good_steps, scaler.skipped) == (4.0, 0, 1)
    for _ in range(3):
        assert scaler.unscale(np.ones(2, np.float32))
    assert (scaler.scale, scaler.good_steps) == (8.0, 0)
    assert not scaler.unscale(np.array([np.nan], np.float32)) and scaler.scale == 4.0


def test_loss_scaler_state_round_trips_and_refuses_nonsense():
    scaler = LossScaler()
    scaler.unscale(np.ones(1, np.float32))
    again = LossScaler()
    again.load_state_dict(scaler.state_dict())
    assert again.state_dict() == {"scale": 65536.0, "good_steps": 1}
    for state in ({"scale": -1.0, "good_steps": 0}, {"scale": 2.0, "good_steps": 5000}):
        with pytest.raises(ValueError, match="out of range"):
            again.load_state_dict(state)


def test_fp16_step_skips_the_update_on_overflow_then_applies_it_unscaled():
    model, x, y = model_and_batch("fp16")
    reference_model, _, _ = model_and_batch("fp16")
    scaler = LossScaler(init_scale=2.0**40)  # scaled gradients overflow fp16's 65504
    opt = nn.make_optimizer("sgd", model.params, model.grads, momentum=0.9)
    parts = StepParts(model, opt, scaler=scaler)
    before = model.params.copy()
    skipped = 0
    while True:
        dropout_state = model.get_rng_state()
        result = train_step(parts, x, y, lr=0.1)
        if result.applied:
            break
        skipped += 1
        np.testing.assert_array_equal(model.params, before)
        assert not opt.velocity.any()  # the optimizer did not run either
    assert skipped >= 10 and scaler.skipped == skipped
    assert scaler.scale == 2.0**40 / 2**skipped
    # The applied step's gradients are the unscaled ones: the same as at scale 1 up to
    # fp16's rounding of the activation gradients.
    reference_model.set_rng_state(dropout_state)  # the same dropout masks
    logits = reference_model.forward(x, train=True)
    _, dlogits = nn.softmax_cross_entropy(logits, y)
    reference_model.backward(dlogits)
    diff = np.linalg.norm(model.grads - reference_model.grads)
    assert diff / np.linalg.norm(reference_model.grads) < 1e-2
    assert not np.array_equal(model.params, before) and np.isfinite(result.loss)
