"""Do the ranks agree on one named collective? The checks a round makes on every rank alike.

Every rank runs disagreement() on the same table (NOTE [negotiation rounds] in engine.py), so
every rank fails the same collective with the same line and none waits in MPI for a partner
that will not come. A rank's own problem with its arguments (bad alltoall splits, a scalar to
scatter, a non-contiguous tensor) is a ValueError; ranks that disagree with each other make a
HorovodInternalError (a RuntimeError), as in Horovod.
"""

from __future__ import annotations

from typing import Any

from hpcdl.torch.unbuilt import HorovodInternalError, NotBuilt

_OP_NAMES = {0: "Average", 1: "Sum", 2: "Adasum", 3: "Min", 4: "Max", 5: "Product"}
_ROWS_MAY_DIFFER = ("allgather", "alltoall")  # the first dimension may differ by rank


def disagreement(descs: list[Any], joined: set[int], size: int) -> BaseException | None:
    """The error for this collective on every rank, or None when it may run.

    descs[r]: rank r's Descriptor, None for a joined rank that did not submit it."""
    present = [(r, d) for r, d in enumerate(descs) if d is not None]
    name = present[0][1].name
    for r, d in present:
        if d.problem is not None:
            error = NotBuilt if d.unbuilt else ValueError
            return error(f"{d.kind} {name!r} on rank {r}: {d.problem}")
    first = present[0][1]
    kinds = {d.kind for _, d in present}
    if len(kinds) > 1:
        return _mismatch(name, "collective", [(r, d.kind) for r, d in present])
    if joined and first.kind not in ("allreduce", "barrier"):
        return HorovodInternalError(
            f"{first.kind} {name!r}: rank(s) {sorted(joined)} called join(); only allreduce "
            "runs while a rank has joined"
        )
    for label, value in (
        ("number of tensors", lambda d: len(d.specs)),
        ("device", lambda d: tuple(s[2] for s in d.specs)),
        ("dtype", lambda d: tuple(s[1].replace("torch.", "") for s in d.specs)),
        ("shape", lambda d: tuple(_shape_key(s[0], first.kind) for s in d.specs)),
        ("op", lambda d: _OP_NAMES.get(d.op, d.op)),
        ("root rank", lambda d: d.root),
        ("prescale/postscale factors", lambda d: d.scale),
    ):
        values = [(r, value(d)) for r, d in present]
        if len({v for _, v in values}) > 1:
            if label == "device":
                return HorovodInternalError(
                    f"{first.kind} {name!r} mixes CPU and GPU tensors across ranks: "
                    + ", ".join(f"rank {r}: {'/'.join(v)}" for r, v in values)
                )
            return _mismatch(name, label, values, first.kind)
    if first.kind == "broadcast" and not 0 <= first.root < size:
        return HorovodInternalError(
            f"broadcast {name!r}: root rank {first.root} is out of range (0..{size - 1})"
        )
    return None


def _shape_key(shape: tuple[int, ...], kind: str) -> tuple[Any, ...]:
    if kind in _ROWS_MAY_DIFFER:
        return (len(shape), *shape[1:])
    return tuple(shape)


def _mismatch(name: str, label: str, values: list[tuple[int, Any]], kind: str = "") -> Exception:
    shown = ", ".join(f"rank {r}: {v}" for r, v in values[:8])
    what = f"{kind} {name!r}" if kind else repr(name)
    hint = (
        " (the first dimension may differ; the others may not)" if kind in _ROWS_MAY_DIFFER else ""
    )
    return HorovodInternalError(f"{what}: ranks disagree on the {label}{hint}: {shown}")
