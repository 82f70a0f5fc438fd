"""The one timing convention of hpcdl's benchmarks: each round's slowest rank, then the median
over the rounds.

A data-parallel step, or a collective, takes as long as its slowest rank, round by round; the
median over the rounds then drops the rounds that a burst of other load slowed. Every
multi-rank figure of `bench allreduce`, `bench calibrate` and the `bench scaling` worker is
taken this way (calibrate once took each rank's median first and then the slowest rank, which
lets one rank's typical round stand for rounds in which another rank was the slow one).

One figure is summed rather than typical: the trainer's step that `bench calibrate` gives the
cluster model, whose epochs are the sum of their steps, rare slow ones included. It takes the
mean over the rounds of the same slowest-rank times (slowest_rank_mean).
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
    """Mean over rounds of slowest_per_round: for a figure that is summed (see the module)."""
    return float(np.mean(slowest_per_round(comm, seconds)))
