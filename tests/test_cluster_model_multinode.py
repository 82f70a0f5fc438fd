"""The cluster model against training runs on 4 emulated nodes (tools.bench.validate).

Calibrate under mpirun across the nodes, predict with the dry run, then train 2 epochs with
staging from the slow FUSE file system, twice from empty stage dirs. The model's epoch 1, later
epoch and staging finish lie within 15 % of the runs' medians (their means), and its PFS opens
are each run's, up to one open per loader miss (a loader that read a file before its copy was
ready). Two runs, not the tool's three: each is 43 s of CI's longest test (calibration 111 s,
runs 43 s each, 2026-11-29), and with one rank per node no run stalled in the runs recorded,
whose errors stayed within about 5 %, a third of the bound.

One rank per node: with two, 8 ranks spin in MPI on this 2-core machine beside 4 stagers and
the FUSE server, and about one run in four stalls for 1-6 s in epoch 1 while staging runs
(docs/PERFORMANCE.md, issue 26); `python -m tools.bench validate` covers 2 ranks per node.
Calibration times windows of 10 steps, not the tool's 30: over these 150 Mbit/s links a step is
about 0.65 s, and the median of three such windows still holds it (quiet windows within 2 % of
each other). Each shorter window also shortens the contention loads, which are sized to cover a
window: 10 steps take calibration to 111 s from 150 s at 20 (30 took 43 s more), with the errors as
before (at 10: within 3.4 %; at 20: 5.1 %; at 30: 5.4 %).
"""

from __future__ import annotations

import pytest
from slowfs import require_fuse

from tools.bench.cluster import leftovers, unavailable
from tools.bench.validate import CHECKS, Setup, compare, run_case

pytestmark = [pytest.mark.multinode, pytest.mark.alone]  # its 15 % is wall clock


def test_model_predicts_a_4_node_run_within_15_percent_and_its_pfs_opens(tmp_path):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    require_fuse()
    setup = Setup(nodes=4, ranks_per_node=1, runs=2, calibrate_steps=10)
    result = run_case(setup, tmp_path)
    assert not leftovers(), leftovers()
    errors, measured, predicted = compare(result), result["measured"], result["predicted"]
    for figure in CHECKS[:3]:
        assert abs(errors[figure]) <= 0.15, (figure, errors, measured, predicted)
    steps = setup.files // (setup.nodes * setup.ranks_per_node) // setup.batch_size
    reads = setup.epochs * setup.nodes * setup.ranks_per_node * steps * setup.batch_size
    for run in result["runs"]:
        assert 0 <= run["pfs_opens"] - predicted["pfs_opens_total"] <= run["misses"], run
        assert run["hits"] + run["misses"] == reads, run
