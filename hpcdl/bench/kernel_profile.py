"""`python -m hpcdl.bench compute --kernel-profile`: device time per CUDA kernel, hpcdl vs PyTorch.

NOTE [kernel profile]
The per-layer profile (hpcdl.bench.profile) synchronises the device around every layer, so a
layer's row holds its host launch time as well as its kernels, and a CUDA graph replay, which
calls no layer, cannot be split at all. This profile leaves the step alone and asks the driver
instead. Both sides are built as the plain `bench compute` builds them (hpcdl_stepper,
torch_stepper). Each runs --steps plain steps, then each runs --steps steps under
`torch.profiler.profile(activities=[CPU, CUDA])`, synchronised before the recording stops;
every phase starts with 3 warm-up steps and a sync, as time_interleaved's, so hpcdl's step is
captured and replayed as the bench runs it. torch.profiler records device activity through
CUPTI, which sees every kernel launched in the process: CuPy's and cuDNN's kernels launched by
hpcdl, and the kernels a CUDA graph replays. So one recorder measures both sides: which
kernels, how many, how long.

Three details of the recording (Recorder.record). The profiler's schedule runs one step with
the recorder on before the recorded ones and drops it: CUPTI starts there, and a session can
lose kernels at its very start. The plain phases run before any profile, since CUPTI, once set
up, may stay attached and slow launches. Before CUDA 12.6 CUPTI crashes when it is set up again
after a teardown with CUDA graphs about (hpcdl's step is one, and each side is a session), so
there the teardown is switched off, as torch.profiler does for its own graphs.

What is kept: the profiler's events on the CUDA device whose activity is a kernel, a memcpy or
a memset (kineto's "kernel", "gpu_memcpy", "gpu_memset"), each with its device duration. Other
device events are counted, not summed: "gpu_user_annotation" spans (record_function ranges
mirrored on the device, e.g. PyTorch's optimizer step) overlap the kernels they contain.

Figures per side: wall ms per step without the profiler and under it (sync included;
recording PyTorch's CPU ops costs its host a few us per op, hpcdl's replayed step has no torch
ops to record); device ms per step (the kernels' durations summed, so kernels that overlap on
two streams count twice); kernels and memcpy/memset per step; busy = device ms / profiled wall
ms, near 1 when the GPU is the bottleneck, well below 1 when the host is (it launches too
slowly to keep the GPU fed). Then the top kernels by time and the sums by group
(kernel_group, a table of name patterns).

Off a GPU (or with a torch without CUDA) no device activity is asked for. PyTorch's side then
lists its CPU ops by self CPU time in the same table ("device": "cpu"), and hpcdl's side, whose
NumPy work torch.profiler cannot see, gives its wall time, no kernels and a note saying why.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hpcdl import backend
from hpcdl.bench.compute_setup import hpcdl_stepper, run_config, torch_stepper

WARMUP = 3  # steps before the profile, as time_interleaved warms up
TOP = 25  # kernels listed per side
NAME_CHARS = 90  # a kernel's name is cut to this many characters in the table and the JSON
DEVICE_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")  # kineto's names of the kept activities
MEMORY_KINDS = ("gpu_memcpy", "gpu_memset")

# (group, pattern over the kernel's full demangled name), first match wins: a convolution's
# "implicit_gemm" must land before gemm, an optimizer's and a reduction's cupy_* kernels before
# the elementwise catch-all. The names follow each library's habits (the test lists examples):
# cuDNN's sm90_xmma_{fprop,dgrad,wgrad}_* and cudnn::bn_fw_*, cuBLAS's sm90_xmma_gemm_* and
# ampere_bf16_s16816gemm_*, PyTorch's at::native::*_kernel<...>, CuPy's cupy_<ufunc>__<dtypes>,
# hpcdl's hpcdl_<name>; off a GPU, PyTorch's CPU ops (aten::*). A name no pattern knows is
# "other", and the top-kernel table shows it by name.
GROUP_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (group, re.compile(pattern, re.IGNORECASE))
    for group, pattern in (
        ("memcpy/memset", r"^mem(cpy|set)\b"),
        (
            "convolution",
            r"conv(?!ert)|fprop|dgrad|wgrad|implicit_gemm|implicit_precomp|winograd|fft"
            r"|im2col|col2im",
        ),
        (
            "gemm",
            r"gemm|gemv|cublas|cutlass|matmul|splitkreduce|aten::(add|b)?mm\b|aten::linear",
        ),
        ("optimizer", r"multi_tensor|_foreach_|sgd|adam|momentum|optimizer"),
        ("batchnorm/norm", r"(?<![a-z])bn_|batch_?norm|norm(?!al)"),
        ("pooling", r"pool"),
        (
            "reduction",
            r"reduce|reduction|softmax|nll_loss|cross_entropy|logsumexp"
            r"|cupy_(sum|mean|max|min|argmax|argmin|prod|var|all|any)(_|$)",
        ),
        (
            "elementwise/copy",
            r"elementwise|vectorized|unrolled|cupy_|copy|transpose|cast|fill|nchwtonhwc"
            r"|nhwctonchw|convert|dropout|relu|clamp|threshold|aten::(add|sub|mul|div)_?$",
        ),
    )
)
GROUPS = (  # as the tables list them: compute first, then data movement and the rest
    "convolution",
    "gemm",
    "batchnorm/norm",
    "pooling",
    "reduction",
    "elementwise/copy",
    "optimizer",
    "memcpy/memset",
    "other",
)


def kernel_group(name: str) -> str:
    """The group of a kernel (or, off a GPU, a PyTorch CPU op) by its name: one of GROUPS."""
    for group, pattern in GROUP_PATTERNS:
        if pattern.search(name):
            return group
    return "other"


def short_name(name: str, chars: int = NAME_CHARS) -> str:
    """A kernel's demangled name on one line, cut to `chars` ("void " and repeated spaces go)."""
    name = " ".join(name.split())
    name = name.removeprefix("void ")
    return name if len(name) <= chars else name[: chars - 3] + "..."


