"""The plan side of the peer tier: file homes, per-node peer sources, the plan's peer section."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import ShardDataset, make_tree

from hpcdl.data.sampler import SamplerSpec
from hpcdl.staging import plan_for_node
from hpcdl.staging.peers import NO_HOME, file_homes, peer_sources, render_peer_section
from hpcdl.staging.plan import node_figures, render_plan

LAYOUTS = {
    "block": ((0, 1), (2, 3), (4, 5)),
    "round-robin": ((0, 3), (1, 4), (2, 5)),
    "uneven": ((0, 1, 2, 3), (4,), (5,)),
}


def reference_homes(ds, spec, batch, epochs, layout, fits):
    """Naive walk over every read: the earliest (tick, node) among fitting nodes, per file;
    among nodes tied at that tick the first at or after node (file id mod nodes), round."""
    node_of = {r: n for n, ranks in enumerate(layout) for r in ranks}
    steps = spec.for_rank(0).steps_per_epoch(batch)
    best = {}
    for epoch in range(*epochs):
        for rank in range(spec.world_size):
            if not fits[node_of[rank]]:
                continue
            for step, indices in enumerate(spec.for_rank(rank).batches(epoch, batch)[:steps]):
                for fid in ds.file_ids(np.asarray(indices)).tolist():
                    turn = (node_of[rank] - fid) % len(layout)
                    key = (epoch * steps + step, turn, node_of[rank])
                    best[fid] = min(best.get(fid, key), key)
    return {fid: (tick, node) for fid, (tick, _, node) in best.items()}


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("per_file", [1, 3])
def test_homes_are_the_first_fitting_reader(tmp_path, layout_name, per_file):
    layout = LAYOUTS[layout_name]
    tree = make_tree(tmp_path, 30, 10)
    ds = ShardDataset(tmp_path, [f.relpath for f in tree.files], per_file=per_file)
    spec = SamplerSpec(num_samples=len(ds), world_size=6, seed=5, shuffle="global")
    for fits in ([True, True, True], [False, True, True], [True, False, False]):
        homes = file_homes(ds, spec, 2, (1, 4), layout, fits)
        want = reference_homes(ds, spec, 2, (1, 4), layout, fits)
        got = {f: (int(homes.tick[f]), int(homes.node[f])) for f in np.flatnonzero(homes.node >= 0)}
        assert got == want, f"fits={fits}"
        assert (homes.node[[f for f in range(len(ds.files)) if f not in want]] == NO_HOME).all()


def test_shards_read_by_every_node_at_once_get_homes_spread_over_the_nodes(tmp_path):
    """Tar shards: every node reads samples of nearly every shard in its first step; the homes
    must not all go to the lowest node (S / N a node, as the cluster model assumes)."""
    nodes, shards = 8, 64
    tree = make_tree(tmp_path, shards, 10)
    ds = ShardDataset(tmp_path, [f.relpath for f in tree.files], per_file=32)
    spec = SamplerSpec(num_samples=len(ds), world_size=nodes, seed=1, shuffle="global")
    layout = [(n,) for n in range(nodes)]
    homes = file_homes(ds, spec, 64, (0, 2), layout, [True] * nodes)
    assert (homes.tick == 0).mean() > 0.9, "the case needs ties in the first step"
    per_node = np.bincount(homes.node, minlength=nodes)
    assert per_node.max() <= 2 * shards / nodes, per_node


def run_plans(ds, spec, batch, epochs, layout, fits=None):
    """Every node's plans as the session writes them (current and next epoch, one per epoch),
    with their peer sources."""
    fits = fits or [True] * len(layout)
    homes = file_homes(ds, spec, batch, epochs, layout, fits)
    out = []
    for node, ranks in enumerate(layout):
        for epoch in range(*epochs):
            window = (epoch, min(epoch + 2, epochs[1]))
            plan = plan_for_node(ds, spec, batch, window, ranks, node)
            out.append((plan, peer_sources(plan, homes)))
    return homes, out


def test_global_shuffle_reads_each_file_from_the_pfs_once(tmp_path):
    """Each file's only PFS-sourced entry is its home's; every other node fetches it from the
    home, and only after the home has read it."""
    layout = LAYOUTS["block"]
    ds = make_tree(tmp_path, 48, 10)
    spec = SamplerSpec(num_samples=48, world_size=6, seed=2, shuffle="global")
    homes, plans = run_plans(ds, spec, 2, (0, 4), layout)
    pfs_readers: dict[int, set[int]] = {}
    fetched = 0
    for plan, sources in plans:
        offset = plan.epoch_begin * plan.steps_per_epoch
        for k, fid in enumerate(plan.file_ids.tolist()):
            peer = int(sources.peer[k])
            if peer == NO_HOME:
                pfs_readers.setdefault(fid, set()).add(plan.node)
                continue
            fetched += 1
            assert peer == homes.node[fid] != plan.node
            ready = int(sources.ready_tick[k])
            assert ready + offset >= homes.tick[fid] and ready <= plan.ticks[k][0]
    assert fetched > 0
    assert all(readers == {int(homes.node[f])} for f, readers in pfs_readers.items())
    assert len(pfs_readers) <= len(ds.files)


def test_node_shuffle_and_one_node_need_no_peer(tmp_path):
    ds = make_tree(tmp_path, 24, 10)
    layout = LAYOUTS["block"]
    spec = SamplerSpec(num_samples=24, world_size=6, seed=2, shuffle="node", ranks_by_node=layout)
    _, plans = run_plans(ds, spec, 2, (0, 3), layout)
    assert all(sources.count == 0 for _, sources in plans)
    solo = SamplerSpec(num_samples=24, world_size=2, seed=2, shuffle="global")
    _, plans = run_plans(ds, solo, 2, (0, 3), ((0, 1),))
    assert all(sources.count == 0 for _, sources in plans)


def test_a_node_that_cannot_hold_its_run_is_nobodys_source(tmp_path):
    layout = LAYOUTS["block"]
    ds = make_tree(tmp_path, 48, 10)
    spec = SamplerSpec(num_samples=48, world_size=6, seed=2, shuffle="global")
    need = node_figures(ds, spec, 2, (0, 4), layout).bytes
    capacity = [int(need[0]) - 1, int(need[1]), int(need[2])]
    fits = [int(b) <= c for b, c in zip(need, capacity)]
    assert fits == [False, True, True]
    homes, plans = run_plans(ds, spec, 2, (0, 4), layout, fits)
    assert 0 not in set(homes.node.tolist())
    assert all(0 not in set(s.peer.tolist()) for _, s in plans)
    # A node that is down (its peer tier failed to start) serves nobody either.
    plan = plans[0][0]
    assert (peer_sources(plan, homes, up=[True, False, True]).peer != 1).all()


def test_plan_file_carries_the_peer_section(tmp_path):
    layout = LAYOUTS["block"]
    ds = make_tree(tmp_path, 48, 10)
    spec = SamplerSpec(num_samples=48, world_size=6, seed=2, shuffle="global")
    homes = file_homes(ds, spec, 2, (0, 3), layout, [True] * 3)
    plan = plan_for_node(ds, spec, 2, (1, 3), layout[2], 2)
    sources = peer_sources(plan, homes)
    addresses = ["10.0.0.1:4000", "10.0.0.2:4001", "10.0.0.3:4002"]
    text = render_plan(plan, ds, peer_lines=render_peer_section(plan, sources, addresses))
    lines = text.splitlines()
    at = lines.index(next(line for line in lines if line.startswith("peers ")))
    npeers = int(lines[at].split()[1])
    assert 1 <= npeers <= 2 and lines[-1] == "end"
    assert all(line.split("\t")[1] in addresses[:2] for line in lines[at + 1 : at + 1 + npeers])
    count_line = lines[at + 1 + npeers]
    assert count_line == f"peer_sources {sources.count}"
    rows = [line.split("\t") for line in lines[at + 2 + npeers : -1]]
    assert len(rows) == sources.count
    for fid, peer, ready in rows:
        k = plan.file_ids.tolist().index(int(fid))
        assert int(peer) == sources.peer[k] and int(ready) == sources.ready_tick[k]
    with pytest.raises(ValueError, match="no usable peer address"):
        render_peer_section(plan, sources, [None, None, None])


def test_the_peer_tier_runs_where_it_can_help():
    from hpcdl.staging.peer_tier import peer_tier_wanted

    assert peer_tier_wanted("auto", 2, "global") and peer_tier_wanted("on", 2, "node")
    assert not peer_tier_wanted("auto", 2, "node")  # a node never reads another's files
    assert not peer_tier_wanted("auto", 1, "global") and not peer_tier_wanted("on", 1, "global")
    assert not peer_tier_wanted("off", 8, "global")
    with pytest.raises(ValueError, match="--peer-staging must be one of auto, on, off"):
        peer_tier_wanted("yes", 2, "global")


@pytest.mark.parametrize("fits", [[True, True, True], [True, False, True]])
def test_epoch_sources_count_each_nodes_copies_and_their_source(tmp_path, fits):
    from hpcdl.staging.peers import epoch_sources

    layout = LAYOUTS["round-robin"]
    ds = make_tree(tmp_path, 40, 10)
    spec = SamplerSpec(num_samples=40, world_size=6, seed=4, shuffle="global")
    homes = reference_homes(ds, spec, 2, (1, 5), layout, fits)
    steps = spec.for_rank(0).steps_per_epoch(2)
    want = np.zeros((4, 4), dtype=np.int64)  # staged, pfs, peer files; pfs bytes
    for node, ranks in enumerate(layout):
        seen: set[int] = set()
        for k, epoch in enumerate(range(1, 5)):
            first: dict[int, int] = {}
            for rank in ranks:
                for step, batch in enumerate(spec.for_rank(rank).batches(epoch, 2)[:steps]):
                    for fid in ds.file_ids(np.asarray(batch)).tolist():
                        first[fid] = min(first.get(fid, 1 << 40), epoch * steps + step)
            copies = {f: t for f, t in first.items() if not (fits[node] and f in seen)}
            seen.update(first)
            for fid, tick in copies.items():
                home = homes.get(fid)
                from_peer = home is not None and home[1] != node and home[0] < tick
                want[:, k] += [1, not from_peer, from_peer, 0 if from_peer else ds.files[fid].size]
    got = epoch_sources(ds, spec, 2, (1, 5), layout, fits)
    assert got.staged_files.tolist() == want[0].tolist()
    assert got.pfs_files.tolist() == want[1].tolist()
    assert got.peer_files.tolist() == want[2].tolist()
    assert got.pfs_bytes.tolist() == want[3].tolist()
    assert (got.pfs_bytes + got.peer_bytes == got.staged_bytes).all()
    if all(fits):  # each file read in the run is opened on the PFS once
        read = {f for e in range(1, 5) for r in range(6) for b in spec.for_rank(r).batches(e, 2)
                for f in ds.file_ids(np.asarray(b)).tolist()}  # fmt: skip
        assert int(got.pfs_files.sum()) == len(read) < int(got.staged_files.sum())
