"""`python -m tools.bench validate`: the cluster model against training runs on emulated nodes.

Needs root and FUSE. For each --nodes count it builds an emulated cluster (tools.bench.cluster,
every link limited to --link with tc) and mounts the slow FUSE file system (tools.bench.slowfs,
--latency-ms per open) over a folder of small PNG images: that is the PFS. Then, in order:

1. calibrate: `bench calibrate` under mpirun across the nodes, --ranks-per-node ranks each;
2. predict: `hpcdl.stage --dry-run --calibration` for the job below (--json);
3. measure: `hpcdl.train` of an MLP with staging to each node's /local, --epochs epochs, --runs
   times (each from empty stage dirs);

and compares, against the median of the runs: epoch 1, the later epochs (mean), the staging
finish time of the busiest node's epoch-1 files, and the PFS opens of each run (the slow FS
counts every open; the index is built before the job, as a dry run leaves it cached, so the job
opens none for it). Measured staging finish: the change time of the node's staged copies
(published by link, in staging order) from its first copy to the last of epoch 1's files, plus
one open and read (the first copy's).

The design keeps the figures robust on a shared 2-core machine: the slow FS's latency sets
staging, and the tc-limited links set the step (a 6 MB gradient allreduce with Open MPI's flat
collectives, whose timings repeat where coll_han's do not), so that neither depends much on how
busy the cores are. Still, with 2 ranks on each of 4 nodes, about one run in four has an
epoch 1 that stalls for 1-6 s in a few allreduces while staging runs (8 ranks spinning in MPI,
4 stagers and the FUSE server on 2 cores; a run that reuses staged copies never does;
docs/PERFORMANCE.md, issue 26): the median of --runs runs is what the model is held to, and
every run is listed. Tear-down (mount, namespaces) runs on every path.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.bench import synthetic
from hpcdl.helpformat import HelpFormatter
from tools.bench.cluster import Cluster, harness_can_start
from tools.bench.slowfs import SlowFSOptions, mounted
from tools.bench.slowfs import unavailable as no_fuse

YIELD = ("--mca", "mpi_yield_when_idle", "1")  # emulated nodes share the cores (interconnect.py)
# Open MPI's flat collectives: coll_han's figures swing by up to 8x from run to run on the shared
# cores of emulated nodes, the flat ones repeat (docs/PERFORMANCE.md, "Interconnect across
# emulated nodes"); calibrate and job use the same, as they would on a cluster.
FLAT = ("--mca", "coll", "^han")
# A node's own disk (Setup.node_disks): the stager keeps max(5 %, 1 GiB) of a file system free
# (hpcdl-stage --default-capacity), so a few GiB, sparse; the data sets here take a few MB.
NODE_DISK_BYTES = 4 << 30
CHECKS = ("epoch1_s", "later_epoch_s", "staging_finish_s", "pfs_opens")


@dataclass(frozen=True)
class Setup:
    """One validation case: the emulated machine and the job."""

    nodes: int
    ranks_per_node: int = 2
    files: int = 960  # 32x32 RGB PNGs in 4 classes
    latency_ms: float = 100.0  # per open on the slow FS: far above the CPU time of one open
    link: str = "150mbit"  # every node's link
    batch_size: int = 8
    epochs: int = 2
    stage_threads: int = 4  # 4 nodes x 4 copy threads: fewer wake-ups among 8 ranks on 2 cores
    runs: int = 3  # training runs measured; the model is compared with their median
    node_disks: bool = False  # each node's /local its own file system (tools.bench.cluster)
    calibrate_steps: int = 30  # calibrate's --steps: each timed window of the trainer's step


def make_images(root: Path, files: int, classes: int = 4) -> Path:
    """files PNG images of 32x32 random pixels in `classes` directories."""
    pixels = synthetic.noise(np.random.default_rng(0))
    return synthetic.image_folder(root, files, pixels, classes=classes, class_dir="c{label}",
                                  name="{i:05d}")  # fmt: skip


def job_flags(setup: Setup) -> list[str]:
    return ["--batch-size", str(setup.batch_size), "--epochs", str(setup.epochs),
            "--stage-threads", str(setup.stage_threads)]  # fmt: skip


def calibrate_args(setup: Setup, mount: Path, out: Path) -> list[str]:
    return ["-m", "hpcdl.bench", "calibrate", "--data", str(mount), "--stage-dir", "/local",
            "--batch-size", str(setup.batch_size), "--classes", "4", "--files", "24",
            "--threads", str(setup.stage_threads), "--repeats", "5",
            "--steps", str(setup.calibrate_steps),
            "--checkpoint-dir", str(out.parent / "calibrate-ckpt"),  # where the jobs' go
            "--out", str(out)]  # fmt: skip


def train_args(setup: Setup, mount: Path, metrics: Path) -> list[str]:
    return ["-m", "hpcdl.train", "--data", str(mount), "--model", "mlp", "--workers", "0",
            "--seed", "0", "--quiet", "--metrics-every", "1", "--metrics", str(metrics),
            "--stage-dir", "/local/stage", "--keep-staged", *job_flags(setup)]  # fmt: skip


def run_case(setup: Setup, workdir: Path, given: Path | None = None) -> dict[str, Any]:
    """Calibrate (unless a calibration file is given), predict and measure one case."""
    with slow_pfs_cluster(setup, workdir) as (pfs, cluster, mount):
        calib = given or workdir / "calibration.toml"
        calibrated = (
            f"calibration: {given}" if given
            else run_mpi(cluster, setup, calibrate_args(setup, mount, calib))
        )  # fmt: skip
        predicted = dry_run_prediction(setup, mount, calib)
        runs = [train_once(cluster, pfs, setup, mount, workdir / f"metrics-{k}.jsonl", predicted)
                for k in range(setup.runs)]  # fmt: skip
    return dict(setup=setup.__dict__, calibration=calibrated.strip().splitlines(),
                predicted=predicted, measured=median_run(runs), runs=runs)  # fmt: skip


def train_once(
    cluster: Cluster, pfs: Any, setup: Setup, mount: Path, metrics: Path, predicted: dict
) -> dict[str, Any]:
    """One training run from empty stage dirs; its measured figures."""
    stages = [node.local / "stage" for node in cluster.nodes]
    for stage in stages:
        shutil.rmtree(stage, ignore_errors=True)
    opens_before = pfs.stats(settle=True)["opens"]
    run_mpi(cluster, setup, train_args(setup, mount, metrics))
    opens = pfs.stats(settle=True)["opens"] - opens_before
    finish = max(staging_finish(stage, predicted, setup) for stage in stages)
    return measure(metrics, opens, finish)


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each timed figure's median over the runs. The PFS opens and loader misses: those of the
    run with the most opens beyond its misses (the one the exact count is hardest on); every
    run's are listed too."""
    out: dict[str, Any] = {k: float(np.median([r[k] for r in runs]))
                           for k in ("epoch1_s", "staging_finish_s")}  # fmt: skip
    later = [r["later_epoch_s"] for r in runs if r["later_epoch_s"] is not None]
    out["later_epoch_s"] = float(np.median(later)) if later else None
    out["each_epoch1_s"] = [r["epoch1_s"] for r in runs]
    out["each_pfs_opens"] = [r["pfs_opens"] for r in runs]
    out["each_misses"] = [r["misses"] for r in runs]
    most = max(runs, key=lambda r: r["pfs_opens"] - r["misses"])
    out.update(pfs_opens=most["pfs_opens"], misses=most["misses"], hits=most["hits"])
    return out


