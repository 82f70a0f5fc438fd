"""`python -m tools.bench interconnect`: allreduce across emulated nodes, per link limit and MPI.

Needs root. It builds an emulated cluster (tools.bench.cluster: network namespaces on a private
bridge, nothing on the host's network), then runs `bench allreduce --json` with 2 nodes x
`--ranks-per-node` ranks inside it, once for every combination of:

- link: the plain veth pair (no limit), then each `--rates` value as a `tc tbf` qdisc on every
  node's link. Each node's egress is limited, so both directions are.
- collectives: `han` (Open MPI's hierarchical component, forced with
  `--mca coll_han_priority 100`; Open MPI 5 also picks it by default for communicators that
  span nodes) and `tuned` (`--mca coll ^han`: flat algorithms whose summation order depends only
  on rank numbers, what hpcdl's bitwise-reproducibility tests use).

For each it prints the reducer, the raw flat Allreduce, the per-array Allreduce and a two-level
(node-aware) reduction written in mpi4py, as bus bandwidth, plus the load average of the
machine before and after, since the emulated nodes share its cores. The ranks yield when idle
(`mpi_yield_when_idle`), as Open MPI does by itself on an oversubscribed node. Tear-down runs
on every path (errors, Ctrl-C, SIGTERM) and takes the namespaces, links and qdiscs with it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from hpcdl.helpformat import HelpFormatter
from tools.bench.cluster import Cluster, harness_can_start

# The emulated nodes share the machine's cores, so the ranks outnumber them; ranks that
# busy-poll then starve each other (2.6 MB/s across the link on 2 cores with 4 ranks).
# Open MPI yields by itself only when it knows it is oversubscribed, which a hostfile of
# "2 slots per node" hides from it.
YIELD = ("--mca", "mpi_yield_when_idle", "1")
COLLECTIVES = {
    "han": ("--mca", "coll_han_priority", "100"),
    "tuned": ("--mca", "coll", "^han"),
}


def run_allreduce(cluster: Cluster, ranks_per_node: int, coll: str, bench_args: list[str]) -> dict:
    """One `bench allreduce --json` across the cluster; its JSON result."""
    program = [sys.executable, "-m", "hpcdl.bench", "allreduce", "--json", *bench_args]
    slots = [ranks_per_node] * len(cluster.nodes)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    extra = (*COLLECTIVES[coll], *YIELD)
    proc = cluster.run(1, cluster.mpirun(slots, *program, extra=extra), env=env)
    if proc.returncode != 0:
        raise RuntimeError(
            f"bench allreduce ({coll}) failed with status {proc.returncode}:\n"
            + proc.stdout[-2000:]
            + proc.stderr[-3000:]
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    head = (
        f"{'link':<8}{'coll':<7}{'gradients':<15}{'MB':>7}{'flat':>8}{'reducer':>9}"
        f"{'naive':>8}{'2-level':>9}{'red/flat':>10}{'exposed':>9}{'load':>12}"
    )
    lines = [head, "bus bandwidth in GB/s; exposed: % of the raw allreduce (overlap test)"]
    for row in rows:
        overlap = row["result"]["overlap"]
        exposed = f"{overlap['exposed_fraction_of_raw'] * 100:.1f}%" if overlap else "-"
        load = f"{row['load'][0]:.1f}->{row['load'][1]:.1f}"
        for name, r in row["result"]["models"].items():
            lines.append(
                f"{row['link']:<8}{row['coll']:<7}{name:<15}{r['bytes'] / 1e6:>7.1f}"
                f"{r['flat_busbw_gbs']:>8.3f}{r['reducer_busbw_gbs']:>9.3f}"
                f"{r['naive_busbw_gbs']:>8.3f}{r['two_level_busbw_gbs'] or 0:>9.3f}"
                f"{r['reducer_busbw_gbs'] / r['flat_busbw_gbs']:>10.2f}{exposed:>9}"
                f"{load:>12}"
            )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench interconnect",
        description=__doc__.split("\n")[0],
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    a = parser.add_argument
    a("--ranks-per-node", type=int, default=2, help="MPI ranks on each of the 2 emulated nodes")
    a("--rates", default="1gbit", help="comma-separated tbf rates to test besides no limit")
    a("--colls", default="han,tuned", help=f"Open MPI collectives, from {', '.join(COLLECTIVES)}")
    a("--repeats", type=int, default=5, help="timed repetitions per case")
    a("--models", default="resnet20,resnet50_like", help="gradient lists for bench allreduce")
    a("--bucket-mb", type=float, default=25.0, help="gradient bucket size in MiB")
    a(
        "--backward-factor",
        type=float,
        default=0.0,
        help="bench allreduce's overlap test (0: off; on shared cores it measures "
        "the CPU contention more than the link)",
    )
    a("--json", action="store_true", help="also print every result as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    colls = args.colls.split(",")
    if any(c not in COLLECTIVES for c in colls):
        parser.error(f"--colls: choose from {', '.join(COLLECTIVES)}, got {args.colls!r}")
    if not harness_can_start("python -m tools.bench interconnect"):
        return 2
    bench_args = ["--repeats", str(args.repeats), "--models", args.models]
    bench_args += ["--bucket-mb", str(args.bucket_mb)]
    bench_args += ["--backward-factor", str(args.backward_factor)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="hpcdl-interconnect-") as tmp:
        with Cluster(Path(tmp), nodes=2) as cluster:
            for rate in ["none", *[r for r in args.rates.split(",") if r]]:
                if rate != "none":
                    cluster.limit_links(rate)
                for coll in colls:
                    before = os.getloadavg()[0]
                    result = run_allreduce(cluster, args.ranks_per_node, coll, bench_args)
                    load = (before, os.getloadavg()[0])
                    rows.append(dict(link=rate, coll=coll, result=result, load=load))
                    print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    print(f"2 nodes x {args.ranks_per_node} ranks, {os.cpu_count()} cores shared by all nodes")
    print(table(rows))
    if args.json:
        print(json.dumps(rows))
    return 0
