"""hpcdl.nn.step_graph: when a step may be a CUDA graph replay, the fallbacks said once, the
order of a segmented replay with a gradient reducer (a recording stand-in for the CUDA stream,
the step's own code around it), and (marked gpu) that graph and plain steps give the same
parameters, with and without a reducer (one rank: MPI.COMM_SELF)."""

import contextlib
import copy
from dataclasses import replace

import numpy as np
import pytest

from hpcdl import nn
from hpcdl.backend import cupy_or_none, gpu_available
from hpcdl.comm.reducer import GradientReducer
from hpcdl.nn import kernels, step_graph
from hpcdl.nn.kernels import optimizer as optimizer_kernels
from hpcdl.nn.kernels.optimizer import FusedAdam, numpy_kernel
from hpcdl.nn.step import StepParts, train_step
from hpcdl.nn.step_graph import StepGraph
from hpcdl.nn.step_segments import GraphStream, segment_plan


def parts_of(model_name="resnet20", xp=np, graph=None, optimizer="sgd", **kw):
    model = nn.build_model(model_name, (3, 8, 8), 10, seed=2, xp=xp)
    opt = nn.make_optimizer(optimizer, model.params, model.grads, weight_decay=1e-4)
    return StepParts(model, opt, xp, graph=graph, **kw)


def batch(xp=np, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    return xp.asarray(x), xp.asarray(rng.integers(0, 10, 4))


def test_on_the_cpu_the_step_runs_plainly_bitwise_and_quietly(capsys):
    graphed, plain = parts_of(graph=StepGraph()), parts_of()
    for seed in range(3):
        x, y = batch(seed=seed)
        a, b = train_step(graphed, x, y, 0.1), train_step(plain, x, y, 0.1)
        assert float(a.loss) == float(b.loss)
    np.testing.assert_array_equal(graphed.model.params, plain.model.params)
    assert graphed.graph.why_not(graphed, x) == "not on a GPU" and not graphed.graph.graphs
    assert "CUDA graph" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"reducer": object()}, "the gradient reducer has no buckets to cut the step at"),
        (
            {"scaler": nn.precision.LossScaler(on_device=False)},
            "fp16's loss scaler decides on the host",
        ),
        ({"model_name": "cnn"}, "dropout draws its seed on the host"),
    ],
)
def test_what_keeps_a_step_out_of_a_graph(monkeypatch, change, reason):
    monkeypatch.setattr(step_graph, "is_device_array", lambda a: True)
    graph = StepGraph()
    parts = parts_of(graph=graph, **change)
    assert graph.why_not(parts, batch()[0]) == reason


def test_philox_dropout_is_captured_its_keys_drawn_before_each_replay(monkeypatch):
    """cnn's dropouts (--gpu-kernels: Philox) no longer keep its step out of a graph: the
    capture puts back every draw of its warm-up, notes the dropout layers in forward order,
    and each replay draws their seeds into their keys as a plain step's forward would."""
    monkeypatch.setattr(step_graph, "is_device_array", lambda a: True)
    monkeypatch.setattr(kernels, "_enabled", True)
    log = []
    parts = parts_of("cnn", graph=StepGraph(make_stream=lambda xp: RecordingStream(log)))
    model, (x, y) = parts.model, batch()
    dropouts = [layer for layer in model.body.layers if isinstance(layer, nn.Dropout)]  # forward
    assert len(dropouts) == 3 and parts.graph.why_not(parts, x) is None
    state = model.get_rng_state()
    assert parts.graph.takes(parts, x)
    assert model.get_rng_state() == state and parts.graph._keys.layers == dropouts
    generator = np.random.default_rng()
    generator.bit_generator.state = state
    for _ in range(2):
        train_step(parts, x, y, 0.1)  # a replay ("launch g0" on the stand-in)
        for layer in dropouts:  # in forward order, from the one generator the model shares
            seed = int(generator.integers(2**63))
            assert [int(w) for w in layer.fed_key] == [seed & 0xFFFFFFFF, seed >> 32]
        assert model.get_rng_state() == generator.bit_generator.state
    assert log.count("launch g0") == 2


