"""hpcdl's lines for users on stderr, one format for every kind: `hpcdl: rank R: KIND: text`.

Every `hpcdl: rank R: ...` line is made here: errors and the stand-down line of
hpcdl.comm.failure ("hpcdl: rank R: error: ...", "hpcdl: rank R: stopped because rank N
failed"), a bug's traceback ("hpcdl: rank R failed:" and the traceback under it), and warnings
that code below the trainer raises while it runs (the loader's watchdog), in this shape rather
than Python's warnings format with a source path and a line of code under it, which reads as a
bug.
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


def rank_line(text: str, kind: str | None = None, rank: int | None = None) -> str:
    """`hpcdl: rank R: kind: text` (`hpcdl: rank R: text` without a kind); R is the given rank,
    else the launcher's."""
    where = launcher_rank() if rank is None else rank
    return f"hpcdl: rank {where}: {kind + ': ' if kind else ''}{text}"


def say(text: str, kind: str | None = None, rank: int | None = None) -> None:
    """Print rank_line(...) on stderr at once (the job may end soon after)."""
    print(rank_line(text, kind, rank), file=sys.stderr, flush=True)


def warn(text: str, rank: int | None = None) -> None:
    """`hpcdl: rank R: warning: text` on stderr."""
    say(text, "warning", rank)


def error(text: str, rank: int | None = None) -> None:
    """`hpcdl: rank R: error: text` on stderr: the one line of a user's error."""
    say(text, "error", rank)


def crashed(report: str, rank: int | None = None) -> None:
    """`hpcdl: rank R failed:` and a bug's traceback under it, on stderr."""
    where = launcher_rank() if rank is None else rank
    print(f"hpcdl: rank {where} failed:\n{report}", file=sys.stderr, flush=True)
