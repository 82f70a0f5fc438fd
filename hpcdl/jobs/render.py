"""Render sbatch scripts from a template, a site, and a job's shape.

Everything substituted into the shell body goes through `shlex.quote` (or `shell_words`, which
also lets site values reference `$VAR`s); values that cannot be quoted safely where they land
(control characters anywhere, odd characters in `#SBATCH` directives, which sbatch parses
without a shell) are rejected with a message naming the field.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from hpcdl.jobs.site import JobSpecError, Site

KINDS = ("train", "stage", "script")  # script: a user's command (hpcdl.jobs.script_job)
DEVICES = ("cpu", "gpu")
EXIT_STOPPED_BY_SIGNAL = 3  # hpcdl.train's exit status after a signal-triggered checkpoint
EXIT_UNFINISHED = 5  # launcher said 0 but the run wrote no summary: a node stopped taking part

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
_TIME = re.compile(r"(?:(\d+)-)?(\d{1,3}):(\d{2}):(\d{2})")
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DIRECTIVE_UNSAFE = re.compile(r"[\s'\"\\%$`#;]")
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


@dataclass
class JobSpec:
    kind: str  # train | stage
    nodes: int
    tasks_per_node: int  # training ranks (= GPUs) per node; stage jobs run 1 task per node
    device: str  # cpu | gpu | "" = the config's device, else cpu
    time: str  # Slurm time limit, HH:MM:SS or D-HH:MM:SS
    config: str  # the training TOML (hpcdl.train --config)
    site: Site
    job_name: str = ""  # "" = hpcdl-<kind>
    output_dir: str = "."  # where Slurm writes <job name>-<job id>.out
    cpus_per_task: int | None = None  # None = the site's default
    signal_seconds: int | None = None  # None = the site's default; 0 = no early signal
    checkpoint_dir: str | None = None  # overrides the config's checkpoint_dir
    stage: bool = True  # pass a node-local --stage-dir to the trainer
    stage_key: str = ""  # stage subdirectory key; "" = u<uid>, the user's (stage jobs need one)
    requeue: bool = False  # #SBATCH --requeue, and requeue itself after a signal stop
    chain: int = 1  # > 1: a script that submits this many identical jobs, each after the last
    extra_args: list[str] = field(default_factory=list)  # appended to the hpcdl command


def check_text(name: str, value: str) -> str:
    """Reject control characters (newlines included) in a value bound for the script."""
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise JobSpecError(f"{name} must not contain newlines or control characters: {value!r}")
    return value


def quote(name: str, value: str) -> str:
    """One shell word holding exactly `value`."""
    return shlex.quote(check_text(name, value))


def shell_words(name: str, value: str) -> str:
    """One shell word for a site value that may reference variables as $NAME or ${NAME}.

    Literal parts are shlex-quoted and each reference becomes "${NAME}", so nothing but the
    named variables is ever expanded (no command substitution, no globbing, no splitting).
    """
    check_text(name, value)
    words, pos = [], 0
    for m in [*_VAR.finditer(value), None]:
        literal = value[pos : m.start() if m else len(value)]
        if "$" in literal:
            raise JobSpecError(
                f"{name} may use $ only in variable references like $USER or ${{USER}}: {value!r}"
            )
        if literal:
            words.append(shlex.quote(literal))
        if m:
            words.append('"${' + (m.group(1) or m.group(2)) + '}"')
            pos = m.end()
    return "".join(words) or "''"


def directive(name: str, value: str) -> str:
    """A value for an `#SBATCH` line: sbatch reads these without a shell, so no quoting."""
    check_text(name, value)
    if not value or _DIRECTIVE_UNSAFE.search(value):
        raise JobSpecError(
            f"{name} must be non-empty without spaces, quotes, backslashes or any of %$`#; "
            f"(it goes into an #SBATCH line): {value!r}"
        )
    return value


def time_seconds(value: str) -> int:
    """Seconds in a Slurm time limit HH:MM:SS or D-HH:MM:SS."""
    m = _TIME.fullmatch(value)
    if not m:
        raise JobSpecError(f"--time must be HH:MM:SS or D-HH:MM:SS, got {value!r}")
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
    if minutes > 59 or seconds > 59:
        raise JobSpecError(f"--time minutes and seconds must be 00-59, got {value!r}")
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    if total <= 0:
        raise JobSpecError(f"--time must be longer than zero, got {value!r}")
    return total


def positive(name: str, value: int) -> int:
    if value < 1:
        raise JobSpecError(f"{name} must be >= 1, got {value}")
    return value


def cpus_per_task(spec: JobSpec) -> int:
    """--cpus-per-task, else the site's: 1 or more (0 is refused, not read as "the site's")."""
    if spec.cpus_per_task is None:
        return positive("site cpus_per_task", spec.site.cpus_per_task)
    return positive("--cpus-per-task", spec.cpus_per_task)