def test_the_graphs_pool_is_counted_once_it_is_captured(monkeypatch):
    """What the step graph's own memory pool holds (every allocation of its capture: the
    activations of the step it replays), which the default pool does not count: `bench
    compute`'s peak memory adds it (the second lend's gk rows left it out)."""
    monkeypatch.setattr(step_graph, "is_device_array", lambda a: True)
    monkeypatch.setattr(kernels, "_enabled", True)
    parts = parts_of("cnn", graph=StepGraph(make_stream=lambda xp: RecordingStream([], 5 << 20)))
    assert parts.graph.pool_bytes() == 0  # nothing captured, no pool
    assert parts.graph.takes(parts, batch()[0])
    assert parts.graph.pool_bytes() == 5 << 20


def test_dropout_keys_are_made_before_the_graphs_pool_is_the_allocator(monkeypatch):
    """A key the host writes before each replay must not be a block of the graph's own pool:
    one allocated during the capture may be a block an earlier kernel of the same graph used
    for a temporary, which each replay writes over before the dropout reads its key. cnn's
    first graph step differed from the plain one's on the H200 (2026-11-29, its loss 2.325269
    against 2.327039) depending on what the process had allocated before."""
    monkeypatch.setattr(step_graph, "is_device_array", lambda a: True)
    monkeypatch.setattr(kernels, "_enabled", True)
    seen = []

    class Watching(RecordingStream):
        @contextlib.contextmanager
        def capturing(self):
            seen.append([getattr(layer, "fed_key", None) is not None for layer in dropouts])
            yield

    parts = parts_of("cnn", graph=StepGraph(make_stream=lambda xp: Watching([])))
    dropouts = [layer for layer in parts.model.body.layers if isinstance(layer, nn.Dropout)]
    assert parts.graph.takes(parts, batch()[0])
    assert seen == [[True, True, True]]  # every key there before the graph's pool was
    assert all(layer in parts.graph._keys.layers for layer in dropouts)


def test_a_failed_capture_falls_back_to_plain_steps_said_once(monkeypatch, capsys):
    """Pretend the batch is on a GPU: the capture cannot work on NumPy arrays and fails."""
    monkeypatch.setattr(step_graph, "is_device_array", lambda a: True)
    graphed, plain = parts_of(graph=StepGraph()), parts_of()
    for seed in range(2):
        x, y = batch(seed=seed)
        train_step(graphed, x, y, 0.1)
        train_step(plain, x, y, 0.1)
    assert graphed.graph.failed and graphed.graph.why_not(graphed, x) == "its capture failed"
    np.testing.assert_array_equal(graphed.model.params, plain.model.params)
    np.testing.assert_array_equal(graphed.model.buffers, plain.model.buffers)
    assert capsys.readouterr().err.count("capture failed") == 1


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])  # both updates in the graph (FusedAdam)
@pytest.mark.parametrize("model", ["resnet20", "cnn"])  # cnn: Philox dropout, its keys fed
def test_graph_and_plain_steps_give_the_same_parameters_on_the_gpu(monkeypatch, optimizer, model):
    """The graph is a --gpu-kernels feature (its GEMMs through hpcdl's own cuBLAS handle: NOTE
    [capturable GEMM]); plain steps run the same kernels, on deterministic cuDNN engines (NOTE
    [deterministic engines]: with atomics in the sums, Adam's steps drifted 1.2e-4 apart on
    the H200 of 2026-11-29, SGD's stayed within 1e-6)."""
    cp = cupy_or_none()
    monkeypatch.setattr(kernels, "_enabled", True)
    monkeypatch.setattr(kernels, "_deterministic", True)
    graphed = parts_of(model, xp=cp, graph=StepGraph(), optimizer=optimizer)
    plain = parts_of(model, xp=cp, optimizer=optimizer)
    for seed in range(4):
        x, y = batch(cp, seed)
        lr = 0.05 / (seed + 1)  # a schedule: the graph reads each step's lr
        a, b = train_step(graphed, x, y, lr), train_step(plain, x, y, lr)
        np.testing.assert_allclose(float(a.loss), float(b.loss), rtol=1e-6)
    assert graphed.graph.graphs, "the step was not captured"
    np.testing.assert_allclose(
        cp.asnumpy(graphed.model.params), cp.asnumpy(plain.model.params), rtol=1e-6, atol=1e-6
    )
    np.testing.assert_allclose(
        cp.asnumpy(graphed.model.buffers), cp.asnumpy(plain.model.buffers), rtol=1e-6, atol=1e-6
    )


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("model", ["resnet20", "cnn"])
def test_two_plain_runs_on_deterministic_engines_give_the_same_bits_on_the_gpu(monkeypatch, model):
    """NOTE [deterministic engines]: Adam, which magnifies a gradient's last bits, over the
    same batches twice; every loss, parameter and statistic the same, bit for bit."""
    cp = cupy_or_none()
    monkeypatch.setattr(kernels, "_enabled", True)
    monkeypatch.setattr(kernels, "_deterministic", True)
    runs = [parts_of(model, xp=cp, optimizer="adam") for _ in range(2)]
    for seed in range(4):
        x, y = batch(cp, seed)
        a, b = (train_step(parts, x, y, 0.05 / (seed + 1)) for parts in runs)
        assert float(a.loss) == float(b.loss)
    for name in ("params", "buffers"):
        np.testing.assert_array_equal(*(cp.asnumpy(getattr(p.model, name)) for p in runs))


