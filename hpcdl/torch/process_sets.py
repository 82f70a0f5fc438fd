"""Horovod's process sets: only the global one (every rank) is built.

`global_process_set` is every collective's default; any other set raises NotBuilt
(hpcdl.torch.unbuilt, docs/horovod.md "Not built").
"""

from __future__ import annotations

from typing import Any

from hpcdl.torch import process
from hpcdl.torch.unbuilt import not_built


class ProcessSet:
    """Horovod's process set: only the global one (every rank) exists here."""

    def __init__(self, ranks_or_comm: Any = None) -> None:
        self.ranks = ranks_or_comm
        self.process_set_id = 0 if ranks_or_comm is None else None

    def included(self) -> bool:
        return True

    def size(self) -> int:
        return process.size()

    def rank(self) -> int:
        return process.rank()

    def __repr__(self) -> str:
        return "ProcessSet(global)" if self.process_set_id == 0 else f"ProcessSet({self.ranks})"


global_process_set = ProcessSet()


def check_process_set(process_set: Any) -> None:
    """The global process set passes; any other raises NotBuilt."""
    if process_set is not global_process_set:
        raise not_built("process sets (process_set=...)")


def add_process_set(process_set: Any) -> ProcessSet:
    """Horovod's dynamic process sets; not built.

    Args:
        process_set: a ProcessSet or a list of ranks.

    Raises:
        NotBuilt, always (run the collectives over every rank)."""
    raise not_built("process sets (hvd.add_process_set)")


def remove_process_set(process_set: Any) -> bool:
    """Horovod's dynamic process sets; not built.

    Args:
        process_set: the ProcessSet to remove.

    Raises:
        NotBuilt, always."""
    raise not_built("process sets (hvd.remove_process_set)")
