"""`python -m hpcdl.bench torch-sync`: hvd.DistributedOptimizer vs DDP (gloo), images/s.

    python -m hpcdl.bench torch-sync --ranks 2 --models resnet20,resnet50 --rounds 3

One PyTorch model trained on synthetic data (random images and labels made once, as Horovod's
pytorch_synthetic_benchmark.py does) in one mpirun job, four ways, alternated `--rounds` times
so that the load of the machine falls on each alike:
- `local`: the optimizer alone, no communication: the compute every mode pays;
- `ddp`: DistributedDataParallel over gloo (what most PyTorch users run);
- `hvd`: hpcdl.torch.DistributedOptimizer (hpcdl's buckets over MPI);
- `hvd-fp16`: the same with Compression.fp16 (`--fp16`).
Each run: `--warmup` steps, then `--steps` timed steps of SGD with momentum; a run's time is its
slowest rank's. images/s = ranks x batch x steps / time; exposed communication = step time -
`local`'s step time (what communication adds to a step, after overlap), 0 when a mode's step
came out faster than `local`'s (timing noise on a loaded machine, said under the table).
Reported: the median over rounds of each, and the ratio hvd / ddp. resnet20 is the CIFAR
ResNet-20 on 3x32x32 (He et al. 2016), resnet50 torchvision's on 3x112x112
(hpcdl.bench.torch_models). Threads: the cores are shared out among the ranks
(OMP_NUM_THREADS), and MPI's waits yield the core (`--mca mpi_yield_when_idle 1`). Needs
torch; hpcdl never imports this module.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

from hpcdl.helpformat import HelpFormatter

SHAPES = {"resnet20": (3, 32, 32), "resnet50": (3, 112, 112)}
CLASSES = {"resnet20": 10, "resnet50": 1000}


def resnet20(classes: int = 10) -> Any:
    """CIFAR ResNet-20: a 3x3 stem, 3 stages of 3 basic blocks (16, 32, 64 channels)."""
    from torch import nn  # noqa: PLC0415

    def block(c_in: int, c_out: int, stride: int) -> nn.Module:
        body = nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False),
            nn.BatchNorm2d(c_out),
            nn.ReLU(),
            nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False),
            nn.BatchNorm2d(c_out),
        )
        short = nn.Sequential()
        if stride != 1 or c_in != c_out:
            short = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )
        return _Residual(body, short)

    layers = [nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
    c = 16
    for stage, width in enumerate((16, 32, 64)):
        for i in range(3):
            layers.append(block(c, width, 2 if stage and i == 0 else 1))
            c = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, classes)]
    return nn.Sequential(*layers)


def _Residual(body: Any, short: Any) -> Any:  # noqa: N802 (a module factory)
    from torch import nn  # noqa: PLC0415

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.short = body, short

        def forward(self, x: Any) -> Any:
            return (self.body(x) + self.short(x)).relu()

    return Residual()


def build(name: str) -> Any:
    import torch  # noqa: PLC0415

    torch.manual_seed(0)
    if name == "resnet20":
        return resnet20(CLASSES[name])
    from hpcdl.bench.torch_models import imagenet_resnet  # noqa: PLC0415

    return imagenet_resnet(name, 3, CLASSES[name])


# ---------------------------------------------------------------------- the worker (each rank)


def run_mode(mode: str, name: str, batch: Any, args: argparse.Namespace, comm: Any) -> float:
    """Seconds of `--steps` steps in one mode, the slowest rank's."""
    import torch  # noqa: PLC0415

    import hpcdl.torch as hvd  # noqa: PLC0415

    model = build(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif mode.startswith("hvd"):
        fp16 = hvd.Compression.fp16 if mode == "hvd-fp16" else hvd.Compression.none
        opt = hvd.DistributedOptimizer(opt, model.named_parameters(), compression=fp16)
    images, labels = batch
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            comm.Barrier()
            start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        opt.step()
    return comm.allreduce(time.perf_counter() - start, op=_max())


def _max() -> Any:
    from mpi4py import MPI  # noqa: PLC0415

    return MPI.MAX


def worker(args: argparse.Namespace) -> None:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    import hpcdl.torch as hvd  # noqa: PLC0415

    hvd.init()
    comm = hvd.process.state().world.comm
    port = comm.bcast(_free_port(args.rendezvous) if comm.rank == 0 else None)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.rendezvous}:{port}",
        rank=comm.rank,
        world_size=comm.size,
    )
    modes = ["local", "ddp", "hvd"] + (["hvd-fp16"] if args.fp16 else [])
    records = []
    for name in args.models.split(","):
        g = torch.Generator().manual_seed(comm.rank)
        batch = (
            torch.randn(args.batch_size, *SHAPES[name], generator=g),
            torch.randint(0, CLASSES[name], (args.batch_size,), generator=g),
        )
        for r in range(args.rounds):
            for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:  # rotated: fair
                seconds = run_mode(mode, name, batch, args, comm)
                records.append({"model": name, "mode": mode, "round": r, "seconds": seconds})
    dist.destroy_process_group()
    if comm.rank == 0:
        print(json.dumps({"ranks": comm.size, "records": records}), flush=True)


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------- the driver


