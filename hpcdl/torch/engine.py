"""The engine behind hpcdl.torch's named collectives: Horovod's matching by name on mpi4py.

NOTE [negotiation rounds]
Horovod matches collectives by name, not by call order: one rank may submit `a` then `b` and
another `b` then `a`; a rank may submit an async op and reach barrier() while another reaches
barrier() first and submits the op afterwards. So a collective does not go to MPI when it is
submitted. It waits in this rank's pending table until a round finds it submitted on every
rank. A round is one allgather (pickled, small) of every rank's pending descriptors (name, kind,
shapes, dtypes, device, op, root, scale factors, splits, joined or not) on the engine's own
duplicate of the communicator. Every rank then holds the same table and takes the same decisions
without another message:
- which ops are submitted on every rank that has not joined (in the submission order of the
  lowest such rank);
- which of those disagree (shape, dtype, device, op, root) or carry a rank's own problem (bad
  splits, a scalar to scatter): they fail on every rank with one line naming the ranks;
- the rest run as blocking MPI collectives, in that order, on every rank.
The descriptors also carry what the data movement needs (each rank's first dimension for
allgather, each rank's splits for alltoall), so a collective costs one small allgather plus its
data. Rounds are driven by callers that wait: synchronize(), barrier(), join(). poll() never
communicates, so an async op makes progress when a call on this rank waits (Horovod's
background thread makes progress alone). The DistributedOptimizer's gradients do not come here:
they go through hpcdl's GradientReducer (hpcdl.torch.optimizer), agreed once per layout.

join(): a joined rank keeps taking part in rounds; an allreduce submitted by every other rank
runs with zeros from it (Average still divides by the whole size, as Horovod's); any other
collective fails while a rank has joined. When every rank has joined, join() returns the highest
rank among those that joined last, on every rank.

A round where nothing is ready while every rank waits is a program whose ranks submit different
names: after STALL_WARNING_S this rank says once which ranks lack which names (Horovod's stall
check), and keeps waiting, as Horovod does.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from hpcdl import messages
from hpcdl.torch import transfer
from hpcdl.torch.unbuilt import HorovodInternalError

STALL_WARNING_S = 60.0


@dataclass(frozen=True)
class Descriptor:
    """What every rank learns about one pending collective in a round."""

    name: str
    kind: str  # allreduce, allgather, broadcast, alltoall, reducescatter, barrier
    specs: tuple[tuple[tuple[int, ...], str, str], ...]  # (shape, dtype, device type) per tensor
    op: int = 0
    root: int = -1
    scale: tuple[float, float] = (1.0, 1.0)  # prescale, postscale
    splits: tuple[int, ...] | None = None  # alltoall: rows sent to each rank
    problem: str | None = None  # this rank's own error with the arguments (ValueError)
    unbuilt: bool = False  # the problem is a feature not built (NotBuilt)


@dataclass
class Op:
    """One submitted collective on this rank, until synchronize() takes its result."""

    desc: Descriptor
    inputs: list[Any]
    in_place: bool
    grouped: bool
    done: bool = False
    result: Any = None
    error: BaseException | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Engine:
    """Pending collectives of this rank, matched with the other ranks' by name in rounds."""

    def __init__(self, comm: Any, aware: bool = False) -> None:
        """comm: the job's communicator (duplicated here; collective). aware: GPU tensors go to
        MPI directly (hpcdl.comm.cuda_aware's decision), else through pinned host memory."""
        self.comm = comm.Dup()  # ours alone: no other collective interleaves with a round
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.aware = aware
        self._lock = threading.RLock()
        self._pending: dict[str, Op] = {}  # by name, in submission order
        self._handles: dict[int, Op] = {}
        self._next_handle = 0
        self._unnamed: dict[str, int] = {}
        self._joined = False
        self._join_device: Any = None
        self._joined_before: set[int] = set()  # the same on every rank: from the rounds' table
        self._join_result = -1
        self._epoch = 0  # joins completed: unnamed collectives are counted afresh after each
        self._gone: str | None = None  # why no round can run any more (a rank shut down)

    # ------------------------------------------------------------------ submitting

    def name_for(self, kind: str, name: str | None) -> str:
        """The name of a collective: the script's, else Horovod's `<kind>.noname.<n>` (ranks
        that submit in the same order get the same names)."""
        if name is not None:
            return str(name)
        count = self._unnamed.get(kind, 0) + 1
        self._unnamed[kind] = count
        return (
            f"{kind}.noname.{count}" if not self._epoch else f"{kind}.noname.{self._epoch}.{count}"
        )

    def submit(
        self,
        desc: Descriptor,
        inputs: list[Any],
        in_place: bool,
        grouped: bool,
        extra: dict[str, Any] | None = None,
    ) -> int:
        """Queue a collective; returns its handle. extra: what its kind needs to finish it
        (Op.extra). A name already in flight is a ValueError here, on this rank (nothing was
        queued, so no other rank waits for it)."""
        with self._lock:
            if self._gone is not None:
                raise HorovodInternalError(self._gone)
            if desc.name in self._pending:
                raise ValueError(
                    f"a collective named {desc.name!r} is already in flight on rank {self.rank}; "
                    "names of concurrent collectives must differ"
                )
            op = Op(desc, inputs, in_place, grouped, extra=dict(extra or {}))
            self._pending[desc.name] = op
            self._next_handle += 1
            self._handles[self._next_handle] = op
            return self._next_handle

    def poll(self, handle: int) -> bool:
        """True when the collective has finished (never communicates)."""
        op = self._handles.get(handle)
        return op is None or op.done

    def synchronize(self, handle: int) -> Any:
        """Wait for a collective and return its result; raises its error on every rank."""
        with self._lock:
            op = self._handles.get(handle)
            if op is None:
                return None
            self._wait(lambda: op.done, [op.desc.name])
            del self._handles[handle]
            if op.error is not None:
                raise op.error
            return op.result

    def barrier(self) -> None:
        desc = Descriptor(self.name_for("barrier", None), "barrier", ())
        self.synchronize(self.submit(desc, [], False, False))

    def join(self, device: Any = None) -> int:
        """Stand in for this rank's allreduces with zeros until every rank has joined; returns
        the last rank that joined (NOTE [negotiation rounds])."""
        with self._lock:
            self._joined, self._join_device, self._join_result = True, device, -1
            self._wait(lambda: not self._joined, ["join"])
            if self._gone is not None:
                raise HorovodInternalError(self._gone)
            return self._join_result

    def close(self) -> None:
        """Leave: one last round tells the other ranks, whose waiting collectives then fail
        (Horovod's shutdown); after a rank has left, no round can run."""
        with self._lock:
            if self._gone is None:
                self._round(leaving=True)
            self.comm.Free()

    # ------------------------------------------------------------------ rounds

    def _wait(self, finished: Any, names: list[str]) -> None:
        idle, since, warned = 0, time.monotonic(), False
        while not finished():
            if self._gone is not None:
                raise HorovodInternalError(self._gone)
            table = self._round()
            if table is not None:
                idle, since = 0, time.monotonic()
                continue
            idle += 1
            time.sleep(min(0.02, 0.0002 * idle))  # everyone waits and nothing is ready
            if not warned and time.monotonic() - since > STALL_WARNING_S:
                warned = True
                messages.warn(
                    f"hpcdl.torch: waiting over {STALL_WARNING_S:.0f} s for {names[0]!r}: "
                    f"{self._missing_line()}"
                )

    def _round(self, leaving: bool = False) -> Any:
        """One round; returns the table when something ran or joined, else None."""
        offers = [op.desc for op in self._pending.values()]
        table = self.comm.allgather((self._joined, leaving, offers))
        self._last_table = table
        left = [r for r, (_, gone, _) in enumerate(table) if gone]
        if left:
            self._leave(left)
            return table
        joined = {r for r, (flag, _, _) in enumerate(table) if flag}
        if len(joined) == self.size:
            newly = joined - self._joined_before
            self._join_result = max(newly) if newly else max(joined)
            self._joined, self._joined_before = False, set()
            self._epoch, self._unnamed = self._epoch + 1, {}
            return table
        changed = joined != self._joined_before
        self._joined_before = joined
        active = [r for r in range(self.size) if r not in joined]
        offered = [{d.name: d for d in descs} for _, _, descs in table]
        ready = [n for n in offered[active[0]] if all(n in offered[r] for r in active)]
        for name in ready:
            self._run(name, [offered[r].get(name) for r in range(self.size)], joined)
        return table if ready or changed else None

    def _leave(self, left: list[int]) -> None:
        """Rank(s) `left` shut down: every collective waiting here fails, and so will later ones."""
        self._gone = (
            f"rank(s) {left} shut down hpcdl.torch (the script ended or called "
            "hvd.shutdown()); the collectives waiting for them cannot complete"
        )
        for op in self._pending.values():
            op.error, op.done = HorovodInternalError(self._gone), True
        self._pending.clear()
        self._joined = False

    def _run(self, name: str, descs: list[Descriptor | None], joined: set[int]) -> None:
        from hpcdl.torch.agreement import disagreement  # noqa: PLC0415

        op = self._pending.pop(name, None)
        error = disagreement(descs, joined, self.size)
        if error is not None:
            if op is not None:
                op.error, op.done = error, True
            return
        present = next(d for d in descs if d is not None)
        if op is None:  # joined, and this rank never submitted it: zeros stand in
            _zeros_allreduce(self.comm, present, self._join_device, self.aware)
            return
        try:
            op.result = _execute(self, op, descs)
        except Exception as exc:  # MPI or torch failed on this rank: said, not hidden
            op.error = HorovodInternalError(
                f"{op.desc.kind} {name!r} failed on rank {self.rank}: {exc}"
            )
        op.done = True

    def _missing_line(self) -> str:
        table = getattr(self, "_last_table", None) or []
        offered = [{d.name for d in descs} for _, _, descs in table]
        every = set().union(*offered) if offered else set()
        parts = []
        for name in sorted(every)[:5]:
            lacking = [
                r for r, names in enumerate(offered) if name not in names and not table[r][0]
            ]
            if lacking:
                parts.append(f"{name!r} not yet submitted by rank(s) {lacking}")
        return "; ".join(parts) or "no rank has submitted a matching collective"