@dataclass
class _Resolved:
    """A JobSpec after validation, with every value as it will appear in the script."""

    values: dict[str, str]
    warnings: list[str]


def _read_config(path: Path) -> dict:
    """The training TOML read exactly as hpcdl.train reads it: dashed keys as underscores,
    values of their flags' types, relative paths relative to its directory; a key the trainer
    does not know is refused here, not in the job."""
    from hpcdl.config import ConfigError, field_types, toml_values  # noqa: PLC0415

    try:
        return toml_values(str(path), field_types())
    except ConfigError as exc:
        raise JobSpecError(f"--config: {exc}") from None


RUN_PATHS = ("--metrics", "--checkpoint-dir")  # after --: the script reads and passes them


def split_extra_args(extra: list[str]) -> tuple[dict[str, str], list[str]]:
    """The --metrics and --checkpoint-dir among the arguments after a bare -- (the last of
    each, as hpcdl.train takes it), made absolute, and the other arguments. The script passes
    these two itself, since it reads the one (did the run finish?) and resumes from the other;
    --config after -- is refused: render reads the config it is given."""
    found: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(extra):
        name, eq, value = extra[i].partition("=")
        if name == "--config":
            raise JobSpecError("--config goes before the bare --: render reads that config file")
        if name in RUN_PATHS and not eq:
            if i + 1 >= len(extra):
                raise JobSpecError(f"{name} after the bare -- needs a value")
            value, i = extra[i + 1], i + 1
        if name in RUN_PATHS:
            if not value:
                raise JobSpecError(f"{name} after the bare -- must not be empty")
            found[name] = str(Path(check_text(name, value)).expanduser().absolute())
        else:
            rest.append(extra[i])
        i += 1
    return found, rest


@dataclass(frozen=True)
class Job:
    """A JobSpec's values after validation, before they are written into the script."""

    nodes: int
    ranks_per_node: int  # training ranks per node (the stage job plans for these)
    cpus: int
    signal_s: int
    job_name: str
    stage_key: str
    device: str
    config_path: Path
    config: dict
    checkpoint_dir: str  # --checkpoint-dir (after --, else render's), else the config's, else ""
    metrics: str  # --metrics after --, else the config's, else "" (the script's default)
    output_dir: str
    extra_args: tuple[str, ...]  # after the bare --, less --metrics and --checkpoint-dir


def validate_names(spec: JobSpec) -> tuple[str, str]:
    """(job name, stage key), checked for the characters sbatch and paths allow."""
    job_name = spec.job_name or f"hpcdl-{spec.kind}"
    if not _NAME.fullmatch(check_text("--job-name", job_name)):
        raise JobSpecError(
            "--job-name must be 1-64 characters from A-Z a-z 0-9 . _ + - "
            f"(starting with a letter or digit), got {job_name!r}"
        )
    stage_key = spec.stage_key
    if stage_key and not _NAME.fullmatch(check_text("--stage-key", stage_key)):
        raise JobSpecError(
            f"--stage-key must be 1-64 characters from A-Z a-z 0-9 . _ + -, got {stage_key!r}"
        )
    if spec.kind == "stage" and not stage_key:
        raise JobSpecError(
            "render stage needs --stage-key KEY (and the same --stage-key for render train), "
            "so the training job finds the files the stage job copied"
        )
    return job_name, stage_key


