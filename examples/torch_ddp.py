"""A plain PyTorch DDP ResNet training script whose data come through hpcdl (docs/torch.md).

    python -m hpcdl.data convert digits digits
    torchrun --nproc-per-node 2 examples/torch_ddp.py --data digits/train --epochs 3 \\
        --stage-dir /tmp/stage
    mpirun -np 2 python examples/torch_ddp.py --data digits/train --epochs 3   # reads in place
    torchrun --nproc-per-node 2 examples/torch_ddp.py --data digits/train --dataloader

torchrun, mpirun or srun start the ranks; gloo on CPU, NCCL on GPU (one GPU per local rank).
hpcdl.torch.Loader yields each rank's batches as torch tensors: with --stage-dir the node's
stager copies the data to node-local disk ahead of need, without it the loader reads the data
in place. --dataloader trains with torch's own DataLoader instead, in hpcdl's sample order and
with hpcdl's per-sample work (hpcdl.torch.HpcdlSampler, HpcdlSamples), so both reach the same
parameters. The model is a CIFAR-style ResNet (3 stages of --blocks basic blocks, --width
channels doubling per stage; 3 blocks and 16 channels: ResNet-20; `--model linear` is one dense
layer, for benchmarks of the input pipeline). Rank 0 prints one line per epoch and one JSON
object last; --save writes its final state dict.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import hpcdl.torch

# Where the launchers put the rank and the world size, when torchrun's variables are absent.
LAUNCHER_VARS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),  # mpirun
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),  # srun
)


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet(channels: int, classes: int, blocks: int = 3, width: int = 16) -> nn.Module:
    layers: list[nn.Module] = [
        nn.Conv2d(channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
    ]  # fmt: skip
    c_in = width
    for stage in range(3):
        c_out = width * 2**stage
        for b in range(blocks):
            layers.append(BasicBlock(c_in, c_out, 2 if stage and b == 0 else 1))
            c_in = c_out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, classes)]
    return nn.Sequential(*layers)


def build_model(name: str, shape: tuple, classes: int, blocks: int, width: int) -> nn.Module:
    """--model resnet; linear: one dense layer, for input-pipeline benchmarks where the step
    should cost next to nothing (tools.bench train --torch-loader); or FILE.py:FN /
    package.module:FN, a builder FN(input_shape, num_classes) of an nn.Module, as
    `hpcdl.train --model` takes it (tools.bench train --torch-engine)."""
    if ":" in name:
        from hpcdl.nn.user_models import load_builder  # noqa: PLC0415

        return load_builder(name)(tuple(shape), classes)
    if name == "linear":
        return nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(shape).prod()), classes))
    return resnet(shape[0], classes, blocks, width)


def init_distributed() -> torch.device:
    """Join the job (env:// rendezvous; mpirun and srun variables mapped onto torchrun's)."""
    env = os.environ
    for rank, size, local in LAUNCHER_VARS:
        if "RANK" not in env and rank in env:
            env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"] = env[rank], env[size], env[local]
    env.setdefault("RANK", "0")
    env.setdefault("WORLD_SIZE", "1")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", "29500")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(env.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def train(args, model, loader, sampler, device) -> dict:
    """The loop; `sampler` is what set_epoch goes to. Rank 0's epoch times and images."""
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    seconds, images = [], []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        start, n = time.perf_counter(), 0
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            n += len(y)
        seconds.append(time.perf_counter() - start)
        images.append(n * dist.get_world_size())
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f}, {seconds[-1]:.2f} s", flush=True)
    return {"epoch_seconds": seconds, "images_per_epoch": images}


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.model not in ("resnet", "linear") and ":" not in args.model:
        ap.error(f"--model {args.model!r}: give resnet, linear or FILE.py:FN")
    if args.save and os.path.lexists(args.save):  # every rank, before the job starts
        ap.error(f"--save {args.save} exists; give a new file name (it is never replaced)")
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    if args.dataloader:  # torch's DataLoader, in hpcdl's order and with its per-sample work
        samples = hpcdl.torch.HpcdlSamples(args.data, args.augment, args.seed)
        sampler = hpcdl.torch.HpcdlSampler(len(samples), args.batch_size, rank, world, args.seed)
        loader = DataLoader(
            samples, args.batch_size, sampler=sampler, num_workers=args.workers,
            persistent_workers=args.workers > 0, pin_memory=device.type == "cuda",
        )  # fmt: skip
        classes = samples.ds.num_classes
        model = DistributedDataParallel(
            build_model(args.model, samples.shape, classes, args.blocks, args.width)
        )
        result = train(args, model.to(device), loader, sampler, device)
        stats = {}
    else:
        with hpcdl.torch.Loader(
            args.data, args.batch_size, epochs=args.epochs, workers=args.workers,
            seed=args.seed, augment=args.augment, stage_dir=args.stage_dir,
            keep_staged=args.keep_staged,
        ) as loader:  # fmt: skip
            shape, classes = loader.sample_shape, loader.dataset.num_classes
            model = DistributedDataParallel(
                build_model(args.model, shape, classes, args.blocks, args.width)
            )
            result = train(args, model.to(device), loader, loader, device)
            stats = loader.stats()
    status = 0
    if rank == 0:
        if args.save:
            status = save_new(model.module.state_dict(), args.save)
        loader_name = "dataloader" if args.dataloader else "hpcdl"
        print(json.dumps(result | {"loader": loader_name, "stats": stats}), flush=True)
    dist.destroy_process_group()
    return status


def save_new(state: dict, path: str) -> int:
    """torch.save into a new file (O_EXCL: one that appeared while training is kept); status."""
    try:
        with open(path, "xb") as f:
            torch.save(state, f)
    except FileExistsError:
        print(f"torch_ddp.py: error: --save {path} appeared while training; not replaced",
              file=sys.stderr)  # fmt: skip
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--data", required=True, help="HDF5 or tar shards, or an image folder (required)"
    )
    ap.add_argument("--epochs", type=int, default=3, help="passes over the data")
    ap.add_argument("--stage-dir", help="node-local directory to stage into (default: none)")
    ap.add_argument("--keep-staged", action="store_true", help="leave the staged copies")
    ap.add_argument("--batch-size", type=int, default=32, help="samples per step and rank")
    ap.add_argument("--workers", type=int, default=2, help="loader processes per rank")
    ap.add_argument("--augment", default="none", help="hpcdl.train --augment, e.g. crop4+flip")
    ap.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (momentum 0.9)")
    ap.add_argument("--seed", type=int, default=0, help="model initialisation and sample order")
    ap.add_argument(
        "--model",
        default="resnet",
        help="the network: resnet, linear, or FILE.py:FN (a builder of an nn.Module, as "
        "hpcdl.train --model takes)",
    )
    ap.add_argument("--blocks", type=int, default=3, help="basic blocks per stage (3: ResNet-20)")
    ap.add_argument("--width", type=int, default=16, help="channels of the first stage")
    ap.add_argument("--dataloader", action="store_true", help="torch's DataLoader instead")
    ap.add_argument(
        "--save", help="rank 0 writes the final state dict here (torch.save; a new file)"
    )
    return ap


if __name__ == "__main__":
    sys.exit(main())