def summarise(out: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per model and mode: median images/s and exposed communication per step over rounds."""
    images = out["ranks"] * args.batch_size * args.steps
    rows = []
    for name in args.models.split(","):
        per_mode = {}
        for mode in dict.fromkeys(r["mode"] for r in out["records"]):
            secs = [r["seconds"] for r in out["records"] if (r["model"], r["mode"]) == (name, mode)]
            per_mode[mode] = statistics.median(secs)
        local = per_mode["local"] / args.steps
        for mode, seconds in per_mode.items():
            rows.append(
                {
                    "model": name,
                    "mode": mode,
                    "images_per_s": images / seconds,
                    "step_ms": 1e3 * seconds / args.steps,
                    # a step faster than local's is the machine's noise, not negative work
                    "exposed_comm_ms": max(0.0, 1e3 * (seconds / args.steps - local)),
                    "faster_than_local": seconds / args.steps < local,
                    "vs_ddp": per_mode["ddp"] / seconds,
                }
            )
    return rows


def drive(args: argparse.Namespace) -> int:
    from hpcdl.bench.launch import child_env, mpirun_command  # noqa: PLC0415

    # Open MPI's waits busy-poll a core; the reducer's thread waits in them beside the ranks'
    # compute, so on a node with no spare core they yield it (both modes run in this one job).
    cmd = mpirun_command(args.ranks) + ["--mca", "mpi_yield_when_idle", "1"] + worker_argv(args)
    done = subprocess.run(
        cmd, env=child_env(args.ranks, "cpu"), capture_output=True, text=True, timeout=args.timeout
    )
    if done.returncode != 0:
        print(
            f"hpcdl.bench torch-sync: the ranks failed: {done.stderr.strip()[-2000:]}",
            file=sys.stderr,
        )
        return 1
    out = json.loads(done.stdout.strip().splitlines()[-1])
    rows = summarise(out, args)
    print_rows(rows, args, f"{args.ranks} ranks")
    return 0


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The ranks' program: this module as `--worker`, with the driver's settings."""
    return [
        sys.executable,
        "-m",
        "hpcdl.bench.torch_sync",
        "--worker",
        "--models",
        args.models,
        "--batch-size",
        str(args.batch_size),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--rounds",
        str(args.rounds),
        "--rendezvous",
        args.rendezvous,
    ] + (["--fp16"] if args.fp16 else [])


def print_rows(rows: list[dict[str, Any]], args: argparse.Namespace, where: str) -> None:
    print(
        f"torch-sync: {where}, batch {args.batch_size}/rank, {args.steps} steps, "
        f"median of {args.rounds} alternated rounds"
    )
    print(
        f"  {'model':<9} {'mode':<9} {'images/s':>9} {'step ms':>8} {'exposed ms':>10} "
        f"{'vs ddp':>7}"
    )
    for r in rows:
        print(
            f"  {r['model']:<9} {r['mode']:<9} {r['images_per_s']:>9.1f} {r['step_ms']:>8.1f} "
            f"{r['exposed_comm_ms']:>10.1f} {r['vs_ddp']:>6.2f}x"
        )
    noise = [f"{r['model']} {r['mode']}" for r in rows if r["faster_than_local"]]
    if noise:
        print(
            f"  ({', '.join(noise)}: the median step came out faster than local's, which no "
            "communication can make: timing noise of a loaded machine; exposed ms shows 0)"
        )
    if args.json:
        print(json.dumps(rows))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m hpcdl.bench torch-sync",
        description=__doc__.split("\n")[0],
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--ranks", type=int, default=2, help="ranks on this node")
    ap.add_argument(
        "--models", default="resnet20,resnet50", help="comma-separated: resnet20, resnet50"
    )
    ap.add_argument("--batch-size", type=int, default=32, help="images per step and rank")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the modes")
    ap.add_argument("--fp16", action="store_true", help="also hvd with Compression.fp16")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds for the whole job")
    ap.add_argument("--json", action="store_true", help="also print the rows as JSON")
    ap.add_argument(
        "--rendezvous",
        default="127.0.0.1",
        help="rank 0's address for gloo's rendezvous (the first node's, across nodes)",
    )
    ap.add_argument(
        "--worker", action="store_true", help="run as one rank of the job (the driver starts these)"
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    for name in ("ranks", "batch_size", "steps", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    unknown = [m for m in args.models.split(",") if m not in SHAPES]
    if unknown:
        print(
            f"hpcdl.bench torch-sync: --models {','.join(unknown)}: choose from "
            f"{', '.join(SHAPES)}",
            file=sys.stderr,
        )
        return 2
    if args.worker:
        worker(args)
        return 0
    return drive(args)


if __name__ == "__main__":
    raise SystemExit(main())