def _validate(spec: JobSpec) -> Job:
    if spec.kind not in KINDS:
        raise JobSpecError(f"job kind must be one of {', '.join(KINDS)}, got {spec.kind!r}")
    nodes = positive("--nodes", spec.nodes)
    ranks_per_node = positive("--tasks-per-node", spec.tasks_per_node)
    cpus = cpus_per_task(spec)
    limit = time_seconds(spec.time)
    if not spec.config:
        raise JobSpecError(f"render {spec.kind} needs --config (the training TOML)")
    signal_s = spec.site.signal_seconds if spec.signal_seconds is None else spec.signal_seconds
    if signal_s < 0 or signal_s > 65535:
        raise JobSpecError(f"--signal-seconds must be 0-65535, got {signal_s}")
    if spec.kind == "train" and signal_s >= limit:
        raise JobSpecError(
            f"--signal-seconds {signal_s} must be shorter than --time {spec.time} ({limit} s); "
            "lower it or pass --signal-seconds 0 for no early checkpoint signal"
        )
    job_name, stage_key = validate_names(spec)
    config_path = Path(check_text("--config", spec.config)).expanduser().resolve()
    config = _read_config(config_path)
    device = spec.device or config.get("device") or "cpu"
    if device not in DEVICES:
        where = "--device" if spec.device else f"device in --config {spec.config}"
        raise JobSpecError(f"{where} must be one of {', '.join(DEVICES)}, got {device!r}")
    if spec.kind == "stage" and not config.get("data"):
        raise JobSpecError(f"--config {spec.config}: render stage needs a data = ... key")
    output_dir = Path(check_text("--output", spec.output_dir)).expanduser().resolve()
    paths, extra_args = split_extra_args(spec.extra_args) if spec.kind == "train" else ({}, [])
    checkpoint_dir = spec.checkpoint_dir and str(Path(spec.checkpoint_dir).expanduser().absolute())
    return Job(
        nodes=nodes,
        ranks_per_node=ranks_per_node,
        cpus=cpus,
        signal_s=signal_s,
        job_name=job_name,
        stage_key=stage_key,
        device=device,
        config_path=config_path,
        config=config,
        checkpoint_dir=(
            paths.get("--checkpoint-dir") or checkpoint_dir or config.get("checkpoint_dir") or ""
        ),
        metrics=paths.get("--metrics") or config.get("metrics") or "",
        output_dir=directive("--output", str(output_dir)),
        extra_args=tuple(extra_args),
    )


def sbatch_lines(spec: JobSpec, job: Job) -> list[str]:
    site = spec.site
    train = spec.kind == "train"
    sbatch = [
        f"--job-name={job.job_name}",
        f"--nodes={job.nodes}",
        f"--ntasks-per-node={job.ranks_per_node if train else 1}",
        f"--cpus-per-task={job.cpus}",
        f"--time={spec.time}",
        f"--output={job.output_dir}/%x-%j.out",
        "--open-mode=append",
    ]
    if train and job.signal_s:
        sbatch.append(f"--signal=B:USR1@{job.signal_s}")
    for key, value in (
        ("partition", site.partition),
        ("account", site.account),
        ("qos", site.qos),
        ("constraint", site.constraint),
    ):
        if value:
            sbatch.append(f"--{key}={directive(f'site {key}', value)}")
    if train and job.device == "gpu":
        if site.gpu_request == "gpus-per-node":
            sbatch.append(f"--gpus-per-node={job.ranks_per_node}")
        elif site.gpu_request == "gres":
            sbatch.append(f"--gres=gpu:{job.ranks_per_node}")
    if spec.requeue:
        sbatch.append("--requeue")
    for line in site.sbatch:
        check_text("site sbatch", line)
        if not line.startswith("-"):
            raise JobSpecError(f"site sbatch entries must be options starting with -: {line!r}")
        sbatch.append(line)
    return sbatch


