"""The plan side of pieces (hpcdl.staging.pieces): which shards a node fetches as byte ranges
from their home, the plan entries and section they get, and the reader taking a staged piece."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import make_tree
from tarshards_helpers import jpeg_bytes, make_shards, write_tar

from hpcdl.clustermodel.calibration import DEFAULT_PEER
from hpcdl.data import open_dataset
from hpcdl.data.sampler import SamplerSpec
from hpcdl.staging import plan_for_node
from hpcdl.staging.peers import NO_HOME, file_homes, peer_sources, render_peer_section
from hpcdl.staging.pieces import (
    FETCH_BYTES,
    PieceSlots,
    piece_relpath,
    pieces_possible,
    split_shards,
)
from hpcdl.staging.plan import render_plan

SHARDS, PER_SHARD, BATCH = 6, 8, 2


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[object, list]:
    """6 tar shards of 8 JPEG samples each, opened as a data set; and their members."""
    root = tmp_path_factory.mktemp("pfs") / "shards"
    members = make_shards(root, SHARDS, PER_SHARD)
    return open_dataset(root), members


@pytest.fixture(scope="module")
def big_samples(tmp_path_factory):
    """6 shards of 8 samples whose 400x400 noise JPEGs (about 145 KB) are worth a fetch each."""
    root = tmp_path_factory.mktemp("pfs") / "big"
    for s in range(SHARDS):
        members = []
        for j in range(PER_SHARD):
            i = s * PER_SHARD + j
            members += [(f"k{i:05d}.jpg", jpeg_bytes(i, (400, 400))), (f"k{i:05d}.cls", b"0")]
        write_tar(root / f"s-{s:04d}.tar", members)
    return open_dataset(root)


def plans(ds, layout, node, epochs, mode, fits=None):
    """(shard plan, piece plan, the split plan, the homes) of `node` for a global shuffle."""
    world = sum(len(r) for r in layout)
    spec = SamplerSpec(num_samples=len(ds), world_size=world, seed=5, shuffle="global")
    homes = file_homes(ds, spec, BATCH, epochs, layout, fits or [True] * len(layout))
    slots = PieceSlots(ds)
    shard_plan = plan_for_node(ds, spec, BATCH, epochs, layout[node], node)
    piece_plan = plan_for_node(slots, spec, BATCH, epochs, layout[node], node)
    split = split_shards(shard_plan, piece_plan, slots, homes, [True] * len(layout), mode)
    return shard_plan, piece_plan, split, homes, spec


def reads_of_node(ds, spec, ranks, epochs) -> dict[int, list[int]]:
    """Naive walk: the plan ticks at which the node's ranks read each sample."""
    steps = spec.for_rank(0).steps_per_epoch(BATCH)
    ticks: dict[int, set[int]] = {}
    for epoch in range(*epochs):
        for rank in ranks:
            for step, indices in enumerate(spec.for_rank(rank).batches(epoch, BATCH)[:steps]):
                for i in np.asarray(indices).tolist():
                    ticks.setdefault(i, set()).add((epoch - epochs[0]) * steps + step)
    return {i: sorted(t) for i, t in ticks.items()}


def test_on_fetches_every_shard_homed_elsewhere_as_its_samples_pieces(shards):
    ds, _ = shards
    layout = ((0, 1), (2, 3))
    shard_plan, _, split, homes, spec = plans(ds, layout, 1, (0, 2), "on")
    elsewhere = {int(f) for f in shard_plan.file_ids if homes.node[f] not in (NO_HOME, 1)}
    assert elsewhere, "the layout must give node 0 some homes"
    whole = {int(f) for f in split.file_ids if f < SHARDS}
    assert whole == {int(f) for f in shard_plan.file_ids} - elsewhere
    reads = reads_of_node(ds, spec, layout[1], (0, 2))
    pieces = {int(f) - SHARDS: k for k, f in enumerate(split.file_ids) if f >= SHARDS}
    expected = {i for i in reads if int(ds.file_ids([i])[0]) in elsewhere}
    assert set(pieces) == expected
    lengths = ds.index.columns["data_len"]
    for sample, k in pieces.items():
        assert split.ticks[k].tolist() == reads[sample]
        assert split.sizes[k] == lengths[sample]
    assert np.all(np.diff(split.first_use()) >= 0), "entries stay in first-use order"


def test_auto_splits_a_shard_only_where_its_pieces_cost_less_than_it(big_samples):
    ds = big_samples
    lengths, sizes = ds.index.columns["data_len"], np.asarray(ds.files.sizes)
    assert lengths.min() > FETCH_BYTES, "samples worth a fetch, so that both outcomes occur"
    split_somewhere = kept_somewhere = False
    for layout, epochs in ((((0,), (1,), (2,), (3,)), (0, 1)), (((0, 1), (2, 3)), (0, 2))):
        for node in range(len(layout)):
            shard_plan, _, split, homes, spec = plans(ds, layout, node, epochs, "auto")
            reads = reads_of_node(ds, spec, layout[node], epochs)
            mine = np.zeros(SHARDS)
            for i in reads:
                mine[int(ds.file_ids([i])[0])] += lengths[i] + FETCH_BYTES
            for f in shard_plan.file_ids.tolist():
                elsewhere = homes.node[f] not in (NO_HOME, node)
                want_pieces = elsewhere and mine[f] < sizes[f]
                assert (f in split.file_ids.tolist()) != want_pieces, (layout, node, f)
                split_somewhere |= want_pieces
                kept_somewhere |= elsewhere and not want_pieces
    assert split_somewhere and kept_somewhere, "the cases must show both outcomes"


