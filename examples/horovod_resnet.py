"""A Horovod-style PyTorch script on hpcdl: `import hpcdl.torch as hvd` is the migration
(docs/horovod.md), and hpcdl.torch.Loader feeds it with node-local staging (docs/torch.md).

    python -m hpcdl.data convert digits digits
    mpirun -np 2 python examples/horovod_resnet.py --data digits/train --epochs 3 \\
        --stage-dir /tmp/stage
    srun -n 8 python examples/horovod_resnet.py --data /pfs/imagenet --stage-dir $SLURM_TMPDIR

mpirun or srun start the ranks (no torch.distributed, no rendezvous): the collectives are
MPI's, through mpi4py. The model is a CIFAR-style ResNet (3 stages of --blocks basic blocks,
--width channels doubling per stage; 3 blocks and 16 channels: ResNet-20). The learning rate
is scaled by the number of ranks, as Horovod's examples do. Rank 0 prints one line per epoch
and one JSON object last, with a checksum of the parameters that every rank agreed on.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

import hpcdl.torch as hvd


def block(c_in: int, c_out: int, stride: int, norm) -> nn.Module:
    """A basic residual block: two 3x3 convolutions and a shortcut."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False),
                norm(c_out),
                nn.ReLU(),
                nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False),
                norm(c_out),
            )
            self.shortcut = nn.Sequential()
            if stride != 1 or c_in != c_out:
                self.shortcut = nn.Sequential(
                    nn.Conv2d(c_in, c_out, 1, stride, bias=False), norm(c_out)
                )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.body(x) + self.shortcut(x))

    return Block()


def resnet(shape: tuple[int, int, int], classes: int, blocks: int, width: int, norm) -> nn.Module:
    """CIFAR-style ResNet for (C, H, W) inputs (He et al. 2016, section 4.2)."""
    layers: list[nn.Module] = [
        nn.Conv2d(shape[0], width, 3, 1, 1, bias=False),
        norm(width),
        nn.ReLU(),
    ]
    c = width
    for stage in range(3):
        for i in range(blocks):
            out = width * 2**stage
            layers.append(block(c, out, 2 if stage and i == 0 else 1, norm))
            c = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes)]
    return nn.Sequential(*layers)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    with hvd.Loader(
        args.data,
        args.batch_size,
        epochs=args.epochs,
        workers=args.workers,
        seed=args.seed,
        augment=args.augment,
        stage_dir=args.stage_dir,
    ) as loader:
        norm = hvd.SyncBatchNorm if args.sync_bn else nn.BatchNorm2d
        model = resnet(
            loader.sample_shape, loader.dataset.num_classes, args.blocks, args.width, norm
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
        compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
        optimizer = hvd.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), compression=compression
        )
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        losses = [train_epoch(model, optimizer, loader, epoch) for epoch in range(args.epochs)]
        stats = loader.stats()
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    agreed = len(set(hvd.allgather_object(round(checksum, 6)))) == 1
    if hvd.rank() == 0:
        print(
            json.dumps(
                {
                    "ranks": hvd.size(),
                    "losses": losses,
                    "checksum": checksum,
                    "ranks_agree": agreed,
                    "stats": stats,
                }
            ),
            flush=True,
        )
    return 0


def train_epoch(model: nn.Module, optimizer, loader, epoch: int) -> float:
    """One epoch; returns the mean loss over every rank's batches."""
    model.train()
    loader.set_epoch(epoch)
    total, start = torch.zeros(2), time.perf_counter()
    for images, labels in loader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        total += torch.tensor([loss.item(), 1.0])
    total = hvd.allreduce(total, op=hvd.Sum, name=f"epoch{epoch}.loss")
    mean = float(total[0] / total[1])
    if hvd.rank() == 0:
        print(f"epoch {epoch}: loss {mean:.4f}, {time.perf_counter() - start:.1f} s", flush=True)
    return mean


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--data", required=True, help="HDF5 or tar shards, or an image folder (required)"
    )
    ap.add_argument("--epochs", type=int, default=3, help="passes over the data")
    ap.add_argument("--stage-dir", help="node-local directory to stage into (default: none)")
    ap.add_argument("--batch-size", type=int, default=32, help="samples per step and rank")
    ap.add_argument("--workers", type=int, default=2, help="loader processes per rank")
    ap.add_argument("--augment", default="none", help="hpcdl.train --augment, e.g. crop4+flip")
    ap.add_argument("--lr", type=float, default=0.05, help="learning rate per rank (x ranks)")
    ap.add_argument("--seed", type=int, default=0, help="model initialisation and sample order")
    ap.add_argument("--blocks", type=int, default=3, help="basic blocks per stage (3: ResNet-20)")
    ap.add_argument("--width", type=int, default=16, help="channels of the first stage")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--sync-bn", action="store_true", help="hvd.SyncBatchNorm over all ranks")
    ap.add_argument("--fp16-allreduce", action="store_true", help="Compression.fp16")
    return ap


if __name__ == "__main__":
    raise SystemExit(main())