def setup_lines(site: Site) -> list[str]:
    setup = [f"module load {quote('site modules', m)}" for m in site.modules]
    setup += [check_text("site setup", line) for line in site.setup]
    for key, value in site.env.items():
        if not _ENV_NAME.fullmatch(key):
            raise JobSpecError(f"site env name {key!r} is not a valid shell variable name")
        setup.append(f"export {key}={shell_words(f'site env {key}', value)}")
    if site.launcher.allow_root and site.launcher.kind == "mpirun":
        setup.append(
            'if [ "$(id -u)" = 0 ]; then '
            "export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi"
        )
    return setup


def _launch_lines(spec: JobSpec, job: Job) -> list[str]:
    """The launcher command, one list entry per line of the script: a flag stays with its value.

    The trainer gets --config, --metrics, --device (so the ranks use the GPUs the job asked
    for), --resume auto when there is a checkpoint directory, --stage-dir unless --no-stage,
    --checkpoint-dir when given, then the arguments after a bare --.
    """
    launch = launcher_words(spec.site, job, job.ranks_per_node if spec.kind == "train" else 1)
    if spec.kind == "train":
        launch.append('"$python" -u -m hpcdl.train --config "$config" --metrics "$metrics"')
        launch.append(f"--device {job.device}")
        if job.checkpoint_dir:  # hpcdl.train refuses --resume auto without a checkpoint directory
            launch.append("--resume auto")
        if spec.stage:
            launch.append('--stage-dir "$stage_dir"')
        if job.checkpoint_dir != job.config.get("checkpoint_dir", ""):  # render's, or after --
            launch.append('--checkpoint-dir "$checkpoint_dir"')
    else:
        data = quote("config data", str(job.config["data"]))
        launch.append(f'"$python" -u -m hpcdl.stage --data {data} --config "$config"')
        # Plan for the training job's shape, not this job's one task per node.
        launch.append(
            f'--nodes {job.nodes} --ranks-per-node {job.ranks_per_node} --stage-dir "$stage_dir"'
        )
    if job.extra_args:
        launch.append(" ".join(quote("extra argument", a) for a in job.extra_args))
    return launch


def launcher_words(site: Site, job: Job, ranks: int) -> list[str]:
    """The site's launcher starting `ranks` ranks per node, one script line per entry."""
    if site.launcher.kind == "mpirun":
        launch = [
            # scancel's SIGTERM reaches every process: NOTE [mpirun and SIGTERM]
            '"$python" -m hpcdl.sigterm_blocked "$launcher"',
            f"-np {job.nodes * ranks} --map-by ppr:{ranks}:node --bind-to none"
            # --on-node-loss continue needs Open MPI's fault-tolerant mode (hpcdl.comm.ulfm)
            + (" --with-ft ulfm" if job.config.get("on_node_loss") == "continue" else ""),
        ]
    else:
        srun_mpi = directive("site launcher.srun_mpi", site.launcher.srun_mpi)
        launch = [
            '"$launcher"',
            f"--mpi={srun_mpi} --ntasks-per-node={ranks} --cpus-per-task={job.cpus}",
            "--kill-on-bad-exit=1",
        ]
    if site.launcher.args:
        launch.append(" ".join(quote("site launcher.args", a) for a in site.launcher.args))
    return launch