@pytest.mark.parametrize(("optimizer", "kept_out"), [("sgd", False), ("adam", False)])
def test_fp16_decided_on_the_device_may_be_in_the_graph(monkeypatch, optimizer, kept_out):
    monkeypatch.setattr(step_graph, "is_device_array", lambda a: True)
    graph = StepGraph()
    scaler = nn.precision.LossScaler(on_device=True)
    parts = parts_of(graph=graph, optimizer=optimizer, scaler=scaler)
    reason = graph.why_not(parts, batch()[0])
    assert reason == ("fp16's loss scaler decides on the host" if kept_out else None)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a GPU")
def test_an_fp16_graph_decides_skip_or_apply_on_the_device_as_the_plain_step(monkeypatch):
    """With --gpu-kernels, as every step graph (without them its GEMMs are CuPy's cuBLAS calls,
    which a capture refuses: the H200 run of 2026-11-29 ran this test so and it failed)."""
    cp = cupy_or_none()
    monkeypatch.setattr(kernels, "_enabled", True)
    monkeypatch.setattr(kernels, "_deterministic", True)  # NOTE [deterministic engines]

    def fp16_parts(graph):
        scaler = nn.precision.LossScaler(init_scale=2.0**30, growth_interval=2, on_device=True)
        model = nn.build_model("resnet20", (3, 8, 8), 10, seed=2, xp=cp)
        model.set_precision("fp16")  # before the optimizer: its buffers are the masters
        opt = nn.make_optimizer("sgd", model.params, model.grads, momentum=0.9)
        return StepParts(model, opt, cp, graph=graph, scaler=scaler)

    graphed, plain = fp16_parts(StepGraph()), fp16_parts(None)
    applied = []
    for seed in range(6):
        x, y = batch(cp, seed)
        a, b = train_step(graphed, x, y, 0.05), train_step(plain, x, y, 0.05)
        applied.append((bool(a.applied), bool(b.applied)))
    assert graphed.graph.graphs, "the step was not captured"
    assert all(a == b for a, b in applied) and (False, False) in applied
    assert graphed.scaler.state_dict() == plain.scaler.state_dict()
    np.testing.assert_allclose(
        cp.asnumpy(graphed.model.params), cp.asnumpy(plain.model.params), rtol=1e-6, atol=1e-6
    )


def comm_self():
    from mpi4py import MPI

    return MPI.COMM_SELF


class RecordingReducer(GradientReducer):
    """A real reducer over one rank (the sum is the gradients themselves) that notes what the
    step asks of it, in the log the recording stream writes to."""

    def __init__(self, log, grads, bucket_mb=0.01):
        super().__init__(comm_self(), grads, bucket_mb, prescaled=True)
        self.log = log

    def begin_step(self):
        self.log.append("begin_step")
        super().begin_step()

    def mark_ready(self, n):
        self.log.append(f"mark_ready {n}")
        super().mark_ready(n)

    def wait(self):
        self.log.append("wait")
        super().wait()


class RecordingStream:
    """GraphStream's stand-in on NumPy: a "capture" runs the step's work (NumPy cannot defer
    it), end() gives a graph named by its order, and a launch notes that name."""

    def __init__(self, log, pool_bytes=0):
        self.log, self.ended, self.held = log, 0, pool_bytes

    def pool_bytes(self):
        return self.held

    @contextlib.contextmanager
    def capturing(self):
        yield

    @contextlib.contextmanager
    def current(self):  # the reducer's events are recorded on CuPy's current stream
        self.log.append("stream current")
        yield
        self.log.append("stream released")

    def begin(self):
        self.log.append("begin")

    def end(self):
        self.ended += 1
        return f"g{self.ended - 1}"

    def abandon(self):
        pass

    def launch(self, graph):
        self.log.append(f"launch {graph}")

    def follows_caller(self):
        pass

    def caller_follows(self):
        pass


