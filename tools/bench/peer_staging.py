"""`python -m tools.bench peer-staging`: the peer tier on emulated nodes (issue 35).

One emulated cluster (tools.bench.cluster, needs root) with the slow FUSE file system as the
PFS (its index built before the jobs), and the same training job from empty stage dirs, in
turn: `--shuffle node`, `--shuffle global --peer-staging off`, `--shuffle global` with peers.
Per job: the slow FS's opens during the job, the stagers' own PFS opens and peer fetches (their
status maps, through the metrics' staging_nodes), the loaders' misses, each epoch's seconds;
and whether the two global jobs' final parameters are bitwise equal. The three jobs run in turn,
--rounds times, on the same machine; the table shows each figure's median over the rounds and
the peers / node ratio of later epochs per round, the figures to read (docs/PERFORMANCE.md).

The cluster model beside them: `bench calibrate` on the same emulated nodes before each round
(as `bench validate` does; or one --calibration FILE for all), then the dry run's epoch times
for each job (its --shuffle and --peer-staging, --workers 0 as the jobs run), and the median
over the rounds of measured / predicted - 1 per epoch figure: each round against the model of
its own calibration, since this machine's speed drifts over the minutes a round takes.

Each node's /local (its stage dir) is an ext4 file system of its own by default, as nodes have
disks of their own (--node-disks shared: directories on this machine's file system, whose one
journal and writeback couple the nodes; docs/PERFORMANCE.md, issue 35, "Node disks").
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.helpformat import HelpFormatter
from tools.bench.cluster import Cluster, harness_can_start
from tools.bench.slowfs import unavailable as no_fuse
from tools.bench.validate import Setup, calibrate_args, run_mpi, slow_pfs_cluster

JOBS = {  # name -> hpcdl.train flags
    "node": ("--shuffle", "node", "--peer-staging", "off"),
    "global, no peers": ("--shuffle", "global", "--peer-staging", "off"),
    "global, peers": ("--shuffle", "global", "--peer-staging", "on"),
}


def train_args(setup: Setup, mount: Path, out: Path, flags: tuple[str, ...]) -> list[str]:
    return ["-m", "hpcdl.train", "--data", str(mount), "--model", "mlp", "--workers", "0",
            "--seed", "0", "--quiet", "--metrics", str(out / "metrics.jsonl"),
            "--checkpoint-dir", str(out / "ckpt"), "--batch-size", str(setup.batch_size),
            "--epochs", str(setup.epochs), "--stage-threads", str(setup.stage_threads),
            "--stage-dir", "/local/stage", "--keep-staged", "--metrics-every", "1",
            *flags]  # fmt: skip


def run_job(cluster: Cluster, pfs: Any, setup: Setup, mount: Path, out: Path, flags) -> dict:
    """One job from empty stage dirs; its measured figures."""
    for node in cluster.nodes:
        shutil.rmtree(node.local / "stage", ignore_errors=True)
    out.mkdir()
    before = pfs.stats(settle=True)["opens"]
    run_mpi(cluster, setup, train_args(setup, mount, out, flags))
    opens = pfs.stats(settle=True)["opens"] - before
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    nodes = next(r for r in records if r["event"] == "summary")["staging_nodes"]
    epochs = [r["seconds"] for r in records if r["event"] == "epoch"]
    steps = [[r for r in records if r["event"] == "step" and r["epoch"] == e]  # every step
             for e in range(len(epochs))]  # fmt: skip
    return dict(
        epochs_s=epochs,
        data_wait_s=[sum(r["t_data"] for r in epoch) for epoch in steps],  # rank 0's
        step_median_s=[float(np.median([r["t_step"] for r in epoch])) for epoch in steps],
        step_mean_s=[float(np.mean([r["t_step"] for r in epoch])) for epoch in steps],
        fs_opens=opens,
        stager_pfs_opens=sum(n["pfs_opens"] for n in nodes),
        peer_files=sum(n["peer_files"] for n in nodes),
        peer_bytes=sum(n["peer_bytes"] for n in nodes),
        misses=sum(n["misses"] for n in nodes),
    )


def params_of(out: Path) -> np.ndarray:
    from hpcdl import checkpoint  # noqa: PLC0415

    return checkpoint.load(checkpoint.latest(out / "ckpt")).params


def predicted_epochs(
    setup: Setup, mount: Path, calib: Path, flags: tuple[str, ...], checkpoints: Path | None = None
) -> tuple[list, dict]:
    """The dry run's seconds of every epoch of this job (hpcdl.clustermodel), and its step's
    figures: the calibration's input and contention terms, the model's step. checkpoints: the
    job's --checkpoint-dir (the dry run charges a checkpoint per epoch; it writes nothing)."""
    from hpcdl import stage  # noqa: PLC0415

    saving = ["--checkpoint-dir", str(checkpoints)] if checkpoints else []
    argv = ["--dry-run", "--data", str(mount), "--calibration", str(calib), "--nodes",
            str(setup.nodes), "--ranks-per-node", str(setup.ranks_per_node), "--seed", "0",
            "--batch-size", str(setup.batch_size), "--epochs", str(setup.epochs),
            "--stage-threads", str(setup.stage_threads), "--workers", "0", "--json",
            *saving, *flags]  # fmt: skip
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if stage.main(argv) != 0:
            raise RuntimeError("hpcdl.stage --dry-run failed")
    answer = json.loads(out.getvalue().strip().splitlines()[-1])
    (prediction,) = answer["predictions"]
    compute = answer["calibration"]["compute"]
    return prediction["epoch_s"], dict(
        step_s=prediction["step_s"],
        input_s_per_sample=compute["input_s_per_sample"],
        contention_s_per_file=compute["contention_s_per_file"],
        contention_s_per_fetch=compute.get("contention_s_per_fetch"),
        checkpoint_s=compute.get("checkpoint_s", 0.0),
    )


