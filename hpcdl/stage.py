"""`python -m hpcdl.stage`: staging plans, dry runs and stage-only job steps.

    python -m hpcdl.stage --version
    python -m hpcdl.stage --dry-run --data DIR --nodes 16 --ranks-per-node 4 [--json]
    python -m hpcdl.stage --data DIR --stage-dir /local/scratch/me    # stage the first epoch
    mpirun --map-by ppr:1:node python -m hpcdl.stage --config job.toml

A stage-only run copies what every node reads in the first epoch and leaves it there; a later
`hpcdl.train` with the same --stage-dir reuses the copies. See docs/staging.md.

Which training ranks share a node: launched like the training job (same mpirun placement, more
than one process on a node, no --ranks-per-node), the ranks gathered on each node; otherwise
--nodes, --ranks-per-node and --placement describe the training job (docs/multinode.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpcdl.clustermodel.calibration import PfsFigures
from hpcdl.clustermodel.equations import staged_at, staging_rate
from hpcdl.config import (
    MAX_SEED,
    STAGE_THREADS,
    TrainConfig,
    empty_path_error,
    field_types,
    toml_values,
)
from hpcdl.data.augment import parse_augment
from hpcdl.data.pfs import open_source
from hpcdl.data.sampler import PLACEMENTS, NodeLayout, SamplerSpec, rank_layout
from hpcdl.data.worker_cores import whole_node
from hpcdl.helpformat import HelpFormatter
from hpcdl.stage_flags import stage_flags_error
from hpcdl.staging.binary import StagerNotFound, find_stager_binary
from hpcdl.staging.dry_run_report import epoch_rows, print_dry_run
from hpcdl.staging.fskind import copy_threads, path_kind
from hpcdl.staging.ownership import (
    StageDirError,
    StageDirFull,
    StageDirLease,
    check_no_overlap,
    check_stage_dir,
    data_key,
)
from hpcdl.staging.peers import epoch_sources
from hpcdl.staging.plan import (
    FileTreeDataset,
    NodePlan,
    dataset_fingerprint,
    first_epoch_plans,
    node_figures,
    plan_for_node,
    write_plan,
)
from hpcdl.staging.session import default_capacity, parse_capacity
from hpcdl.staging.stage_once import print_summary, show_progress
from hpcdl.staging.stager_process import StagerProcess
from hpcdl.staging.status import CounterFile, ProgressFile, StatusView
from hpcdl.startup_checks import batch_size_error


class UsageError(ValueError):
    """A bad flag or config value; the message names it."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hpcdl.stage",
        description=__doc__.split("\n")[0],
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    a = p.add_argument
    a("--version", action="store_true", help="print the version of hpcdl-stage and exit")
    a(
        "--config",
        help="TOML file (the training job's serves): keys are the flag names with underscores, "
        "values checked as hpcdl.train checks them",
    )
    a("--data", help="data set (HDF5 file/shard directory, image folder, or any tree)")
    a("--files-only", action="store_true", help="treat every file under --data as one sample")
    a("--stage-dir", help="node-local directory to stage into")
    a("--dry-run", action="store_true", help="print the plan per node; copy nothing, no MPI")
    a(
        "--nodes",
        help="nodes of the training job (default: Slurm/MPI environment); with --dry-run "
        "--calibration also a list, e.g. 2,4,8,...,1024",
    )
    a("--ranks-per-node", type=int, help="training ranks per node (default: environment or 1)")
    a("--node", type=int, help="stage-only: which node this process stages for (default: MPI)")
    a(
        "--placement",
        choices=PLACEMENTS,
        help="how the training job places ranks: block (mpirun's default, Slurm block) or "
        "cyclic (mpirun --map-by node, Slurm cyclic); default block",
    )
    a("--batch-size", type=int, help="per-rank batch size (default 32)")
    a("--seed", type=int, help="sampler seed (default 0)")
    a(
        "--epochs",
        type=int,
        help="training epochs (dry run: also report the whole run) (default "
        f"{TrainConfig.epochs}, hpcdl.train's)",
    )
    a("--shuffle", choices=("global", "node", "none"), help="sampler shuffle mode (default global)")
    a("--augment", help="dry run: the training --augment, for the samples' shape (default none)")
    a(
        "--stage-threads",
        type=int,
        help=f"copy threads (default: stage-only chooses by the source's file system and the "
        f"cores, {STAGE_THREADS} for a network one; the dry run {STAGE_THREADS})",
    )
    a("--stage-capacity", help="bytes (200G) or percent of free space (80%%) to use (default: all)")
    a("--stage-verify", action="store_true", default=None, help="verify copies by checksum")
    a("--pfs-bandwidth", type=float, help="dry run estimate: PFS MB/s per node (default 1000)")
    a("--pfs-open-latency", type=float, help="dry run estimate: ms per open (default 1)")
    a("--probe", action="store_true", default=None, help="dry run: measure PFS speed by reading")
    a("--write-plans", help="dry run: write each node's plan file into this directory")
    add_model_flags(a)
    a("--json", action="store_true", default=None, help="last line: one JSON object")
    a("--quiet", action="store_true", default=None, help="no progress output")
    return p


