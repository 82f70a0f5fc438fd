"""StepGraph: forward, loss, backward and (SGD) the update of a training step captured once as a
CUDA graph and replayed, one launch instead of hundreds (--gpu-kernels, on CuPy).

NOTE [step graphs]
A graph replays the kernels that capture recorded, with the arguments they had, on the same
memory. So:
- the batch is copied into static device arrays before each replay, and the batch shape is
  part of the capture (another shape, e.g. an epoch's short last batch, runs plainly);
- every array the captured kernels use must stay where it was: the layers' workspaces
  (hpcdl.nn.workspace) do, and what the step allocates during capture (activations, logits,
  the loss) comes from a memory pool of the graph's own, kept with it, so nothing outside
  the graph is ever handed those blocks;
- nothing may depend on the host between kernels. That rules out, for now, and the step then
  runs plainly, saying why once: a gradient reducer (its mark_ready is Python between the
  backward kernels, and its allreduce is MPI on a helper thread), fp16's loss scaler when it
  decides on the host, and dropout (its seed is drawn on the host per mask and would repeat);
- fp16 is in the graph when its skip-or-apply is decided on the device (--gpu-kernels: NOTE
  [device loss scale] in hpcdl/nn/precision.py): with SGD the unscale, the scale's update and
  SGD's update masked by the device "apply" flag are captured after backward (with Adam they
  run after the replay, its step count a device scalar too), and the step's `applied` is
  that flag, read when a record is written;
- the optimizer's update is in the graph for SGD, whose learning rate the graph reads from a
  device scalar filled before each replay (a float32, as the plain step's scalar becomes);
  Adam's bias correction counts steps on the host, so its update runs after the replay.
The way to a reducer: cut the step at its bucket boundaries (BucketCuts, segment_plan). A
segment ends at the first report of backward that completes a bucket; the capture would end
one graph there and begin the next, and a replay launches segment k, records an event and
calls reducer.mark_ready(ready_upto_k) on the host (the helper thread then stages or hands the
bucket to MPI after that event, as today), then launches segment k+1; after the last, wait()
and a last graph with the unscale and the update. What lands today is the plan and the cut
step on NumPy (tests/test_step_segments.py: its ends are the buckets', and on 2 ranks its
gradients are the plain step's, bitwise); the per-segment capture needs a GPU to be tried.
A capture that fails for any other reason also falls back, said once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hpcdl.backend import array_module, is_device_array
from hpcdl.nn.kernels import say_once
from hpcdl.nn.layers import Dropout
from hpcdl.nn.model import FLAG_OVERFLOW
from hpcdl.nn.optim import SGD
from hpcdl.nn.step import forward_backward, fp16_decided_on_device

NOT_ON_A_GPU = "not on a GPU"


def _decided_on_device(parts: Any) -> bool:
    """fp16 may be in the graph: its skip-or-apply is decided on the device (and the update
    it masks is captured with it, SGD's, or runs after the replay, Adam's)."""
    return fp16_decided_on_device(parts, agreed=False)


class StepGraph:
    """Captures forward_backward for one batch shape on first use, then replays it."""

    def __init__(self) -> None:
        self.shape: tuple[int, ...] | None = None  # the batch shape captured
        self.graph: Any = None
        self.failed = False  # capture raised: plain steps from now on
        self._static: tuple[Any, Any] = (None, None)  # (images, labels) the graph reads
        self._lr: Any = (
            None  # float32 0-d device array the graph's SGD update reads; None: no update
        )
        self._out: tuple[Any, Any] = (None, None)  # (loss, logits) the graph writes
        self.applied: Any = None  # fp16: the 0-d bool "apply" flag the graph writes
        self._pool: Any = None  # the graph's own memory pool (NOTE [step graphs])
        self._stream: Any = None

    def why_not(self, parts: Any, images: Any) -> str | None:
        """Why this step cannot be a graph replay, or None when it can."""
        if not is_device_array(images):
            return NOT_ON_A_GPU
        if parts.reducer is not None:
            return "a gradient reducer runs between the backward kernels"
        if parts.scaler is not None and not _decided_on_device(parts):
            return "fp16's loss scaler decides on the host"
        if any(isinstance(leaf, Dropout) and leaf.rate for leaf in parts.model.body.leaves()):
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
        if self.graph is not None and tuple(images.shape) != self.shape:
            return False  # another batch shape: plain launches
        if self.graph is None:
            self._capture(parts, images)
        return self.graph is not None

    def replay(self, images: Any, labels: Any, lr: float) -> tuple[Any, Any, bool]:
        """Copy the batch (and lr) in, launch the graph; (loss, logits) as the graph wrote them,
        and whether the graph also applied the optimizer's update."""
        static_x, static_y = self._static
        static_x[...] = images
        static_y[...] = labels
        if self._lr is not None:
            self._lr.fill(lr)
        self.graph.launch(stream=self._stream)
        self._stream_waits()
        return (*self._out, self._lr is not None)

    def _capture(self, parts: Any, images: Any) -> None:
        cp = array_module(images)
        buffers = parts.model.buffers.copy()  # the warm-up must not move BatchNorm's statistics
        try:
            self._static = (images.copy(), cp.zeros(images.shape[:1], cp.int64))
            self._stream = cp.cuda.Stream(non_blocking=True)
            self._pool = cp.cuda.MemoryPool()
            self._stream.wait_event(cp.cuda.get_current_stream().record())
            with self._stream, cp.cuda.using_allocator(self._pool.malloc):
                forward_backward(parts, *self._static)  # warm-up: workspaces and plans
                # the warm-up's gradients are never unscaled nor applied: the scaler's state
                # and the parameters are as before it
                if isinstance(parts.optimizer, SGD):
                    self._lr = cp.zeros((), cp.float32)
                self._stream.begin_capture()
                loss, logits, _ = forward_backward(parts, *self._static)
                self._capture_update(parts)
                self.graph = self._stream.end_capture()
            self._out, self.shape = (loss, logits), tuple(images.shape)
            parts.model.buffers[...] = buffers
        except Exception as exc:  # noqa: BLE001 - any failure: plain launches, said once
            if self._stream is not None and self._stream.is_capturing():
                self._stream.end_capture()  # else the stream stays capturing, and so breaks
            self.failed, self.graph, self._lr = True, None, None  # every later sync on it
            say_once("step-graph-capture", f"CUDA graph of the step off: capture failed ({exc})")

    def _capture_update(self, parts: Any) -> None:
        """fp16's device-side unscale, then SGD's update masked by its decision, into the
        graph being captured; Adam's update runs after the replay (NOTE [step graphs])."""
        if self._lr is None:
            return
        apply = None
        if parts.scaler is not None:
            overflows = parts.model.step_flags[FLAG_OVERFLOW : FLAG_OVERFLOW + 1]
            apply = parts.scaler.unscale_on_device(parts.model.grads, overflows)
        parts.optimizer.step(self._lr, apply)
        self.applied = apply

    def _stream_waits(self) -> None:
        """The caller's stream waits for the replay, so what follows sees its results."""
        cp = array_module(self._static[0])
        cp.cuda.get_current_stream().wait_event(self._stream.record())


