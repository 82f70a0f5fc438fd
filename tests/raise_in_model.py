"""Test-only entry point: `python tests/raise_in_model.py STEP RANKS -- <hpcdl.train flags>`.

Runs hpcdl.train.main with every Linear layer's training forward raising RuntimeError at
training step STEP (counted from 0) on the world ranks listed in RANKS ("0", "1" or "0,1"): a bug
in model code, which the product gives no way to provoke. Lives in tests/ only.
"""

from __future__ import annotations

import os
import sys

from hpcdl import train
from hpcdl.nn.layers import Linear


class ModelBug(RuntimeError):
    """The exception the patched layer raises."""


def patch(step: int, ranks: set[int]) -> None:
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    original = Linear.forward
    seen: dict[int, int] = {}  # id(layer) -> training forwards so far

    def forward(self, x, train=True):
        if train:
            count = seen.get(id(self), 0)
            seen[id(self)] = count + 1
            if count == step and rank in ranks:
                raise ModelBug(f"model bug at step {step} on rank {rank}")
        return original(self, x, train)

    Linear.forward = forward


if __name__ == "__main__":
    at, on, sep, *flags = sys.argv[1:]
    assert sep == "--", "usage: raise_in_model.py STEP RANKS -- FLAGS"
    patch(int(at), {int(r) for r in on.split(",")})
    sys.exit(train.main(flags))