def add_model_flags(a: Callable[..., Any]) -> None:
    """The dry run's cluster-model flags (hpcdl.clustermodel, docs/cluster-model.md): the
    calibration, and the training job's own flags that change its time."""
    a(
        "--calibration",
        help="dry run: calibration file (python -m hpcdl.bench calibrate, or the site's); "
        "predicts PFS load, staging, allreduce and time to train per --nodes",
    )
    a(
        "--peer-staging",
        choices=("auto", "on", "off"),
        help="dry run with --calibration: the training job's peer tier (default auto: on with "
        "2+ nodes and --shuffle global)",
    )
    a(
        "--workers",
        type=int,
        help="dry run with --calibration: the training job's --workers, for the time a step "
        "waits for its batch (default: as hpcdl.train, a fair share of this machine's cores)",
    )
    a(
        "--checkpoint-dir",
        help="dry run with --calibration: the training job's --checkpoint-dir (nothing is "
        "written there): each epoch then ends with a checkpoint, at the calibration's checkpoint_s",
    )
    a(
        "--checkpoint-every",
        type=int,
        help="dry run with --checkpoint-dir: the training job's --checkpoint-every (steps)",
    )
    a("--dataset-files", type=int, help="with --calibration and no --data: the data set's files")
    a("--dataset-bytes", type=float, help="with --dataset-files: the data set's bytes in all")
    a("--shards", type=int, help="with --calibration: predict the data set stored as this many "
      "shard files (tar or HDF5), beside it as a folder")  # fmt: skip


DEFAULTS: dict[str, Any] = dict(
    batch_size=32,
    seed=0,
    epochs=TrainConfig.epochs,  # the whole run is the run hpcdl.train would do
    shuffle="global",
    augment="none",
    placement="block",
    stage_threads=STAGE_THREADS,
    pfs_bandwidth=1000.0,
    pfs_open_latency=1.0,
    probe=False,
    json=False,
    quiet=False,
    stage_verify=False,
    peer_staging="auto",
)


