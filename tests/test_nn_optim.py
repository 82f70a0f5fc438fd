"""Optimizers on flat buffers (against reference formulas), schedules, and the fit loop's errors."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl import nn
from hpcdl.nn import schedule


def buffers(p=11, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(p).astype(np.float32), rng.standard_normal(p).astype(np.float32)


def reference_sgd(p, grads, lr, momentum, nesterov, wd):
    """Per-element PyTorch SGD, written out for a list of gradients."""
    p, v = p.astype(np.float64), np.zeros(p.shape)
    for g in grads:
        g = g + wd * p
        v = momentum * v + g
        p = p - lr * (g + momentum * v if nesterov else v)
    return p


@pytest.mark.parametrize(
    "momentum,nesterov,wd",
    [(0.0, False, 0.0), (0.9, False, 0.0), (0.9, True, 1e-2), (0.5, False, 5e-4)],
)
def test_sgd_matches_the_reference_update(momentum, nesterov, wd):
    params, _ = buffers()
    grads = np.zeros_like(params)
    start = params.copy()
    opt = nn.make_optimizer(
        "sgd", params, grads, momentum=momentum, nesterov=nesterov, weight_decay=wd
    )
    history = []
    for step in range(4):
        grads[...] = buffers(seed=step + 1)[1]
        history.append(grads.copy())
        opt.step(0.1)
    np.testing.assert_allclose(
        params, reference_sgd(start, history, 0.1, momentum, nesterov, wd), rtol=1e-5, atol=1e-6
    )


def test_adam_matches_the_reference_update():
    params, _ = buffers()
    grads = np.zeros_like(params)
    p = params.astype(np.float64)
    m = v = np.zeros(p.shape)
    opt = nn.make_optimizer("adam", params, grads, weight_decay=0.01)
    for t in range(1, 6):
        grads[...] = buffers(seed=t)[1]
        opt.step(0.01)
        g = grads + 0.01 * p
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        mhat, vhat = m / (1 - 0.9**t), v / (1 - 0.999**t)
        p = p - 0.01 * mhat / (np.sqrt(vhat) + 1e-8)
    np.testing.assert_allclose(params, p, rtol=1e-4, atol=1e-6)


def reference_adamw(p, grads, lr, wd, betas=(0.9, 0.999), eps=1e-8):
    """Loshchilov & Hutter's AdamW as torch.optim.AdamW writes it: decay first, then Adam."""
    (b1, b2), p = betas, p.astype(np.float64)
    m = v = np.zeros(p.shape)
    for t, g in enumerate(grads, start=1):
        p = p * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    return p


def run_steps(name, steps=20, lr=0.01, wd=0.1, dtype=np.float64, **kwargs):
    params, _ = buffers()
    params = params.astype(dtype)
    grads, start, history = np.zeros_like(params), params.copy(), []
    opt = nn.make_optimizer(name, params, grads, weight_decay=wd, **kwargs)
    for step in range(steps):
        grads[...] = buffers(seed=step + 1)[1]
        history.append(grads.astype(np.float64))
        opt.step(lr)
    return start, history, params


def test_adamw_matches_the_reference_formula():
    start, history, params = run_steps("adamw")
    np.testing.assert_allclose(params, reference_adamw(start, history, 0.01, 0.1), rtol=1e-13)
    # Decoupled: with zero gradients only the decay moves the parameters, by (1 - lr*wd);
    # Adam's L2 form would divide the decay term by its own RMS and move each by ~lr instead.
    p = buffers()[0].astype(np.float64)
    start = p.copy()
    nn.make_optimizer("adamw", p, np.zeros_like(p), weight_decay=0.5).step(0.1)
    np.testing.assert_allclose(p, start * 0.95, rtol=1e-15)


