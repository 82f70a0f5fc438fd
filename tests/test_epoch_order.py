"""The rest of an interrupted epoch on another world size (hpcdl.data.epoch_order): the samples
the checkpoint had not read, each exactly once, in the interrupted job's global batches."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from hpcdl.data.epoch_order import (
    EpochOrder,
    global_order,
    rest_of_epoch,
    rest_size,
    resume_batch,
)
from hpcdl.data.sampler import SamplerSpec

N, SEED, EPOCH = 203, 5, 2


def spec(world: int, shuffle: str = "global", layout=()) -> SamplerSpec:
    return SamplerSpec(N, world, SEED, shuffle, layout)


@pytest.mark.parametrize("shuffle", ["global", "node", "none"])
def test_global_order_is_every_ranks_batches_step_by_step(shuffle):
    layout = ((0, 2), (1, 3))
    job = spec(4, shuffle, layout)
    flat = global_order(job, EPOCH, 4)
    steps = job.for_rank(0).steps_per_epoch(4)
    assert flat.shape == (steps * 16,)
    for rank in range(4):
        for t, batch in enumerate(job.for_rank(rank).batches(EPOCH, 4)):
            assert np.array_equal(flat[t * 16 + rank * 4 : t * 16 + rank * 4 + 4], batch)


def rest_by_rank(job: SamplerSpec, order: EpochOrder, world: int, batch: int):
    return [rest_of_epoch(job, order, EPOCH, r, world, batch) for r in range(world)]


@pytest.mark.parametrize("shuffle", ["global", "node"])
@pytest.mark.parametrize("new_world", [2, 1, 8])
def test_a_smaller_or_larger_world_reads_the_rest_once_in_the_same_global_batches(
    shuffle, new_world
):
    layout = ((0, 1), (2, 3))
    old = spec(4, shuffle, layout)
    order = EpochOrder(4, 4, layout, samples_done=5 * 16)  # stopped after global step 5
    flat = global_order(old, EPOCH, 4)
    batch = resume_batch(16, new_world)
    assert batch * new_world == 16
    rest = rest_by_rank(spec(new_world, shuffle), order, new_world, batch)
    steps = len(rest[0])
    assert steps == len(flat) // 16 - 5 and all(len(r) == steps for r in rest)
    for k in range(steps):  # global batch k of the rest is the old job's global batch 5 + k
        now = np.concatenate([r[k] for r in rest])
        assert np.array_equal(now, flat[(5 + k) * 16 : (6 + k) * 16])
    seen = Counter(int(i) for r in rest for b in r for i in b)
    seen.update(int(i) for i in flat[: 5 * 16])  # what the checkpoint had read
    assert set(seen.values()) == {1} and set(seen) == {int(i) for i in flat}
    assert rest_size(N, order) == sum(len(b) for r in rest for b in r)


def test_a_world_that_does_not_divide_the_global_batch_skips_less_than_one_global_batch():
    order = EpochOrder(4, 4, (), samples_done=3 * 16)
    flat = global_order(spec(4), EPOCH, 4)
    batch = resume_batch(16, 3)
    assert batch == 5  # global batch 15
    rest = rest_by_rank(spec(3), order, 3, batch)
    read = [int(i) for k in range(len(rest[0])) for r in rest for i in r[k]]
    left = rest_size(N, order)
    assert len(read) == left - left % 15 and left % 15 > 0
    assert read == [int(i) for i in flat[3 * 16 : 3 * 16 + len(read)]]  # in order, once each


def test_a_checkpoint_inside_the_rest_resumes_the_same_epoch_on_yet_another_world():
    flat = global_order(spec(4), EPOCH, 4)
    first = EpochOrder(4, 4, (), samples_done=2 * 16)
    # the 2-rank job read 3 global batches of 16 of the rest, then was checkpointed
    later = EpochOrder(4, 4, (), samples_done=first.samples_done + 3 * 16)
    rest = rest_by_rank(spec(1), later, 1, 16)
    assert np.array_equal(np.concatenate(rest[0]), flat[5 * 16 :])


def test_epoch_order_round_trips_and_rejects_nonsense():
    order = EpochOrder(4, 8, ((0, 1), (2, 3)), 96)
    assert EpochOrder.from_json(order.to_json()) == order
    for bad in ({"world_size": 0, "batch_size": 8, "ranks_by_node": [], "samples_done": 0},
                {"world_size": 2, "batch_size": 8, "ranks_by_node": [], "samples_done": -1},
                {"world_size": 2}):  # fmt: skip
        with pytest.raises((ValueError, KeyError)):
            EpochOrder.from_json(bad)


def test_resume_batch_keeps_the_global_batch_or_the_largest_below():
    assert [resume_batch(32, w) for w in (1, 2, 3, 4, 5, 64)] == [32, 16, 10, 8, 6, 1]