class Activity(NamedTuple):
    """One recorded kernel, memcpy or memset (or, off a GPU, one CPU op) of a profile."""

    name: str  # full demangled name
    kind: str  # "kernel", "gpu_memcpy", "gpu_memset"; "cpu_op" off a GPU
    us: float  # device duration; a CPU op's self CPU time


def recorded_activities(events: Iterable[Any], cuda: bool) -> tuple[list[Activity], Counter]:
    """The activities a profile keeps from torch.profiler's events (FunctionEvent), and a count
    by activity type of the device events it leaves out (NOTE [kernel profile]).

    cuda: the device kernels, memcpys and memsets, each with its device duration. Else the CPU
    ops (not user annotations) with their self CPU time."""
    from torch.autograd import DeviceType  # noqa: PLC0415 (torch only where it runs)

    kept: list[Activity] = []
    skipped: Counter = Counter()
    for event in events:
        kind = event.activity_type
        if cuda:
            if event.device_type != DeviceType.CUDA:
                continue
            if kind in DEVICE_KINDS:
                kept.append(Activity(event.name, kind, float(event.time_range.elapsed_us())))
            else:
                skipped[str(kind)] += 1
        elif event.device_type == DeviceType.CPU and kind == "cpu_op":
            kept.append(Activity(event.name, kind, float(event.self_cpu_time_total)))
    return kept, skipped


@dataclass(frozen=True)
class KernelRow:
    """One kernel name's totals over the profiled steps."""

    name: str
    group: str
    calls: int
    us: float

    def as_json(self, steps: int, total_us: float) -> dict[str, Any]:
        return {
            "name": short_name(self.name),
            "group": self.group,
            "calls_per_step": round(self.calls / steps, 2),
            "ms_per_step": round(self.us / steps / 1e3, 4),
            "share": round(self.us / total_us, 4) if total_us else None,
        }


def kernel_rows(activities: Sequence[Activity]) -> list[KernelRow]:
    """Activities summed by full name, the most time first."""
    calls: Counter = Counter()
    us: Counter = Counter()
    for a in activities:
        calls[a.name] += 1
        us[a.name] += a.us
    rows = [KernelRow(name, kernel_group(name), calls[name], us[name]) for name in calls]
    return sorted(rows, key=lambda r: (-r.us, r.name))


