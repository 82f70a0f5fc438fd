import numpy as np
import pytest

from hpcdl.data.sampler import DistributedSampler, eval_indices


def shards(n, world, epoch, seed=0, shuffle="global", rpn=1):
    return [
        DistributedSampler(n, world, r, seed, shuffle, rpn).indices(epoch) for r in range(world)
    ]


@pytest.mark.parametrize("shuffle", ["global", "node", "none"])
@pytest.mark.parametrize("n,world,rpn", [(100, 1, 1), (101, 4, 2), (1797, 3, 3), (10, 10, 5)])
def test_shards_are_disjoint_equal_and_cover_all_but_the_remainder(shuffle, n, world, rpn):
    parts = shards(n, world, epoch=3, shuffle=shuffle, rpn=rpn)
    assert {len(p) for p in parts} == {n // world}
    merged = np.concatenate(parts)
    assert len(np.unique(merged)) == len(merged) == (n // world) * world
    assert merged.min() >= 0 and merged.max() < n


def test_global_shuffle_differs_between_epochs_and_is_reproducible():
    a0, a1 = shards(500, 2, 0), shards(500, 2, 1)
    assert not np.array_equal(a0[0], a1[0])
    assert all(np.array_equal(x, y) for x, y in zip(a0, shards(500, 2, 0), strict=True))
    assert not np.array_equal(a0[0], shards(500, 2, 0, seed=1)[0])


def test_node_shuffle_keeps_each_node_on_the_same_samples():
    # 4 ranks on 2 nodes: a node's set of samples is fixed, its order changes per epoch
    e0, e1 = shards(400, 4, 0, shuffle="node", rpn=2), shards(400, 4, 1, shuffle="node", rpn=2)
    for node in range(2):
        s0 = np.concatenate(e0[2 * node : 2 * node + 2])
        s1 = np.concatenate(e1[2 * node : 2 * node + 2])
        assert set(s0) == set(s1)
        assert not np.array_equal(s0, s1)


def test_no_shuffle_is_contiguous_and_fixed():
    parts = shards(10, 2, 5, shuffle="none")
    assert parts[0].tolist() == [0, 1, 2, 3, 4] and parts[1].tolist() == [5, 6, 7, 8, 9]


def test_batches_drop_the_last_partial_batch():
    s = DistributedSampler(103, 2, 1, seed=0)
    batches = s.batches(0, 10)
    assert len(batches) == s.steps_per_epoch(10) == 5
    assert all(len(b) == 10 for b in batches)
    assert np.array_equal(np.concatenate(batches), s.indices(0)[:50])


def test_eval_indices_cover_every_sample_once():
    parts = [eval_indices(11, 3, r) for r in range(3)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(11))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_samples=10, world_size=2, rank=2), "rank 2"),
        (dict(num_samples=1, world_size=2, rank=0), "cannot be shared"),
        (dict(num_samples=10, world_size=2, rank=0, shuffle="random"), "shuffle"),
        (dict(num_samples=10, world_size=3, rank=0, shuffle="node", ranks_per_node=2), "divisible"),
    ],
)
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DistributedSampler(**kwargs)
