"""`python -m tools.bench on-node-loss` (issue 49): one round of its five jobs on this machine.
Its figures of time are not asserted (no timed assertions); what it reports is: the continue
job finished (exit 0), every sample of each epoch read once on both paths, the final
parameters bitwise equal when both paths resumed from the same checkpoint."""

from __future__ import annotations

import json

from tools.bench import on_node_loss


def test_one_round_reports_exactly_once_and_bitwise_for_both_paths(capsys):
    argv = ["--rounds", "1", "--samples", "360", "--kill-at", "15", "--json"]
    assert on_node_loss.main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    (round_,) = json.loads(out[-1])["rounds"]
    assert round_["status"]["continue_"] == 0 and round_["status"]["resume"] == 0, round_
    assert round_["status"]["stop"] != 0  # the killed job of the restart path
    assert round_["exactly_once"] == {"continue_": True, "restart": True}, round_
    resumed = round_["resumed_step"]
    assert 10 <= resumed["continue_"] < 30 and 10 <= resumed["restart"] < 30, resumed
    if resumed["continue_"] == resumed["restart"]:
        assert round_["bitwise_equal"] is True
    else:
        assert round_["bitwise_equal"] is None  # said so, not compared
    assert round_["lost_s"]["continue_"] > 0 and round_["lost_s"]["restart"] > 0
    assert out[1].startswith("continue: exit 0 and every sample of each epoch read once in 1 of 1")