def measure(setup: Setup, workdir: Path, given: Path | None = None) -> dict[str, Any]:
    with slow_pfs_cluster(setup, workdir) as (pfs, cluster, mount):  # the index built first
        rounds: dict[str, list[dict]] = {name: [] for name in JOBS}
        for r in range(setup.runs):  # the three jobs in turn, so that drift hits each alike
            calib = given or workdir / f"calibration-{r}.toml"
            if not given:  # each round's own: the model sees the machine as its jobs do
                run_mpi(cluster, setup, calibrate_args(setup, mount, calib))
            for k, (name, flags) in enumerate(JOBS.items()):
                out = workdir / f"job{r}-{k}"
                job = run_job(cluster, pfs, setup, mount, out, flags)
                job["model_epochs_s"], job["model_step"] = predicted_epochs(
                    setup, mount, calib, flags, out / "ckpt"
                )  # as train_args gives the job
                rounds[name].append(job)
    same = all(
        params_of(workdir / f"job{r}-1").tobytes() == params_of(workdir / f"job{r}-2").tobytes()
        for r in range(setup.runs)
    )
    jobs = {name: dict(rounds=runs) for name, runs in rounds.items()}
    return dict(setup=setup.__dict__, jobs=jobs, global_params_bitwise_equal=same)


def later(epochs: list[float]) -> float:
    """The mean of every epoch after the first."""
    return float(np.mean(epochs[1:])) if len(epochs) > 1 else float("nan")


def median_of(runs: list[dict], figure) -> float:
    return float(np.median([figure(run) for run in runs]))


def with_model(runs: list[dict], figure) -> str:
    """The figure's median over the rounds, the model's, and the median of each round's
    measured / model - 1 (a round's model is from that round's calibration)."""
    measured = median_of(runs, lambda r: figure(r["epochs_s"]))
    model = median_of(runs, lambda r: figure(r["model_epochs_s"]))
    error = median_of(runs, lambda r: figure(r["epochs_s"]) / figure(r["model_epochs_s"]) - 1)
    return f"{measured:.2f} (model {model:.2f}, {error:+.0%})"


