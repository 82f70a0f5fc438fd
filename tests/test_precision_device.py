"""fp16's skip-or-apply decided on the device (NOTE [device loss scale] in
hpcdl/nn/precision.py): the same rule, the same bits as the host's, no host read in the step."""

import numpy as np
import pytest

from hpcdl import nn
from hpcdl.nn import kernels
from hpcdl.nn.kernels import optimizer as optimizer_kernels
from hpcdl.nn.kernels.optimizer import FusedAdam, numpy_kernel
from hpcdl.nn.precision import LossScaler
from hpcdl.nn.step import StepParts, train_step


def scaler_pair(**kw):
    return LossScaler(on_device=False, **kw), LossScaler(on_device=True, **kw)


def test_the_device_rule_is_the_host_rule_step_for_step():
    host, device = scaler_pair(init_scale=8.0, growth_interval=3)
    cases = [[8.0, 16.0], [1.0, np.inf], [1.0, 1.0], [3.0, 5.0], [7.0, 2.0], [np.nan], [6.0]]
    for values in cases:
        a, b = np.array(values, np.float32), np.array(values, np.float32)
        applied = host.unscale(a)
        apply = device.unscale_on_device(b)
        assert isinstance(apply, np.ndarray) and apply.shape == ()  # a device scalar
        assert bool(apply) == applied
        np.testing.assert_array_equal(a, b)  # unscaled alike; a skipped step's left alone
        assert (device.scale, device.good_steps, device.skipped) == (
            host.scale,
            host.good_steps,
            host.skipped,
        )
    assert host.skipped == 2 and host.scale == 4.0


def test_the_device_state_checkpoints_in_the_host_format():
    _, device = scaler_pair(growth_interval=5)
    device.unscale_on_device(np.ones(2, np.float32))
    state = device.state_dict()
    assert state == {"scale": 65536.0, "good_steps": 1}
    assert type(state["scale"]) is float and type(state["good_steps"]) is int
    held = device._device["scale"]
    device.load_state_dict({"scale": 8.0, "good_steps": 2})
    assert device._device["scale"] is held and float(held) == 8.0  # in place
    assert device.state_dict() == {"scale": 8.0, "good_steps": 2}


def test_the_device_decision_follows_gpu_kernels_unless_told(monkeypatch):
    monkeypatch.setattr(kernels, "_enabled", False)
    assert not LossScaler().decides_on_device(agreed=False)
    monkeypatch.setattr(kernels, "_enabled", True)
    assert LossScaler().decides_on_device(agreed=False)
    assert not LossScaler(on_device=False).decides_on_device(agreed=False)
    # several ranks whose flags the reducer did not carry: the host collective decides
    assert not LossScaler(lambda flag: flag, on_device=True).decides_on_device(agreed=False)
    assert LossScaler(lambda flag: flag, on_device=True).decides_on_device(agreed=True)


def run_steps(on_device, optimizer="sgd", steps=14, masked=True, **opt_kw):
    model = nn.build_model("resnet20", (3, 8, 8), 10, seed=3)
    model.set_precision("fp16")
    mask = model.decay_mask() if masked else None  # biases and BatchNorm out of the decay
    opt = nn.make_optimizer(
        optimizer, model.params, model.grads, weight_decay=1e-4, decay_mask=mask, **opt_kw
    )
    # 2**30: the first steps overflow and are skipped, then the scale is low enough;
    # growth_interval 3: it grows again, and overflows again
    scaler = LossScaler(init_scale=2.0**30, growth_interval=3, on_device=on_device)
    parts = StepParts(model, opt, scaler=scaler)
    rng = np.random.default_rng(0)
    applied = []
    for _ in range(steps):
        x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
        y = rng.integers(0, 10, 4)
        result = train_step(parts, x, y, lr=0.05)
        applied.append(bool(result.applied))
    return model, opt, scaler, applied


@pytest.mark.parametrize(
    "opt_kw", [{"momentum": 0.9}, {"momentum": 0.9, "nesterov": True}, {"masked": False}]
)
def test_a_run_with_the_device_decision_is_bitwise_the_host_run(opt_kw):
    host_model, host_opt, host_scaler, host_applied = run_steps(False, **opt_kw)
    model, opt, scaler, applied = run_steps(True, **opt_kw)
    assert applied == host_applied and False in applied and True in applied
    np.testing.assert_array_equal(model.params, host_model.params)
    np.testing.assert_array_equal(opt.velocity, host_opt.velocity)
    assert scaler.state_dict() == host_scaler.state_dict()
    assert scaler.skipped == host_scaler.skipped > 0


def test_the_device_decision_never_reads_the_host(monkeypatch):
    """The host rule is the one place a step reads the overflow flag: it never runs."""

    def host_rule(*args, **kw):
        raise AssertionError("the host decided")

    monkeypatch.setattr(LossScaler, "unscale", host_rule)
    _, _, scaler, applied = run_steps(True, steps=4)
    assert scaler._device is not None and len(applied) == 4


@pytest.mark.parametrize(
    ("optimizer", "masked"), [("adam", True), ("adamw", True), ("adamw", False)]
)
def test_adam_with_the_device_decision_is_bitwise_the_host_run(optimizer, masked):
    host_model, host_opt, host_scaler, host_applied = run_steps(False, optimizer, masked=masked)
    model, opt, scaler, applied = run_steps(True, optimizer, masked=masked)
    assert scaler._device is not None and opt._t_device is not None  # decided on the device
    assert applied == host_applied and False in applied
    np.testing.assert_array_equal(model.params, host_model.params)
    np.testing.assert_array_equal(opt.m, host_opt.m)
    np.testing.assert_array_equal(opt.v, host_opt.v)
    assert opt.t == host_opt.t == applied.count(True)
    assert int(opt.state_dict()["t"]) == host_opt.t  # the checkpoint's format holds


@pytest.mark.parametrize(("optimizer", "masked"), [("adam", True), ("adamw", False)])
def test_fused_adam_with_the_device_decision_is_bitwise_the_host_run(
    monkeypatch, optimizer, masked
):
    """FusedAdam's whole step (its program evaluated by NumPy in the CuPy kernel's place),
    masked by the device flag through train_step, is the host-decided reference run."""
    host_model, host_opt, host_scaler, host_applied = run_steps(False, optimizer, masked=masked)
    monkeypatch.setattr(kernels, "_enabled", True)
    monkeypatch.setattr(FusedAdam, "applies", lambda self, opt, params: True)
    monkeypatch.setattr(optimizer_kernels, "_cupy_kernel", lambda xp, f, key: numpy_kernel(f, key))
    model, opt, scaler, applied = run_steps(True, optimizer, masked=masked)
    assert opt.seam.kernel is not None and opt.seam.kernel.name == "fused-adam"
    assert applied == host_applied and False in applied
    for name in ("params", "m", "v"):
        np.testing.assert_array_equal(getattr(opt, name), getattr(host_opt, name))
    assert int(opt.state_dict()["t"]) == host_opt.t == applied.count(True) and opt._t == 0