def test_the_recording_stream_stands_in_for_every_call_of_graph_stream():
    def public(cls):
        return {name for name in vars(cls) if not name.startswith("_")}

    assert public(RecordingStream) == public(GraphStream)


@pytest.mark.parametrize(
    ("optimizer", "fp16"), [("sgd", False), ("adam", False), ("sgd", True)]
)  # SGD's update a graph of its own (fp16: with the device unscale), Adam's plain after wait()
def test_a_step_with_a_reducer_replays_its_segments_each_handing_its_buckets_then_the_update(
    monkeypatch, optimizer, fp16
):
    """The order a GPU runs (the step's own code, a stand-in only for the CUDA stream): the
    warm-up and the capture hand nothing to the reducer; each replay launches the segments in
    order with mark_ready(the plan's n) after each, on the capture stream, then wait(), then
    the update's graph. BatchNorm's statistics are as before the capture."""
    monkeypatch.setattr(step_graph, "is_device_array", lambda a: True)
    log, streams = [], []

    def make_stream(xp):
        streams.append(RecordingStream(log))
        return streams[-1]

    parts = parts_of(graph=StepGraph(make_stream=make_stream), optimizer=optimizer)
    if fp16:
        parts.model.set_precision("fp16")
        parts = replace(parts, scaler=nn.precision.LossScaler(on_device=True))
    parts = replace(parts, reducer=RecordingReducer(log, parts.model.grads_and_flags))
    try:
        x, y = batch()
        plan = segment_plan(parts, x, y)
        buffers = parts.model.buffers.copy()
        assert parts.graph.takes(parts, x) and parts.graph.segments == plan and len(plan) > 1
        np.testing.assert_array_equal(parts.model.buffers, buffers)
        assert not [e for e in log if e.startswith("mark_ready")]  # nothing handed yet
        updates = 1 if optimizer == "sgd" else 0
        assert log.count("begin") == len(plan) + updates  # the segments', the update's
        readies = [f"mark_ready {s.ready_upto}" for s in plan]
        replay = ["begin_step", "stream current"]
        for k, ready in enumerate(readies):
            replay += [f"launch g{k}", ready]
        replay += ["stream released", "wait"] + [f"launch g{len(plan)}"] * updates
        for seed in range(2):
            log.clear()
            parts.graph.takes(parts, x)  # captured: no work here
            result = train_step(parts, *batch(seed=seed), 0.1)
            assert log == replay
            if fp16 and updates:  # the graph's device flag, copied
                assert result.applied.shape == () and result.applied is not parts.graph.applied
        assert readies[-1] == f"mark_ready {parts.reducer.grads.size}"  # the flags' bucket last
        assert len(streams) == 1
    finally:
        parts.reducer.close()


class ReplayingStream(RecordingStream):
    """RecordingStream whose graphs also hold the FusedAdam steps captured in them, as a CUDA
    graph holds its kernels: the capture records each step and runs none, with a copy of the
    optimizer's host state as it was then (its arrays shared, as device memory is); a launch
    runs them again from that state, so an update that counted or read on the host would show.
    """

    def __init__(self, log):
        super().__init__(log)
        self.capturing_now, self.recorded, self.held = False, [], {}

    def begin(self):
        super().begin()
        self.capturing_now, self.recorded = True, []

    def end(self):
        graph = super().end()
        self.capturing_now, self.held[graph] = False, self.recorded
        return graph

    def launch(self, graph):
        super().launch(graph)
        for step in self.held.get(graph, []):
            step()


def fused_adam_on_numpy(monkeypatch, streams):
    """FusedAdam takes Adam on NumPy, its program evaluated in the CuPy kernel's place, and a
    step during a ReplayingStream's capture is recorded in the graph (NOTE [step graphs])."""
    monkeypatch.setattr(kernels, "_enabled", True)
    monkeypatch.setattr(FusedAdam, "applies", lambda self, opt, p: isinstance(opt, nn.optim.Adam))
    monkeypatch.setattr(optimizer_kernels, "_cupy_kernel", lambda xp, f, key: numpy_kernel(f, key))
    fused_step = FusedAdam.step

    def step(self, optimizer, lr, apply=None):
        if not (streams and streams[-1].capturing_now):
            return fused_step(self, optimizer, lr, apply)
        frozen = copy.copy(optimizer)
        streams[-1].recorded.append(lambda: fused_step(self, copy.copy(frozen), lr, apply))

    monkeypatch.setattr(FusedAdam, "step", step)


