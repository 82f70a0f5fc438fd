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
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcdl import backend, nn
from hpcdl.comm import blas_threads
from hpcdl.helpformat import HelpFormatter
from hpcdl.nn.step import StepParts, train_step


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
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="ms per layer, forward and backward, plus loss and update (hpcdl.bench.profile)",
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
    if args.profile and args.precision != "fp32":
        ap.error("--profile times fp32 steps only; leave out --precision")
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


def hpcdl_setup(args: argparse.Namespace) -> tuple[StepParts, Any, Any]:
    """(step parts, images, labels): the model with SGD momentum and a fixed random batch."""
    xp = backend.select(args.device)
    model = nn.build_model(args.model, args.shape, args.classes, seed=0, xp=xp)
    model.set_precision(args.precision)
    opt = nn.make_optimizer("sgd", model.params, model.grads, momentum=0.9)
    rng = np.random.default_rng(0)
    x = xp.asarray(rng.standard_normal((args.batch_size, *args.shape)).astype(np.float32))
    y = xp.asarray(rng.integers(0, args.classes, args.batch_size))
    scaler = nn.precision.LossScaler() if args.precision == "fp16" else None
    return StepParts(model, opt, xp, scaler=scaler), x, y


def hpcdl_stepper(args: argparse.Namespace):
    """(step, sync) for one hpcdl training step on a fixed random batch."""
    parts, x, y = hpcdl_setup(args)
    xp = parts.xp

    def step() -> None:
        train_step(parts, x, y, 0.01)

    return step, lambda: backend.synchronize(xp)


def torch_model(torch: Any, name: str, shape: tuple[int, int, int], classes: int):
    """The same architecture in PyTorch (NCHW), following the rules of hpcdl.nn.models."""
    tnn = torch.nn
    c, h, w = shape
    if name == "mlp":
        return tnn.Sequential(
            tnn.Flatten(),
            tnn.Linear(c * h * w, 512),
            tnn.ReLU(),
            tnn.Dropout(0.2),
            tnn.Linear(512, classes),
        )
    if name == "cnn":
        layers: list[Any] = []
        for filters in (32, 64):
            pad = (int(h < 3), int(w < 3))
            layers += [tnn.Conv2d(c, filters, 3, padding=1), tnn.ReLU()]
            layers += [tnn.Conv2d(filters, filters, 3, padding=pad), tnn.ReLU()]
            h, w = h + 2 * pad[0] - 2, w + 2 * pad[1] - 2
            pool = (min(2, h), min(2, w))
            if pool != (1, 1):
                layers.append(tnn.MaxPool2d(pool))
                h, w = h // pool[0], w // pool[1]
            layers.append(tnn.Dropout(0.25))
            c = filters
        return tnn.Sequential(
            *layers,
            tnn.Flatten(),
            tnn.Linear(c * h * w, 512),
            tnn.ReLU(),
            tnn.Dropout(0.5),
            tnn.Linear(512, classes),
        )
    if name in ("resnet18", "resnet50"):
        from hpcdl.bench.torch_models import imagenet_resnet  # noqa: PLC0415 (needs torch)

        return imagenet_resnet(name, c, classes)
    return _torch_resnet20(torch, c, classes)


def _torch_resnet20(torch: Any, c: int, classes: int):
    tnn = torch.nn

    class Block(tnn.Module):
        def __init__(self, c_in: int, c_out: int, stride: int) -> None:
            super().__init__()
            self.conv1 = tnn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
            self.bn1 = tnn.BatchNorm2d(c_out)
            self.conv2 = tnn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
            self.bn2 = tnn.BatchNorm2d(c_out)
            self.stride, self.pad = stride, (c_out - c_in) // 2

        def forward(self, x):
            out = torch.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            short = x[:, :, :: self.stride, :: self.stride]
            if self.pad:
                short = tnn.functional.pad(short, (0, 0, 0, 0, self.pad, self.pad))
            return torch.relu(out + short)

    layers: list[Any] = [tnn.Conv2d(c, 16, 3, 1, 1, bias=False), tnn.BatchNorm2d(16), tnn.ReLU()]
    c_in = 16
    for stage, width in enumerate((16, 32, 64)):
        for block in range(3):
            layers.append(Block(c_in, width, 2 if stage > 0 and block == 0 else 1))
            c_in = width
    layers += [tnn.AdaptiveAvgPool2d(1), tnn.Flatten(), tnn.Linear(64, classes)]
    return tnn.Sequential(*layers)