@dataclass(frozen=True)
class Segment:
    """One piece of a step cut at the reducer's bucket boundaries (NOTE [step graphs])."""

    ready_upto: int  # grads[:ready_upto] are final when it ends: mark_ready's n after it
    buckets: tuple[int, ...]  # the reducer's buckets (indices) that are ready from then on
    params: tuple[str, ...]  # the parameters (Model.layout names) whose gradients it finished


class BucketCuts:
    """mark_ready for a step cut into segments at the reducer's bucket boundaries.

    Backward reports grads[:n] final after each layer; a segment ends at the first report that
    completes a bucket (or several, when one layer's gradients span them) and `cut(n)` runs
    there: the reducer's mark_ready(n) on NumPy; in a segmented capture, the end of one graph
    and the beginning of the next, with mark_ready(n) on the host between their replays.
    Reports inside a bucket pass without a cut. `segments` is the plan so far."""

    def __init__(self, model: Any, reducer: Any, cut: Callable[[int], None]) -> None:
        self.bucket_ends = [bucket.hi for bucket in reducer.buckets]
        self.layout = model.layout()  # (name, shape, offset) of every parameter
        self.cut = cut
        self.segments: list[Segment] = []
        self._next = 0  # the first bucket not yet ready

    def __call__(self, n: int) -> None:
        first = self._next
        while self._next < len(self.bucket_ends) and self.bucket_ends[self._next] <= n:
            self._next += 1
        if self._next == first:
            return
        lo = self.segments[-1].ready_upto if self.segments else 0
        names = tuple(name for name, _, offset in self.layout if lo <= offset < n)
        self.segments.append(Segment(n, tuple(range(first, self._next)), names))
        self.cut(n)

    def finish(self, size: int) -> None:
        """Backward has ended: the last segment takes what is left (the reducer's wait()
        reduces its buckets)."""
        self(size)


def segment_plan(parts: Any, images: Any, labels: Any) -> list[Segment]:
    """The segments of this step's backward at parts.reducer's buckets, from one run of
    forward and backward that hands nothing to the reducer (the capture's warm-up, on a GPU).
    BatchNorm's statistics are put back; the gradients are this batch's (unreduced)."""
    buffers = parts.model.buffers.copy()
    cuts = BucketCuts(parts.model, parts.reducer, cut=lambda n: None)
    try:
        forward_backward(parts, images, labels, mark_ready=cuts)
        cuts.finish(parts.reducer.grads.size)
    finally:
        parts.model.buffers[...] = buffers
    return cuts.segments
