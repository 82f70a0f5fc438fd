"""PyTorch DDP (gloo) + DataLoader on an HDF5 data set: the peer of `tools.bench train --vs-torch`.

    mpirun -np R python -m tools.bench.torch_ddp --data DIR --port P --model cnn \
        --batch-size B --workers K --prefetch S --epochs E --augment crop4+flip

What a PyTorch user writes for hpcdl's job, on the same terms: the ranks are started by the
same mpirun (so they get the same core binding), find each other over TCP on 127.0.0.1:P
(`init_process_group("gloo")`, rank and size from Open MPI's environment), and train the
reference model of `bench compute` (hpcdl.bench.compute_setup.torch_model) wrapped in
DistributedDataParallel, with SGD momentum 0.9 at lr 0.01 (hpcdl.train's defaults) and
softmax cross-entropy. Data: hpcdl's HDF5 shards (N, H, W, C) uint8 with `mean`/`std`
attributes, read one sample at a time with h5py in each worker (handles opened lazily per
worker), cropP (zero padding, random crop) and flip per sample in NumPy, normalised to float32
(C, H, W). DataLoader: `num_workers=K`, `prefetch_factor=S/K` (hpcdl's S slots per rank),
`persistent_workers` (hpcdl's workers live across epochs), DistributedSampler with shuffling and
drop_last. Threads: torch's intra-op pool follows OMP_NUM_THREADS, which the launcher sets as it
does for hpcdl's ranks. An epoch is timed from asking for its first batch to its last step, as
hpcdl.train times it. Rank 0 prints one JSON object last. Needs torch; hpcdl never imports
this module.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.bench.launch import child_env, mpirun_command
from hpcdl.data.augment import parse_augment
from hpcdl.helpformat import HelpFormatter


class HDF5Samples:
    """Map-style data set over hpcdl's HDF5 shards: sample i = (float32 (C, H, W), label)."""

    def __init__(self, root: Path, pad: int, flip: bool, seed: int = 0) -> None:
        import h5py  # noqa: PLC0415

        self.shards = sorted(root.glob("*.h5")) if root.is_dir() else [root]
        self.starts, labels = [0], []
        for shard in self.shards:
            with h5py.File(shard, "r") as f:
                labels.append(np.asarray(f["labels"], np.int64))
                self.starts.append(self.starts[-1] + len(labels[-1]))
                if shard == self.shards[0]:
                    mean = np.asarray(f.attrs["mean"], np.float32)
                    std = np.asarray(f.attrs["std"], np.float32)
        self.labels = np.concatenate(labels)
        self.scale = (1.0 / std)[:, None, None]
        self.bias = (-mean / std)[:, None, None]
        self.pad, self.flip, self.seed = pad, flip, seed
        self.files: list[Any] = []  # opened by the process that reads (each worker)
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        import h5py  # noqa: PLC0415
        import torch  # noqa: PLC0415

        if not self.files:
            self.files = [h5py.File(s, "r")["images"] for s in self.shards]
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        x = self.files[k][i - self.starts[k]]  # (H, W, C) uint8
        h, w, _ = x.shape
        if self.pad:
            p = self.pad
            x = np.pad(x, ((p, p), (p, p), (0, 0)))
            top, left = self.rng.integers(0, 2 * p + 1, 2)
            x = x[top : top + h, left : left + w]
        if self.flip and self.rng.random() < 0.5:
            x = x[:, ::-1]
        out = np.empty((x.shape[2], h, w), np.float32)
        np.multiply(x.transpose(2, 0, 1), self.scale, out=out, dtype=np.float32)
        out += self.bias
        return torch.from_numpy(out), int(self.labels[i])


def seed_worker(worker_id: int) -> None:
    """Give each DataLoader worker its own augmentation stream."""
    import torch.utils.data  # noqa: PLC0415

    info = torch.utils.data.get_worker_info()
    info.dataset.rng = np.random.default_rng([info.dataset.seed, info.seed % 2**32])


