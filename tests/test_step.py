"""hpcdl.nn.step.train_step: the one training step, bitwise the step written out by hand."""

import numpy as np

from hpcdl import nn
from hpcdl.nn.step import StepParts, train_step


def model_and_optimizer():
    model = nn.build_model("cnn", (1, 8, 8), 10, seed=3)
    return model, nn.make_optimizer("sgd", model.params, model.grads, momentum=0.9)


def batch():
    rng = np.random.default_rng(0)
    return rng.standard_normal((16, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 16)


def test_train_step_is_bitwise_forward_loss_backward_update():
    (x, y), lr = batch(), 0.05
    by_hand, opt = model_and_optimizer()
    stepped, opt2 = model_and_optimizer()
    by_hand.set_rng_state(nn.rank_rng_state(1, 0))
    stepped.set_rng_state(nn.rank_rng_state(1, 0))
    parts = StepParts(stepped, opt2)
    for _ in range(3):
        logits = by_hand.forward(x, train=True)
        loss, dlogits = nn.softmax_cross_entropy(logits, y)
        by_hand.backward(dlogits)
        opt.step(lr)
        result = train_step(parts, x, y, lr, waited_since=None)
        assert result.loss == float(loss)
        np.testing.assert_array_equal(result.logits, logits)
        np.testing.assert_array_equal(stepped.params, by_hand.params)
    t = result.times
    assert t.t_data == 0.0 and min(t.t_compute, t.t_comm_exposed, t.t_update) >= 0.0
    assert t.t_step >= t.t_compute + t.t_comm_exposed + t.t_update


class RecordingReducer:
    """Stands in for GradientReducer's protocol on one process: records what the step asks."""

    world_size = 4

    def __init__(self, grads):
        self.grads, self.calls, self.marks = grads, [], []

    def begin_step(self):
        self.calls.append("begin")

    def mark_ready(self, n):
        self.marks.append(n)

    def wait(self):
        self.calls.append("wait")


def test_train_step_hands_buckets_to_the_reducer_and_scales_the_loss_gradient():
    x, y = batch()
    plain, opt = model_and_optimizer()
    reduced, opt2 = model_and_optimizer()
    reducer = RecordingReducer(reduced.grads)
    averaged = []
    parts = StepParts(reduced, opt2, reducer=reducer, average_params=lambda: averaged.append(1))
    train_step(StepParts(plain, opt), x, y, 0.0)
    result = train_step(parts, x, y, 0.0, mix_params=True)
    assert reducer.calls == ["begin", "wait"] and averaged == [1]
    assert reducer.marks == sorted(reducer.marks) and reducer.marks[-1] == reduced.params.size
    # the loss gradient is scaled by 1 / world_size before backward: the ranks' sum is the mean
    np.testing.assert_allclose(reduced.grads * 4, plain.grads, rtol=1e-5, atol=1e-7)
    assert np.isfinite(result.loss)


def test_the_step_uses_the_loss_it_is_given():
    """The loss is a part of the step (a profiler times it by giving a wrapped one)."""
    (x, y), calls = batch(), []
    model, opt = model_and_optimizer()
    before = model.params.copy()

    def no_gradient(logits, labels):
        calls.append(labels)
        return np.float32(7.0), np.zeros_like(logits)

    result = train_step(StepParts(model, opt, loss=no_gradient), x, y, 0.05)
    assert result.loss == 7.0 and len(calls) == 1 and calls[0] is y
    np.testing.assert_array_equal(model.params, before)  # zero gradient, no momentum yet: no change


def test_the_loss_and_its_finite_flag_stay_arrays_and_ride_after_the_gradients():
    """NOTE [device scalars]: no float() in the step; the flag sits where the reducer sums it."""
    (x, y), calls = batch(), []
    model, opt = model_and_optimizer()
    result = train_step(StepParts(model, opt), x, y, 0.05)
    assert type(result.loss) is not float and result.loss.shape == ()  # 0-d, on the backend
    assert float(result.nonfinite_ranks) == 0.0
    assert model.grads_and_flags.size == model.grads.size + 2
    assert np.shares_memory(model.step_flags, model.grads_and_flags)

    def not_finite(logits, labels):
        calls.append(1)
        return np.float32(np.nan), np.zeros_like(logits)

    result = train_step(StepParts(model, opt, loss=not_finite), x, y, 0.05)
    assert calls and float(result.nonfinite_ranks) == 1.0
    assert model.step_flags[0] == 1.0  # what a reducer over grads_and_flags would sum


def test_loss_watch_keeps_the_first_non_finite_step_and_counts_every_one():
    from hpcdl.nn.loss_watch import LossWatch

    watch = LossWatch(np)
    for step, loss in enumerate([1.5, 2.0, np.inf, np.nan, 3.0]):
        bad = np.float32(0.0 if np.isfinite(loss) else 1.0)
        watch.note(bad, np.float32(loss), step, epoch=step // 2)
    assert watch.any_rank_count() == 2.0
    assert watch.first() == (2, 1, float("inf"))
    assert LossWatch(np).first() is None


def test_accuracy_count_is_left_on_the_backend():
    logits = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]], np.float32)
    count = nn.accuracy_count(logits, np.array([1, 1, 1]))
    assert not isinstance(count, int) and int(count) == 2
