"""StepGraph: forward, loss, backward and the update (SGD's; Adam's through FusedAdam) of a
training step captured once as CUDA graphs and replayed, a few launches instead of hundreds
(--gpu-kernels, on CuPy).

NOTE [step graphs]
A graph replays the kernels that capture recorded, with the arguments they had, on the same
memory. So:
- the batch is copied into static device arrays before each replay, and the batch shape is
  part of the capture (another shape, e.g. an epoch's short last batch, runs plainly);
- every array the captured kernels use must stay where it was: the layers' workspaces
  (hpcdl.nn.workspace) do, and what the step allocates during capture (activations, logits,
  the loss) comes from a memory pool of the graph's own, kept with it, so nothing outside
  the graph is ever handed those blocks;
- no library call may refuse the capturing stream: CuPy's cuBLAS wrappers do (the H100 run of
  bd800bf failed its capture at the first matmul), so with --gpu-kernels every GEMM goes
  through cuBLAS on a handle of hpcdl's own, called through ctypes (NOTE [capturable GEMM]
  in hpcdl/nn/kernels/gemm.py), in the plain steps too, so both give the same bits;
- the replay runs on the capture stream, which first waits for the caller's (the batch and
  lr copied in, an update that ran after the last replay), and the caller's stream then
  waits for it;
- nothing may depend on the host inside a graph. That rules out, and the step then runs
  plainly, saying why once: fp16's loss scaler when it decides on the host, and the reference
  dropout (its seed is drawn on the host per mask and would repeat). Philox dropout
  (--gpu-kernels) is captured reading its key from device memory, which the replay fills
  with the seeds a plain step would draw, drawn on the host just before it (NOTE [dropout
  keys in a graph] in hpcdl/nn/kernels/dropout.py); the capture's own draws are put back;
- fp16 is in the graph when its skip-or-apply is decided on the device (--gpu-kernels: NOTE
  [device loss scale] in hpcdl/nn/precision.py): the unscale, the scale's update and the
  optimizer's update masked by the device "apply" flag are captured after backward when the
  update is in the graph (else they run after the replay), and the step's `applied` is that
  flag, read when a record is written;
- the optimizer's update is in the graph for SGD, whose learning rate the graph reads from a
  device scalar filled before each replay (a float32, as the plain step's scalar becomes),
  and for Adam(W) when FusedAdam takes it (hpcdl/nn/kernels/optimizer.py): its learning rate
  a float64 device scalar (the decay factor and the bias-corrected step are computed from it
  in float64 and rounded to float32 once, as from the plain step's Python float), its step
  count a device scalar made before the capture (Adam.count_on_device) that each replay
  advances by one, or by fp16's apply flag, so the count moves once per applied step and
  the host's Adam.t reads it when a checkpoint is written. Otherwise (the reference Adam,
  which counts on the host) Adam's update runs after the replay.
A gradient reducer hands buckets to its helper thread from the host between backward's
kernels (mark_ready), and the update must follow its wait(). So with a reducer the step is cut
at its bucket boundaries (hpcdl.nn.step_segments): the warm-up runs forward and backward once
with cuts that hand nothing to the reducer and finds where each segment ends (segment_plan: at
the first report of backward that completes a bucket; the last one, which holds the step's
flags, ends with backward); the capture ends one graph there and begins the next, on the same
stream and pool. A replay launches graph k, then calls reducer.mark_ready(ready_upto_k) with
the capture stream current, so the reducer's event follows graph k and its helper thread
stages or reduces those buckets while graph k+1 runs; train_step then waits for the reducer
(the flags summed with the last bucket, as in the plain step), and the update runs as a graph
of its own (SGD or FusedAdam, fp16's device unscale with it) or plainly (the reference Adam).
tests/test_step_segments.py shows on NumPy and 2 ranks that the cut step's gradients are the
plain step's, bitwise; tests/test_step_graph.py runs the capture and replay code on NumPy with
a recording stand-in for GraphStream (all they ask of CUDA), replays a captured Adam update
there with the host's state as it was at the capture (as a CUDA graph holds it) against plain
steps, bitwise, and (marked gpu, not yet run on a GPU) compares graph and plain steps with a
one-rank reducer.
A capture that fails for any reason (or cuts elsewhere than its warm-up), and a reducer whose
buckets are not those it was captured with, give plain steps from then on, said once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hpcdl.backend import array_module, is_device_array
from hpcdl.nn import kernels
from hpcdl.nn.kernels import choose, say_once
from hpcdl.nn.kernels.dropout import KeyFeed
from hpcdl.nn.layers import Dropout
from hpcdl.nn.model import FLAG_OVERFLOW
from hpcdl.nn.optim import SGD, Adam
from hpcdl.nn.step import forward_backward, fp16_decided_on_device
from hpcdl.nn.step_segments import (
    GraphStream,
    Segment,
    capture_segments,
    launch_step,
    segment_plan,
)

NOT_ON_A_GPU = "not on a GPU"


def _decided_on_device(parts: Any) -> bool:
    """fp16 may be in the graph: its skip-or-apply is decided on the device (and the update
    it masks is captured with it, SGD's or FusedAdam's, or runs after the replay)."""
    return fp16_decided_on_device(parts, agreed=False)


def _captured_lr(optimizer: Any, xp: Any) -> Any:
    """The device scalar a captured update reads its learning rate from, or None: the update
    runs after the replay. SGD's a float32; Adam's a float64, when FusedAdam takes it, its
    step count then made a device scalar before the capture (NOTE [step graphs])."""
    if isinstance(optimizer, SGD):
        return xp.zeros((), xp.float32)
    kernel = choose("optimizer", optimizer, optimizer.params)
    if isinstance(optimizer, Adam) and getattr(kernel, "name", None) == "fused-adam":
        optimizer.count_on_device()
        return xp.zeros((), xp.float64)
    return None


def _dropouts(model: Any) -> list[Any]:
    """The model's dropout layers that drop something."""
    return [leaf for leaf in model.body.leaves() if isinstance(leaf, Dropout) and leaf.rate]


