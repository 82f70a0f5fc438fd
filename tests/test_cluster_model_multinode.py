"""The cluster model against one training run on 4 emulated nodes (hpcdl.bench.validate).

Calibrate under mpirun across the nodes, predict with the dry run, then train 2 epochs with
staging from the slow FUSE file system: the predicted epoch times and staging finish lie
within 15 % of the run's, and the PFS opens match (each loader miss may add one open).
"""

from __future__ import annotations

import pytest
from slowfs import require_fuse

from hpcdl.bench.cluster import leftovers, unavailable
from hpcdl.bench.validate import Setup, compare, run_case

pytestmark = pytest.mark.multinode


def test_model_predicts_a_4_node_run_within_15_percent(tmp_path):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    require_fuse()
    result = run_case(Setup(nodes=4), tmp_path)
    assert not leftovers(), leftovers()
    errors, measured = compare(result), result["measured"]
    shown = {k: round(v, 3) for k, v in errors.items()}
    for figure in ("epoch1_s", "later_epoch_s", "staging_finish_s"):
        assert abs(errors[figure]) <= 0.15, (figure, shown, result)
    assert 0 <= errors["pfs_opens"] <= measured["misses"], (shown, measured)
    assert measured["hits"] + measured["misses"] == 2 * 8 * 30 * 8  # epochs x ranks x steps x b
