"""The cluster model against one training run on 4 emulated nodes (hpcdl.bench.validate).

Calibrate under mpirun across the nodes, predict with the dry run, then train 2 epochs with
staging from the slow FUSE file system: the predicted PFS opens are the run's, up to one open
per loader miss (a loader that read a file before its copy was ready). The predicted times are
compared by `python -m hpcdl.bench validate` (docs/PERFORMANCE.md, issue 26): on this 2-core
machine they land within 15 % in most runs but not all (epoch 1 up to +23 %), so they are a
benchmark's figures here, not a test's assertion.
"""

from __future__ import annotations

import pytest
from slowfs import require_fuse

from hpcdl.bench.cluster import leftovers, unavailable
from hpcdl.bench.validate import Setup, compare, run_case

pytestmark = pytest.mark.multinode


def test_model_counts_the_pfs_opens_of_a_4_node_run(tmp_path):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    require_fuse()
    setup = Setup(nodes=4, files=960, latency_ms=100.0, stage_threads=4)
    result = run_case(setup, tmp_path)
    assert not leftovers(), leftovers()
    errors, measured = compare(result), result["measured"]
    assert 0 <= errors["pfs_opens"] <= measured["misses"], (errors, measured)
    steps = setup.files // (setup.nodes * setup.ranks_per_node) // setup.batch_size
    reads = setup.epochs * setup.nodes * setup.ranks_per_node * steps * setup.batch_size
    assert measured["hits"] + measured["misses"] == reads
