"""`python -m hpcdl.bench compute`: ms per training step of hpcdl.nn vs PyTorch, same run.

A step is forward + softmax cross-entropy + backward + SGD-momentum update on a random batch
(hpcdl: hpcdl.nn.step.train_step, the step hpcdl.train runs), for the same architecture (cnn = the
Keras cifar10_cnn network; resnet18/resnet50 = torchvision's, written out in
hpcdl.bench.torch_models) on the same device. PyTorch is optional (benchmark-only): without it
the torch column is null. With --json the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from hpcdl import backend, nn
from hpcdl.bench.compute_setup import hpcdl_stepper, run_config, set_threads, torch_stepper
from hpcdl.bench.kernel_profile import main_kernel_profile
from hpcdl.bench.profile import main_profile
from hpcdl.helpformat import HelpFormatter


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m hpcdl.bench compute",
        description=__doc__,
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--model", default="cnn", choices=nn.MODELS, help="network to time")
    ap.add_argument("--batch-size", type=int, default=64, help="samples per step")
    ap.add_argument("--input-shape", default="3,32,32", help="C,H,W of one synthetic sample")
    ap.add_argument("--classes", type=int, default=10, help="output classes of the network")
    ap.add_argument("--device", default="cpu", choices=("cpu", "gpu"), help="cpu or gpu (CuPy)")
    ap.add_argument(
        "--steps", type=int, default=20, help="timed steps per framework (after 3 warm-up steps)"
    )
    ap.add_argument(
        "--chunk",
        type=int,
        default=0,
        help="interleave the frameworks in turns of this many steps (default 0: each runs "
        "all its steps alone, the best case for both)",
    )
    ap.add_argument(
        "--precision",
        default="fp32",
        choices=nn.precision.PRECISIONS,
        help="hpcdl --precision (docs/precision.md) against PyTorch autocast to the same format "
        "(fp16: with GradScaler) (default: fp32)",
    )
    ap.add_argument(
        "--gpu-kernels",
        action="store_true",
        help="hpcdl's opt-in fast kernels (hpcdl.nn.kernels; hpcdl.train --gpu-kernels)",
    )
    ap.add_argument(
        "--tf32",
        action="store_true",
        help="float32 convolutions and GEMMs on TF32 tensor cores, in both frameworks (hpcdl: "
        "with --gpu-kernels; hpcdl.train --tf32); without it both compute IEEE float32 (PyTorch's "
        "own default would run its convolutions in TF32)",
    )
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="ms per layer, forward and backward, plus loss and update (hpcdl.bench.profile)",
    )
    ap.add_argument(
        "--kernel-profile",
        action="store_true",
        help="device time per CUDA kernel of the step as it runs, from torch.profiler (CUPTI); "
        "off a GPU, PyTorch's CPU ops (hpcdl.bench.kernel_profile)",
    )
    ap.add_argument("--json", action="store_true", help="last line: one JSON object")
    return ap


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        args.shape = tuple(int(v) for v in args.input_shape.split(","))
        if len(args.shape) != 3:
            raise ValueError
    except ValueError:
        ap.error(f"--input-shape must be C,H,W (three integers), got {args.input_shape!r}")
    if args.batch_size < 1 or args.steps < 1 or args.chunk < 0:
        ap.error("--batch-size and --steps must be >= 1 and --chunk >= 0")
    if args.kernel_profile and args.profile:
        ap.error("--kernel-profile and --profile are two profiles of the step: ask for one")
    if args.profile and args.precision == "fp16":
        ap.error("--profile times fp32 and bf16 steps (fp16's loss scaler may skip one)")
    if args.tf32 and not args.gpu_kernels:  # else the row would set TF32 against IEEE
        ap.error("--tf32 needs --gpu-kernels: hpcdl's plain kernels compute IEEE float32")
    return args


def time_interleaved(
    steppers: list, steps: int, chunk: int = 5, pause_s: float = 0.3
) -> list[list[float]]:
    """Seconds per step for each (step, sync), after 3 warm-up steps each.

    The frameworks take turns in chunks of `chunk` steps, so background load on a shared
    machine affects both alike. Each turn starts after `pause_s` so that the other framework's
    thread pool (OpenBLAS, OpenMP spin-waiting for up to ~200 ms) has gone to sleep and does
    not steal cores from this one.
    """
    for step, sync in steppers:
        for _ in range(3):
            step()
        sync()
    times: list[list[float]] = [[] for _ in steppers]
    while len(times[0]) < steps:
        for (step, sync), out in zip(steppers, times):
            time.sleep(pause_s)
            for _ in range(min(chunk, steps - len(out))):
                t0 = time.perf_counter()
                step()
                sync()
                out.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.threads = set_threads(args.device, with_torch=not args.no_torch)
    if args.profile or args.kernel_profile:  # parse_args refuses both at once
        return (main_profile if args.profile else main_kernel_profile)(args)
    try:
        steppers = [hpcdl_stepper(args)]
    except backend.BackendError as exc:
        print(f"hpcdl.bench compute: {exc}", file=sys.stderr)
        return 2
    torch_step = None if args.no_torch else torch_stepper(args)
    if torch_step is not None:
        steppers.append(torch_step)
    timed = time_interleaved(steppers, args.steps, chunk=args.chunk or args.steps)
    ours, theirs = timed[0], (timed[1] if torch_step is not None else None)
    ours_ms = statistics.median(ours) * 1e3
    theirs_ms = statistics.median(theirs) * 1e3 if theirs else None
    ratio = ours_ms / theirs_ms if theirs_ms else None
    where = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    print(
        f"{args.model} batch {args.batch_size} input {args.input_shape} {args.precision}"
        f"{' (TF32 in both)' if args.tf32 else ''} on "
        f"{args.device} ({where}), median of {args.steps} steps"
        + (f", interleaved in turns of {args.chunk}" if args.chunk else "")
    )
    print(f"  hpcdl  {ours_ms:8.1f} ms/step")
    if theirs_ms is None:
        print("  torch       n/a (torch not installed, or --no-torch)")
    else:
        print(f"  torch  {theirs_ms:8.1f} ms/step   ratio hpcdl/torch {ratio:.2f}")
    graph = steppers[0][0].graph_state()
    if graph is not None:
        print(f"  CUDA graph of the step: {graph}")
    memory = peak_memory_mib(args.device, torch_step is not None, steppers[0][0].pool_bytes())
    if memory:
        print(
            f"  peak GPU memory: hpcdl {memory['hpcdl_peak_mib']:.0f} MiB (CuPy's pools), torch "
            + (
                "n/a"
                if memory["torch_peak_mib"] is None
                else f"{memory['torch_peak_mib']:.0f} MiB (caching allocator, reserved)"
            )
        )
    if args.json:
        result = {
            **run_config(args),
            "chunk": args.chunk or args.steps,
            "gpu_kernels": args.gpu_kernels,
            "step_graph": graph,
            "hpcdl_ms_per_step": round(ours_ms, 3),
            "torch_ms_per_step": None if theirs_ms is None else round(theirs_ms, 3),
            "ratio": None if ratio is None else round(ratio, 3),
            "hpcdl_images_per_s": round(args.batch_size / ours_ms * 1e3, 1),
            "torch_images_per_s": None
            if theirs_ms is None
            else round(args.batch_size / theirs_ms * 1e3, 1),
            **memory,
        }
        print(json.dumps(result))
    return 0


def peak_memory_mib(device: str, with_torch: bool, graph_bytes: int = 0) -> dict[str, float | None]:
    """Peak GPU memory of each framework after the timed steps (empty on CPU), in MiB.

    Both hold what they allocate in a caching pool and return nothing to the driver unless
    asked, so CuPy's pools after the run are hpcdl's high-water mark: its default pool and
    graph_bytes, what a captured step's own pool holds (every allocation of the capture: the
    step's activations; StepGraph.pool_bytes), also given alone. The PyTorch peer is
    torch.cuda.max_memory_reserved() (the peak of what PyTorch's allocator held), with
    max_memory_allocated() beside it."""
    if device != "gpu":
        return {}
    import cupy  # noqa: PLC0415

    mib = float(1 << 20)
    pools = cupy.get_default_memory_pool().total_bytes() + graph_bytes
    result: dict[str, float | None] = {
        "hpcdl_peak_mib": round(pools / mib, 1),
        "hpcdl_graph_pool_mib": round(graph_bytes / mib, 1),
        "torch_peak_mib": None,
        "torch_peak_allocated_mib": None,
    }
    if with_torch:
        import torch  # noqa: PLC0415

        result["torch_peak_mib"] = round(torch.cuda.max_memory_reserved() / mib, 1)
        result["torch_peak_allocated_mib"] = round(torch.cuda.max_memory_allocated() / mib, 1)
    return result
