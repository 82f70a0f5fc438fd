"""Node-local staging: plans (Python), the hpcdl-stage process (C++), the trainer's session.

See docs/staging.md for the file formats and behaviour.

The names below are imported when first asked for (PEP 562), not with the package: the
detached remover (`python -m hpcdl.staging.trash`, NOTE [clean-up off the job's path]) runs
while a job's processes end, on the same cores, and needs only the standard library; importing
the session, the data sets and NumPy first cost it half a second of CPU.
"""

from __future__ import annotations

import importlib

# name -> the module that defines it
_LAZY = {
    "FileEntry": "hpcdl.data.dataset",
    "FileTable": "hpcdl.data.dataset",
    "PfsEmulation": "hpcdl.data.pfs",
    "open_source": "hpcdl.data.pfs",
    "StagerNotFound": "hpcdl.staging.binary",
    "find_stager_binary": "hpcdl.staging.binary",
    "stager_version": "hpcdl.staging.binary",
    "FileTreeDataset": "hpcdl.staging.plan",
    "NodePlan": "hpcdl.staging.plan",
    "PlanError": "hpcdl.staging.plan",
    "dataset_fingerprint": "hpcdl.staging.plan",
    "plan_for_node": "hpcdl.staging.plan",
    "write_plan": "hpcdl.staging.plan",
    "Locator": "hpcdl.staging.session",
    "StageOptions": "hpcdl.staging.session",
    "StagingSession": "hpcdl.staging.session",
    "default_capacity": "hpcdl.staging.session",
    "parse_capacity": "hpcdl.staging.session",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hpcdl.staging' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups do not come here
    return value
