"""The step `bench compute` times, built from its arguments, in both frameworks.

hpcdl: hpcdl_setup (the model with SGD momentum and a fixed random batch: StepParts for
hpcdl.nn.step.train_step). PyTorch: torch_setup, the same network (hpcdl.bench.torch_models for
the torchvision ResNets), optimizer and batch shape; torch is imported only inside the functions
that run it (hpcdl.bench sits above hpcdl.torch in the layers, docs/internals.md). `bench
compute`, its `--profile` (hpcdl.bench.profile) and `bench calibrate` all build their step here,
so the three time one step.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcdl import backend, nn
from hpcdl.comm import blas_threads
from hpcdl.nn.kernels import cudnn_graphs
from hpcdl.nn.step import StepParts, train_step
from hpcdl.nn.step_graph import StepGraph


def tf32(args: argparse.Namespace) -> bool:
    """Whether both frameworks' float32 runs on TF32 tensor cores: --tf32, or HPCDL_TF32=1 as
    hpcdl.train reads it (NOTE [TF32] in hpcdl/nn/kernels/__init__.py)."""
    return bool(getattr(args, "tf32", False)) or nn.kernels.tf32()


def hpcdl_setup(args: argparse.Namespace) -> tuple[StepParts, Any, Any]:
    """(step parts, images, labels): the model with SGD momentum and a fixed random batch."""
    xp = backend.select(args.device)
    if getattr(args, "gpu_kernels", False):
        nn.kernels.enable(True)
    nn.kernels.allow_tf32(tf32(args))  # NOTE [TF32]
    model = nn.build_model(args.model, args.shape, args.classes, seed=0, xp=xp)
    model.set_precision(args.precision)
    opt = nn.make_optimizer("sgd", model.params, model.grads, momentum=0.9)
    rng = np.random.default_rng(0)
    x = xp.asarray(rng.standard_normal((args.batch_size, *args.shape)).astype(np.float32))
    y = xp.asarray(rng.integers(0, args.classes, args.batch_size))
    scaler = nn.precision.LossScaler() if args.precision == "fp16" else None
    graph = StepGraph() if getattr(args, "gpu_kernels", False) else None
    return StepParts(model, opt, xp, scaler=scaler, graph=graph), x, y


def hpcdl_stepper(args: argparse.Namespace):
    """(step, sync) for one hpcdl training step on a fixed random batch; step.graph_state()
    says whether its steps replayed a CUDA graph (graph_state), step.pool_bytes() what that
    graph's own memory pool holds."""
    parts, x, y = hpcdl_setup(args)
    xp = parts.xp

    def step() -> None:
        train_step(parts, x, y, 0.01)

    step.graph_state = lambda: graph_state(parts, x)  # type: ignore[attr-defined]
    # what the step graph's own pool holds (0 without one): part of hpcdl's peak memory
    step.pool_bytes = lambda: parts.graph.pool_bytes() if parts.graph else 0  # type: ignore[attr-defined]
    return step, lambda: backend.synchronize(xp)


def graph_state(parts: StepParts, images: Any) -> str | None:
    """Whether the step replays a CUDA graph: "captured"; "off: why" when --gpu-kernels asked
    for one and the step ran plainly; None without --gpu-kernels (no graph asked for)."""
    graph = parts.graph
    if graph is None:
        return None
    if graph.graphs:
        return "captured"
    return f"off: {graph.why_not(parts, images) or 'not captured'}"


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
    from hpcdl.torch_engine.device import set_fp32_precision, use_channels_last  # noqa: PLC0415

    set_fp32_precision(tf32(args))  # hpcdl's float32 arithmetic (NOTE [TF32])
    # HPCDL_CUDNN_AUTOTUNE times hpcdl's engines: PyTorch's benchmark mode times its own
    torch.backends.cudnn.benchmark = nn.kernels.autotune() > 1
    device = "cuda" if args.device == "gpu" else "cpu"
    model = model.to(device).train()
    x = torch.randn(args.batch_size, *args.shape, device=device)
    # On a GPU, convolutions in channels_last: NHWC as hpcdl's arrays are, and PyTorch's fast
    # layout on tensor cores (as the end-to-end baseline and hpcdl.train's torch engine run)
    args.torch_channels_last = use_channels_last(model, torch.device(device))
    if args.torch_channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    return TorchSetup(
        torch=torch,
        device=device,
        model=model,
        opt=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        x=x,
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
        "tf32": tf32(args),  # both frameworks' float32: TF32, else IEEE
        "torch_channels_last": getattr(args, "torch_channels_last", None),  # None: no torch
        # engines timed per convolution in both frameworks (NOTE [engine autotuning]), and
        # what hpcdl's cuDNN plans run (None: no plan, e.g. without --gpu-kernels)
        "cudnn_autotune": nn.kernels.autotune(),
        "half_wgrad": nn.kernels.half_wgrad(),  # bf16/fp16 weight gradients in the format
        "cudnn_plans": cudnn_graphs.plan_report() if args.device == "gpu" else None,
    }
