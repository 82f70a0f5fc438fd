"""Site settings for sbatch scripts: one small TOML file per cluster, defaults in one place.

A site file says how a cluster differs (partition, account, modules, GPU request style, the
node-local SSD, the MPI launcher, extra #SBATCH lines, environment). Bundled examples live in
`hpcdl/jobs/sites/*.toml`; `python -m hpcdl.jobs sites` lists them. Every value is validated
here, before rendering, with a message naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

GPU_REQUEST_STYLES = ("gpus-per-node", "gres", "none")
LAUNCHERS = ("mpirun", "srun")


class JobSpecError(ValueError):
    """An invalid site or job value; the message names the field."""


@dataclass
class Launcher:
    kind: str = "mpirun"  # mpirun: Open MPI/MPICH mpirun inside the allocation; srun: srun --mpi=
    command: str = ""  # "" = mpirun next to the job's python if there, else `mpirun`/`srun`
    args: list[str] = field(default_factory=list)  # extra launcher arguments, before python
    srun_mpi: str = "pmix"  # srun --mpi=<this> (only for kind = "srun")
    allow_root: bool = False  # export OMPI_ALLOW_RUN_AS_ROOT* when the job runs as root


@dataclass
class Site:
    name: str = "generic"
    description: str = ""
    tested: str = "untested"  # where this file was last run for real; shown by `sites`
    partition: str = ""  # "" = the cluster's default partition
    account: str = ""
    qos: str = ""
    constraint: str = ""
    gpu_request: str = "gpus-per-node"  # gpus-per-node | gres | none
    cpus_per_task: int = 1  # default for --cpus-per-task
    local_ssd: str = ""  # node-local staging base after $HPCDL_STAGE_DIR and $SLURM_TMPDIR
    signal_seconds: int = 120  # --signal=B:USR1@<this>: checkpoint this long before the limit
    python: str = ""  # "" = the interpreter running the renderer
    modules: list[str] = field(default_factory=list)  # `module load` each, in order
    setup: list[str] = field(default_factory=list)  # shell lines copied verbatim (site code)
    sbatch: list[str] = field(default_factory=list)  # extra `#SBATCH` options, e.g. "--exclusive"
    env: dict[str, str] = field(default_factory=dict)  # exported before launching
    launcher: Launcher = field(default_factory=Launcher)


def _bundled_dir():
    return resources.files("hpcdl.jobs").joinpath("sites")


def bundled_sites() -> dict[str, Site]:
    """Name -> Site for every bundled example, sorted by name."""
    sites = {}
    for entry in sorted(_bundled_dir().iterdir(), key=lambda p: p.name):
        if entry.name.endswith(".toml"):
            sites[entry.name[: -len(".toml")]] = _parse(entry.read_text(), f"bundled {entry.name}")
    return sites


def load_site(name_or_path: str | None) -> Site:
    """A bundled site by name (default: generic) or a site TOML file by path."""
    if not name_or_path:
        name_or_path = "generic"
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise JobSpecError(f"--site: file {name_or_path} does not exist") from None
        except OSError as exc:
            raise JobSpecError(f"--site: cannot read {name_or_path}: {exc.strerror}") from None
        return _parse(text, str(path))
    sites = bundled_sites()
    if name_or_path not in sites:
        known = ", ".join(sites)
        raise JobSpecError(
            f"--site: no bundled site named {name_or_path!r} (bundled: {known}); "
            "pass a path to a site .toml file instead"
        )
    return sites[name_or_path]


def _parse(text: str, source: str) -> Site:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise JobSpecError(f"site file {source} is not valid TOML: {exc}") from None
    launcher_data = data.pop("launcher", {})
    if not isinstance(launcher_data, dict):
        raise JobSpecError(f"site file {source}: [launcher] must be a table")
    site = Site(
        **_typed(Site, data, source, ""),
        launcher=Launcher(**_typed(Launcher, launcher_data, source, "launcher.")),
    )
    _check(site, source)
    return site


def _typed(cls: type, data: dict[str, Any], source: str, prefix: str) -> dict[str, Any]:
    """Check keys and value types of one TOML table against a dataclass."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "launcher"}
    out = {}
    for key, value in data.items():
        if key not in fields:
            allowed = ", ".join(fields)
            raise JobSpecError(f"site file {source}: unknown key {prefix}{key} (known: {allowed})")
        default = fields[key].default
        if default is dataclasses.MISSING:
            default = fields[key].default_factory()  # type: ignore[misc]
        ok = isinstance(value, type(default)) and not (
            isinstance(value, bool) and not isinstance(default, bool)
        )
        if ok and isinstance(value, list):
            ok = all(isinstance(v, str) for v in value)
        if ok and isinstance(value, dict):
            ok = all(isinstance(v, str) for v in value.values())
        if not ok:
            want = type(default).__name__
            if isinstance(default, (list, dict)):
                want += " of strings"
            raise JobSpecError(f"site file {source}: {prefix}{key} must be a {want}, got {value!r}")
        out[key] = value
    return out


def _check(site: Site, source: str) -> None:
    if site.gpu_request not in GPU_REQUEST_STYLES:
        raise JobSpecError(
            f"site file {source}: gpu_request must be one of {', '.join(GPU_REQUEST_STYLES)}, "
            f"got {site.gpu_request!r}"
        )
    if site.launcher.kind not in LAUNCHERS:
        raise JobSpecError(
            f"site file {source}: launcher.kind must be one of {', '.join(LAUNCHERS)}, "
            f"got {site.launcher.kind!r}"
        )
    if site.cpus_per_task < 1:
        raise JobSpecError(f"site file {source}: cpus_per_task must be >= 1")
    if site.signal_seconds < 0:
        raise JobSpecError(f"site file {source}: signal_seconds must be >= 0")