def config_types() -> dict[str, type]:
    """The type of each TOML key this command reads (hpcdl.config.convert_value): hpcdl.train's
    for the keys both read, so that one job file means the same to both, else its flag's;
    --nodes (a number or a list) as given, for node_counts."""
    train = field_types()
    types: dict[str, type] = {}
    for action in build_parser()._actions:
        if action.dest not in ("help", "config"):
            flag = bool if action.nargs == 0 else action.type or str
            types[action.dest] = train.get(action.dest, flag)
    return {**types, "nodes": object}


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Defaults < --config TOML < flags; relative TOML paths are relative to the TOML file.
    The TOML's values are checked as hpcdl.train checks them; keys of the training job's that
    this command has no use for are left out."""
    values = dict(DEFAULTS)
    given = {k for k, v in vars(args).items() if v is not None and v is not False}
    refuse_empty_paths(vars(args), "command line")
    if args.config:
        toml = toml_values(args.config, config_types(), ignore_unknown=True)
        refuse_empty_paths(toml, args.config)
        values.update(toml)
        given |= set(toml)
    values.update({k: v for k, v in vars(args).items() if v is not None and v is not False})
    out = argparse.Namespace(**{k: values.get(k) for k in set(values) | set(vars(args))})
    for name in ("batch_size", "epochs", "stage_threads"):
        if int(getattr(out, name)) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= int(out.seed) <= MAX_SEED:  # hpcdl.train's range: one job file, one meaning
        raise UsageError(f"--seed must be 0..{MAX_SEED} (2**63 - 1), got {out.seed}")
    if out.workers is not None and int(out.workers) < 0:
        raise UsageError("--workers must be 0 or more")
    if out.checkpoint_every is not None and int(out.checkpoint_every) < 0:
        raise UsageError("--checkpoint-every must be 0 (each epoch's end only) or more")
    parse_augment(out.augment)  # a bad value is said before the data set's errors, as in training
    error = stage_flags_error(int(out.stage_threads), out.stage_capacity)  # the stager's ranges
    if error:
        raise UsageError(error)
    out.stage_threads_given = "stage_threads" in given  # else stage-only chooses (fskind)
    out.node_counts = node_counts(out.nodes)
    out.nodes = out.node_counts[0] if out.node_counts else None
    if len(out.node_counts) > 1 and not (out.dry_run and out.calibration):
        raise UsageError("--nodes takes a list (2,4,8) only with --dry-run --calibration")
    if out.shards is not None and not (out.dry_run and out.calibration):
        raise UsageError("--shards (the data set as shards) is for --dry-run --calibration only")
    return out


# Flags naming a file or a directory, and what each wants where it is given empty.
PATH_FLAGS = {
    "config": "a TOML file",
    "data": "the data set's path",
    "stage_dir": "a directory",
    "write_plans": "a directory",
    "calibration": "a calibration file",
    "checkpoint_dir": "a directory",
}


def refuse_empty_paths(values: dict[str, Any], source: str) -> None:
    """A path flag given as "" (an unset $LOCAL_SCRATCH, say) is an error, never "none"."""
    for name, what in PATH_FLAGS.items():
        if values.get(name) == "":
            raise UsageError(empty_path_error(name, source, what))


def node_counts(value: Any) -> list[int]:
    """--nodes as a list: 16, "16" or "2,4,8" (TOML: an integer or a list)."""
    if value is None:
        return []
    items = value if isinstance(value, list) else str(value).split(",")
    try:
        counts = [int(v) for v in items]
    except ValueError:
        raise UsageError(f"--nodes must be a number or a list like 2,4,8, got {value!r}") from None
    if not counts or min(counts) < 1:
        raise UsageError(f"--nodes must be at least 1, got {value!r}")
    return counts


def env_layout() -> tuple[int | None, int | None]:
    """(nodes, ranks per node) announced by Slurm or the MPI launcher, if any."""
    env = os.environ
    nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    per = (env.get("SLURM_NTASKS_PER_NODE") or "").split("(")[0] or env.get(
        "OMPI_COMM_WORLD_LOCAL_SIZE"
    )
    if nodes is None and env.get("OMPI_COMM_WORLD_SIZE") and per:
        nodes = str(int(env["OMPI_COMM_WORLD_SIZE"]) // max(int(per), 1))
    return (int(nodes) if nodes else None, int(per) if per and per.isdigit() else None)


def open_data(args: argparse.Namespace, samples: bool = True) -> Any:
    """The data set of --data; samples=False: only what staging needs (an image folder's
    listing and sizes, no image opened: hpcdl.data.kinds.open_listing)."""
    if not args.data:
        raise UsageError("--data is required (the data set directory or file)")
    if args.files_only:
        return FileTreeDataset(args.data)
    try:
        from hpcdl.data.kinds import open_dataset, open_listing  # noqa: PLC0415
    except ImportError:
        return FileTreeDataset(args.data)
    return open_dataset(args.data) if samples else open_listing(args.data)


def node_plan(
    ds: Any, args: argparse.Namespace, layout: NodeLayout, node: int, epochs: tuple[int, int]
) -> NodePlan:
    """Plan of `node` of a training job whose ranks sit on the nodes as `layout` says."""
    sampler = job_sampler(ds, args, layout)
    return plan_for_node(ds, sampler, int(args.batch_size), epochs, ranks=layout[node], node=node)


def probe_pfs(ds: Any, plan: NodePlan, samples: int = 16) -> tuple[float, float]:
    """(ms per open, MB/s) measured by reading up to `samples` planned files."""
    opens, nbytes, t_read = [], 0, 0.0
    for fid in plan.file_ids[:samples].tolist():
        t0 = time.perf_counter()
        with open_source(Path(ds.root) / ds.files[fid].relpath) as f:
            t1 = time.perf_counter()
            nbytes += len(f.read())
        opens.append(t1 - t0)
        t_read += time.perf_counter() - t1
    latency = 1000 * sum(opens) / max(len(opens), 1)
    return latency, (nbytes / 1e6) / max(t_read, 1e-9)


def staging_seconds(files: int, nbytes: int, latency_ms: float, mbps: float, threads: int) -> float:
    """One node's first-epoch staging time by the cluster model's formula (equations.
    staging_rate): the dry run's figures are one thread's open latency and bandwidth, which
    is also the node's (--pfs-bandwidth is per node; --probe reads with one thread)."""
    bandwidth = max(mbps, 1e-9) * 1e6
    pfs = PfsFigures(latency_ms / 1000, bandwidth, node_bandwidth_Bps=bandwidth)
    rate = staging_rate(pfs, threads, 1, nbytes / max(files, 1))
    return float(staged_at(rate, files))