@pytest.mark.parametrize("with_reducer", [False, True])
def test_adams_update_in_the_graph_replays_as_plain_steps_bitwise(monkeypatch, with_reducer):
    """With FusedAdam, Adam's update is captured (with a reducer, a graph of its own after the
    wait()): each replay reads that step's lr from the graph's device scalar and advances the
    device step count, so params, moments and the checkpoint's t are plain steps', bitwise,
    and the host's count never moves."""
    monkeypatch.setattr(step_graph, "is_device_array", lambda a: True)
    log, streams = [], []
    fused_adam_on_numpy(monkeypatch, streams)

    def make_stream(xp):
        streams.append(ReplayingStream(log))
        return streams[-1]

    parts = parts_of(graph=StepGraph(make_stream=make_stream), optimizer="adamw")
    if with_reducer:
        parts = replace(parts, reducer=RecordingReducer(log, parts.model.grads_and_flags))
    model, opt = parts.model, parts.optimizer
    plain = nn.make_optimizer(
        "adamw", model.params.copy(), np.zeros_like(model.grads), weight_decay=1e-4
    )
    rng = np.random.default_rng(5)
    try:
        x, y = batch()
        assert parts.graph.takes(parts, x) and parts.graph._lr.dtype == np.float64
        assert (parts.graph.update_graph is not None) == with_reducer
        for step in range(4):
            lr = 0.05 / (step + 1)
            model.grads[...] = plain.grads[...] = rng.standard_normal(model.grads.size) / 10
            assert train_step(parts, x, y, lr).applied is True
            if with_reducer:  # the update's graph follows the reducer's wait()
                assert log[-2:] == ["wait", f"launch g{len(parts.graph.segments)}"]
            monkeypatch.setattr(kernels, "_enabled", False)  # the reference's plain step
            plain.step(lr)
            monkeypatch.setattr(kernels, "_enabled", True)
            if step == 1:  # a checkpoint loaded: the captured count is set in place
                held = opt._t_device
                opt.load_state_dict(plain.state_dict())
                assert opt._t_device is held and int(held) == 2
    finally:
        if parts.reducer is not None:
            parts.reducer.close()
    for name in ("params", "m", "v"):
        np.testing.assert_array_equal(getattr(opt, name), getattr(plain, name))
    assert int(opt.state_dict()["t"]) == opt.t == plain.t == 4
    assert opt._t == 2  # set by the checkpoint only: the replays counted on the device


def test_a_capture_that_cuts_elsewhere_than_its_warm_up_falls_back_said_once(monkeypatch, capsys):
    monkeypatch.setattr(step_graph, "is_device_array", lambda a: True)
    monkeypatch.setattr(kernels, "_said", set())
    monkeypatch.setattr(step_graph, "segment_plan", lambda *a: segment_plan(*a)[1:])
    log = []
    parts = parts_of(graph=StepGraph(make_stream=lambda xp: RecordingStream(log)))
    plain = parts_of()
    reducers = [RecordingReducer(log, p.model.grads_and_flags) for p in (parts, plain)]
    parts = replace(parts, reducer=reducers[0])
    plain = replace(plain, reducer=reducers[1])
    try:
        for seed in range(2):
            x, y = batch(seed=seed)
            a, b = train_step(parts, x, y, 0.1), train_step(plain, x, y, 0.1)
            assert float(a.loss) == float(b.loss)
    finally:
        for reducer in reducers:
            reducer.close()
    assert parts.graph.failed and not parts.graph.graphs
    np.testing.assert_array_equal(parts.model.params, plain.model.params)
    np.testing.assert_array_equal(parts.model.buffers, plain.model.buffers)
    err = capsys.readouterr().err
    assert err.count("capture failed (the capture cut the step at") == 1, err