def table(result: dict[str, Any]) -> str:
    """Each job's figures, the median over its rounds; then the peers / node ratio per round."""
    files = result["setup"]["files"]
    lines = ["| job | epoch 1 s | later epochs s | rank 0's data wait, later epochs s | stagers' "
             "PFS opens | peer fetches | loader misses | slow FS opens |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, j in result["jobs"].items():
        runs = j["rounds"]
        opens = median_of(runs, lambda r: r["stager_pfs_opens"])
        lines.append(
            f"| {name} | {with_model(runs, lambda e: e[0])} | {with_model(runs, later)} "
            f"| {median_of(runs, lambda r: later(r['data_wait_s'])):.2f} "
            f"| {opens:.0f} ({opens / files:.2f}x files) "
            f"| {median_of(runs, lambda r: r['peer_files']):.0f} "
            f"| {sum(r['misses'] for r in runs)} "
            f"| {median_of(runs, lambda r: r['fs_opens']):.0f} |"
        )
    own = result["setup"].get("node_disks")
    lines.append("nodes' /local: " + ("an ext4 file system each" if own
                                      else "directories on one file system"))  # fmt: skip
    pairs = zip(result["jobs"]["global, peers"]["rounds"], result["jobs"]["node"]["rounds"])
    ratios = [later(peers["epochs_s"]) / later(node["epochs_s"]) for peers, node in pairs]
    each = ", ".join(f"{r:.2f}" for r in ratios)
    lines.append(f"later epochs, global with peers / node, per round: {each} "
                 f"(median {np.median(ratios):.2f})")  # fmt: skip
    steps = [r["model_step"] for r in result["jobs"]["node"]["rounds"]]
    lines.append("model per round (its calibration): step ms "
                 + ", ".join(f"{m['step_s'] * 1e3:.1f}" for m in steps)
                 + "; input ms/sample " + ", ".join(f"{m['input_s_per_sample'] * 1e3:.2f}"
                                                   for m in steps)
                 + "; contention ms per copy " + ", ".join(
                     f"{m['contention_s_per_file'] * 1e3:.2f}" for m in steps)
                 + "; per fetch " + ", ".join(
                     "-" if m.get("contention_s_per_fetch") is None
                     else f"{m['contention_s_per_fetch'] * 1e3:.2f}" for m in steps)
                 + "; checkpoint ms " + ", ".join(
                     f"{m.get('checkpoint_s', 0.0) * 1e3:.0f}" for m in steps))  # fmt: skip
    lines.append(f"final parameters of the two global jobs bitwise equal in every round: "
                 f"{result['global_params_bitwise_equal']}")  # fmt: skip
    return "\n".join(lines)


def add_cluster_arguments(ap: argparse.ArgumentParser) -> None:
    """The emulated cluster and job of the peer harnesses (this one and peer-ranges)."""
    a = ap.add_argument
    a("--nodes", type=int, default=4, help="emulated nodes")
    a("--ranks-per-node", type=int, default=1, help="training ranks per node")
    a("--files", type=int, default=960, help="PNG files of the data set")
    a("--latency-ms", type=float, default=20.0, help="slow FS: ms per open")
    a("--epochs", type=int, default=4, help="training epochs")
    a("--stage-threads", type=int, default=8, help="copy threads per node")
    a("--rounds", type=int, default=3, help="times each job runs (in turn); medians are shown")


def cluster_setup(args: argparse.Namespace, link: str, node_disks: bool) -> Setup:
    """The Setup of add_cluster_arguments' flags."""
    return Setup(args.nodes, args.ranks_per_node, args.files, args.latency_ms, link,
                 epochs=args.epochs, stage_threads=args.stage_threads, runs=args.rounds,
                 node_disks=node_disks)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m tools.bench peer-staging",
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    a = ap.add_argument
    add_cluster_arguments(ap)
    a(
        "--node-disks",
        choices=("own", "shared"),
        default="own",
        help="each node's /local its own ext4 file system, as on a cluster; or directories on "
        "this machine's file system, one journal for all nodes (tools/bench/cluster.py)",
    )
    a("--calibration", help="calibration file for all rounds (default: calibrate each round)")
    a("--json", action="store_true", help="last line: one JSON object")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not harness_can_start("tools.bench peer-staging", no_fuse):
        return 2
    setup = cluster_setup(args, "", node_disks=args.node_disks == "own")
    with tempfile.TemporaryDirectory(prefix="hpcdl-peer-staging-") as scratch:
        given = Path(args.calibration).resolve() if args.calibration else None
        result = measure(setup, Path(scratch), given)
    print(table(result), flush=True)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
