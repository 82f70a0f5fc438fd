"""Staging plans: which files a node reads, in first-use order, for a range of epochs.

The plan of a node interleaves its local ranks step by step (step s of local rank 0, step s of
local rank 1, ..., then step s+1), so the order is the order in which the node's loaders first
need each file. A node's ranks are the world ranks the node communicator found on it
(World.node_ranks), never computed from a node number: launchers also place ranks round robin
or unevenly. Every file also carries the steps (counted from the plan's first epoch) that read
it; the stager uses them to evict the file whose next use is farthest away. Format: docs/staging.md.
"""

from __future__ import annotations

import hashlib
import os
import re
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.atomic import write_bytes_atomically
from hpcdl.data.dataset import (
    DataError,
    FileTable,
    check_entries,
    check_table,
    has_control_character,
    is_plain_relpath,
)
from hpcdl.data.sampler import SamplerSpec

PLAN_VERSION = 1


class PlanError(ValueError):
    """A data set file cannot be staged safely (bad destination path)."""


class TickLists(Sequence):
    """Every entry's ticks as views of one array: values[bounds[k] : bounds[k + 1]] for entry k.
    The planner makes them so, with no object per entry (the trainer replans every epoch)."""

    def __init__(self, values: np.ndarray, bounds: np.ndarray) -> None:
        self.values, self.bounds = values, bounds

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def __getitem__(self, k):  # type: ignore[override]
        if isinstance(k, slice):
            return [self[j] for j in range(*k.indices(len(self)))]
        k = range(len(self))[k]  # negative indices; IndexError past the end
        return self.values[self.bounds[k] : self.bounds[k + 1]]


@dataclass(frozen=True)
class NodePlan:
    """The files one node reads in epochs [epoch_begin, epoch_end), in first-use order."""

    node: int
    file_ids: np.ndarray  # (F,) int64, first-use order
    ticks: Sequence[np.ndarray]  # per entry: ascending int64 steps that read it (TickLists)
    sizes: np.ndarray  # (F,) int64 bytes
    epoch_begin: int
    epoch_end: int
    steps_per_epoch: int
    ranks: tuple[int, ...]  # world ranks of the node, in local-rank order
    seed: int
    shuffle: str

    @property
    def local_ranks(self) -> int:
        return len(self.ranks)

    def tick_table(self) -> tuple[np.ndarray, np.ndarray]:
        """(every entry's ticks, one after the other; (F + 1,) int64 offsets into them)."""
        if isinstance(self.ticks, TickLists):
            return self.ticks.values, self.ticks.bounds
        counts = np.fromiter((len(t) for t in self.ticks), np.int64, count=len(self.ticks))
        bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        values = np.concatenate(self.ticks).astype(np.int64) if self.ticks else bounds[:0]
        return values, bounds

    def first_use(self) -> np.ndarray:
        """(F,) int64 first tick of each entry: ascending, as the entries are in first-use
        order (0 for an entry without ticks, which the planner never makes)."""
        values, bounds = self.tick_table()
        if len(values) == 0:
            return np.zeros(len(bounds) - 1, np.int64)
        used = bounds[1:] > bounds[:-1]
        return np.where(used, values[np.minimum(bounds[:-1], len(values) - 1)], 0)

    @property
    def files(self) -> int:
        return len(self.file_ids)

    @property
    def bytes(self) -> int:
        return int(self.sizes.sum())


def check_relpath(relpath: str) -> None:
    """Raise PlanError unless relpath is a safe destination inside the stage dir.

    The path and name rules are the data sets' own (hpcdl.data.dataset), so a data set that
    opens also stages; '.hpcdl' is the only rule of the stager's own."""
    if has_control_character(relpath):
        raise PlanError(f"data set file {relpath!r}: control characters not allowed")
    if not relpath or relpath.startswith("/") or os.path.isabs(relpath):
        raise PlanError(f"data set file {relpath!r}: absolute or empty path cannot be staged")
    if not is_plain_relpath(relpath):
        raise PlanError(f"data set file {relpath!r}: '..', '.' or empty components not allowed")
    if relpath.split("/")[0] == ".hpcdl":
        raise PlanError(f"data set file {relpath!r}: '.hpcdl' is reserved for the stager")


def check_relpaths(relpaths: Sequence[str]) -> None:
    """check_relpath of every entry: one pass of the data sets' own checks over them all
    (hpcdl.data.dataset.check_entries) and one for '.hpcdl'; the entries one by one only when
    that finds something."""
    try:
        check_entries(Path("."), relpaths)
        suspect = _RESERVED_FIRST.search(("\n" + "\n".join(relpaths)).encode()) is not None
    except DataError:
        suspect = True
    if suspect:
        for rel in relpaths:
            check_relpath(rel)


