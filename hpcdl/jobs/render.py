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

KINDS = ("train", "stage")
DEVICES = ("cpu", "gpu")
EXIT_STOPPED_BY_SIGNAL = 3  # hpcdl.train's exit status after a signal-triggered checkpoint

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
    device: str  # cpu | gpu
    time: str  # Slurm time limit, HH:MM:SS or D-HH:MM:SS
    config: str  # the training TOML (hpcdl.train --config)
    site: Site
    job_name: str = ""  # "" = hpcdl-<kind>
    output_dir: str = "."  # where Slurm writes <job name>-<job id>.out
    cpus_per_task: int | None = None  # None = the site's default
    signal_seconds: int | None = None  # None = the site's default; 0 = no early signal
    checkpoint_dir: str | None = None  # overrides the config's checkpoint_dir
    stage: bool = True  # pass a node-local --stage-dir to the trainer
    stage_key: str = ""  # stage subdirectory key; "" = the job id (stage jobs need one)
    requeue: bool = False  # #SBATCH --requeue, and requeue itself after a signal stop
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


def _positive(name: str, value: int) -> int:
    if value < 1:
        raise JobSpecError(f"{name} must be >= 1, got {value}")
    return value


def _read_config(path: str) -> dict:
    from hpcdl.config import ConfigError, load_toml  # noqa: PLC0415

    try:
        return load_toml(path)
    except ConfigError as exc:
        raise JobSpecError(f"--config: {exc}") from None


@dataclass
class _Resolved:
    """A JobSpec after validation, with every value as it will appear in the script."""

    values: dict[str, str]
    warnings: list[str]


