"""hpcdl.bench.timing: each round's slowest rank, then the median over rounds (2 MPI ranks)."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.bench.timing import slowest_per_round, slowest_rank_mean, slowest_rank_median


@pytest.mark.mpi(min_size=2)
def test_each_rounds_slowest_rank_then_the_median(world):
    # rank 0 is slow in round 0, rank 1 in rounds 1 and 2: no rank's own median is the answer
    mine = {0: [5.0, 1.0, 1.0], 1: [1.0, 4.0, 3.0]}.get(world.rank, [1.0, 1.0, 1.0])
    assert slowest_per_round(world.comm, mine).tolist() == [5.0, 4.0, 3.0]
    assert slowest_rank_median(world.comm, mine) == 4.0  # median-then-max would say 3.0
    from mpi4py import MPI  # noqa: PLC0415

    alone = slowest_rank_median(MPI.COMM_SELF, mine)  # one rank: the median of its own rounds
    assert alone == float(np.median(mine))


@pytest.mark.mpi(min_size=2)
def test_a_summed_figure_is_the_slowest_ranks_whole_run(world):
    """Ranks that wait for each other in turn: each round's maximum would count both waits
    (mean 4.0), while each rank's run took 3 rounds of 2.0 on average, as the wall clock."""
    mine = {0: [5.0, 1.0, 0.0], 1: [1.0, 4.0, 1.0]}.get(world.rank, [2.0, 2.0, 2.0])
    assert slowest_per_round(world.comm, mine).mean() > 3.0
    assert slowest_rank_mean(world.comm, mine) == 2.0
