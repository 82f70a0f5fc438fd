"""`python -m hpcdl.jobs render train|stage ... > job.sbatch` and `python -m hpcdl.jobs sites`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpcdl.helpformat import HelpFormatter
from hpcdl.jobs import render
from hpcdl.jobs.render import DEVICES, KINDS, JobSpec
from hpcdl.jobs.site import JobSpecError, bundled_sites, load_site


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hpcdl.jobs",
        allow_abbrev=False,
        description="Render hpcdl sbatch scripts for a Slurm site.",
        formatter_class=HelpFormatter,
        epilog="Arguments after a bare -- are passed to hpcdl.train / hpcdl.stage unchanged "
        "(for train, --metrics and --checkpoint-dir there become the script's own, made "
        "absolute; --config there is refused); for render script they are the command.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    r = sub.add_parser(
        "render",
        help="print an sbatch script for a training or stage-only job",
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    add_job_arguments(r)
    add_restart_arguments(r)

    sub.add_parser(
        "sites",
        help="list the bundled site files",
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    return parser


def add_job_arguments(r: argparse.ArgumentParser) -> None:
    """render's options for the job itself: its kind, size, device, time, config and site."""
    r.add_argument(
        "kind",
        choices=KINDS,
        help="train: a training job; stage: a stage-only job; script: your own command after "
        "a bare -- (e.g. -- python train.py ARGS; {stage_dir} in it is the node-local stage dir)",
    )
    r.add_argument("--nodes", type=int, required=True, help="nodes to request (required)")
    r.add_argument(
        "--tasks-per-node",
        type=int,
        default=1,
        help="MPI ranks per node, one per GPU (stage jobs always run one task per node)",
    )
    r.add_argument(
        "--device",
        choices=DEVICES,
        default="",
        help="passed to hpcdl.train; gpu also requests one GPU per task (default: the config's "
        "device, else cpu)",
    )
    r.add_argument("--time", required=True, help="time limit, HH:MM:SS or D-HH:MM:SS (required)")
    r.add_argument(
        "--config", default="", help="the training TOML (hpcdl.train --config) (train and stage)"
    )
    r.add_argument("--site", default="generic", help="bundled site name or a site .toml path")
    r.add_argument("--job-name", default="", help="default: hpcdl-train / hpcdl-stage")
    r.add_argument(
        "--output",
        default=".",
        help="directory for the job log <job-name>-<job-id>.out (made if missing)",
    )
    r.add_argument(
        "--cpus-per-task",
        type=int,
        default=None,
        help="cores per rank; also OMP_NUM_THREADS in the job (default: the site's)",
    )
    r.add_argument(
        "--signal-seconds",
        type=int,
        default=None,
        help="send SIGUSR1 this many seconds before the time limit to checkpoint "
        "(default: the site's; 0: none)",
    )


def add_restart_arguments(r: argparse.ArgumentParser) -> None:
    """render's options for checkpoints, staging and what follows a stop (requeue, chains)."""
    r.add_argument(
        "--checkpoint-dir",
        default=None,
        help="overrides the config's checkpoint_dir (made absolute)",
    )
    r.add_argument(
        "--no-stage",
        dest="stage",
        action="store_false",
        help="do not pass a node-local --stage-dir to the trainer",
    )
    r.add_argument(
        "--stage-key",
        default="",
        help="name of the node-local stage subdirectory shared by a stage job and the training "
        "job after it (default for train: u<uid>, one shared by the user's jobs on a node)",
    )
    r.add_argument(
        "--requeue",
        action="store_true",
        help="#SBATCH --requeue, and requeue the job itself after a checkpoint-on-signal stop",
    )
    r.add_argument(
        "--chain",
        type=int,
        default=1,
        metavar="N",
        help="train: print a bash script that submits N identical jobs, each starting when the "
        "one before ended (sbatch --dependency=afterany), all resuming with --resume auto: a "
        "training longer than the time limit (needs a checkpoint directory) (default: 1, the "
        "job script itself)",
    )


def make_log_directory(output: str) -> None:
    """Make --output (the user's log directory) when missing: Slurm opens the job's log before
    the script runs, and a job whose log directory is missing ends FAILED with no log at all."""
    path = Path(output).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise JobSpecError(
            f"--output {output}: the log directory cannot be made ({exc.strerror}); "
            "pass a directory you can write"
        ) from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Everything after a bare -- goes to hpcdl.train / hpcdl.stage unchanged.
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    try:
        if args.command == "sites":
            for name, site in bundled_sites().items():
                print(f"{name:12s} {site.description}")
                print(f"{'':12s} tested: {site.tested}")
            return 0
        spec = JobSpec(
            kind=args.kind,
            nodes=args.nodes,
            tasks_per_node=args.tasks_per_node,
            device=args.device,
            time=args.time,
            config=args.config,
            site=load_site(args.site),
            job_name=args.job_name,
            output_dir=args.output,
            cpus_per_task=args.cpus_per_task,
            signal_seconds=args.signal_seconds,
            checkpoint_dir=args.checkpoint_dir,
            stage=args.stage,
            stage_key=args.stage_key,
            requeue=args.requeue,
            chain=args.chain,
            extra_args=extra,
        )
        script, warnings = render(spec)
        make_log_directory(args.output)
    except JobSpecError as exc:
        print(f"hpcdl.jobs: error: {exc}", file=sys.stderr)
        return 2
    for warning in warnings:
        print(f"hpcdl.jobs: warning: {warning}", file=sys.stderr)
    sys.stdout.write(script)
    return 0


if __name__ == "__main__":
    from hpcdl import cli

    sys.exit(cli.run(main))