_RESERVED_FIRST = re.compile(rb"\n\.hpcdl(?:/|\n|$)")  # '.hpcdl' first, but in the first name
_TABLES_CHECKED: weakref.WeakSet[FileTable] = weakref.WeakSet()


def table_checked(files: FileTable) -> bool:
    """True when every name of the table passes check_relpath: checked whole, once per
    process, where the names lie (hpcdl.data.dataset.check_table, and '.hpcdl'), since the
    trainer replans every epoch and ImageNet's node plans hold 10^5 entries. False: check
    the plan's entries one by one (check_relpaths), which names the bad one."""
    if files in _TABLES_CHECKED:
        return True
    try:
        check_table(Path("."), files)
        names = memoryview(files.names).cast("B")
        first = b"\n" + bytes(names[:8])  # the first name's start, as the others follow '\n'
        clean = _RESERVED_FIRST.match(first) is None and _RESERVED_FIRST.search(names) is None
    except DataError:
        clean = False
    if clean:
        _TABLES_CHECKED.add(files)
    return clean


def dataset_fingerprint(dataset: Any) -> str:
    """16 hex digits identifying the data set's root, file names and sizes."""
    h = hashlib.blake2b(digest_size=8)
    h.update(str(Path(dataset.root).resolve()).encode())
    for entry in dataset.files:
        h.update(f"\0{entry.relpath}\0{entry.size}".encode())
    return h.hexdigest()


def epoch_range(epochs: tuple[int, int]) -> tuple[int, int]:
    """(begin, end) of the epochs [begin, end) as ints; ValueError when the range is empty."""
    begin, end = int(epochs[0]), int(epochs[1])
    if end <= begin:
        raise ValueError(f"empty epoch range {epochs!r}")
    return begin, end


def plan_for_node(
    dataset: Any,
    sampler: SamplerSpec,
    batch_size: int,
    epochs: tuple[int, int],
    ranks: Sequence[int] = (0,),
    node: int = 0,
) -> NodePlan:
    """Plan of one node: unique files of its ranks in first-use order, with their uses.

    sampler: the job's SamplerSpec. epochs: [begin, end). ranks: the world ranks on the node, in
    local-rank order (World.node_ranks). node: the node's index, a label in the plan file.
    One permutation per epoch for the whole node (SamplerSpec.rank_indices), not one per rank.
    """
    begin, end = epoch_range(epochs)
    if not ranks:
        raise ValueError("a node plan needs at least one rank")
    steps = sampler.for_rank(ranks[0]).steps_per_epoch(batch_size)
    # (E, steps, L, B) file ids in reading order: epoch, step, local rank, position in batch.
    reads = np.stack(
        [
            _reads(dataset, sampler.rank_indices(epoch, ranks), steps, batch_size)
            for epoch in range(begin, end)
        ]
    )
    return _plan_of_reads(dataset, reads, (begin, end), ranks, node, sampler)


def first_epoch_plans(
    dataset: Any, sampler: SamplerSpec, batch_size: int, epoch: int, layout: Sequence[Sequence[int]]
) -> Iterator[NodePlan]:
    """plan_for_node(..., (epoch, epoch + 1), layout[node], node) of every node in turn, from
    one permutation for them all (dry runs that write or probe every node's plan)."""
    rows = sampler.rank_indices(epoch)
    steps = sampler.for_rank(0).steps_per_epoch(batch_size)
    for node, ranks in enumerate(layout):
        reads = _reads(dataset, rows[list(ranks)], steps, batch_size)[None]
        yield _plan_of_reads(dataset, reads, (epoch, epoch + 1), ranks, node, sampler)


def _reads(dataset: Any, rows: np.ndarray, steps: int, batch_size: int) -> np.ndarray:
    """(steps, L, B) file ids that L ranks read in one epoch, from their (L, samples) indices."""
    used = rows[:, : steps * batch_size]
    ids = np.asarray(dataset.file_ids(used.reshape(-1)), dtype=np.int64)
    return ids.reshape(len(rows), steps, batch_size).transpose(1, 0, 2)


