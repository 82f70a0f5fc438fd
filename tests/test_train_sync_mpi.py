"""Start-up agreement and `--sync params:K`, checked inside a 2-rank MPI job (pytest --with-mpi).

Every test gathers each rank's outcome with a collective before asserting, so a rank that
behaves differently fails the test on every rank instead of leaving the others in a collective.
"""

import numpy as np
import pytest
from helpers import digest

from hpcdl import nn, resume, startup_checks
from hpcdl import train as trainer
from hpcdl.comm import collectives
from hpcdl.comm.failure import SystemExitWithMessage
from hpcdl.config import TrainConfig, parse_args

# --- verify_same_run ---------------------------------------------------------------------------


def _verify_outcome(world, cfg, layout):
    """'ok', or ('raised', message) -- gathered from every rank."""
    try:
        startup_checks.verify_same_run(world, cfg, layout)
        mine = "ok"
    except SystemExitWithMessage as exc:
        mine = ("raised", exc.message)
    return world.comm.allgather(mine)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("differs", ["nothing", "config", "layout", "model"])
def test_verify_same_run_stops_every_rank_when_one_rank_differs(world, differs):
    odd = world.rank == world.size - 1  # the last rank is the odd one out
    cfg = TrainConfig(data="/data/train", model="mlp", lr=0.1)
    name, shape = "mlp", (1, 8, 8)
    if odd and differs == "config":
        cfg = TrainConfig(data="/data/train", model="mlp", lr=0.2)
    if odd and differs == "layout":
        shape = (1, 8, 9)  # same model, another input size: other parameter shapes
    if odd and differs == "model":
        name = "cnn"
    layout = resume.shapes(nn.build_model(name, shape, 10, seed=0))

    outcomes = _verify_outcome(world, cfg, layout)

    if differs == "nothing":
        assert outcomes == ["ok"] * world.size
        return
    assert all(o != "ok" for o in outcomes), outcomes  # every rank stops, none trains on
    message = outcomes[0][1]
    assert message is not None and "\n" not in message
    assert f"ranks [{world.size - 1}]" in message, message
    assert "different model or configuration than rank 0" in message
    assert outcomes[1:] == [("raised", None)] * (world.size - 1)  # printed once, by rank 0


# --- --sync grad / params:K through the real training loop -------------------------------------


def _run_trainer_recording_params(world, tmp, data, sync, monkeypatch):
    """Run hpcdl.train.train() in-process for 7 steps and record this rank's parameters
    after every step (spy on resume.save, called with --checkpoint-every 1 after each step)
    and the steps at which the trainer averaged them (spy on collectives.allreduce_mean)."""
    cfg = parse_args(
        [
            *("--data", str(data / "train"), "--model", "mlp", "--epochs", "1"),
            *("--batch-size", "16", "--workers", "0", "--seed", "5", "--lr", "0.05"),
            *("--sync", sync, "--max-steps", "7", "--quiet"),
            *("--checkpoint-dir", str(tmp / "ckpt"), "--checkpoint-every", "1"),
        ]
    )
    after_step: dict[int, np.ndarray] = {}
    calls = []  # (step, buffer, copy before, copy after) for every allreduce_mean
    models = []
    real_save, real_mean = resume.save, collectives.allreduce_mean

    def save(run, at, epoch_stats=None):
        models.append(run.engine.model)
        after_step[at.global_step] = run.engine.model.params.copy()
        return real_save(run, at, epoch_stats)

    def allreduce_mean(comm, buf, host_staged=False):
        before = buf.copy()
        real_mean(comm, buf, host_staged)
        calls.append((len(after_step) + 1, buf, before, buf.copy()))

    monkeypatch.setattr(resume, "save", save)
    monkeypatch.setattr(collectives, "allreduce_mean", allreduce_mean)
    status = trainer.train(cfg, world)
    assert models, "the trainer never saved"
    params = models[0].params
    averaged = [(s, b, a) for s, buf, b, a in calls if np.shares_memory(buf, params)]
    return status, after_step, averaged


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(("sync", "k"), [("grad", 1), ("params:3", 3)])
def test_parameters_agree_exactly_at_sync_points_and_differ_between(
    world, shared_digits, mpi_tmp_path, monkeypatch, sync, k
):
    status, after_step, averaged = _run_trainer_recording_params(
        world, mpi_tmp_path, shared_digits, sync, monkeypatch
    )
    assert status == 0
    assert sorted(after_step) == list(range(1, 8))
    digests = world.comm.allgather({s: digest(p) for s, p in after_step.items()})
    same = {s: len({d[s] for d in digests}) == 1 for s in after_step}
    assert same == {s: s % k == 0 for s in after_step}, (sync, same)

    # The trainer averaged exactly at steps K, 2K, ..., and the result is the mean over ranks.
    expected_steps = [] if sync == "grad" else list(range(k, 8, k))
    assert [s for s, _, _ in averaged] == expected_steps
    befores = world.comm.allgather([b for _, b, _ in averaged])
    for i, (step, _, after) in enumerate(averaged):
        assert not np.array_equal(befores[0][i], befores[1][i])  # ranks trained on other data
        mean = np.mean([b[i] for b in befores], axis=0, dtype=np.float64)
        np.testing.assert_allclose(after, mean, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(after, after_step[step])  # nothing changed it afterwards
