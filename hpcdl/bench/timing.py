"""The one timing convention of hpcdl's benchmarks: each round's slowest rank, then the median
over the rounds.

A data-parallel step, or a collective, takes as long as its slowest rank, round by round; the
median over the rounds then drops the rounds that a burst of other load slowed. Every
multi-rank figure of `bench allreduce`, `bench calibrate` and the `bench scaling` worker is
taken this way (calibrate once took each rank's median first and then the slowest rank, which
lets one rank's typical round stand for rounds in which another rank was the slow one).

One figure is summed rather than typical: the trainer's step that `bench calibrate` gives the
cluster model, whose epochs are the sum of their steps, rare slow ones included. It takes each
rank's mean over the rounds, then the slowest rank (slowest_rank_mean): the ranks' rounds end
at different moments, so a round's maximum over ranks counts one rank's wait in one round and
another's in the next, which the wall clock of the whole run does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def slowest_per_round(comm: Any, seconds: Sequence[float] | np.ndarray) -> np.ndarray:
    """Each round's time on the slowest rank; collective (every rank, the same rounds)."""
    rounds = np.array(seconds, dtype=np.float64)
    if comm.Get_size() > 1:
        from mpi4py import MPI  # noqa: PLC0415

        comm.Allreduce(MPI.IN_PLACE, rounds, op=MPI.MAX)
    return rounds


def slowest_rank_median(comm: Any, seconds: Sequence[float] | np.ndarray) -> float:
    """Median over rounds of slowest_per_round: the convention's one figure."""
    return float(np.median(slowest_per_round(comm, seconds)))


def slowest_rank_mean(comm: Any, seconds: Sequence[float] | np.ndarray) -> float:
    """The largest of the ranks' mean round: for a figure that is summed (see the module)."""
    mean = float(np.mean(np.asarray(seconds, dtype=np.float64)))
    if comm.Get_size() > 1:
        from mpi4py import MPI  # noqa: PLC0415

        mean = comm.allreduce(mean, op=MPI.MAX)
    return mean
