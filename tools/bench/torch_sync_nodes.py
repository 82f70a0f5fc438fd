"""`python -m tools.bench torch-sync-nodes`: `bench torch-sync` across 2 emulated nodes.

Needs root. The emulated cluster of the multinode tests (tools.bench.cluster: network
namespaces on a private bridge), `--ranks-per-node` ranks on each of 2 nodes, every node's link
limited to `--rate` with a token bucket (1 Gbit/s by default, the issue's setup; `none`: the
plain veth pair). The ranks run `hpcdl.bench.torch_sync --worker`, so the four modes (local,
ddp, hvd, hvd-fp16 with `--fp16`) alternate in one job exactly as `bench torch-sync` runs them on
one node; gloo's rendezvous is node 1's address and gloo and MPI both use the nodes' eth0.
The emulated nodes share this machine's cores, so each rank gets cores / ranks threads and MPI's
waits yield (`mpi_yield_when_idle`). Prints the same table as `bench torch-sync`, plus the
machine's load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from hpcdl.bench import torch_sync
from hpcdl.bench.launch import child_env
from tools.bench.cluster import Cluster, harness_can_start

PROG = "python -m tools.bench torch-sync-nodes"


def build_parser() -> argparse.ArgumentParser:
    parser = torch_sync.build_parser()
    parser.prog = PROG
    parser.description = __doc__.split("\n")[0]
    parser.set_defaults(ranks=1)
    for action in parser._actions:
        if action.dest == "ranks":
            action.help = "ranks on each of the 2 emulated nodes"
    parser.add_argument("--rate", default="1gbit", help="tbf rate of every node's link, or none")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    unknown = [m for m in args.models.split(",") if m not in torch_sync.SHAPES]
    if unknown:
        print(
            f"{PROG}: --models {','.join(unknown)}: choose from resnet20, resnet50", file=sys.stderr
        )
        return 2
    if not harness_can_start(PROG):
        return 2
    nodes = 2
    env = child_env(nodes * args.ranks, "cpu")
    env["GLOO_SOCKET_IFNAME"] = "eth0"
    with tempfile.TemporaryDirectory(prefix="hpcdl-torch-sync-nodes-") as tmp:
        with Cluster(Path(tmp), nodes=nodes) as cluster:
            if args.rate != "none":
                cluster.limit_links(args.rate)
            args.rendezvous = cluster.node(1).ip
            program = torch_sync.worker_argv(args)
            extra = ("--mca", "mpi_yield_when_idle", "1")
            command = cluster.mpirun([args.ranks] * nodes, *program, extra=extra)
            before = os.getloadavg()[0]
            done = cluster.run(1, command, timeout=args.timeout, env=env)
            after = os.getloadavg()[0]
    if done.returncode != 0:
        tail = (done.stdout[-1000:] + done.stderr[-2000:]).strip()
        print(f"{PROG}: the ranks failed (status {done.returncode}):\n{tail}", file=sys.stderr)
        return 1
    rows = torch_sync.summarise(json.loads(done.stdout.strip().splitlines()[-1]), args)
    where = f"2 emulated nodes x {args.ranks} ranks, links {args.rate}"
    torch_sync.print_rows(rows, args, where)
    print(f"  load average {before:.1f} before, {after:.1f} after; {os.cpu_count()} cores")
    return 0
