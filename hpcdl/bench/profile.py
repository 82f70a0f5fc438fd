"""`python -m hpcdl.bench compute --profile`: ms per layer, forward and backward, hpcdl vs PyTorch.

Both frameworks run the step of `bench compute` (forward, softmax cross-entropy, backward,
SGD-momentum update on a fixed random batch) on the same architecture, timed from the outside:
no layer of either framework is edited, so the profile measures the code that trains.

hpcdl: `timed_leaves` replaces each leaf layer's bound `forward`/`backward` by a timed wrapper for
the duration of the profile (and the step's loss by a timed one, given to the step in its
`StepParts.loss`), then puts the originals back. The step is `hpcdl.nn.step.train_step`
itself, so the optimizer update is its `t_update`. Work outside the leaves (the input transpose
to channels-last, the residual adds of the ResNet blocks) is what the step takes beyond the
rows: the "other" row.

PyTorch: the same wrapping, done with module hooks on every leaf `nn.Module` (one without
children). Forward: a forward pre-hook and a forward hook. Backward: from the module's full
backward pre-hook (the gradient of its output is ready) to the later of its full backward hook
and the post-accumulate-grad hooks of its parameters (the first layer's input needs no
gradient, so its backward hook fires before its weight gradient exists; the parameter hooks
close that interval). This maps backward time to modules the way hpcdl's rows are defined,
which an autograd profiler's per-op table (ConvolutionBackward0, ...) cannot do for a network
with many layers of one kind. Loss: the criterion's forward plus the autograd time until the
logits' gradient exists (log-softmax and NLL backward). Update: `optimizer.step()`. Functional
calls that are no module (torch.relu and the shortcut's slice and pad in the ResNet-20 block)
land in "other", as the residual adds do on both sides; torchvision's blocks call one ReLU
module twice, and its row holds both calls.

Every figure is a mean over the faster half of the profiled steps (`quiet_mean`): on a shared
machine a burst of other work inflates whichever layer it lands in. Rows are paired by kind in
forward order (Conv2d with Conv2d, BatchNorm2d with BatchNorm, ...); a layer one side has and
the other computes functionally gets a blank on that side. On GPU every timestamp is taken
after synchronising the device, which serialises the step: the rows show where time goes, the
un-instrumented step of `bench compute` how fast the step is.

GPU time per layer: on a GPU each interval is also bracketed by CUDA events on the current
stream (GpuClock: CuPy's for hpcdl, torch.cuda's for PyTorch), so a row has its device time
beside its wall time; wall minus device is what the host spends launching (Python, the cuDNN
frontend's execute, allocations). Off a GPU the device columns are None. With --gpu-kernels
the instrumented steps run the layers eagerly (no CUDA graph of the step: a graph replay never
calls a layer); the un-instrumented median keeps the graph.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from hpcdl import backend, nn
from hpcdl.bench.compute_setup import hpcdl_setup, run_config, torch_setup
from hpcdl.nn.step import StepParts, train_step

# torch module class -> the hpcdl leaf class it is paired with
TORCH_KINDS = {
    "Conv2d": "Conv2d",
    "BatchNorm2d": "BatchNorm",
    "ReLU": "ReLU",
    "MaxPool2d": "MaxPool2d",
    "Dropout": "Dropout",
    "Flatten": "Flatten",
    "Linear": "Linear",
    "AdaptiveAvgPool2d": "GlobalAvgPool",
}
WARMUP = 3


@dataclass(eq=False)  # rows are told apart by identity
class LayerTimes:
    """Seconds one leaf layer spends per step (a sum while profiling, then the mean)."""

    name: str  # path in the model, e.g. "3.branch.0.Conv2d"
    kind: str  # hpcdl class name (torch modules: the hpcdl kind they pair with, else their own)
    forward_s: float = 0.0
    backward_s: float = 0.0
    forward_gpu_s: float | None = None  # CUDA-event device time; None off a GPU
    backward_gpu_s: float | None = None

    def add(self, attr: str, wall_s: float, gpu_s: float | None) -> None:
        """Add one interval to forward or backward (attr "forward_s" / "backward_s")."""
        setattr(self, attr, getattr(self, attr) + wall_s)
        if gpu_s is not None:
            gpu = attr.replace("_s", "_gpu_s")
            setattr(self, gpu, (getattr(self, gpu) or 0.0) + gpu_s)


class GpuClock:
    """CUDA events on the current stream, for the device time of an interval; off a GPU every
    mark is None and so is every interval."""

    def __init__(self, events: Callable[[], Any] | None = None) -> None:
        self._event = events  # () -> a recorded event, or None: no device

    @classmethod
    def for_array_module(cls, xp: Any) -> GpuClock:
        if xp is np:
            return cls()

        def cupy_event() -> Any:
            event = xp.cuda.Event()
            event.record()
            return event

        return cls(cupy_event)

    @classmethod
    def for_torch(cls, torch: Any, device: str) -> GpuClock:
        if device != "cuda":
            return cls()

        def torch_event() -> Any:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event

        return cls(torch_event)

    def mark(self) -> Any:
        return None if self._event is None else self._event()

    @staticmethod
    def seconds(start: Any, end: Any) -> float | None:
        """Device seconds from start to end (waits for end), or None without events."""
        if start is None or end is None:
            return None
        end.synchronize()
        if hasattr(start, "elapsed_time"):  # torch.cuda.Event
            return start.elapsed_time(end) / 1e3
        import cupy  # noqa: PLC0415 - only with CuPy's events

        return cupy.cuda.get_elapsed_time(start, end) / 1e3


@dataclass
class Breakdown:
    """Seconds per step of one framework (quiet_mean), split by leaf layer, loss and update."""

    framework: str
    rows: list[LayerTimes]  # forward order of first call
    loss_s: float
    update_s: float
    step_s: float  # the instrumented step (what the rows add up to, with other_s)
    plain_step_s: float  # median un-instrumented step, as `bench compute` times it

    @property
    def other_s(self) -> float:
        layers = sum(r.forward_s + r.backward_s for r in self.rows)
        return self.step_s - layers - self.loss_s - self.update_s

    @property
    def layers_gpu_s(self) -> float | None:
        """The rows' device time, or None off a GPU."""
        times = [t for r in self.rows for t in (r.forward_gpu_s, r.backward_gpu_s)]
        return None if any(t is None for t in times) or not times else sum(times)

    def as_json(self) -> dict[str, Any]:
        ms = lambda s: None if s is None else s * 1e3  # noqa: E731
        return {
            "rows": [
                {
                    "name": r.name,
                    "kind": r.kind,
                    "forward_ms": r.forward_s * 1e3,
                    "backward_ms": r.backward_s * 1e3,
                    "forward_gpu_ms": ms(r.forward_gpu_s),
                    "backward_gpu_ms": ms(r.backward_gpu_s),
                }
                for r in self.rows
            ],
            "layers_ms": sum(r.forward_s + r.backward_s for r in self.rows) * 1e3,
            "layers_gpu_ms": ms(self.layers_gpu_s),
            "loss_ms": self.loss_s * 1e3,
            "update_ms": self.update_s * 1e3,
            "other_ms": self.other_s * 1e3,
            "step_ms": self.step_s * 1e3,
            "plain_step_ms": self.plain_step_s * 1e3,
        }


