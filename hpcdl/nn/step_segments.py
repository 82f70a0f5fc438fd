"""The step cut at the gradient reducer's bucket boundaries, so that a step with a reducer can be
captured as CUDA graphs (NOTE [step graphs] in hpcdl/nn/step_graph.py): the plan of the cuts
(BucketCuts, segment_plan), their capture (capture_segments) and the replay that hands the
buckets to the reducer between the graphs (launch_step), on a GraphStream, the one object that
speaks to CUDA (a recording stand-in takes its place in tests/test_step_graph.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from hpcdl.nn.step import forward_backward


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


class GraphStream:
    """The CUDA stream a step graph is captured on and replayed from, with the memory pool of
    its own that every allocation during the capture comes from (NOTE [step graphs])."""

    def __init__(self, cp: Any) -> None:
        self._cp = cp
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.pool = cp.cuda.MemoryPool()

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """The stream CuPy's current one and the pool its allocator: warm-up and capture."""
        with self.stream, self._cp.cuda.using_allocator(self.pool.malloc):
            yield

    def pool_bytes(self) -> int:
        """Bytes the capture's pool holds (the default pool does not count them)."""
        return int(self.pool.total_bytes())

    def current(self) -> Any:
        """A context in which the stream is CuPy's current one (the reducer's events are
        recorded there, so each follows the graph launched before it)."""
        return self.stream

    def begin(self) -> None:
        self.stream.begin_capture()

    def end(self) -> Any:
        """The graph captured since begin()."""
        return self.stream.end_capture()

    def abandon(self) -> None:
        """A capture that raised: end it, else the stream stays capturing and breaks every
        later synchronization on it."""
        if self.stream.is_capturing():
            self.stream.end_capture()

    def launch(self, graph: Any) -> None:
        graph.launch(stream=self.stream)

    def follows_caller(self) -> None:
        """The stream waits for the caller's: the batch and lr copied in, the last update."""
        self.stream.wait_event(self._cp.cuda.get_current_stream().record())

    def caller_follows(self) -> None:
        """The caller's stream waits for this one, so what follows sees the replay's results."""
        self._cp.cuda.get_current_stream().wait_event(self.stream.record())


def capture_segments(
    parts: Any, static: tuple[Any, Any], stream: Any, plan: list[Segment]
) -> tuple[list[Any], Any, Any]:
    """Forward and backward captured as one graph per segment of `plan` (segment_plan's, from
    the warm-up), on `stream`, capturing when called; returns (graphs, loss, logits).

    Each cut but the last ends the graph being captured and begins the next; the last segment
    ends with backward (all that follows the last cut). Nothing is handed to the reducer. A
    capture that cuts elsewhere than its warm-up raises (the caller runs plain steps)."""
    graphs: list[Any] = []

    def cut(n: int) -> None:
        if len(graphs) < len(plan) - 1:
            graphs.append(stream.end())
            stream.begin()

    cuts = BucketCuts(parts.model, parts.reducer, cut)
    loss, logits, _ = forward_backward(parts, *static, mark_ready=cuts)
    cuts.finish(parts.reducer.grads.size)
    graphs.append(stream.end())
    if cuts.segments != plan:
        ends = [s.ready_upto for s in cuts.segments], [s.ready_upto for s in plan]
        raise RuntimeError(f"the capture cut the step at {ends[0]}, its warm-up at {ends[1]}")
    return graphs, loss, logits


def launch_step(stream: Any, graphs: list[Any], segments: list[Segment], reducer: Any) -> None:
    """Launch the captured step's graphs in order on `stream`; with segments (one per graph),
    the reducer's mark_ready(segment.ready_upto) after each, its event recorded on `stream`
    after that graph, so its helper thread stages or reduces those buckets once they are
    written while the next graph runs. The caller then waits for the reducer (train_step)."""
    if segments:
        reducer.begin_step()
    with stream.current():
        for k, graph in enumerate(graphs):
            stream.launch(graph)
            if segments:
                reducer.mark_ready(segments[k].ready_upto)