def calibrate_only(setup: Setup, workdir: Path, out: Path) -> str:
    """Calibrate on setup.nodes emulated nodes into `out`; the calibration's summary."""
    with slow_pfs_cluster(setup, workdir, index=False) as (_, cluster, mount):
        return run_mpi(cluster, setup, calibrate_args(setup, mount, out))


@contextlib.contextmanager
def slow_pfs_cluster(
    setup: Setup, workdir: Path, index: bool = True, shards: int = 0
) -> Iterator[tuple[Any, Cluster, Path]]:
    """(pfs, cluster, mount): the setup's PNG data set in workdir behind the slow FUSE file
    system mounted at workdir/pfs (pfs: its handle, which counts opens), and setup.nodes
    emulated nodes (each with a disk of its own where setup.node_disks), every link limited to
    setup.link ("": not limited). index: the data set's
    index is built first (cached outside the read-only mount, as a dry run leaves it), so
    that what runs next opens no file for it. shards: the images as that many WebDataset tar
    shards in workdir/shards instead. Both are torn down on every path."""
    data = make_images(workdir / "images", setup.files)
    if shards:
        from hpcdl.data.convert_files import ShardSize, folder_files, write_tar  # noqa: PLC0415

        per_shard = -(-setup.files // shards)
        write_tar(folder_files(data, workdir / "shards"), workdir / "shards", ShardSize(per_shard))
        data = workdir / "shards"
    mount = workdir / "pfs"
    mount.mkdir()
    with (
        mounted(data, mount, SlowFSOptions(setup.latency_ms, 0.0)) as pfs,
        Cluster(
            workdir / "cluster",
            nodes=setup.nodes,
            disk_bytes=NODE_DISK_BYTES if setup.node_disks else 0,
        ) as cluster,
    ):
        if setup.link:
            cluster.limit_links(setup.link)
        if index:
            from hpcdl.data import open_dataset  # noqa: PLC0415

            open_dataset(mount)
        yield pfs, cluster, mount


def run_mpi(cluster: Cluster, setup: Setup, program: list[str]) -> str:
    slots = [setup.ranks_per_node] * setup.nodes
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    command = cluster.mpirun(slots, sys.executable, *program, extra=(*YIELD, *FLAT))
    proc = cluster.run(1, command, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{shlex.join(program[:3])} failed with status {proc.returncode}:\n"
            + proc.stdout[-2000:] + proc.stderr[-3000:]
        )  # fmt: skip
    return proc.stdout


def dry_run_prediction(setup: Setup, mount: Path, calib: Path) -> dict[str, Any]:
    """The dry run's JSON prediction for this case."""
    from hpcdl import stage  # noqa: PLC0415

    argv = ["--dry-run", "--data", str(mount), "--calibration", str(calib), "--nodes",
            str(setup.nodes), "--ranks-per-node", str(setup.ranks_per_node), "--seed", "0",
            "--workers", "0", "--json", *job_flags(setup)]  # fmt: skip
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = stage.main(argv)
    if status != 0:
        raise RuntimeError(f"hpcdl.stage --dry-run failed with status {status}")
    (prediction,) = json.loads(out.getvalue().strip().splitlines()[-1])["predictions"]
    return prediction


def staging_finish(stage: Path, predicted: dict[str, Any], setup: Setup) -> float:
    """Seconds from the node's staging start to its last epoch-1 file (see the docstring)."""
    times = sorted(
        os.stat(Path(d) / n).st_ctime_ns
        for d, dirs, names in os.walk(stage)
        if ".hpcdl" not in Path(d).relative_to(stage).parts
        for n in names
    )
    epoch1 = min(len(times), predicted["node_files_epoch1"])
    per_file = setup.latency_ms / 1000  # the first copy: one open of the slow FS, then a read
    return (times[epoch1 - 1] - times[0]) / 1e9 + per_file


def measure(metrics: Path, opens: int, finish: float) -> dict[str, Any]:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    epochs = [r["seconds"] for r in records if r["event"] == "epoch"]
    summary = next(r for r in records if r["event"] == "summary")
    nodes = summary.get("staging_nodes") or []
    return dict(
        epoch1_s=epochs[0],
        later_epoch_s=float(np.mean(epochs[1:])) if len(epochs) > 1 else None,
        staging_finish_s=finish,
        pfs_opens=opens,
        misses=sum(n["misses"] for n in nodes),
        hits=sum(n["hits"] for n in nodes),
        mean_step=summary["mean_step"],
    )


def compare(result: dict[str, Any]) -> dict[str, float]:
    """measured / predicted - 1 per check (pfs_opens: the difference in opens)."""
    p, m = result["predicted"], result["measured"]
    out = {k: m[k] / p[k] - 1 for k in CHECKS[:3] if m[k] is not None}
    out["pfs_opens"] = m["pfs_opens"] - p["pfs_opens_total"]
    return out


def table(results: list[dict[str, Any]]) -> str:
    lines = [f"{'nodes':>5} {'figure':>17} {'predicted':>10} {'measured':>10} {'error':>8}"]
    for r in results:
        p, m, err = r["predicted"], r["measured"], compare(r)
        for k in CHECKS:
            want = p["pfs_opens_total"] if k == "pfs_opens" else p[k]
            shown = f"{err[k]:+d}" if k == "pfs_opens" else f"{err.get(k, float('nan')):+.1%}"
            lines.append(f"{p['nodes']:>5} {k:>17} {want:>10.2f} {m[k]:>10.2f} {shown:>8}")
        reads = m["hits"] + m["misses"]
        lines.append(f"{'':>5} {'loader misses':>17} {0:>10} {m['misses']:>10} of {reads} reads")
        each = ", ".join(f"{t:.2f}" for t in m["each_epoch1_s"])
        lines.append(f"{'':>5} {'epoch 1 of each run':>17} {each}; opens {m['each_pfs_opens']}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m tools.bench validate",
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    d = Setup(nodes=2)
    a = ap.add_argument
    a("--nodes", default="2,4", help="node counts, one case each")
    a("--ranks-per-node", type=int, default=d.ranks_per_node, help="training ranks per node")
    a("--files", type=int, default=d.files, help="PNG files of the data set")
    a("--latency-ms", type=float, default=d.latency_ms, help="slow FS: ms per open")
    a("--link", default=d.link, help="tc rate of every node's link")
    a("--epochs", type=int, default=d.epochs, help="training epochs")
    a("--stage-threads", type=int, default=d.stage_threads, help="copy threads per node")
    a("--runs", type=int, default=d.runs, help="training runs per case (their median is compared)")
    a(
        "--calibrate-nodes",
        type=int,
        help="calibrate once on this many nodes and predict every case from that file "
        "(default: each case calibrates on its own node count)",
    )
    a("--keep", action="store_true", help="keep each case's files (data, metrics, calibration)")
    a("--json", action="store_true", help="last line: one JSON object")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not harness_can_start("tools.bench validate", no_fuse):
        return 2

    def setup(nodes: int) -> Setup:
        return Setup(nodes, args.ranks_per_node, args.files, args.latency_ms, args.link,
                     epochs=args.epochs, stage_threads=args.stage_threads,
                     runs=args.runs)  # fmt: skip

    results = []
    with tempfile.TemporaryDirectory(prefix="hpcdl-validate-") as scratch:
        given = None
        if args.calibrate_nodes:
            given = Path(scratch) / "calibration.toml"
            work = Path(scratch) / "calibrate"
            work.mkdir()
            summary = calibrate_only(setup(args.calibrate_nodes), work, given)
            print(summary.strip(), flush=True)
        for nodes in (int(n) for n in args.nodes.split(",")):
            kept = tempfile.mkdtemp(prefix=f"hpcdl-validate-{nodes}-") if args.keep else None
            if kept:
                print(f"keeping the case's files in {kept}", flush=True)
            place = contextlib.nullcontext(kept) if kept else tempfile.TemporaryDirectory()
            with place as workdir:
                results.append(run_case(setup(nodes), Path(workdir), given))
            print("\n".join(results[-1]["calibration"]), flush=True)
            print(table(results[-1:]), flush=True)
    if args.json:
        print(json.dumps([{**r, "errors": compare(r)} for r in results]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