# --- hpcdl -----------------------------------------------------------------------------------


def leaf_names(root: nn.Layer) -> dict[int, str]:
    """id(leaf) -> '<index>.<attr>...<Class>' for every leaf of root, parameter-free ones too."""
    leaves = {id(leaf) for leaf in root.leaves()}
    names: dict[int, str] = {}

    def walk(layer: nn.Layer, prefix: str) -> None:
        if id(layer) in leaves:
            names[id(layer)] = f"{prefix}{type(layer).__name__}"
            return
        children = dict(layer.named_children())
        seen = {id(c) for c in children.values()}
        # Parameter-free sub-layers held as attributes (a block's final ReLU) are not children.
        for key, value in vars(layer).items():
            if isinstance(value, nn.Layer) and id(value) not in seen:
                children[key] = value
        for key, child in children.items():
            walk(child, f"{prefix}{key}.")

    walk(root, "")
    return names


def _timed(
    fn: Callable, row: LayerTimes, attr: str, sync: Callable, order: list, clock: GpuClock
) -> Callable:
    def timed(*args: Any, **kwargs: Any) -> Any:
        sync()
        t0, start = time.perf_counter(), clock.mark()
        out = fn(*args, **kwargs)
        end = clock.mark()
        sync()
        row.add(attr, time.perf_counter() - t0, clock.seconds(start, end))
        if attr == "forward_s" and row not in order:
            order.append(row)
        return out

    return timed