def _execute(engine: Engine, op: Op, descs: list[Descriptor | None]) -> Any:
    """Run one agreed collective on this rank; returns what synchronize() gives back."""
    d, comm, aware = op.desc, engine.comm, engine.aware
    if d.kind == "barrier":
        return None
    if d.kind == "allreduce":
        outs = op.inputs if op.in_place else [t.clone() for t in op.inputs]
        for t in outs:
            transfer.allreduce_(comm, t, d.op, d.scale[0], d.scale[1], aware)
    elif d.kind == "broadcast":
        outs = op.inputs if op.in_place else [t.clone() for t in op.inputs]
        for t in outs:
            transfer.broadcast_(comm, t, d.root, aware)
    elif d.kind == "allgather":
        outs = [
            transfer.allgather(comm, t, [e.specs[i][0][0] for e in descs], aware)
            for i, t in enumerate(op.inputs)
        ]
    elif d.kind == "reducescatter":
        outs = [
            transfer.reducescatter(
                comm,
                t,
                transfer.split_rows(t.shape[0], engine.size),
                d.op,
                d.scale[0],
                d.scale[1],
                aware,
            )
            for t in op.inputs
        ]
    else:  # alltoall
        recv = [e.splits[engine.rank] for e in descs]
        out = transfer.alltoall(comm, op.inputs[0], list(d.splits), recv, aware)
        return out, op.extra["recv_splits"](recv)
    return outs if op.grouped else outs[0]


def _zeros_allreduce(comm: Any, desc: Descriptor, device: Any, aware: bool) -> None:
    import torch  # noqa: PLC0415

    for shape, dtype, _ in desc.specs:
        zeros = torch.zeros(shape, dtype=getattr(torch, dtype.split(".")[-1]), device=device)
        transfer.allreduce_(comm, zeros, desc.op, desc.scale[0], desc.scale[1], aware)