def job_sampler(ds: Any, args: argparse.Namespace, layout: NodeLayout) -> SamplerSpec:
    """The SamplerSpec of a training job whose ranks sit on the nodes as `layout` says."""
    return SamplerSpec(
        num_samples=len(ds),
        world_size=sum(len(ranks) for ranks in layout),
        seed=int(args.seed),
        shuffle=args.shuffle,
        ranks_by_node=layout,
    )


def loader_workers(args: argparse.Namespace, ranks_per_node: int) -> int:
    """The training job's loader workers per rank: --workers, else hpcdl.train's default."""
    if args.workers is not None:
        return int(args.workers)
    from hpcdl.data.loader import default_workers  # noqa: PLC0415

    return default_workers(ranks_per_node=ranks_per_node)


def model_dry_run(args: argparse.Namespace) -> int:
    """The dry run with --calibration: the cluster model's prediction per --nodes."""
    from hpcdl.clustermodel import calibration, prediction  # noqa: PLC0415

    if args.dataset_files:
        ds = prediction.described_dataset(args.dataset_files, args.dataset_bytes)
    else:
        ds = open_data(args)
    per_node = int(args.ranks_per_node or 1)
    node_counts = tuple(args.node_counts or [env_layout()[0] or 1])
    data = args.data or f"--dataset-files {len(ds)}"
    for nodes in node_counts:  # every row must be a run training would start
        error = batch_size_error(int(args.batch_size), len(ds), nodes * per_node, data)
        if error:
            raise UsageError(f"at --nodes {nodes}: {error}")
    if args.stage_dir and args.data:
        check_stage_dir(args.stage_dir, {"--data": args.data})
    request = prediction.PredictionRequest(
        calibration=calibration.load(args.calibration),
        source=args.calibration,
        dataset=ds,
        node_counts=node_counts,
        ranks_per_node=per_node,
        batch_size=int(args.batch_size),
        epochs=int(args.epochs),
        stage_threads=int(args.stage_threads),
        seed=int(args.seed),
        shuffle=args.shuffle,
        placement=args.placement,
        peer_staging=args.peer_staging,
        workers=loader_workers(args, per_node),
        checkpoint=bool(args.checkpoint_dir),
        checkpoint_every=int(args.checkpoint_every or 0),
        shards=args.shards,
    )
    return prediction.print_predictions(request, bool(args.json))


def refuse_as_the_real_run(args: argparse.Namespace, ds: Any, ranks: int) -> None:
    """The dry run's refusals, in the real run's words, creating nothing: a --batch-size that
    training refuses on `ranks` ranks (its own check), a --stage-dir that is a file or overlaps
    the data (the stager's checks before it creates anything)."""
    error = batch_size_error(int(args.batch_size), len(ds), ranks, args.data)
    if error:
        raise UsageError(error)
    if args.stage_dir:
        check_stage_dir(args.stage_dir, {"--data": args.data})


