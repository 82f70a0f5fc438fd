"""The stage directory: where it is mounted, whether it is node-local, free space, writable.

Staging only pays when the stage directory is on the node's own disk or memory; a stage
directory on NFS, Lustre or GPFS copies from one shared file system to another. The file system
and its kind come from hpcdl.staging.fskind (the mount table), which stage-only's choice of
copy threads shares.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

from hpcdl.doctor.findings import ERROR, WARNING, Problem
from hpcdl.staging.fskind import (  # noqa: F401 (the doctor's names since before the move)
    NETWORK_FS,
    Mount,
    classify,
    mount_of,
    parse_mounts,
    read_mounts,
)

LOW_FREE_BYTES = 1 << 30
FIX_LOCAL = "fix: pass --stage-dir a node-local directory ($SLURM_TMPDIR, a local SSD, /tmp)"


def default_stage_dir(environ: dict[str, str] | None = None) -> tuple[str, str]:
    """(directory, where it came from), in the order the sbatch templates use."""
    env = os.environ if environ is None else environ
    for key in ("HPCDL_STAGE_DIR", "SLURM_TMPDIR", "TMPDIR"):
        if env.get(key):
            return env[key], f"${key}"
    return "/tmp", "default"


def _existing_ancestor(path: Path) -> tuple[Path, str | None]:
    """The deepest existing directory on the way to path, and what stops the rest if anything."""
    current = path
    while True:
        if current.is_dir():
            return current, None
        if current.exists() or current.is_symlink():
            return current.parent, f"{current} is not a directory"
        if current.parent == current:
            return current, None
        current = current.parent


def _writable(target: Path) -> str | None:
    """None when the stager could create a file in target; else why not (strerror).

    Tried for real, as the stager would: missing directories are made, a probe file is written,
    and everything the doctor made is removed again (nothing else is touched)."""
    made: list[Path] = []
    try:
        for part in reversed([target, *target.parents]):
            if not part.is_dir():
                part.mkdir()
                made.append(part)
        fd, name = tempfile.mkstemp(prefix=".hpcdl-doctor-", dir=target)
        os.close(fd)
        os.unlink(name)
        return None
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        for part in reversed(made):  # only what the doctor made, and only while it is empty
            with contextlib.suppress(OSError):
                os.rmdir(part)


def check_stage_dir(
    path: str, origin: str, mounts_text: str
) -> tuple[dict[str, Any], list[Problem]]:
    """Facts about the stage directory and its problems (one line each, with the fix)."""
    target = Path(os.path.abspath(os.path.expanduser(path)))
    facts: dict[str, Any] = {"path": str(target), "origin": origin, "exists": target.is_dir()}
    problems: list[Problem] = []
    directory, blocked = _existing_ancestor(target)
    if blocked:
        facts["writable"] = False
        problems.append(
            Problem(ERROR, f"stage dir {target} cannot be created: {blocked}; {FIX_LOCAL}")
        )
        return facts, problems
    real = os.path.realpath(directory)
    mount = mount_of(real, parse_mounts(mounts_text))
    if mount is not None:
        kind = classify(mount.fstype)
        facts.update(fs_type=mount.fstype, mount_point=mount.point, device=mount.source, kind=kind)
        if kind == "network":
            problems.append(
                Problem(
                    WARNING,
                    f"stage dir {target} is on {mount.fstype} ({mount.source} at {mount.point}), "
                    f"shared between nodes, not node-local: staging only adds copies; {FIX_LOCAL}",
                )
            )
    st = os.statvfs(directory)
    facts["free_bytes"] = st.f_bavail * st.f_frsize
    facts["total_bytes"] = st.f_blocks * st.f_frsize
    why = _writable(target)
    facts["writable"] = why is None
    if why is not None:
        problems.append(Problem(ERROR, f"stage dir {target} is not writable ({why}); {FIX_LOCAL}"))
    elif facts["free_bytes"] < LOW_FREE_BYTES:
        problems.append(
            Problem(
                WARNING,
                f"stage dir {target} has only {facts['free_bytes'] / 2**20:.0f} MiB free: staging "
                f"stops early and the rest is read from the PFS; {FIX_LOCAL} with more space",
            )
        )
    return facts, problems