@dataclass
class TorchSetup:
    """The PyTorch side of one benchmark step: the model, SGD momentum, a random batch, loss."""

    torch: Any
    device: str  # "cuda" or "cpu"
    model: Any
    opt: Any
    x: Any
    y: Any
    loss_fn: Any
    precision: str = "fp32"
    scaler: Any = None  # fp16: torch.amp.GradScaler

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def step(self) -> None:
        """One step; bf16/fp16: forward and loss under autocast, fp16 with GradScaler."""
        self.opt.zero_grad(set_to_none=False)
        dtype = {"bf16": self.torch.bfloat16, "fp16": self.torch.float16}.get(self.precision)
        with self.torch.autocast(self.device, dtype=dtype, enabled=dtype is not None):
            loss = self.loss_fn(self.model(self.x), self.y)
        if self.scaler is None:
            loss.backward()
            self.opt.step()
            return
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()


def torch_setup(args: argparse.Namespace) -> TorchSetup | None:
    """The same network, optimizer and batch shape as hpcdl's in PyTorch (seeded, in train
    mode), or None when torch (or the reference model) is not importable."""
    try:
        import torch  # noqa: PLC0415

        torch.manual_seed(0)
        model = torch_model(torch, args.model, args.shape, args.classes)
    except ImportError:
        return None
    device = "cuda" if args.device == "gpu" else "cpu"
    model = model.to(device).train()
    return TorchSetup(
        torch=torch,
        device=device,
        model=model,
        opt=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        x=torch.randn(args.batch_size, *args.shape, device=device),
        y=torch.randint(0, args.classes, (args.batch_size,), device=device),
        loss_fn=torch.nn.CrossEntropyLoss(),
        precision=args.precision,
        scaler=torch.amp.GradScaler(device) if args.precision == "fp16" else None,
    )


def torch_stepper(args: argparse.Namespace):
    """(step, sync) for the same step in PyTorch, or None when torch is not importable."""
    t = torch_setup(args)
    if t is None:
        return None

    return t.step, t.sync


def set_threads(device: str, with_torch: bool) -> int:
    """The threads both frameworks compute on, said once: on CPU, the cores of this process's
    affinity mask (or OMP_NUM_THREADS), hpcdl's convolutions split over them with a one-thread
    BLAS as hpcdl.train does (hpcdl.comm.blas_threads), and torch's intra-op pool the same
    (torch is imported only when it will run: with_torch)."""
    mine = blas_threads.affinity()
    choice = blas_threads.choose(mine, [mine], os.environ)
    if device == "cpu":
        pool = blas_threads.use_layer_threads(choice.threads)
        print(blas_threads.describe(choice, pool, [choice.threads], "here"), flush=True)
    if with_torch:
        try:
            import torch  # noqa: PLC0415

            torch.set_num_threads(choice.threads)
        except ImportError:
            pass
    return choice.threads


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """What a --json result says about the run: model, batch, input, device, steps, threads."""
    return {
        "model": args.model,
        "batch_size": args.batch_size,
        "input_shape": list(args.shape),
        "device": args.device,
        "steps": args.steps,
        "threads": args.threads,
        "precision": args.precision,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.threads = set_threads(args.device, with_torch=not args.no_torch)
    if args.profile:
        from hpcdl.bench.profile import main_profile  # noqa: PLC0415

        return main_profile(args)
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
        f"{args.model} batch {args.batch_size} input {args.input_shape} {args.precision} on "
        f"{args.device} "
        f"({where}), median of {args.steps} steps"
        + (f", interleaved in turns of {args.chunk}" if args.chunk else "")
    )
    print(f"  hpcdl  {ours_ms:8.1f} ms/step")
    if theirs_ms is None:
        print("  torch       n/a (torch not installed, or --no-torch)")
    else:
        print(f"  torch  {theirs_ms:8.1f} ms/step   ratio hpcdl/torch {ratio:.2f}")
    if args.json:
        result = {
            **run_config(args),
            "chunk": args.chunk or args.steps,
            "hpcdl_ms_per_step": round(ours_ms, 3),
            "torch_ms_per_step": None if theirs_ms is None else round(theirs_ms, 3),
            "ratio": None if ratio is None else round(ratio, 3),
        }
        print(json.dumps(result))
    return 0
