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
  backward kernels, and its allreduce is MPI on a helper thread; capture per bucket segment is
  the way there), fp16's loss scaler (the host decides whether the update runs), and dropout
  (its seed is drawn on the host per mask and would repeat);
- the optimizer's update is in the graph for SGD, whose learning rate the graph reads from a
  device scalar filled before each replay (a float32, as the plain step's scalar becomes);
  Adam's bias correction counts steps on the host, so its update runs after the replay.
A capture that fails for any other reason also falls back, said once.
"""

from __future__ import annotations

from typing import Any

from hpcdl.backend import array_module, is_device_array
from hpcdl.nn.kernels import say_once
from hpcdl.nn.layers import Dropout
from hpcdl.nn.optim import SGD
from hpcdl.nn.step import forward_backward

NOT_ON_A_GPU = "not on a GPU"


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
        self._pool: Any = None  # the graph's own memory pool (NOTE [step graphs])
        self._stream: Any = None

    def why_not(self, parts: Any, images: Any) -> str | None:
        """Why this step cannot be a graph replay, or None when it can."""
        if not is_device_array(images):
            return NOT_ON_A_GPU
        if parts.reducer is not None:
            return "a gradient reducer runs between the backward kernels"
        if parts.scaler is not None:
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
                if isinstance(parts.optimizer, SGD):
                    self._lr = cp.zeros((), cp.float32)
                self._stream.begin_capture()
                loss, logits, _ = forward_backward(parts, *self._static)
                if self._lr is not None:
                    parts.optimizer.step(self._lr)
                self.graph = self._stream.end_capture()
            self._out, self.shape = (loss, logits), tuple(images.shape)
            parts.model.buffers[...] = buffers
        except Exception as exc:  # noqa: BLE001 - any failure: plain launches, said once
            if self._stream is not None and self._stream.is_capturing():
                self._stream.end_capture()  # else the stream stays capturing, and so breaks
            self.failed, self.graph, self._lr = True, None, None  # every later sync on it
            say_once("step-graph-capture", f"CUDA graph of the step off: capture failed ({exc})")

    def _stream_waits(self) -> None:
        """The caller's stream waits for the replay, so what follows sees its results."""
        cp = array_module(self._static[0])
        cp.cuda.get_current_stream().wait_event(self._stream.record())