@contextmanager
def timed_leaves(
    model: nn.Model, xp: Any, clock: GpuClock | None = None
) -> Iterator[tuple[list[LayerTimes], LayerTimes]]:
    """Time every leaf's forward/backward and the loss while inside; ([rows], loss row).

    Rows are listed in the order of their first forward call; the originals are back on exit."""
    sync = lambda: backend.synchronize(xp)  # noqa: E731
    clock = clock or GpuClock.for_array_module(xp)
    names = leaf_names(model.body)
    order: list[LayerTimes] = []
    loss = LayerTimes("loss", "loss")
    with ExitStack() as undo:
        for leaf in model.body.leaves():
            row = LayerTimes(names[id(leaf)], type(leaf).__name__)
            for method, attr in (("forward", "forward_s"), ("backward", "backward_s")):
                timed = _timed(getattr(leaf, method), row, attr, sync, order, clock)
                setattr(leaf, method, timed)
                undo.callback(delattr, leaf, method)  # the class's method shows through again
        yield order, loss


def timed_loss(parts: StepParts, row: LayerTimes) -> StepParts:
    """parts with its loss timed into row.forward_s (the step is given its loss)."""
    sync = lambda: backend.synchronize(parts.xp)  # noqa: E731
    clock = GpuClock.for_array_module(parts.xp)
    return replace(parts, loss=_timed(parts.loss, row, "forward_s", sync, [], clock))


def profile_hpcdl(args: argparse.Namespace) -> Breakdown:
    """The hpcdl breakdown over args.steps steps after WARMUP (quiet_mean)."""
    parts, x, y = hpcdl_setup(args)
    xp, model = parts.xp, parts.model
    plain = []
    for _ in range(WARMUP + args.steps):
        t0 = time.perf_counter()
        train_step(parts, x, y, 0.01)
        plain.append(time.perf_counter() - t0)
    with timed_leaves(model, xp) as (rows, loss):
        parts = timed_loss(replace(parts, graph=None), loss)  # layers run: no graph replay
        for _ in range(WARMUP):
            train_step(parts, x, y, 0.01)

        def step() -> tuple[float, float, float]:
            loss.forward_s = 0.0
            times = train_step(parts, x, y, 0.01).times
            return loss.forward_s, times.t_update, times.t_step

        totals = quiet_mean(rows, step, args.steps)
    return Breakdown("hpcdl", rows, *totals, statistics.median(plain[WARMUP:]))


def quiet_mean(
    rows: list[LayerTimes], step: Callable[[], tuple[float, float, float]], steps: int
) -> tuple[float, float, float]:
    """Run `steps` steps; set the rows to their mean over the quieter half of the steps and
    return the (loss, update, step) seconds averaged over the same steps.

    step() runs one step, during which the rows add up their times, and returns (loss s,
    update s, step s). The quieter half are the steps no slower than the median step: on a
    shared machine a burst of other work lands in a few steps and would inflate whichever rows
    it hits. One set of steps for every row keeps the rows adding up to the step."""
    fields = ("forward_s", "backward_s", "forward_gpu_s", "backward_gpu_s")
    samples = []
    for _ in range(steps):
        for row in rows:
            row.forward_s = row.backward_s = 0.0
            row.forward_gpu_s = row.backward_gpu_s = None
        totals = step()
        values = [getattr(r, f) for r in rows for f in fields]
        samples.append([np.nan if v is None else v for v in values] + list(totals))
    table = np.array(samples)  # (steps, 4 * rows + 3) seconds; NaN: no device time
    mean = table[table[:, -1] <= np.median(table[:, -1])].mean(axis=0)
    for i, row in enumerate(rows):
        for j, name in enumerate(fields):
            value = float(mean[len(fields) * i + j])
            setattr(row, name, None if np.isnan(value) else value)
    return float(mean[-3]), float(mean[-2]), float(mean[-1])