def test_off_keeps_whole_shards_and_folders_get_no_pieces(shards, tmp_path):
    ds, _ = shards
    shard_plan, _, split, _, _ = plans(ds, ((0, 1), (2, 3)), 1, (0, 2), "off")
    assert split is shard_plan
    assert pieces_possible(ds, "auto") and not pieces_possible(ds, "off")
    assert not pieces_possible(make_tree(tmp_path, 4, 10), "on")
    with pytest.raises(ValueError, match="--peer-ranges must be one of"):
        pieces_possible(ds, "always")


def test_the_plan_file_names_each_piece_and_its_shards_range(shards):
    ds, _ = shards
    layout = ((0, 1), (2, 3))
    _, _, split, homes, _ = plans(ds, layout, 1, (0, 2), "on")
    slots = PieceSlots(ds)
    slot_homes = slots.homes(homes)
    sources = peer_sources(split, slot_homes)
    peer_lines = render_peer_section(split, sources, ["10.0.0.1:4000", "10.0.0.2:4001"])
    text = render_plan(split, ds, dest_prefix="key", peer_lines=peer_lines, slots=slots)
    lines = text.splitlines()
    assert f"dataset_files {SHARDS + len(ds)}" in lines and lines[-1] == "end"
    at = ds.index.columns["data_at"]
    entries = [line.split("\t") for line in lines if line.count("\t") == 4]
    assert len(entries) == split.files
    section = lines.index(next(line for line in lines if line.startswith("pieces ")))
    rows = [line.split("\t") for line in lines[section + 1 : -1]]
    assert int(lines[section].split()[1]) == len(rows) == int((split.file_ids >= SHARDS).sum())
    by_slot = {int(r[0]): r[1:] for r in rows}
    fetched = 0
    for (fid, size, _, dest, source), k in zip(entries, range(split.files)):
        fid = int(fid)
        shard = fid if fid < SHARDS else int(ds.file_ids([fid - SHARDS])[0])
        rel = ds.files.relpath(shard)
        assert source == f"{ds.root}/{rel}"
        if fid < SHARDS:
            assert dest == f"key/{rel}" and fid not in by_slot
            continue
        sample = fid - SHARDS
        assert dest == f"key/{piece_relpath(rel, at[sample])}" == f"key/{rel}.pieces/{at[sample]}"
        assert int(size) == ds.index.columns["data_len"][sample]
        assert by_slot[fid] == [str(shard), str(ds.files.sizes[shard]), str(at[sample])]
        # fetched from the shard's home once the home has read the shard; read at the same
        # step as the home's first read: from the PFS, as a whole file would be
        after = homes.tick[shard] < split.first_use()[k]
        assert sources.peer[k] == (homes.node[shard] if after else NO_HOME)
        assert sources.ready_tick[k] == (homes.tick[shard] if after else 0)
        fetched += after
    assert fetched > 0


class StagedPieces:
    """A locate whose `piece` answers from a directory of piece files (as Locator.piece does
    from the stager's READY slots)."""

    def __init__(self, ds, root: Path) -> None:
        self.ds, self.root, self.asked = ds, root, 0

    def __call__(self, file_id: int) -> Path:
        return Path(self.ds.root) / self.ds.files.relpath(file_id)

    def piece(self, shard: int, sample: int, offset: int) -> Path | None:
        self.asked += 1
        path = self.root / piece_relpath(self.ds.files.relpath(shard), offset)
        return path if path.exists() else None


def test_the_reader_takes_a_staged_piece_and_the_shard_otherwise(shards, tmp_path):
    ds, members = shards
    at, length = ds.index.columns["data_at"], ds.index.columns["data_len"]
    staged = StagedPieces(ds, tmp_path)
    for sample in (3, 9):
        shard = int(ds.file_ids([sample])[0])
        path = tmp_path / piece_relpath(ds.files.relpath(shard), at[sample])
        path.parent.mkdir(parents=True, exist_ok=True)
        image = members[shard][2 * (sample - shard * PER_SHARD)][1]
        path.write_bytes(image if sample == 3 else image[:-1])  # 9: shorter than indexed
    reader = ds.reader(staged)
    for sample in (3, 9, 4):
        shard = int(ds.file_ids([sample])[0])
        data, where = reader._open(sample)
        assert data.read() == members[shard][2 * (sample - shard * PER_SHARD)][1]
        assert len(data.getvalue()) == length[sample]
        assert (".pieces/" in where) == (sample == 3), where
    assert staged.asked == 3 and reader.counts.local == 1 and reader.counts.pfs == 2
    reader.close()


def test_a_fetchs_cost_in_bytes_is_the_cluster_models_default_peer():
    """auto's rule charges a fetch what the cluster model does without a calibration."""
    latency_bytes = DEFAULT_PEER.fetch_latency_s * DEFAULT_PEER.thread_bandwidth_Bps
    assert latency_bytes == pytest.approx(FETCH_BYTES)