def test_a_reducer_with_other_buckets_than_the_captured_ones_gives_plain_steps_said_once(
    monkeypatch, capsys
):
    """Another reducer with the same buckets (a rebuilt one) is handed this step's buckets;
    one with others cannot be: plain steps from then on, said once."""
    monkeypatch.setattr(step_graph, "is_device_array", lambda a: True)
    monkeypatch.setattr(kernels, "_said", set())
    logs = [[], [], []]
    parts = parts_of(graph=StepGraph(make_stream=lambda xp: RecordingStream(logs[0])))
    reducers = [
        RecordingReducer(log, parts.model.grads_and_flags, mb)
        for log, mb in zip(logs, (0.01, 0.01, 0.02))
    ]
    try:
        x, y = batch()
        assert parts.graph.takes(replace(parts, reducer=reducers[0]), x)
        train_step(replace(parts, reducer=reducers[1]), x, y, 0.1)
        assert [e for e in logs[1] if e.startswith("mark_ready")] == [
            f"mark_ready {s.ready_upto}" for s in parts.graph.segments
        ]
        other = replace(parts, reducer=reducers[2])
        assert not parts.graph.takes(other, x) and not parts.graph.takes(other, x)
    finally:
        for reducer in reducers:
            reducer.close()
    assert capsys.readouterr().err.count("reducer's buckets are not those") == 1


def gpu_reducer_parts(cp, graph, optimizer="sgd", fp16=False):
    """resnet20 with a real reducer over one rank (its allreduce the identity, its buckets,
    events and helper thread all running), host-staged (any MPI), small buckets."""
    model = nn.build_model("resnet20", (3, 8, 8), 10, seed=2, xp=cp)
    scaler = None
    if fp16:
        model.set_precision("fp16")  # before the optimizer: its buffers are the masters
        scaler = nn.precision.LossScaler(init_scale=2.0**30, growth_interval=2, on_device=True)
    opt = nn.make_optimizer(optimizer, model.params, model.grads, momentum=0.9)
    reducer = GradientReducer(
        comm_self(), model.grads_and_flags, 0.05, host_staged=True, prescaled=True
    )
    return StepParts(model, opt, cp, reducer=reducer, graph=graph, scaler=scaler)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize(
    ("optimizer", "fp16"), [("sgd", False), ("adam", False), ("sgd", True), ("adam", True)]
)  # the update a graph of its own after the reducer's wait (SGD's, FusedAdam's with its step
# count on the device); fp16 decided on the device, its skipped steps leaving Adam's count
def test_segmented_graph_and_plain_steps_with_a_reducer_give_the_same_parameters(
    monkeypatch, optimizer, fp16
):
    cp = cupy_or_none()
    monkeypatch.setattr(kernels, "_enabled", True)  # the graph's GEMMs: NOTE [capturable GEMM]
    monkeypatch.setattr(kernels, "_deterministic", True)  # NOTE [deterministic engines]
    graphed = gpu_reducer_parts(cp, StepGraph(), optimizer, fp16)
    plain = gpu_reducer_parts(cp, None, optimizer, fp16)
    applied = []
    try:
        for seed in range(6):
            x, y = batch(cp, seed)
            lr = 0.05 / (seed + 1)
            a, b = train_step(graphed, x, y, lr), train_step(plain, x, y, lr)
            np.testing.assert_allclose(float(a.loss), float(b.loss), rtol=1e-6)
            np.testing.assert_allclose(
                cp.asnumpy(a.logits), cp.asnumpy(b.logits), rtol=1e-5, atol=1e-5
            )
            assert float(a.nonfinite_ranks) == float(b.nonfinite_ranks) == 0
            applied.append((bool(a.applied), bool(b.applied)))
        assert graphed.graph.graphs, "the step was not captured"
        plan = segment_plan(graphed, x, y)
    finally:
        graphed.reducer.close()
        plain.reducer.close()
    graph = graphed.graph
    assert graph.segments == plan and len(graph.graphs) == len(plan) > 1
    handed = [b for s in graph.segments for b in s.buckets]
    assert handed == list(range(len(graphed.reducer.buckets)))  # every bucket once, in order
    assert graph.update_graph is not None  # SGD's, or Adam's through FusedAdam
    assert all(a == b for a, b in applied) and (not fp16 or (False, False) in applied)
    if optimizer == "adam":
        assert graphed.optimizer.t == plain.optimizer.t == sum(a for a, _ in applied)
    if fp16:
        assert graphed.scaler.state_dict() == plain.scaler.state_dict()
    for name in ("params", "buffers"):
        np.testing.assert_allclose(
            cp.asnumpy(getattr(graphed.model, name)),
            cp.asnumpy(getattr(plain.model, name)),
            rtol=1e-6,
            atol=1e-6,
        )