def _resolve(spec: JobSpec) -> _Resolved:
    job = _validate(spec)
    site = spec.site
    warnings = []
    if spec.kind == "train" and not job.checkpoint_dir:
        warnings.append(
            "no checkpoint_dir in the config and no --checkpoint-dir: a job stopped by its "
            "time-limit signal cannot be resumed (the script omits --resume auto)"
        )
    setup = setup_lines(site)
    python = site.python or sys.executable
    launcher = site.launcher.command or default_launcher(site, python)
    metrics = job.metrics
    values = {
        "kind": spec.kind,
        "site": site.name,
        "sbatch": "\n".join(f"#SBATCH {line}" for line in sbatch_lines(spec, job)),
        "setup": "\n".join(setup) if setup else ":",
        "python": quote("site python", python),
        "launcher": quote("site launcher.command", launcher),
        "config": quote("--config", str(job.config_path)),
        "metrics": (
            quote("config metrics", str(metrics))
            if metrics
            else quote("--output", job.output_dir)
            + '/"${SLURM_JOB_NAME}-${SLURM_JOB_ID}.metrics.jsonl"'
        ),
        "local_ssd": shell_words("site local_ssd", site.local_ssd) if site.local_ssd else "''",
        "stage_key": quote("--stage-key", job.stage_key),
        "checkpoint_dir": quote("checkpoint_dir", job.checkpoint_dir),
        "requeue": "true" if spec.requeue else "false",
        "stage": "true" if spec.stage else "false",
        "exit_stopped": str(EXIT_STOPPED_BY_SIGNAL),
        "exit_unfinished": str(EXIT_UNFINISHED),
        "launch": " \\\n    ".join(_launch_lines(spec, job)),
    }
    return _Resolved(values, warnings)


def default_launcher(site: Site, python: str) -> str:
    name = site.launcher.kind
    if name == "mpirun" and "/" in python:
        beside = Path(python).parent / "mpirun"
        if beside.exists():
            return str(beside)
    return name


def template_text(name: str) -> str:
    """A bundled template by file name (train.sbatch, stage.sbatch, chain.sh, ...)."""
    return resources.files("hpcdl.jobs").joinpath("templates", name).read_text()


def render(spec: JobSpec) -> tuple[str, list[str]]:
    """The sbatch script for `spec` (with chain > 1: the script that submits the chain), and
    warnings for the user (stderr). Kind "script" is hpcdl.jobs.script_job.render_script, which
    builds on this module."""
    if spec.kind == "script":
        raise JobSpecError("render kind 'script' with hpcdl.jobs.script_job.render_script")
    resolved = _resolve(spec)
    script = fill_template(f"{spec.kind}.sbatch", resolved.values)
    if spec.chain == 1:
        return script, resolved.warnings
    return _render_chain(spec, script, resolved.values), resolved.warnings


def _render_chain(spec: JobSpec, script: str, values: dict[str, str]) -> str:
    """A bash script that submits `script` spec.chain times, each job after the one before
    (--dependency=afterany): a training too long for one job's time limit (docs/slurm.md)."""
    positive("--chain", spec.chain)
    if spec.kind != "train":
        raise JobSpecError("--chain is for training jobs (render train)")
    if spec.requeue:
        raise JobSpecError(
            "--chain and --requeue both start the training again after a time-limit stop; "
            "use one of them"
        )
    if values["checkpoint_dir"] == "''":
        raise JobSpecError(
            "--chain needs a checkpoint directory (the config's checkpoint_dir or "
            "--checkpoint-dir): every job of the chain resumes from the last one's checkpoint"
        )
    about = {"count": str(spec.chain), "site": values["site"]}
    about["checkpoint_dir"] = values["checkpoint_dir"]
    return chain_script(script, spec.chain, fill_template("chain_about_train.txt", about))


def chain_script(job: str, count: int, about: str) -> str:
    """chain.sh: submits the sbatch script `job` `count` times, each after the one before;
    `about` is its header comment (what the jobs are and how they resume)."""
    if "\nHPCDL_CHAIN_JOB\n" in job:  # the here-document's end marker
        raise JobSpecError("the job script must not contain a line HPCDL_CHAIN_JOB")
    values = {"about": about.rstrip("\n"), "count": str(count), "job": job.rstrip("\n")}
    return fill_template("chain.sh", values)


def fill_template(template: str, values: dict[str, str]) -> str:
    """A template's text with every {{placeholder}} replaced by its value."""

    def fill(m: re.Match) -> str:
        key = m.group(1)
        if key not in values:
            raise KeyError(f"template {template} uses unknown placeholder {key}")
        return values[key]

    return _PLACEHOLDER.sub(fill, template_text(template))
