import dataclasses

import numpy as np
import pytest

from hpcdl.data.sampler import DistributedSampler, SamplerSpec, eval_indices, rank_layout

# World ranks on each node: block (mpirun's default), round robin (--map-by node), uneven.
BLOCK = ((0, 1), (2, 3))
ROUND_ROBIN = ((0, 2), (1, 3))
UNEVEN = ((0, 1, 2), (3,))
UNEVEN_ROUND_ROBIN = ((0, 2, 3), (1,))


def shards(n, world, epoch, seed=0, shuffle="global", layout=()):
    return [
        DistributedSampler(n, world, r, seed, shuffle, ranks_by_node=layout).indices(epoch)
        for r in range(world)
    ]


@pytest.mark.parametrize("shuffle", ["global", "node", "none"])
@pytest.mark.parametrize(
    "n,world,layout",
    [
        (100, 1, ()),
        (101, 4, BLOCK),
        (101, 4, ROUND_ROBIN),
        (101, 4, UNEVEN),
        (1797, 3, ((0, 1, 2),)),
        (10, 10, (tuple(range(5)), tuple(range(5, 10)))),
    ],
)
def test_shards_are_disjoint_equal_and_cover_all_but_the_remainder(shuffle, n, world, layout):
    parts = shards(n, world, epoch=3, shuffle=shuffle, layout=layout)
    assert {len(p) for p in parts} == {n // world}
    merged = np.concatenate(parts)
    assert len(np.unique(merged)) == len(merged) == (n // world) * world
    assert merged.min() >= 0 and merged.max() < n


def test_global_shuffle_differs_between_epochs_and_is_reproducible():
    a0, a1 = shards(500, 2, 0), shards(500, 2, 1)
    assert not np.array_equal(a0[0], a1[0])
    assert all(np.array_equal(x, y) for x, y in zip(a0, shards(500, 2, 0), strict=True))
    assert not np.array_equal(a0[0], shards(500, 2, 0, seed=1)[0])


@pytest.mark.parametrize("layout", [BLOCK, ROUND_ROBIN, UNEVEN, UNEVEN_ROUND_ROBIN])
def test_node_shuffle_keeps_each_node_on_the_same_samples(layout):
    # 4 ranks on 2 nodes: a node's set of samples is fixed, its order changes per epoch
    e0 = shards(400, 4, 0, shuffle="node", layout=layout)
    e1 = shards(400, 4, 1, shuffle="node", layout=layout)
    node_sets = []
    for ranks in layout:
        s0 = np.concatenate([e0[r] for r in ranks])
        s1 = np.concatenate([e1[r] for r in ranks])
        assert set(s0) == set(s1)
        assert not np.array_equal(s0, s1)
        node_sets.append(set(s0))
    assert not node_sets[0] & node_sets[1]


def test_node_shuffle_follows_the_ranks_not_their_numbers():
    # The same node block goes to the node's ranks whatever their world rank numbers are.
    block = shards(400, 4, 2, shuffle="node", layout=BLOCK)
    cyclic = shards(400, 4, 2, shuffle="node", layout=ROUND_ROBIN)
    for b, c in zip(BLOCK, ROUND_ROBIN, strict=True):
        for rb, rc in zip(b, c, strict=True):
            assert np.array_equal(block[rb], cyclic[rc])


@pytest.mark.parametrize(
    "counts,placement,layout",
    [
        ((2, 2), "block", BLOCK),
        ((2, 2), "cyclic", ROUND_ROBIN),
        ((3, 1), "block", UNEVEN),
        ((3, 1), "cyclic", UNEVEN_ROUND_ROBIN),
        ((1, 2, 1), "cyclic", ((0,), (1, 3), (2,))),
    ],
)
def test_rank_layout_of_launcher_placements(counts, placement, layout):
    assert rank_layout(counts, placement) == layout


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
        (dict(num_samples=10, world_size=3, rank=0, ranks_by_node=((0, 1), (1, 2))), "once"),
        (dict(num_samples=10, world_size=3, rank=0, ranks_by_node=((0, 1),)), "once"),
    ],
)
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DistributedSampler(**kwargs)


def test_sampler_spec_views_are_the_ranks_samplers_and_the_spec_is_frozen():
    layout = ((0, 2), (1, 3))
    spec = SamplerSpec(num_samples=50, world_size=4, seed=9, shuffle="node", ranks_by_node=layout)
    for rank, view in zip((2, 0), spec.for_ranks((2, 0))):
        direct = DistributedSampler(50, 4, rank, 9, "node", layout)
        assert view == direct == spec.for_rank(rank)
        np.testing.assert_array_equal(view.indices(3), direct.indices(3))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.seed = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="rank 4 outside world of size 4"):
        spec.for_rank(4)


@pytest.mark.parametrize("shuffle", ["global", "node"])
def test_a_rank_cannot_change_the_order_the_other_views_share(shuffle):
    """The epoch's permutation and the node split are drawn once per process and shared by
    every sampler and planner there: what a caller gets is its own copy."""
    layout = ((0, 1), (2, 3))
    spec = SamplerSpec(100, 4, 7, shuffle, layout)
    mine = spec.for_rank(1).indices(3)
    expected = mine.copy()
    mine[:] = -1
    spec.rank_indices(3, [0, 1, 2, 3])[:] = -1
    assert spec.for_rank(1).indices(3).tolist() == expected.tolist()
    assert spec.rank_indices(3, [1])[0].tolist() == expected.tolist()
    fresh = DistributedSampler(100, 4, 1, 7, shuffle, layout)  # same as a new process draws
    assert fresh.indices(3).tolist() == expected.tolist()
