"""Resuming a mid-epoch checkpoint with another number of ranks (issue 26: a job that lost a
node goes on on the survivors): the interrupted epoch's remaining samples are each read exactly
once, with the same global batch, and the next epoch follows the new world size's sampler.

The probe model (tests/probe_model.py) records the sample indices every rank trains on."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from helpers import mpi_env, run_train
from probe_model import recorded_steps, sample_index_h5

from hpcdl import checkpoint
from hpcdl.data.epoch_order import global_order
from hpcdl.data.sampler import DistributedSampler, SamplerSpec

N, SEED, BATCH = 192, 4, 4  # 4 ranks: 12 steps of global batch 16 per epoch
PROBE = f"{Path(__file__).parent / 'probe_model.py'}:probe_mlp"


def args(data: Path, ckpt: Path, *more) -> list:
    return ["--data", data, "--model", PROBE, "--epochs", 2, "--batch-size", BATCH, "--lr", 0.001,
            "--workers", 0, "--seed", SEED, "--checkpoint-dir", ckpt, *more]  # fmt: skip


def probed(directory: Path) -> dict[str, str]:
    directory.mkdir()
    return {**mpi_env(), "HPCDL_PROBE_RECORD": str(directory)}


def test_four_ranks_stopped_mid_epoch_finish_it_on_two_with_every_sample_once(tmp_path):
    data, ckpt = sample_index_h5(tmp_path / "idx.h5", N), tmp_path / "ckpt"
    first = run_train(4, *args(data, ckpt, "--max-steps", 7, "--checkpoint-every", 7, "--quiet"),
                      env=probed(tmp_path / "a"), timeout=120)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    assert checkpoint.load(checkpoint.latest(ckpt)).global_step == 7

    second = run_train(2, *args(data, ckpt, "--resume", "auto", "--progress", "none"),
                       env=probed(tmp_path / "b"), timeout=120)  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    assert (
        "hpcdl: the checkpoint was written by 4 ranks x 4 (global batch 16); this job trains on "
        "2 ranks x 8 (global batch 16); the 80 samples left of epoch 1 are read once each"
    ) in second.stdout.splitlines(), second.stdout

    before = [recorded_steps(tmp_path / "a", r) for r in range(4)]
    after = [recorded_steps(tmp_path / "b", r) for r in range(2)]
    assert [len(s) for s in before] == [7] * 4 and [len(s) for s in after] == [5 + 12] * 2
    epoch0 = Counter(i for steps in before for step in steps for i in step)
    epoch0.update(i for steps in after for step in steps[:5] for i in step)
    plan = global_order(SamplerSpec(N, 4, SEED), 0, BATCH)
    assert sorted(epoch0) == sorted(plan.tolist()) and set(epoch0.values()) == {1}
    for k in range(5):  # the same global batches as the 4-rank job would have trained on
        assert sorted(after[0][k] + after[1][k]) == sorted(plan[(7 + k) * 16 : (8 + k) * 16])
    for rank in range(2):  # then the 2-rank sampler, per-rank batch 8
        expected = DistributedSampler(N, 2, rank, SEED).batches(1, 8)
        assert after[rank][5:] == [b.tolist() for b in expected]
    assert checkpoint.load(checkpoint.latest(ckpt)).global_step == 7 + 5 + 12


def test_a_world_that_does_not_divide_the_global_batch_says_what_it_skips(tmp_path):
    ranks = 3
    data, ckpt = sample_index_h5(tmp_path / "idx.h5", N), tmp_path / "ckpt"
    first = run_train(2, *args(data, ckpt, "--batch-size", 8, "--max-steps", 3,
                                "--checkpoint-every", 3, "--quiet"), timeout=120)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_train(ranks, *args(data, ckpt, "--resume", "auto", "--progress", "none"),
                       env=probed(tmp_path / "b"), timeout=120)  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    assert (
        "hpcdl: the checkpoint was written by 2 ranks x 8 (global batch 16); this job trains on "
        "3 ranks x 5 (global batch 15): 16 is not a multiple of 3 ranks, lr unchanged; the 144 "
        "samples left of epoch 1 are read once each but the last 9 (less than one global "
        "batch), which are skipped"
    ) in second.stdout.splitlines(), second.stdout
    after = [recorded_steps(tmp_path / "b", r) for r in range(ranks)]
    plan = global_order(SamplerSpec(N, 2, SEED), 0, 8)
    read = [i for k in range(9) for r in range(ranks) for i in after[r][k]]
    assert read == plan[48 : 48 + 135].tolist()  # in the interrupted order, once each
