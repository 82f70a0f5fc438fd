"""`python -m hpcdl.jobs render script ... -- python train.py ARGS`: hpcdl's sbatch around a
user's own training script (a Horovod-style or hpcdl.torch script; docs/slurm.md).

The job gets what `render train` gives hpcdl.train: the site's setup and launcher, one rank per
task, the node-local stage directory (in $HPCDL_JOB_STAGE_DIR, and wherever the command says
`{stage_dir}`), and the time-limit signal: Slurm sends SIGUSR1 to the batch shell --signal-seconds
before the limit, the shell forwards it (and SIGTERM, as SIGUSR1) to every rank, and
`hpcdl.torch.stop_requested()` turns True there, so the script checkpoints and exits 0. The
shell tells a stopped job (exit 0 after the signal) from a finished one, and with --requeue
requeues a stopped one. --chain N prints a script that submits N such jobs one after the other;
each job's script resumes from its own checkpoint (hpcdl does not know where it keeps it).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from hpcdl.jobs.render import (
    DEVICES,
    Job,
    JobSpec,
    chain_script,
    check_text,
    cpus_per_task,
    default_launcher,
    directive,
    fill_template,
    launcher_words,
    positive,
    quote,
    sbatch_lines,
    setup_lines,
    shell_words,
    time_seconds,
    validate_names,
)
from hpcdl.jobs.site import JobSpecError

STAGE_DIR_WORD = "{stage_dir}"  # in the command: the node-local stage directory


def _job(spec: JobSpec) -> Job:
    """The job's values, checked (as render train checks them, without a config)."""
    if not spec.extra_args:
        raise JobSpecError(
            "render script needs the command after a bare --, e.g. "
            "`-- python train.py --epochs 90 --stage-dir {stage_dir}`"
        )
    limit = time_seconds(spec.time)
    signal_s = spec.site.signal_seconds if spec.signal_seconds is None else spec.signal_seconds
    if signal_s < 0 or signal_s >= limit:
        raise JobSpecError(
            f"--signal-seconds {signal_s} must be 0 or more and shorter than --time {spec.time} "
            f"({limit} s)"
        )
    job_name, stage_key = validate_names(replace(spec, job_name=spec.job_name or "hpcdl-script"))
    device = spec.device or "cpu"
    if device not in DEVICES:
        raise JobSpecError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    output_dir = Path(check_text("--output", spec.output_dir)).expanduser().resolve()
    return Job(
        nodes=positive("--nodes", spec.nodes),
        ranks_per_node=positive("--tasks-per-node", spec.tasks_per_node),
        cpus=cpus_per_task(spec),
        signal_s=signal_s,
        job_name=job_name,
        stage_key=stage_key,
        device=device,
        config_path=Path("."),
        config={},
        checkpoint_dir="",
        metrics="",
        output_dir=directive("--output", str(output_dir)),
        extra_args=(),
    )


def _command(spec: JobSpec) -> str:
    """The user's command, shell-quoted word by word; `{stage_dir}` becomes "$stage_dir"."""
    words = []
    for word in spec.extra_args:
        parts = [quote("command", part) for part in word.split(STAGE_DIR_WORD)]
        words.append('"$stage_dir"'.join(p if p != "''" else "" for p in parts) or "''")
    return " ".join(words)


def render_script(spec: JobSpec) -> tuple[str, list[str]]:
    """The sbatch script (or, with chain > 1, the script that submits the chain); warnings."""
    if spec.chain > 1 and spec.requeue:
        raise JobSpecError("--chain and --requeue both start the job again; use one of them")
    job = _job(spec)
    site = spec.site
    python = site.python or sys.executable
    setup = setup_lines(site)
    launch = launcher_words(site, job, job.ranks_per_node) + [_command(spec)]
    values = {
        "site": site.name,
        "sbatch": "\n".join(
            f"#SBATCH {line}" for line in sbatch_lines(replace(spec, kind="train"), job)
        ),
        "setup": "\n".join(setup) if setup else ":",
        "python": quote("site python", python),
        "launcher": quote(
            "site launcher.command", site.launcher.command or default_launcher(site, python)
        ),
        "local_ssd": shell_words("site local_ssd", site.local_ssd) if site.local_ssd else "''",
        "stage_key": quote("--stage-key", job.stage_key),
        "stage": "true" if spec.stage else "false",
        "requeue": "true" if spec.requeue else "false",
        "launch": " \\\n    ".join(launch),
    }
    script = fill_template("script.sbatch", values)
    warnings = []
    if not job.signal_s:
        warnings.append(
            "--signal-seconds 0: no signal before the time limit; the script cannot "
            "checkpoint when the limit comes"
        )
    if spec.chain == 1:
        return script, warnings
    positive("--chain", spec.chain)
    about = fill_template("chain_about_script.txt", {"count": str(spec.chain), "site": site.name})
    return chain_script(script, spec.chain, about), warnings