# --- PyTorch ---------------------------------------------------------------------------------


@dataclass
class _ModuleClock:
    """Forward and the open backward intervals of one torch module in one step: (perf_counter
    time, CUDA event or None) at each end."""

    row: LayerTimes
    starts: list[tuple] = field(default_factory=list)
    ends: list[tuple] = field(default_factory=list)
    backward_starts: list[tuple] = field(default_factory=list)
    backward_ends: list[tuple] = field(default_factory=list)

    def close_step(self) -> None:
        """Add this step's intervals to the row and clear them."""
        intervals = (
            ("forward_s", self.starts, self.ends),
            ("backward_s", self.backward_starts, self.backward_ends),
        )
        for attr, starts, ends in intervals:
            for (t0, e0), (t1, e1) in zip(starts, ends):
                self.row.add(attr, t1 - t0, GpuClock.seconds(e0, e1))
        for times in (self.starts, self.ends, self.backward_starts, self.backward_ends):
            times.clear()


def _hook_module(
    name: str, module: Any, sync: Callable, order: list, clock: GpuClock
) -> _ModuleClock:
    kind = type(module).__name__
    mc = _ModuleClock(LayerTimes(name, TORCH_KINDS.get(kind, kind)))

    def now() -> tuple:
        sync()
        return time.perf_counter(), clock.mark()

    def pre(*_: Any) -> None:
        if mc.row not in order:
            order.append(mc.row)
        mc.starts.append(now())

    def backward_end(*_: Any) -> None:
        # Overwrites: a module's backward ends at its last event (input grad or weight grad).
        mc.backward_ends[len(mc.backward_starts) - 1] = now()

    def backward_pre(*_: Any) -> None:
        mc.backward_starts.append(now())
        mc.backward_ends.append(mc.backward_starts[-1])

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(lambda *_: mc.ends.append(now()))
    module.register_full_backward_pre_hook(backward_pre)
    module.register_full_backward_hook(backward_end)
    for p in module.parameters(recurse=False):
        p.register_post_accumulate_grad_hook(backward_end)
    return mc


def profile_torch(args: argparse.Namespace) -> Breakdown | None:
    """The PyTorch breakdown, or None when torch (or the reference model) is not importable."""
    t = torch_setup(args)
    if t is None:
        return None
    model, opt, x, y, loss_fn, sync = t.model, t.opt, t.x, t.y, t.loss_fn, t.sync
    half = t.torch.bfloat16 if t.precision == "bf16" else None  # autocast, as bench compute

    def step(clocks: list[_ModuleClock] | None = None) -> tuple[float, float, float]:
        """One step; (loss s, update s, step s)."""
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        with t.torch.autocast(t.device, dtype=half, enabled=half is not None):
            logits = model(x)
            t1 = time.perf_counter()
            loss = loss_fn(logits, y)
        marks: list[float] = []
        logits.register_hook(lambda _: marks.append(time.perf_counter()))
        sync()
        t2 = time.perf_counter()
        loss.backward()
        sync()
        t3 = time.perf_counter()
        opt.step()
        sync()
        t4 = time.perf_counter()
        for clock in clocks or []:
            clock.close_step()
        return (t2 - t1) + (marks[0] - t2), t4 - t3, t4 - t0

    plain = [step()[2] for _ in range(WARMUP + args.steps)]
    order: list[LayerTimes] = []
    leaves = [(n, m) for n, m in model.named_modules() if not list(m.children())]
    for _, module in leaves:
        # PyTorch forbids an in-place op on the output of a module with a full backward hook
        # (torchvision's ReLU(inplace=True)); out of place is the same math and one more buffer.
        if getattr(module, "inplace", False):
            module.inplace = False
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        gpu = GpuClock.for_torch(t.torch, t.device)
        clocks = [_hook_module(name, m, sync, order, gpu) for name, m in leaves]
        for _ in range(WARMUP):
            step(clocks)
        totals = quiet_mean(order, lambda: step(clocks), args.steps)
    return Breakdown("torch", order, *totals, statistics.median(plain[WARMUP:]))


# --- report ----------------------------------------------------------------------------------


