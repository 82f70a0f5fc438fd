"""What hpcdl.torch does not build of Horovod's API, and the one error each raises.

Process sets, Adasum and `horovod.torch.elastic` are not built (the timeline is hpcdl's,
hpcdl.torch.timeline). Each name exists, so that a Horovod script imports, and using it raises
NotBuilt (a NotImplementedError) with one line naming the feature and what to do instead
(docs/horovod.md, "Not built").
HorovodInternalError is Horovod's error for a collective that failed (ranks that disagree on a
name's shape, dtype, op or root): a RuntimeError, as Horovod's.
"""

from __future__ import annotations

from typing import Any

_INSTEAD = {
    "process sets": "run the collectives over every rank (the global process set)",
    "Adasum": "use op=hvd.Average or op=hvd.Sum",
    "elastic": "restart the job from a checkpoint (docs/slurm.md, job chains)",
}


class HorovodInternalError(RuntimeError):
    """A collective failed on every rank (Horovod's name for it)."""


class NotBuilt(NotImplementedError):
    """A Horovod feature that hpcdl.torch does not build."""


def not_built(feature: str) -> NotBuilt:
    key = next((k for k in _INSTEAD if k.lower() in feature.lower()), feature)
    instead = _INSTEAD.get(key, "see docs/horovod.md")
    return NotBuilt(f"hpcdl.torch does not build Horovod's {feature}: {instead} (docs/horovod.md)")


class _Elastic:
    """`hvd.elastic`: any attribute raises NotBuilt."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise not_built(f"elastic training (hvd.elastic.{name})")


elastic = _Elastic()