def group_us(activities: Sequence[Activity]) -> dict[str, float]:
    """Microseconds per group (GROUPS order, groups with no activity left out)."""
    sums: Counter = Counter()
    for a in activities:
        sums[kernel_group(a.name)] += a.us
    return {group: sums[group] for group in GROUPS if group in sums}


@dataclass(frozen=True)
class SideProfile:
    """What one framework's profiled steps recorded (NOTE [kernel profile])."""

    side: str  # "hpcdl" or "torch"
    device: str  # where the side ran: "cuda" (device activities) or "cpu" (CPU ops' self time)
    steps: int
    wall_s: float | None  # the profiled steps, sync included; None: no torch, no profile
    plain_wall_s: float  # as many steps without the profiler (run before any profile)
    activities: tuple[Activity, ...] = ()
    skipped: dict[str, int] = field(default_factory=dict)  # device events left out, by type
    note: str | None = None  # why the side lists no kernels, when it lists none

    @property
    def listed(self) -> bool:
        """Whether the profiler could see this side's work (hpcdl's NumPy it cannot)."""
        return self.note is None or bool(self.activities)

    def ms_per_step(self, us: float) -> float:
        return us / self.steps / 1e3

    def as_json(self) -> dict[str, Any]:
        """The side's figures per step (ms), its top kernels and its groups, for --json."""
        wall_ms = None if self.wall_s is None else self.wall_s / self.steps * 1e3
        result: dict[str, Any] = {
            "device": self.device,
            "wall_ms_per_step": None if wall_ms is None else round(wall_ms, 3),
            "plain_wall_ms_per_step": round(self.plain_wall_s / self.steps * 1e3, 3),
            "kernel_ms_per_step": None,
            "kernels_per_step": None,
            "memops_per_step": None,
            "busy": None,
            "distinct_kernels": 0,
            "kernels": [],
            "groups": {},
            "skipped_device_events": dict(self.skipped),
            "note": self.note,
        }
        if not self.listed:
            return result
        total = sum(a.us for a in self.activities)
        memops = sum(a.kind in MEMORY_KINDS for a in self.activities)
        rows = kernel_rows(self.activities)
        result.update(
            kernel_ms_per_step=round(self.ms_per_step(total), 3),
            kernels_per_step=round((len(self.activities) - memops) / self.steps, 2),
            memops_per_step=round(memops / self.steps, 2),
            busy=round(self.ms_per_step(total) / wall_ms, 3) if wall_ms else None,
            distinct_kernels=len(rows),
            kernels=[row.as_json(self.steps, total) for row in rows[:TOP]],
            groups={
                g: round(self.ms_per_step(us), 4) for g, us in group_us(self.activities).items()
            },
        )
        return result


def run_steps(step: Callable[[], Any], sync: Callable[[], Any], steps: int) -> float:
    """Seconds for `steps` steps and the sync that ends them."""
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return time.perf_counter() - t0