def pair_rows(ours: list[LayerTimes], theirs: list[LayerTimes]) -> list[tuple]:
    """[(hpcdl row or None, torch row or None)]: rows of one kind paired in forward order."""
    pairs: list[tuple] = [(row, None) for row in ours]
    at = 0
    for row in theirs:
        match = next((i for i in range(at, len(pairs)) if pairs[i][0] and
                      pairs[i][0].kind == row.kind and pairs[i][1] is None), None)  # fmt: skip
        if match is None:
            pairs.insert(at, (None, row))
            at += 1
        else:
            pairs[match] = (pairs[match][0], row)
            at = match + 1
    return pairs


def _ms(value: float | None) -> str:
    return f"{value * 1e3:9.2f}" if value is not None else f"{'':>9}"


def _gpu(row: LayerTimes | None) -> float | None:
    if row is None or row.forward_gpu_s is None:
        return None
    return row.forward_gpu_s + (row.backward_gpu_s or 0.0)


def print_table(ours: Breakdown, theirs: Breakdown | None) -> None:
    """The per-layer table and the totals, hpcdl's and (when measured) PyTorch's columns; on a
    GPU two more: each side's device time (forward + backward, CUDA events)."""
    gpu = ours.layers_gpu_s is not None
    extra = f" {'hpcdl gpu':>9} {'torch gpu':>9}" if gpu else ""
    print(f"{'layer (hpcdl / torch module)':<38} {'hpcdl fwd':>9} {'hpcdl bwd':>9} "
          f"{'torch fwd':>9} {'torch bwd':>9}{extra}  (ms per step)")  # fmt: skip
    for a, b in pair_rows(ours.rows, theirs.rows if theirs else []):
        name = a.name if a else f"(torch) {b.name}"
        if a and b:
            name = f"{a.name} / {b.name}"
        print(
            f"{name[:38]:<38} {_ms(a and a.forward_s)} {_ms(a and a.backward_s)} "
            f"{_ms(b and b.forward_s)} {_ms(b and b.backward_s)}"
            + (f" {_ms(_gpu(a))} {_ms(_gpu(b))}" if gpu else "")
        )

    def line(label: str, get: Callable[[Breakdown], float | None]) -> None:
        print(f"{label:<38} {_ms(get(ours)):>19} {'':9} {_ms(get(theirs) if theirs else None)}")

    def sides(b: Breakdown) -> tuple[float, float]:
        return sum(r.forward_s for r in b.rows), sum(r.backward_s for r in b.rows)

    print(f"{'layers, sum':<38} {_ms(sides(ours)[0])} {_ms(sides(ours)[1])} "
          f"{_ms(theirs and sides(theirs)[0])} {_ms(theirs and sides(theirs)[1])}")  # fmt: skip
    if gpu:
        line("layers, device time (CUDA events)", lambda b: b.layers_gpu_s)
    line("loss (forward + backward)", lambda b: b.loss_s)
    line("optimizer update", lambda b: b.update_s)
    line("other (outside leaf layers)", lambda b: b.other_s)
    line("step, instrumented (= sum)", lambda b: b.step_s)
    line("step, not instrumented (median)", lambda b: b.plain_step_s)
    if theirs is None:
        print("torch: n/a (torch, or its reference model for this network, not installed)")


def main_profile(args: argparse.Namespace) -> int:
    """Print the per-layer profile of args.model (the parsed `bench compute` options)."""
    try:
        ours = profile_hpcdl(args)
    except backend.BackendError as exc:
        print(f"hpcdl.bench compute: {exc}", file=sys.stderr)
        return 2
    time.sleep(0.3)  # let hpcdl's BLAS threads stop spin-waiting before torch's start
    theirs = None if args.no_torch else profile_torch(args)
    print(
        f"{args.model} batch {args.batch_size} input {args.input_shape} {args.precision} on "
        f"{args.device}: "
        f"per-layer profile, mean of the faster half of {args.steps} steps after {WARMUP} "
        "warm-up steps"
    )
    print_table(ours, theirs)
    if args.json:
        result = {
            **run_config(args),
            "gpu_kernels": args.gpu_kernels,
            "profile": {"hpcdl": ours.as_json(), "torch": theirs and theirs.as_json()},
        }
        print(json.dumps(result))
    return 0