def _plan_of_reads(
    dataset: Any,
    reads: np.ndarray,
    epochs: tuple[int, int],
    ranks: Sequence[int],
    node: int,
    sampler: SamplerSpec,
) -> NodePlan:
    """The NodePlan of a node's (E, steps, L, B) file ids in reading order."""
    nepochs, steps, local_ranks, batch_size = reads.shape
    flat = reads.reshape(-1)
    ticks_total = max(1, nepochs * steps)
    tick_of_read = np.repeat(np.arange(nepochs * steps, dtype=np.int64), local_ranks * batch_size)
    uniq, first = np.unique(flat, return_index=True)
    entry_order = np.argsort(first, kind="stable")  # entries: files in first-use order
    file_ids = uniq[entry_order]
    assert file_ids.max(initial=-1) < len(dataset.files)
    # Distinct (file, step) pairs, grouped by file (as uniq is sorted) in ascending step order.
    pairs = np.unique(flat * ticks_total + tick_of_read)
    pair_file, pair_tick = pairs // ticks_total, pairs % ticks_total
    starts = np.flatnonzero(np.diff(pair_file, prepend=-1))  # each file's first pair
    counts = np.diff(np.append(starts, len(pairs)))[entry_order]
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    # the pairs of the entries in entry order: for entry k, starts[entry_order[k]] onwards
    taken = np.repeat(starts[entry_order] - bounds[:-1], counts) + np.arange(bounds[-1])
    return NodePlan(
        node=node,
        file_ids=file_ids,
        ticks=TickLists(pair_tick[taken], bounds),
        sizes=file_sizes(dataset, file_ids),
        epoch_begin=epochs[0],
        epoch_end=epochs[1],
        steps_per_epoch=steps,
        ranks=tuple(int(r) for r in ranks),
        seed=sampler.seed,
        shuffle=sampler.shuffle,
    )


def file_sizes(dataset: Any, file_ids: np.ndarray | None = None) -> np.ndarray:
    """int64 byte sizes of the given data set files (default: all of them)."""
    sizes = np.asarray(dataset.files.sizes, dtype=np.int64)  # a FileTable's column: no loop
    return sizes.copy() if file_ids is None else sizes[file_ids]


@dataclass(frozen=True)
class NodeFigures:
    """What every node of a job reads in a range of epochs: plan_for_node's files and bytes."""

    files: np.ndarray  # (nodes,) int64 distinct files
    bytes: np.ndarray  # (nodes,) int64 their bytes


# Bytes of the (nodes x files) marks node_figures holds at once.
_MARK_BYTES = 64 << 20


