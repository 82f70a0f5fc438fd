"""Node-local staging: plans (Python), the hpcdl-stage process (C++), the trainer's session.

See docs/staging.md for the file formats and behaviour.
"""

from hpcdl.data.dataset import FileEntry, FileTable
from hpcdl.data.pfs import PfsEmulation, open_source
from hpcdl.staging.binary import StagerNotFound, find_stager_binary, stager_version
from hpcdl.staging.plan import (
    FileTreeDataset,
    NodePlan,
    PlanError,
    dataset_fingerprint,
    plan_for_node,
    write_plan,
)
from hpcdl.staging.session import (
    Locator,
    StageOptions,
    StagingSession,
    default_capacity,
    parse_capacity,
)

__all__ = [
    "FileEntry",
    "FileTable",
    "FileTreeDataset",
    "Locator",
    "NodePlan",
    "PfsEmulation",
    "PlanError",
    "StageOptions",
    "StagerNotFound",
    "StagingSession",
    "dataset_fingerprint",
    "default_capacity",
    "find_stager_binary",
    "open_source",
    "parse_capacity",
    "plan_for_node",
    "stager_version",
    "write_plan",
]
