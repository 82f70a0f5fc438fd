"""hpcdl's lines for users on stderr, one format for every kind: `hpcdl: rank R: warning: ...`.

The error lines come from hpcdl.comm.failure ("hpcdl: rank R: error: ..."); warnings that code
below the trainer raises while it runs (the loader's watchdog) use the same shape here, not
Python's warnings format with a source path and a line of code under it, which reads as a bug.
The rank is the launcher's (these modules know no communicator): Open MPI, PMIx, PMI, torchrun
or Slurm's srun, in that order; 0 for a process started alone.
"""

from __future__ import annotations

import os
import sys

# torchrun sets RANK (and TORCHELASTIC_RUN_ID); inside a Slurm job SLURM_PROCID then numbers
# torchrun's agents, not the training processes, so torchrun's RANK comes first.
_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")


def launcher_rank() -> int:
    """This process's world rank as its launcher announced it (0 for a singleton)."""
    keys = list(_MPI_RANK_VARS)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        keys.append("RANK")
    keys.append("SLURM_PROCID")
    for key in keys:
        value = os.environ.get(key)
        if value is not None and value.isdigit():
            return int(value)
    return 0


def warn(text: str) -> None:
    """Print `hpcdl: rank R: warning: text` on stderr at once (the job may end soon after)."""
    print(f"hpcdl: rank {launcher_rank()}: warning: {text}", file=sys.stderr, flush=True)