def dry_run(args: argparse.Namespace) -> int:
    if args.calibration:  # the cluster model instead of the per-node plan listing
        return model_dry_run(args)
    env_nodes, env_per = env_layout()
    nodes, per = args.nodes or env_nodes or 1, args.ranks_per_node or env_per or 1
    layout = rank_layout([per] * nodes, args.placement)
    ds = open_data(args)
    refuse_as_the_real_run(args, ds, nodes * per)
    capacity = parse_capacity(args.stage_capacity, args.stage_dir or ".")
    if capacity is None:
        capacity = default_capacity(args.stage_dir or ".")
    threads, batch = int(args.stage_threads), int(args.batch_size)
    sampler = job_sampler(ds, args, layout)
    # Every node's figures at once, from one permutation per epoch (node_figures).
    first = node_figures(ds, sampler, batch, (0, 1), layout)
    run = (
        first
        if int(args.epochs) == 1
        else node_figures(ds, sampler, batch, (0, int(args.epochs)), layout)
    )
    plans = None
    if args.probe or args.write_plans:
        plans = first_epoch_plans(ds, sampler, batch, 0, layout)
        fingerprint = dataset_fingerprint(ds)
    rows = []
    for node in range(nodes):
        files, nbytes = int(first.files[node]), int(first.bytes[node])
        plan = next(plans) if plans is not None else None
        if args.probe:
            latency_ms, mbps = probe_pfs(ds, plan)
        else:
            latency_ms, mbps = float(args.pfs_open_latency), float(args.pfs_bandwidth)
        seconds = staging_seconds(files, nbytes, latency_ms, mbps, threads)
        if args.write_plans:
            Path(args.write_plans).mkdir(mode=0o755, parents=True, exist_ok=True)
            write_plan(Path(args.write_plans) / f"plan.node{node}", plan, ds, fingerprint)
        rows.append(
            dict(
                node=node,
                files=files,
                bytes=nbytes,
                fits=nbytes <= capacity,
                run_files=int(run.files[node]),
                run_bytes=int(run.bytes[node]),
                run_fits=int(run.bytes[node]) <= capacity,
                capacity=capacity,
                est_seconds=round(seconds, 3),
                pfs_open_latency_ms=round(latency_ms, 3),
                pfs_mbps=round(mbps, 1),
            )
        )
    epochs: list[dict[str, int]] = []
    if nodes > 1:  # one node has no peer
        fits = [r["run_fits"] for r in rows]
        sources = epoch_sources(ds, sampler, batch, (0, int(args.epochs)), layout, fits)
        epochs = epoch_rows(sources)
    print_dry_run(args, ds, rows, nodes, per, capacity, threads, epochs)
    return 0


def stage_only(args: argparse.Namespace) -> int:
    if not args.stage_dir:
        raise UsageError("--stage-dir is required without --dry-run")
    binary = find_stager_binary()
    comm, gathered = None, None
    node, nodes = args.node, args.nodes
    env_nodes, env_per = env_layout()
    if os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE"):
        from hpcdl.comm.failure import install_abort_on_exception  # noqa: PLC0415
        from hpcdl.comm.world import init_world  # noqa: PLC0415

        world = init_world()
        # Like the trainer: a leader that fails while the others wait in a barrier ends the
        # job with its one line (main() raises UserError), never a hang.
        install_abort_on_exception(world.comm, world.rank)
        comm = world.comm
        node = world.node_index if node is None else node
        nodes = nodes or world.num_nodes
        if world.size > world.num_nodes and args.ranks_per_node is None:
            gathered = world.ranks_by_node  # started like the training job: its placement
        if world.local_rank != 0:  # one stager per node
            comm.Barrier()
            return 0
    nodes, node, per = nodes or env_nodes or 1, node or 0, args.ranks_per_node or env_per or 1
    if not 0 <= node < nodes:
        raise UsageError(f"--node {node} outside 0..{nodes - 1}")
    layout = gathered or rank_layout([per] * nodes, args.placement)
    ds = open_data(args, samples=False)  # the copy opens each file once; the index would too
    error = batch_size_error(int(args.batch_size), len(ds), sum(map(len, layout)), args.data)
    if error:  # no step an epoch: the plan would be empty and the run would stage nothing
        raise UsageError(error)
    args.stage_cores = whole_node()  # not the one core mpirun bound this rank to
    args.threads_why = choose_threads(args, ds.root)
    check_no_overlap(args.stage_dir, {"--data": args.data})
    lease = StageDirLease.acquire(args.stage_dir)
    try:
        return _stage_with(lease, binary, ds, args, layout, node, comm)
    finally:
        lease.release(keep=True)  # the copies stay for the training job that follows


