"""A model from a user's file (examples/my_model.py) trains through the real training loop on
2 ranks (pytest --with-mpi) with the guarantee the built-in models have: after every step the
parameters are bitwise identical on every rank."""

from pathlib import Path

import numpy as np
import pytest
from helpers import digest

from hpcdl import resume
from hpcdl import train as trainer
from hpcdl.config import parse_args

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "my_model.py"
STEPS = 3


@pytest.mark.mpi(min_size=2)
def test_a_model_from_a_users_file_keeps_bitwise_identical_parameters_on_every_rank(
    world,  # noqa: F811
    shared_digits,  # noqa: F811
    mpi_tmp_path,
    monkeypatch,
):
    cfg = parse_args(
        [
            *("--data", str(shared_digits / "train"), "--model", f"{EXAMPLE}:build"),
            *("--epochs", "1", "--batch-size", "16", "--workers", "0", "--seed", "5"),
            *("--lr", "0.05", "--max-steps", str(STEPS), "--quiet"),
            *("--checkpoint-dir", str(mpi_tmp_path / "ckpt"), "--checkpoint-every", "1"),
        ]
    )
    after_step: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # step -> (params, buffers)
    names = []
    real_save = resume.save

    def save(run, at, epoch_stats=None):  # --checkpoint-every 1: every rank after every step
        model = run.engine.model
        names.append(model.name)
        after_step[at.global_step] = (model.params.copy(), model.buffers.copy())
        return real_save(run, at, epoch_stats)

    monkeypatch.setattr(resume, "save", save)
    status = trainer.train(cfg, world)

    outcome = (status, sorted(after_step), set(names))
    expected = (0, list(range(1, STEPS + 1)), {"my_model:build"})
    assert world.comm.allgather(outcome) == [expected] * world.size
    params = world.comm.allgather({s: digest(p) for s, (p, _) in after_step.items()})
    buffers = world.comm.allgather({s: digest(b) for s, (_, b) in after_step.items()})
    for step in after_step:
        assert len({p[step] for p in params}) == 1, f"parameters differ after step {step}"
    # Each rank normalised its own batch (no --sync-bn): its BatchNorm statistics differ within
    # the epoch, so the ranks did train on different data and only the reduction made the
    # parameters agree; the end of the epoch (the last step) averages the statistics too.
    for step in range(1, STEPS):
        assert len({b[step] for b in buffers}) == world.size, f"same batches at step {step}"
    assert len({b[STEPS] for b in buffers}) == 1, "BatchNorm statistics differ at epoch end"
    assert not np.array_equal(after_step[1][0], after_step[STEPS][0])  # it did train
