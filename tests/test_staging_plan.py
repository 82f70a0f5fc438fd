"""Staging plans: first-use order, uses per file, atomic plan file, path safety."""

from __future__ import annotations

import dataclasses
import subprocess

import numpy as np
import pytest
from helpers import ShardDataset, make_tree

from hpcdl.data.dataset import FileTable
from hpcdl.data.sampler import DistributedSampler, SamplerSpec
from hpcdl.staging import PlanError, find_stager_binary, plan_for_node, write_plan
from hpcdl.staging.plan import check_relpath

# World ranks on each node: block (mpirun's default), round robin (--map-by node), uneven.
PLACEMENTS = {
    "block": ((0, 1), (2, 3)),
    "round-robin": ((0, 2), (1, 3)),
    "uneven": ((0, 1, 2), (3,)),
    "uneven-round-robin": ((0, 2, 3), (1,)),
}


def reference_order(ds, sampler, batch, epochs, ranks):
    """Naive simulation: walk epochs, steps, the node's ranks, batch positions."""
    samplers = [DistributedSampler(rank=r, **vars(sampler)) for r in ranks]
    local = len(ranks)
    seen, order, uses = set(), [], {}
    steps = samplers[0].steps_per_epoch(batch)
    for e, epoch in enumerate(range(*epochs)):
        batches = [s.batches(epoch, batch) for s in samplers]
        for step in range(steps):
            for r in range(local):
                for fid in ds.file_ids(batches[r][step]).tolist():
                    uses.setdefault(fid, set()).add(e * steps + step)
                    if fid not in seen:
                        seen.add(fid)
                        order.append(fid)
    return order, uses


@pytest.mark.parametrize("shuffle,per_file", [("global", 1), ("node", 1), ("global", 5)])
def test_plan_order_is_first_use_interleaved_by_step(tmp_path, shuffle, per_file):
    ds = make_tree(tmp_path, 40, 100)
    ds = ShardDataset(tmp_path, [f.relpath for f in ds.files], per_file=per_file)
    layout = PLACEMENTS["round-robin"]
    args = SamplerSpec(
        num_samples=len(ds), world_size=4, seed=7, shuffle=shuffle, ranks_by_node=layout
    )
    plan = plan_for_node(ds, args, batch_size=3, epochs=(1, 3), ranks=layout[1], node=1)
    order, uses = reference_order(ds, args, 3, (1, 3), layout[1])
    assert plan.file_ids.tolist() == order
    assert [t.tolist() for t in plan.ticks] == [sorted(uses[f]) for f in order]
    assert plan.bytes == sum(ds.files[f].size for f in order)


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("shuffle", ["global", "node", "none"])
def test_each_node_plans_exactly_the_files_its_own_ranks_read(tmp_path, placement, shuffle):
    layout = PLACEMENTS[placement]
    ds = make_tree(tmp_path, 64, 10)
    args = SamplerSpec(num_samples=64, world_size=4, seed=3, shuffle=shuffle, ranks_by_node=layout)
    planned = []
    for node, ranks in enumerate(layout):
        plan = plan_for_node(ds, args, batch_size=4, epochs=(0, 2), ranks=ranks, node=node)
        read = {
            int(i)
            for r in ranks
            for epoch in (0, 1)
            for batch in args.for_rank(r).batches(epoch, 4)
            for i in batch
        }
        assert set(plan.file_ids.tolist()) == read, f"node {node} ranks {ranks}"
        assert plan.local_ranks == len(ranks)
        planned.append(read)
    if shuffle != "global":  # a node keeps its own samples: nodes never share a file
        assert not planned[0] & planned[1]


def test_plan_file_has_header_and_is_accepted_by_the_stager(tmp_path):
    ds = make_tree(tmp_path / "data", 12, 50)
    args = SamplerSpec(num_samples=12, world_size=2, seed=1, shuffle="global")
    plan = plan_for_node(ds, args, batch_size=2, epochs=(0, 2), ranks=(0, 1))
    path = tmp_path / "plan"
    write_plan(path, plan, ds)
    lines = path.read_text().splitlines()
    assert lines[0] == "hpcdl-plan 1"
    assert lines[1].startswith("fingerprint ") and "seed 1" in lines and "epochs 0 2" in lines
    assert lines[-1] == "end"
    assert not list(tmp_path.glob(".plan.*"))
    out = subprocess.run(
        [find_stager_binary(), "--check-plan", path], capture_output=True, text=True
    )
    assert out.returncode == 0 and f"{plan.files} files" in out.stdout