def choose_threads(args: argparse.Namespace, root: Any) -> str:
    """Without --stage-threads (flag or config), stage-only's copy threads follow the source:
    a local file system is bound by the cores the stager runs on (args.stage_cores, else this
    process's), a network or parallel one by each open's latency (staging.fskind.copy_threads).
    Sets args.stage_threads; returns the start line's account of the choice."""
    kind, fstype = path_kind(root)
    where = f"({fstype}, a {kind} file system)"
    if args.stage_threads_given:
        return f"{where} with {args.stage_threads} copy threads (--stage-threads)"
    cores = len(args.stage_cores or os.sched_getaffinity(0))
    args.stage_threads = copy_threads(kind, cores)
    return (
        f"{where} with {args.stage_threads} copy threads ({cores} cores; --stage-threads to choose)"
    )


def _stage_with(
    lease: StageDirLease,
    binary: Path,
    ds: Any,
    args: argparse.Namespace,
    layout: NodeLayout,
    node: int,
    comm: Any,
) -> int:
    """Stage the first epoch of `node` into the leased stage dir and print the summary."""
    plan = node_plan(ds, args, layout, node, (0, 1))
    if not args.quiet:
        print(f"node {node}: staging {plan.files} files from {ds.root} {args.threads_why}",
              file=sys.stderr)  # fmt: skip
    files = lease.files
    write_plan(files.plan, plan, ds, dest_prefix=data_key(ds.root))
    ProgressFile.create(files.progress, plan.local_ranks)
    CounterFile.create(files.counters, plan.local_ranks)
    capacity = parse_capacity(args.stage_capacity, lease.stage_dir)
    t0 = time.perf_counter()
    proc = StagerProcess.launch(
        binary,
        lease.stage_dir,
        lease.session,
        int(args.stage_threads),
        capacity,
        bool(args.stage_verify),
        once=True,
        quiet=bool(args.quiet),
        cores=args.stage_cores,
    ).proc
    status = StatusView(files.status)
    show_progress(proc, status, node, bool(args.quiet))
    seconds = time.perf_counter() - t0
    status.close()
    if proc.returncode != 0:
        print(
            f"hpcdl.stage: error: hpcdl-stage exited with code {proc.returncode} on node "
            f"{node}; nothing more was staged (see its message above)",
            file=sys.stderr,
        )
        return 1
    summary = print_summary(status, plan, node, seconds)
    if comm is not None:
        comm.Barrier()
    if args.json:
        print(json.dumps(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = resolve(build_parser().parse_args(argv))
        if args.version:
            binary = find_stager_binary()
            os.execv(str(binary), [str(binary), "--version"])
        return dry_run(args) if args.dry_run else stage_only(args)
    except StageDirFull as exc:
        return fail(f"{exc}; nothing was staged", 1)
    except (UsageError, StagerNotFound, StageDirError, FileNotFoundError, ValueError) as exc:
        return fail(str(exc), 2)


def fail(message: str, status: int) -> int:
    """One line; under MPI through comm.failure's hook, which ends every rank of the job."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        from hpcdl.comm.failure import UserError  # noqa: PLC0415

        raise UserError(f"hpcdl.stage: {message}", status)
    print(f"hpcdl.stage: error: {message}", file=sys.stderr)
    return status


if __name__ == "__main__":
    from hpcdl import cli

    sys.exit(cli.run(main))