def make_loader(args: argparse.Namespace, rank: int, size: int):
    """(DataLoader, DistributedSampler, sample shape (C, H, W), classes) for this rank."""
    import torch  # noqa: PLC0415
    from torch.utils.data import DataLoader, DistributedSampler  # noqa: PLC0415

    aug = parse_augment(args.augment)
    ds = HDF5Samples(Path(args.data), aug.pad, aug.flip)
    sampler = DistributedSampler(ds, size, rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(
        ds,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.workers,
        drop_last=True,
        persistent_workers=args.workers > 0,
        prefetch_factor=max(1, args.prefetch // args.workers) if args.workers else None,
        worker_init_fn=seed_worker,
        generator=torch.Generator().manual_seed(rank),
    )
    shape = tuple(ds[0][0].shape)
    return loader, sampler, shape, int(ds.labels.max()) + 1


def train(args: argparse.Namespace) -> dict[str, Any] | None:
    """Train on this rank; rank 0 returns the epochs' seconds and images, the others None."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

    from hpcdl.bench.compute_setup import torch_model  # noqa: PLC0415

    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", 0))
    size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", 1))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=size
    )
    try:
        loader, sampler, shape, classes = make_loader(args, rank, size)
        torch.manual_seed(0)
        model = DistributedDataParallel(torch_model(torch, args.model, shape, classes).train())
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        loss_fn = torch.nn.CrossEntropyLoss()
        seconds, steps = [], []
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            start, n = time.perf_counter(), 0
            for x, y in loader:
                opt.zero_grad(set_to_none=False)
                loss = loss_fn(model(x), y)
                loss.backward()
                opt.step()
                loss.item()  # hpcdl.train checks every step's loss too
                n += 1
            seconds.append(time.perf_counter() - start)
            steps.append(n)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None
    return {
        "epoch_seconds": seconds,
        "epoch_images": [n * args.batch_size * size for n in steps],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for the gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def command_args(args: argparse.Namespace, data: str, port: int) -> list[str]:
    """The worker's command line (after `mpirun -np R python`) for `bench train` options."""
    return [
        "-m", "tools.bench.torch_ddp", "--data", data, "--port", str(port),
        "--model", args.model, "--batch-size", str(args.batch_size),
        "--workers", str(args.workers), "--prefetch", str(args.prefetch),
        "--epochs", str(args.epochs), "--augment", args.augment,
    ]  # fmt: skip


def steady_images_per_s(seconds: list[float], images: list[float]) -> float:
    """Global images/s over the epochs after the first (over the only one when there is one)."""
    skip = 1 if len(seconds) > 1 else 0
    return sum(images[skip:]) / sum(seconds[skip:])


def run(args: argparse.Namespace, data: str) -> dict[str, Any]:
    """`mpirun ... tools.bench.torch_ddp` with `bench train` options: rank 0's record, with
    its steady-state images/s."""
    cmd = mpirun_command(args.ranks) + [sys.executable, *command_args(args, data, free_port())]
    env = child_env(args.ranks, "cpu")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one node: no host name lookup, no other NIC
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"tools.bench.torch_ddp exited with {done.returncode}:\n{tail}")
    result = json.loads(lines[-1])
    result["images_per_s"] = steady_images_per_s(result["epoch_seconds"], result["epoch_images"])
    return result


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m tools.bench.torch_ddp",
        description=__doc__.split("\n")[0],
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--data", required=True, help="HDF5 file or shard directory (required)")
    ap.add_argument("--port", type=int, required=True, help="TCP port of the rendezvous")
    ap.add_argument("--model", default="cnn", help="network (bench compute_setup.torch_model)")
    ap.add_argument("--batch-size", type=int, default=64, help="samples per step and rank")
    ap.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank")
    ap.add_argument("--prefetch", type=int, default=4, help="batches in flight per rank")
    ap.add_argument("--epochs", type=int, default=3, help="passes over the data")
    ap.add_argument("--augment", default="none", help="none, or cropP and/or flip joined by +")
    ap.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = train(args)
    if result is not None:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