def node_figures(
    dataset: Any,
    sampler: SamplerSpec,
    batch_size: int,
    epochs: tuple[int, int],
    layout: Sequence[Sequence[int]],
) -> NodeFigures:
    """NodePlan.files and .bytes of every node of `layout` for epochs [begin, end), at once.

    One permutation per epoch for the whole job; each epoch's file ids are kept grouped by node
    (4 bytes a read), then nodes are taken in groups whose (nodes x files) marks fit
    _MARK_BYTES. Costs O(epochs x samples + nodes x files); no Python loop over files."""
    begin, end = epoch_range(epochs)
    steps = sampler.for_rank(0).steps_per_epoch(batch_size)
    nfiles = len(dataset.files)
    order = np.concatenate([np.asarray(ranks, np.int64) for ranks in layout])
    per_node = np.array([len(ranks) for ranks in layout], np.int64) * steps * batch_size
    starts = np.concatenate([[0], np.cumsum(per_node)])
    id_type = np.int32 if nfiles < 2**31 else np.int64
    by_epoch = [
        np.asarray(
            dataset.file_ids(sampler.rank_indices(epoch)[order, : steps * batch_size].reshape(-1)),
            dtype=id_type,
        )
        for epoch in range(begin, end)
    ]
    sizes = file_sizes(dataset)
    files = np.zeros(len(layout), np.int64)
    nbytes = np.zeros(len(layout), np.int64)
    group = max(1, _MARK_BYTES // max(nfiles, 1))
    for first in range(0, len(layout), group):
        last = min(first + group, len(layout))
        marks = np.zeros((last - first) * nfiles, dtype=bool)
        row = np.repeat(np.arange(last - first, dtype=np.int64), per_node[first:last]) * nfiles
        for ids in by_epoch:
            marks[row + ids[starts[first] : starts[last]]] = True
        hit = np.flatnonzero(marks)
        bounds = np.searchsorted(hit, np.arange(last - first + 1, dtype=np.int64) * nfiles)
        files[first:last] = np.diff(bounds)
        total = np.concatenate([[0], np.cumsum(sizes[hit % nfiles])])
        nbytes[first:last] = np.diff(total[bounds])
    return NodeFigures(files=files, bytes=nbytes)


def render_plan(
    plan: NodePlan,
    dataset: Any,
    fingerprint: str | None = None,
    dest_prefix: str = "",
    peer_lines: Sequence[str] = (),
    slots: Any = None,
) -> str:
    """The plan file's text (format version PLAN_VERSION, docs/staging.md): plan_bytes."""
    return plan_bytes(plan, dataset, fingerprint, dest_prefix, peer_lines, slots).decode()


def plan_bytes(
    plan: NodePlan,
    dataset: Any,
    fingerprint: str | None = None,
    dest_prefix: str = "",
    peer_lines: Sequence[str] = (),
    slots: Any = None,
) -> bytes:
    """The plan file's bytes (format version PLAN_VERSION, docs/staging.md), UTF-8.

    dest_prefix: directory, relative to the stage dir, that the data set's copies go into.
    peer_lines: the optional peer section (hpcdl.staging.peers.render_peer_section).
    slots: a run that may fetch pieces (hpcdl.staging.pieces.PieceSlots): the status map has
    its slots, and the plan's piece entries get their names and `pieces` section."""
    root = Path(dataset.root)
    files: Sequence[Any] = dataset.files
    head = [
        f"hpcdl-plan {PLAN_VERSION}",
        f"fingerprint {fingerprint or dataset_fingerprint(dataset)}",
        f"seed {plan.seed}",
        f"epochs {plan.epoch_begin} {plan.epoch_end}",
        f"steps_per_epoch {plan.steps_per_epoch}",
        f"local_ranks {plan.local_ranks}",
        f"dataset_files {len(files) if slots is None else slots.slots}",
        f"node {plan.node}",
        f"shuffle {plan.shuffle}",
        f"entries {plan.files}",
    ]
    root_text = str(root)
    if "\t" in root_text or "\n" in root_text:
        raise PlanError(f"data set root {root_text!r}: tab or newline in path")
    ids = plan.file_ids
    values, bounds = plan.tick_table()
    prefix = f"{dest_prefix}/" if dest_prefix else ""
    if slots is None:
        sizes = file_sizes(dataset, ids)
        table = isinstance(files, FileTable)
        rels = sources = files.relpaths(ids) if table else [files[i].relpath for i in ids]
        if not (table and table_checked(files)):
            check_relpaths(rels)
    else:  # the shards' names were checked as the data set opened; a piece adds a number
        sizes = slots.files.sizes[ids]
        rels, sources = slots.names(ids)
    ticks = list(map(str, values.tolist()))
    lines = "".join(
        f"{fid}\t{size}\t{','.join(ticks[a:b])}\t{prefix}{rel}\t{root_text}/{src}\n"
        for fid, size, a, b, rel, src in zip(
            ids.tolist(), sizes.tolist(), bounds[:-1].tolist(), bounds[1:].tolist(), rels, sources
        )  # fmt: skip
    ).encode()
    pieces = [] if slots is None else slots.section(plan)
    tail = [*peer_lines, *pieces, "end", ""]
    return b"".join([("\n".join(head) + "\n").encode(), lines, "\n".join(tail).encode()])


def write_plan(
    path: Path,
    plan: NodePlan,
    dataset: Any,
    fingerprint: str | None = None,
    dest_prefix: str = "",
    peer_lines: Sequence[str] = (),
    slots: Any = None,
) -> None:
    """Write the plan atomically (hpcdl.atomic), mode 0600 whatever the umask."""
    data = plan_bytes(plan, dataset, fingerprint, dest_prefix, peer_lines, slots)
    write_bytes_atomically(path, data, mode=0o600)


class FileTreeDataset:
    """Every regular file under root is one sample (staging arbitrary trees, benchmarks)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"data directory {self.root} does not exist")
        relpaths, sizes = [], []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames.sort()
            for name in sorted(filenames):
                full = Path(dirpath) / name
                if full.is_file() and not full.is_symlink():
                    relpaths.append(str(full.relative_to(self.root)))
                    sizes.append(full.stat().st_size)
        if not relpaths:
            raise ValueError(f"data directory {self.root} holds no files")
        self.files = FileTable.from_entries(relpaths, sizes)  # as every data set's

    @classmethod
    def of_files(cls, root: str | Path, relpaths: list[str], sizes: list[int]) -> FileTreeDataset:
        """Some of root's files only (given, not walked): a stager's plan of a sample."""
        ds = cls.__new__(cls)
        ds.root, ds.files = Path(root), FileTable.from_entries(relpaths, sizes)
        return ds

    def __len__(self) -> int:
        return len(self.files)

    def file_ids(self, indices: np.ndarray) -> np.ndarray:
        return np.asarray(indices, dtype=np.int64)