def test_adamw_matches_torch_over_20_steps():
    torch = pytest.importorskip("torch")  # a test/benchmark extra only (issue 17)
    start, history, params = run_steps("adamw", lr=0.003, wd=0.05)
    p = torch.tensor(start, requires_grad=True)
    opt = torch.optim.AdamW([p], lr=0.003, weight_decay=0.05)  # betas, eps: the defaults
    for g in history:
        p.grad = torch.tensor(g)
        opt.step()
    np.testing.assert_allclose(params, p.detach().numpy(), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", nn.OPTIMIZERS)
def test_decay_mask_keeps_biases_and_batchnorm_out_of_weight_decay(name):
    model = nn.build_model("resnet20", (1, 4, 4), 3, seed=0, dtype=np.float64)
    mask = model.decay_mask()
    for layer_name, shape, off in model.layout():
        part = mask[off : off + int(np.prod(shape))]
        excluded = layer_name.endswith((".b", ".beta", ".gamma"))
        assert (part == (0 if excluded else 1)).all(), layer_name
    before = model.params.copy()
    opt = nn.make_optimizer(name, model.params, model.grads, weight_decay=0.1, decay_mask=mask)
    opt.step(0.5)  # zero gradients: only the decay can move a parameter
    moved = model.params != before
    np.testing.assert_array_equal(moved, (mask == 1) & (before != 0))


def test_optimizer_updates_the_model_through_its_flat_buffer():
    model = nn.build_model("mlp", (1, 4, 4), 3, seed=0)
    opt = nn.make_optimizer("sgd", model.params, model.grads, momentum=0.0)
    leaf = [leaf for leaf in model.body.leaves() if leaf.param_specs][0]
    before = leaf.p["W"].copy()
    model.grads[...] = 1.0
    opt.step(0.5)
    np.testing.assert_allclose(leaf.p["W"], before - 0.5)


@pytest.mark.parametrize("name", nn.OPTIMIZERS)
def test_state_dict_round_trip_resumes_identically(name):
    def run(opt, params, grads, steps):
        for s in steps:
            grads[...] = buffers(seed=100 + s)[1]
            opt.step(0.05)

    p1, _ = buffers()
    g1 = np.zeros_like(p1)
    a = nn.make_optimizer(name, p1, g1, momentum=0.9)
    run(a, p1, g1, range(3))
    state = {k: np.array(v, copy=True) for k, v in a.state_dict().items()}
    p2, g2 = p1.copy(), np.zeros_like(p1)
    b = nn.make_optimizer(name, p2, g2, momentum=0.9)
    b.load_state_dict(state)
    run(a, p1, g1, range(3, 6))
    run(b, p2, g2, range(3, 6))
    np.testing.assert_array_equal(p1, p2)


def test_optimizer_errors_are_clear():
    p, g = buffers()
    with pytest.raises(
        ValueError, match="unknown optimizer 'rmsprop'; choose one of sgd, adam, adamw"
    ):
        nn.make_optimizer("rmsprop", p, g)
    with pytest.raises(ValueError, match="Nesterov"):
        nn.make_optimizer("sgd", p, g, momentum=0.0, nesterov=True)
    with pytest.raises(ValueError, match="saved by another optimizer"):
        nn.make_optimizer("sgd", p, g).load_state_dict({"m": p})
    with pytest.raises(ValueError, match="shape"):
        nn.make_optimizer("sgd", p, g).load_state_dict({"velocity": p[:3]})


def test_warmup_then_cosine_and_step_decay():
    spe, base = 10, 0.4
    warm = schedule.LrSchedule(base, spe, warmup_epochs=2, decay="none", total_epochs=5)
    lrs = [schedule.lr_at(warm, s) for s in range(50)]
    assert lrs[0] == pytest.approx(base / 20) and lrs[19] == pytest.approx(base)
    assert all(b > a for a, b in zip(lrs[:20], lrs[1:20]))
    assert lrs[20:] == [base] * 30
    cos = list(map(schedule.LrSchedule(base, spe, 2, "cosine", 5), range(20, 51)))
    assert cos[0] == pytest.approx(base) and cos[-1] == pytest.approx(0.0, abs=1e-12)
    assert all(b <= a for a, b in zip(cos, cos[1:]))
    assert cos[15] == pytest.approx(base / 2)
    step = list(map(schedule.LrSchedule(base, spe, 0, "step", 4), range(40)))
    assert step[19] == base and step[20] == pytest.approx(base / 10)
    assert step[29] == pytest.approx(base / 10) and step[30] == pytest.approx(base / 100)
    with pytest.raises(ValueError, match="lr decay must be one of"):
        schedule.LrSchedule(0.1, 1, decay="linear")


def test_linear_scaling_rule():
    assert schedule.scaled_lr(0.1, 1024, 256) == pytest.approx(0.4)
    assert schedule.scaled_lr(0.1, 64, 64) == 0.1
    with pytest.raises(ValueError):
        schedule.scaled_lr(0.1, 0, 256)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_fit_reports_the_step_where_the_loss_became_non_finite():
    model = nn.build_model("mlp", (1, 4, 4), 3, seed=0)
    opt = nn.make_optimizer("sgd", model.params, model.grads, momentum=0.9)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 1, 4, 4)).astype(np.float32)
    y = rng.integers(0, 3, 32)
    x[5, 0, 0, 0] = np.nan  # sample 5 poisons whichever batch holds it
    order = np.random.default_rng(0).permutation(32)
    bad_step = int(np.where(order == 5)[0][0]) // 8
    with pytest.raises(nn.NonFiniteLossError, match=rf"loss became nan at step {bad_step} "):
        nn.fit(model, x, y, epochs=1, batch_size=8, optimizer=opt, lr=0.1, seed=0)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_fit_raises_when_a_huge_learning_rate_diverges():
    model = nn.build_model("mlp", (1, 4, 4), 3, seed=0)
    opt = nn.make_optimizer("sgd", model.params, model.grads, momentum=0.9)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 1, 4, 4)).astype(np.float32) * 100
    y = rng.integers(0, 3, 64)
    with pytest.raises(nn.NonFiniteLossError, match="lower the learning rate"):
        nn.fit(model, x, y, epochs=50, batch_size=16, optimizer=opt, lr=1e6)


def test_fit_rejects_mismatched_data():
    model = nn.build_model("mlp", (1, 4, 4), 3)
    opt = nn.make_optimizer("sgd", model.params, model.grads)
    with pytest.raises(ValueError, match="x has 4 samples but y has 3"):
        nn.fit(model, np.zeros((4, 1, 4, 4)), np.zeros(3, dtype=np.int64), 1, 2, opt)