@dataclass(frozen=True)
class Recorder:
    """What torch.profiler can record in this run: the same for both sides."""

    torch: Any  # the torch module; None where it is not installed
    device: str  # where the steps run: "cuda" or "cpu"
    cuda: bool  # whether torch can record the GPU's activity (CUPTI)

    @classmethod
    def for_run(cls, args: argparse.Namespace) -> Recorder:
        """The recorder for `bench compute` options: CUDA activity only on a GPU run."""
        try:
            import torch  # noqa: PLC0415
        except ImportError:
            torch = None
        device = "cuda" if args.device == "gpu" else "cpu"
        cuda = device == "cuda" and torch is not None and torch.cuda.is_available()
        if cuda and _before_cuda_12_6(torch):
            # torch.profiler's own rule for CUDA graphs before CUDA 12.6: CUPTI crashes when
            # it is set up again after a teardown, and hpcdl's step is a graph; two sessions
            os.environ["DISABLE_CUPTI_LAZY_REINIT"] = "1"
            os.environ["TEARDOWN_CUPTI"] = "0"
        return cls(torch, device, cuda)

    def unseen(self, side: str) -> str | None:
        """Why the profiler cannot list what this side's steps run, or None when it can."""
        if self.torch is None:
            return "torch is not installed: torch.profiler cannot record what the steps run"
        if self.device == "cuda" and not self.cuda:
            return "this torch has no CUDA: torch.profiler cannot record the GPU's kernels"
        if self.device == "cpu" and side == "hpcdl":
            return "hpcdl runs NumPy on the CPU, which torch.profiler cannot see: no kernels listed"
        return None

    def record(self, stepper: tuple, steps: int) -> tuple[float, Any]:
        """(wall seconds, the stopped profiler) of `steps` steps under torch.profiler.

        One step before them runs with the recorder on and is dropped (the schedule's warm-up
        step): CUPTI starts there, and a session can lose kernels at its very start. The last
        step is synchronised before the schedule stops the recording."""
        from torch.profiler import ProfilerActivity, profile, schedule  # noqa: PLC0415

        step, sync = stepper
        wanted = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        plan = schedule(wait=0, warmup=1, active=steps, repeat=1)
        with profile(activities=wanted, schedule=plan) as prof:
            run_steps(step, sync, 1)
            prof.step()  # warm-up -> recording
            t0 = time.perf_counter()
            for _ in range(steps - 1):
                step()
                prof.step()
            wall_s = run_steps(step, sync, 1) + time.perf_counter() - t0
            prof.step()  # recording -> stopped, the trace collected
        return wall_s, prof


def _before_cuda_12_6(torch: Any) -> bool:
    from torch.torch_version import TorchVersion  # noqa: PLC0415

    return TorchVersion(torch.version.cuda or "0.0") < "12.6"


def profile_side(
    side: str, stepper: tuple, steps: int, plain_s: float, rec: Recorder
) -> SideProfile:
    """The SideProfile of `steps` steps under torch.profiler beside `plain_s`, the seconds of
    as many steps without it (NOTE [kernel profile])."""
    why = rec.unseen(side)
    if rec.torch is None:
        return SideProfile(side, rec.device, steps, None, plain_s, note=why)
    wall_s, prof = rec.record(stepper, steps)
    if why is not None:
        return SideProfile(side, rec.device, steps, wall_s, plain_s, note=why)
    kept, skipped = recorded_activities(prof.events(), rec.cuda)
    if rec.cuda and not kept:
        why = "the profiler recorded no kernel, memcpy or memset on the GPU in these steps"
    return SideProfile(side, rec.device, steps, wall_s, plain_s, tuple(kept), dict(skipped), why)


def profile_both(args: argparse.Namespace) -> tuple[list[SideProfile], str | None]:
    """Build both sides as `bench compute` does; time each without the profiler, then profile
    each; with the hpcdl step's graph_state (whether it replayed a CUDA graph).

    Every phase of a side starts with WARMUP steps and a sync of that side, after a pause that
    lets the other side's BLAS/OpenMP threads stop spin-waiting (time_interleaved's). The plain
    phases come first: CUPTI, once set up, can stay attached and slow launches afterwards."""
    ours = hpcdl_stepper(args)  # raises backend.BackendError where the device is missing
    theirs = None if args.no_torch else torch_stepper(args)
    steppers = [("hpcdl", ours)] + ([("torch", theirs)] if theirs is not None else [])
    rec = Recorder.for_run(args)

    def warm(step: Callable[[], Any], sync: Callable[[], Any]) -> None:
        time.sleep(0.3)
        run_steps(step, sync, WARMUP)

    plain = {}
    for side, (step, sync) in steppers:
        warm(step, sync)
        plain[side] = run_steps(step, sync, args.steps)
    sides = []
    for side, (step, sync) in steppers:
        warm(step, sync)
        sides.append(profile_side(side, (step, sync), args.steps, plain[side], rec))
    return sides, ours[0].graph_state()


