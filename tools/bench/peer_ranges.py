"""`python -m tools.bench peer-ranges`: tar shards on emulated nodes, whole shards or pieces
from their homes (issue 62, hpcdl.staging.pieces).

One emulated cluster (tools.bench.cluster, needs root) with the slow FUSE file system as the
PFS, holding the PNG data set as WebDataset tar shards (`hpcdl.data convert folder --to tar`,
the index built before the jobs), and the same `--shuffle global` training job with the peer
tier from empty stage dirs, in turn: `--peer-ranges off` (a node fetches every shard its plan
touches whole from its home) and `--peer-ranges on` (a node fetches its own samples' bytes of a
shard homed elsewhere, one piece each), --rounds times. Per job: each epoch's seconds, the
bytes and fetches the nodes took from peers, the stagers' PFS opens, the slow FS's opens and the
loaders' misses (status maps through the metrics' staging_nodes), and whether the two jobs'
final parameters are bitwise equal. The table shows the medians over the rounds and the pieces /
whole ratios per round (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.helpformat import HelpFormatter
from tools.bench.cluster import harness_can_start
from tools.bench.peer_staging import (
    add_cluster_arguments,
    cluster_setup,
    later,
    params_of,
    run_job,
)
from tools.bench.slowfs import unavailable as no_fuse
from tools.bench.validate import Setup, slow_pfs_cluster

JOBS = {  # name -> hpcdl.train flags
    "whole shards": ("--shuffle", "global", "--peer-staging", "on", "--peer-ranges", "off"),
    "pieces": ("--shuffle", "global", "--peer-staging", "on", "--peer-ranges", "on"),
}


def measure(setup: Setup, shards: int, workdir: Path) -> dict[str, Any]:
    with slow_pfs_cluster(setup, workdir, shards=shards) as (pfs, cluster, mount):
        rounds: dict[str, list[dict]] = {name: [] for name in JOBS}
        for r in range(setup.runs):  # the jobs in turn, so that drift hits each alike
            for k, (name, flags) in enumerate(JOBS.items()):
                job = run_job(cluster, pfs, setup, mount, workdir / f"job{r}-{k}", flags)
                rounds[name].append(job)
    same = all(
        params_of(workdir / f"job{r}-0").tobytes() == params_of(workdir / f"job{r}-1").tobytes()
        for r in range(setup.runs)
    )
    data_bytes = sum(f.stat().st_size for f in (workdir / "shards").glob("*.tar"))
    return dict(setup=setup.__dict__, shards=shards, data_bytes=data_bytes,
                jobs={name: dict(rounds=runs) for name, runs in rounds.items()},
                params_bitwise_equal=same)  # fmt: skip


def table(result: dict[str, Any]) -> str:
    """Each job's medians over its rounds; then pieces / whole shards per round."""
    lines = ["| job | epoch 1 s | later epochs s | MB from peers | peer fetches | stagers' PFS "
             "opens | slow FS opens | loader misses |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip

    def med(runs: list[dict], figure) -> float:
        return float(np.median([figure(run) for run in runs]))

    for name, job in result["jobs"].items():
        runs = job["rounds"]
        lines.append(
            f"| {name} | {med(runs, lambda r: r['epochs_s'][0]):.2f} "
            f"| {med(runs, lambda r: later(r['epochs_s'])):.2f} "
            f"| {med(runs, lambda r: r['peer_bytes']) / 1e6:.2f} "
            f"| {med(runs, lambda r: r['peer_files']):.0f} "
            f"| {med(runs, lambda r: r['stager_pfs_opens']):.0f} "
            f"| {med(runs, lambda r: r['fs_opens']):.0f} | {sum(r['misses'] for r in runs)} |"
        )
    pairs = list(zip(result["jobs"]["pieces"]["rounds"], result["jobs"]["whole shards"]["rounds"]))
    for what, figure in (("epoch 1", lambda r: r["epochs_s"][0]),
                         ("later epochs", lambda r: later(r["epochs_s"])),
                         ("bytes from peers", lambda r: r["peer_bytes"])):  # fmt: skip
        ratios = [figure(p) / max(figure(w), 1e-9) for p, w in pairs]
        each = ", ".join(f"{x:.2f}" for x in ratios)
        lines.append(f"{what}, pieces / whole shards, per round: {each} "
                     f"(median {np.median(ratios):.2f})")  # fmt: skip
    lines.append(f"data set: {result['shards']} shards, {result['data_bytes'] / 1e6:.1f} MB; "
                 f"final parameters bitwise equal in every round: "
                 f"{result['params_bitwise_equal']}")  # fmt: skip
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m tools.bench peer-ranges",
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    a = ap.add_argument
    add_cluster_arguments(ap)
    a("--shards", type=int, default=8, help="tar shards the PNG files are written to")
    a("--link", default="", help="every node's link, e.g. 100mbit (tc rate; default: not limited)")
    a("--json", action="store_true", help="last line: one JSON object")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not harness_can_start("tools.bench peer-ranges", no_fuse):
        return 2
    setup = cluster_setup(args, args.link, node_disks=True)
    with tempfile.TemporaryDirectory(prefix="hpcdl-peer-ranges-") as scratch:
        result = measure(setup, args.shards, Path(scratch))
    print(table(result), flush=True)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