@pytest.mark.parametrize("bad", ["/etc/passwd", "../escape", "a/../../b", "a//b", ".hpcdl/status"])
def test_unsafe_destinations_are_rejected_by_planner_and_stager(tmp_path, bad):
    with pytest.raises(PlanError):
        check_relpath(bad)
    # A hand-written plan (not from the planner) is rejected by the stager itself.
    plan = tmp_path / "plan"
    plan.write_text(
        "hpcdl-plan 1\nfingerprint 00\nseed 0\nepochs 0 1\nsteps_per_epoch 1\nlocal_ranks 1\n"
        f"dataset_files 1\nentries 1\n0\t1\t0\t{bad}\t/etc/hostname\nend\n"
    )
    out = subprocess.run(
        [find_stager_binary(), "--check-plan", plan], capture_output=True, text=True
    )
    assert out.returncode == 1
    assert str(plan) in out.stderr and "rejected" in out.stderr, out.stderr


def test_planner_refuses_dataset_with_escaping_path(tmp_path):
    ds = make_tree(tmp_path, 4, 10)
    names = [f.relpath for f in ds.files]
    names[2] = "../outside.bin"
    ds.files = FileTable.from_entries(names, ds.files.sizes)
    args = SamplerSpec(num_samples=4, world_size=1, seed=0, shuffle="none")
    plan = plan_for_node(ds, args, batch_size=1, epochs=(0, 1))
    with pytest.raises(PlanError, match="outside.bin"):
        write_plan(tmp_path / "plan", plan, ds)
    assert np.all(plan.sizes > 0)


def reference_render(plan, ds, dest_prefix: str = "") -> list[str]:
    """The entry lines as the planner wrote them before issue 35's replan work: one file entry
    and one check per line (format: docs/staging.md)."""
    lines = []
    for fid, ticks in zip(plan.file_ids.tolist(), plan.ticks):
        rel = ds.files[fid].relpath
        check_relpath(rel)
        dest = f"{dest_prefix}/{rel}" if dest_prefix else rel
        steps = ",".join(map(str, ticks.tolist()))
        lines.append(f"{fid}\t{ds.files[fid].size}\t{steps}\t{dest}\t{ds.root}/{rel}")
    return lines


@pytest.mark.parametrize("shuffle", ["global", "node"])
@pytest.mark.parametrize("prefix", ["", "key"])
def test_the_plan_names_each_entry_as_one_line_per_file_would(tmp_path, shuffle, prefix):
    ds = make_tree(tmp_path / "data", 40, 30)
    names = [f.relpath for f in ds.files]
    names[3], names[7] = "dir/.hidden/é ü.bin", "x/.hpcdl/y.bin"  # legal: not first components
    ds.files = FileTable.from_entries(names, [f.size + k for k, f in enumerate(ds.files)])
    spec = SamplerSpec(40, 4, 3, shuffle, ((0, 1), (2, 3)))
    plan = plan_for_node(ds, spec, batch_size=3, epochs=(2, 5), ranks=(2, 3), node=1)
    write_plan(tmp_path / "plan", plan, ds, "f" * 16, prefix)
    text = (tmp_path / "plan").read_text().splitlines()
    entries = text[text.index(f"entries {plan.files}") + 1 : -1]
    assert entries == reference_render(plan, ds, prefix)
    assert plan.first_use().tolist() == [int(t[0]) for t in plan.ticks]
    by_hand = dataclasses.replace(plan, ticks=[t.copy() for t in plan.ticks])  # a list of arrays
    assert [a.tolist() for a in by_hand.tick_table()] == [a.tolist() for a in plan.tick_table()]
    assert by_hand.first_use().tolist() == plan.first_use().tolist()
    assert [t.tolist() for t in plan.ticks[1:3]] == [plan.ticks[1].tolist(), plan.ticks[2].tolist()]
    assert plan.ticks[-1].tolist() == plan.ticks[plan.files - 1].tolist()
    with pytest.raises(IndexError):
        plan.ticks[plan.files]


@pytest.mark.parametrize("where", [0, 1, 5])
@pytest.mark.parametrize("name", [".hpcdl", ".hpcdl/status"])
def test_the_reserved_first_component_is_refused_wherever_it_stands(tmp_path, where, name):
    ds = make_tree(tmp_path / "data", 6, 10)
    names = [f.relpath for f in ds.files]
    names[where] = name
    ds.files = FileTable.from_entries(names, ds.files.sizes)
    plan = plan_for_node(ds, SamplerSpec(6, 1, 0, "none"), batch_size=1, epochs=(0, 1))
    with pytest.raises(PlanError, match=f"'{name}'.*reserved"):
        write_plan(tmp_path / "plan", plan, ds)
    assert not (tmp_path / "plan").exists()