def _side_line(p: SideProfile, graph: str | None) -> str:
    d = p.as_json()
    head = f"{p.side}: {d['plain_wall_ms_per_step']:.2f} ms/step wall without the profiler"
    if d["wall_ms_per_step"] is not None:
        head += f", {d['wall_ms_per_step']:.2f} under it"
    if p.side == "hpcdl" and graph is not None:
        head += f"; CUDA graph of the step: {graph}"
    if not p.listed:
        return f"{head}\n  {p.note}"
    what = "device kernels" if p.device == "cuda" else "CPU ops (self time)"
    per = "kernels" if p.device == "cuda" else "ops"
    line = (
        f"{head}\n  {what} {d['kernel_ms_per_step']:.2f} ms/step (busy {d['busy']:.2f}), "
        f"{d['kernels_per_step']:g} {per}"
        + (f" + {d['memops_per_step']:g} memcpy/memset" if d["memops_per_step"] else "")
        + f" per step, {d['distinct_kernels']} distinct"
    )
    if p.skipped:
        line += f"; left out: {', '.join(f'{n} {k}' for k, n in sorted(p.skipped.items()))}"
    return line + (f"\n  {p.note}" if p.note else "")


def print_side(p: SideProfile, graph: str | None) -> None:
    """One side's headline and its top kernels (ms/step, calls/step, share, group, name)."""
    print(_side_line(p, graph))
    rows = p.as_json()["kernels"]
    if not rows:
        return
    print(f"  {'ms/step':>8}  {'calls':>7}  {'share':>6}  {'group':<16}  name")
    for r in rows:
        share = f"{100 * r['share']:.1f}%" if r["share"] is not None else "-"
        print(
            f"  {r['ms_per_step']:8.3f}  {r['calls_per_step']:7g}  {share:>6}  "
            f"{r['group']:<16}  {r['name']}"
        )


def print_groups(sides: list[SideProfile]) -> None:
    """hpcdl beside PyTorch by group, with the ratio hpcdl/torch, then the totals and the wall."""
    by_side = {p.side: p.as_json() for p in sides}
    ours, theirs = by_side.get("hpcdl"), by_side.get("torch")
    if ours is None or theirs is None or not (ours["groups"] or theirs["groups"]):
        return

    def cell(value: float | None) -> str:
        return f"{value:10.3f}" if value is not None else f"{'-':>10}"

    def line(label: str, a: float | None, b: float | None) -> None:
        ratio = f"{a / b:7.2f}" if a is not None and b else f"{'-':>7}"
        print(f"  {label:<18}{cell(a)}{cell(b)}  {ratio}")

    print(f"  {'group (ms/step)':<18}{'hpcdl':>10}{'torch':>10}  {'ratio':>7}")
    for group in GROUPS:
        a, b = ours["groups"].get(group), theirs["groups"].get(group)
        if a is not None or b is not None:
            line(group, a, b)
    line("all recorded", ours["kernel_ms_per_step"], theirs["kernel_ms_per_step"])
    line("wall (profiled)", ours["wall_ms_per_step"], theirs["wall_ms_per_step"])
    line("wall (plain)", ours["plain_wall_ms_per_step"], theirs["plain_wall_ms_per_step"])


def main_kernel_profile(args: argparse.Namespace) -> int:
    """Print the kernel profile of args.model (the parsed `bench compute` options)."""
    try:
        sides, graph = profile_both(args)
    except backend.BackendError as exc:
        print(f"hpcdl.bench compute: {exc}", file=sys.stderr)
        return 2
    what = "device time per kernel" if sides[0].device == "cuda" else "CPU time per op"
    print(
        f"{args.model} batch {args.batch_size} input {args.input_shape} {args.precision}"
        f"{' --gpu-kernels' if args.gpu_kernels else ''} on {args.device}: {what} "
        f"(torch.profiler), {args.steps} steps after {WARMUP} warm-up steps"
    )
    for p in sides:
        print_side(p, graph)
    if len(sides) == 1:
        print("torch: not run (torch not installed, or --no-torch)")
    print_groups(sides)
    if args.json:
        by_side = {p.side: p.as_json() for p in sides}
        result = {
            "kind": "kernel_profile",
            **run_config(args),
            "gpu_kernels": args.gpu_kernels,
            "step_graph": graph,
            "hpcdl": by_side["hpcdl"],
            "torch": by_side.get("torch"),
        }
        print(json.dumps(result))
    return 0