def _generator_states(model: Any) -> list[tuple[Any, Any]]:
    """(generator, state) of each dropout generator: the capture's draws are put back."""
    generators = {id(layer.rng): layer.rng for layer in _dropouts(model)}
    return [(g, g.bit_generator.state) for g in generators.values()]


def _bucket_ends(reducer: Any) -> tuple[int, ...] | None:
    """Where the reducer's buckets end (what the segments were cut at); None: no reducer."""
    return None if reducer is None else tuple(bucket.hi for bucket in reducer.buckets)


class StepGraph:
    """Captures forward_backward (and SGD's or FusedAdam's update) for one batch shape on
    first use, then replays it: one graph, or with a reducer one per segment and the update's."""

    def __init__(self, make_stream: Callable[[Any], Any] = GraphStream) -> None:
        self.shape: tuple[int, ...] | None = None  # the batch shape captured
        self.graphs: list[Any] = []  # the step's graphs, launched in order; [] not captured
        self.segments: list[Segment] = []  # with a reducer: where graph k ends (its mark_ready)
        self.update_graph: Any = None  # with a reducer, the update's: launched after its wait()
        self.failed = False  # capture raised: plain steps from now on
        self._static: tuple[Any, Any] = (None, None)  # (images, labels) the graph reads
        self._lr: Any = None  # 0-d device array the captured update reads; None: not captured
        self._out: tuple[Any, Any] = (None, None)  # (loss, logits) the graph writes
        self.applied: Any = None  # fp16: the 0-d bool "apply" flag the graph writes
        self._reducer: Any = None  # the reducer the replay hands the buckets to: this step's
        self._bucket_ends: tuple[int, ...] | None = None  # the reducer's, when captured
        self._make_stream = make_stream  # array module -> GraphStream
        self._stream: Any = None
        self._keys = KeyFeed()  # the dropout keys drawn before each replay

    def pool_bytes(self) -> int:
        """Bytes the graph's own memory pool holds (its capture's allocations); 0 before one."""
        return 0 if self._stream is None else self._stream.pool_bytes()

    def why_not(self, parts: Any, images: Any) -> str | None:
        """Why this step cannot be a graph replay, or None when it can."""
        if not is_device_array(images):
            return NOT_ON_A_GPU
        if parts.reducer is not None and not hasattr(parts.reducer, "buckets"):
            return "the gradient reducer has no buckets to cut the step at"
        if parts.scaler is not None and not _decided_on_device(parts):
            return "fp16's loss scaler decides on the host"
        if _dropouts(parts.model) and not kernels.enabled():
            return "dropout draws its seed on the host"
        if self.failed:
            return "its capture failed"
        return None

    def takes(self, parts: Any, images: Any) -> bool:
        """Whether this step replays the graph (capturing it first if needed)."""
        if self.failed:  # said when it failed
            return False
        reason = self.why_not(parts, images)
        if reason is not None:
            if reason != NOT_ON_A_GPU:  # graphs are a GPU feature: nothing to say on a CPU
                say_once(f"step-graph:{reason}", f"CUDA graph of the step off: {reason}")
            return False
        if self.graphs and _bucket_ends(parts.reducer) != self._bucket_ends:
            self.failed = True
            say_once("step-graph-buckets", "CUDA graph of the step off: the reducer's buckets "
                     "are not those the step was captured with")  # fmt: skip
            return False
        if self.graphs and tuple(images.shape) != self.shape:
            return False  # another batch shape: plain launches
        if not self.graphs:
            self._capture(parts, images)
        self._reducer = parts.reducer  # this step's: the segments need only its bucket ends
        return bool(self.graphs)

    def replay(self, images: Any, labels: Any, lr: float) -> tuple[Any, Any, bool]:
        """Copy the batch (and lr) in, launch the graphs (handing the reducer its buckets
        between them); (loss, logits) as the graphs wrote them, and whether the graphs also
        apply the optimizer's update (with a reducer: update(), after its wait())."""
        static_x, static_y = self._static
        static_x[...] = images
        static_y[...] = labels
        if self._lr is not None:
            self._lr.fill(lr)
        self._keys.draw()
        self._stream.follows_caller()
        launch_step(self._stream, self.graphs, self.segments, self._reducer)
        self._stream.caller_follows()
        return (*self._out, self._lr is not None)

    def update(self) -> Any:
        """The update the replay holds: with a reducer its graph is launched now (after the
        reducer's wait()), else the step's graph ran it. Whether it applied: True, or fp16's
        device flag (a copy, read when a record is written)."""
        if self.update_graph is not None:
            self._stream.launch(self.update_graph)
            self._stream.caller_follows()
        return self.applied.copy() if self.applied is not None else True

    def _capture(self, parts: Any, images: Any) -> None:
        xp = array_module(images)
        buffers = parts.model.buffers.copy()  # the warm-up must not move BatchNorm's statistics
        generators = _generator_states(parts.model)  # nor draw dropout seeds
        try:
            self._static = (images.copy(), xp.zeros(images.shape[:1], xp.int64))
            self._stream = self._make_stream(xp)
            self._lr = _captured_lr(parts.optimizer, xp)  # before capturing: not the graph's pool
            KeyFeed.make_keys(_dropouts(parts.model), xp)  # nor the dropout keys
            self._stream.follows_caller()
            with self._stream.capturing():
                # warm-up (workspaces, plans, the segments): its gradients are never handed to
                # a reducer, unscaled nor applied, so the scaler's state and the parameters
                # are as before it
                plan = [] if parts.reducer is None else segment_plan(parts, *self._static)
                if parts.reducer is None:
                    forward_backward(parts, *self._static)
                with self._keys.recording():
                    self._capture_step(parts, plan)
            self.shape = tuple(images.shape)
        except Exception as exc:  # noqa: BLE001 - any failure: plain launches, said once
            if self._stream is not None:
                self._stream.abandon()
            self.failed, self.graphs, self.update_graph, self._lr = True, [], None, None
            say_once("step-graph-capture", f"CUDA graph of the step off: capture failed ({exc})")
        finally:
            parts.model.buffers[...] = buffers
            for generator, state in generators:
                generator.bit_generator.state = state

    def _capture_step(self, parts: Any, plan: list[Segment]) -> None:
        """The step's graphs: forward, backward and the update in one; with a reducer (a plan),
        one per segment and, when the update is captured, the update's own."""
        self._stream.begin()
        if not plan:
            loss, logits, _ = forward_backward(parts, *self._static)
            self._capture_update(parts)
            graphs = [self._stream.end()]
        else:
            graphs, loss, logits = capture_segments(parts, self._static, self._stream, plan)
            if self._lr is not None:
                self._stream.begin()
                self._capture_update(parts)
                self.update_graph = self._stream.end()
        self.graphs, self.segments, self._out = graphs, plan, (loss, logits)
        self._bucket_ends = _bucket_ends(parts.reducer)

    def _capture_update(self, parts: Any) -> None:
        """fp16's device-side unscale, then the optimizer's update (SGD's, FusedAdam's)
        masked by its decision, into the graph being captured; else the update runs after the
        replay (NOTE [step graphs])."""
        if self._lr is None:
            return
        apply = None
        if parts.scaler is not None:
            overflows = parts.model.step_flags[FLAG_OVERFLOW : FLAG_OVERFLOW + 1]
            apply = parts.scaler.unscale_on_device(parts.model.grads, overflows)
        parts.optimizer.step(self._lr, apply)
        self.applied = apply
