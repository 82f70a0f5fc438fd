"""Finding the hpcdl-stage executable built by `pip install .`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


class StagerNotFound(RuntimeError):
    """hpcdl-stage is not installed where hpcdl looks for it."""


def find_stager_binary() -> Path:
    """$HPCDL_STAGE_BIN, else hpcdl-stage on PATH, else beside the running Python."""
    env = os.environ.get("HPCDL_STAGE_BIN")
    if env:
        if not os.access(env, os.X_OK):
            raise StagerNotFound(f"HPCDL_STAGE_BIN={env} is not an executable file")
        return Path(env)
    found = shutil.which("hpcdl-stage")
    if found:
        return Path(found)
    beside = Path(sys.executable).parent / "hpcdl-stage"
    if os.access(beside, os.X_OK):
        return beside
    raise StagerNotFound(
        "hpcdl-stage (the C++ staging process) was not found: run `pip install .` (or "
        "`pip install -e .`) in the hpcdl checkout to build it, or set HPCDL_STAGE_BIN"
    )


def stager_version() -> str:
    """The first line printed by `hpcdl-stage --version`."""
    out = subprocess.run(
        [str(find_stager_binary()), "--version"], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()