def _resolve(spec: JobSpec) -> _Resolved:
    site = spec.site
    if spec.kind not in KINDS:
        raise JobSpecError(f"job kind must be one of {', '.join(KINDS)}, got {spec.kind!r}")
    if spec.device not in DEVICES:
        raise JobSpecError(f"--device must be one of {', '.join(DEVICES)}, got {spec.device!r}")
    nodes = _positive("--nodes", spec.nodes)
    tpn = _positive("--tasks-per-node", spec.tasks_per_node)
    cpus = _positive("--cpus-per-task", spec.cpus_per_task or site.cpus_per_task)
    limit = time_seconds(spec.time)
    signal_s = site.signal_seconds if spec.signal_seconds is None else spec.signal_seconds
    if signal_s < 0 or signal_s > 65535:
        raise JobSpecError(f"--signal-seconds must be 0-65535, got {signal_s}")
    if spec.kind == "train" and signal_s >= limit:
        raise JobSpecError(
            f"--signal-seconds {signal_s} must be shorter than --time {spec.time} ({limit} s); "
            "lower it or pass --signal-seconds 0 for no early checkpoint signal"
        )
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

    check_text("--config", spec.config)
    config_path = Path(spec.config).expanduser().resolve()
    config = _read_config(str(config_path))
    output_dir = directive(
        "--output", str(Path(check_text("--output", spec.output_dir)).expanduser().resolve())
    )
    warnings = []
    checkpoint_dir = spec.checkpoint_dir or config.get("checkpoint_dir") or ""
    if spec.kind == "train" and not checkpoint_dir:
        warnings.append(
            "no checkpoint_dir in the config and no --checkpoint-dir: a job stopped by its "
            "time-limit signal cannot be resumed (the script omits --resume auto)"
        )
    if spec.kind == "stage" and not config.get("data"):
        raise JobSpecError(f"--config {spec.config}: render stage needs a data = ... key")

    sbatch = [
        f"--job-name={job_name}",
        f"--nodes={nodes}",
        f"--ntasks-per-node={1 if spec.kind == 'stage' else tpn}",
        f"--cpus-per-task={cpus}",
        f"--time={spec.time}",
        f"--output={output_dir}/%x-%j.out",
        "--open-mode=append",
    ]
    if spec.kind == "train" and signal_s:
        sbatch.append(f"--signal=B:USR1@{signal_s}")
    for key, value in (
        ("partition", site.partition),
        ("account", site.account),
        ("qos", site.qos),
        ("constraint", site.constraint),
    ):
        if value:
            sbatch.append(f"--{key}={directive(f'site {key}', value)}")
    if spec.device == "gpu" and spec.kind == "train":
        if site.gpu_request == "gpus-per-node":
            sbatch.append(f"--gpus-per-node={tpn}")
        elif site.gpu_request == "gres":
            sbatch.append(f"--gres=gpu:{tpn}")
    if spec.requeue:
        sbatch.append("--requeue")
    for line in site.sbatch:
        check_text("site sbatch", line)
        if not line.startswith("-"):
            raise JobSpecError(f"site sbatch entries must be options starting with -: {line!r}")
        sbatch.append(line)

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

    python = site.python or sys.executable
    launcher = site.launcher.command or _default_launcher(site, python)
    ranks_per_node = 1 if spec.kind == "stage" else tpn
    # One list entry per line of the rendered command: a flag stays with its value.
    if site.launcher.kind == "mpirun":
        launch = [
            '"$launcher"',
            f"-np {nodes * ranks_per_node} --map-by ppr:{ranks_per_node}:node --bind-to none",
        ]
    else:
        srun_mpi = directive("site launcher.srun_mpi", site.launcher.srun_mpi)
        launch = [
            '"$launcher"',
            f"--mpi={srun_mpi} --ntasks-per-node={ranks_per_node} --cpus-per-task={cpus}",
            "--kill-on-bad-exit=1",
        ]
    if site.launcher.args:
        launch.append(" ".join(quote("site launcher.args", a) for a in site.launcher.args))
    if spec.kind == "train":
        launch += [
            '"$python" -u -m hpcdl.train --config "$config" --metrics "$metrics"',
        ]
        if checkpoint_dir:  # hpcdl.train refuses --resume auto without a checkpoint directory
            launch.append("--resume auto")
        if spec.stage:
            launch.append('--stage-dir "$stage_dir"')
        if spec.checkpoint_dir:
            launch.append(f"--checkpoint-dir {quote('--checkpoint-dir', spec.checkpoint_dir)}")
    else:
        data = quote("config data", str(config["data"]))
        launch.append(f'"$python" -u -m hpcdl.stage --data {data} --config "$config"')
        # Plan for the training job's shape, not this job's one task per node.
        launch.append(f'--nodes {nodes} --ranks-per-node {tpn} --stage-dir "$stage_dir"')
    if spec.extra_args:
        launch.append(" ".join(quote("extra argument", a) for a in spec.extra_args))

    values = {
        "kind": spec.kind,
        "site": site.name,
        "sbatch": "\n".join(f"#SBATCH {line}" for line in sbatch),
        "setup": "\n".join(setup) if setup else ":",
        "python": quote("site python", python),
        "launcher": quote("site launcher.command", launcher),
        "config": quote("--config", str(config_path)),
        "metrics": (
            quote("config metrics", str(config["metrics"]))
            if config.get("metrics")
            else quote("--output", output_dir)
            + '/"${SLURM_JOB_NAME}-${SLURM_JOB_ID}.metrics.jsonl"'
        ),
        "local_ssd": shell_words("site local_ssd", site.local_ssd) if site.local_ssd else "''",
        "stage_key": quote("--stage-key", stage_key),
        "checkpoint_dir": quote("checkpoint_dir", checkpoint_dir),
        "requeue": "true" if spec.requeue else "false",
        "stage": "true" if spec.stage else "false",
        "exit_stopped": str(EXIT_STOPPED_BY_SIGNAL),
        "launch": " \\\n    ".join(launch),
    }
    return _Resolved(values, warnings)


def _default_launcher(site: Site, python: str) -> str:
    name = site.launcher.kind
    if name == "mpirun" and "/" in python:
        beside = Path(python).parent / "mpirun"
        if beside.exists():
            return str(beside)
    return name


def template_text(kind: str) -> str:
    return resources.files("hpcdl.jobs").joinpath("templates", f"{kind}.sbatch").read_text()


def render(spec: JobSpec) -> tuple[str, list[str]]:
    """The sbatch script for `spec`, and warnings for the user (stderr)."""
    resolved = _resolve(spec)
    text = template_text(spec.kind)

    def fill(m: re.Match) -> str:
        key = m.group(1)
        if key not in resolved.values:
            raise KeyError(f"template {spec.kind}.sbatch uses unknown placeholder {key}")
        return resolved.values[key]

    return _PLACEHOLDER.sub(fill, text), resolved.warnings
