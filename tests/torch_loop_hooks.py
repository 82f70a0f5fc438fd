"""Test-only entry point: `python tests/torch_loop_hooks.py STEP RANKS MARK -- <torch_ddp flags>`.

Runs examples/torch_ddp.py's main with its model's training forward patched: at training step
STEP (counted from 0) rank 0 creates the file MARK (the test then knows training is under way;
'-' for none), and on the ranks listed in RANKS ("1", "0,1", or "-" for none) it raises
LoopBug, an exception in the user's training loop. Lives in tests/ only.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torch_ddp.py"


class LoopBug(RuntimeError):
    """The exception the patched forward raises."""


def load_example():
    spec = importlib.util.spec_from_file_location("torch_ddp", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def patch(example, step: int, ranks: set[int], mark: str) -> None:
    import torch.distributed as dist

    original = example.resnet

    def resnet(*args, **kwargs):
        model = original(*args, **kwargs)
        forward, calls = model.forward, [0]

        def patched(x):
            if model.training:
                rank = dist.get_rank()
                if calls[0] == step and rank == 0 and mark != "-":
                    Path(mark).touch()
                if calls[0] == step and rank in ranks:
                    raise LoopBug(f"bug in the training loop at step {step} on rank {rank}")
                calls[0] += 1
            return forward(x)

        model.forward = patched
        return model

    example.resnet = resnet


if __name__ == "__main__":
    at, on, mark, sep, *flags = sys.argv[1:]
    assert sep == "--", "usage: torch_loop_hooks.py STEP RANKS MARK -- FLAGS"
    example = load_example()
    patch(example, int(at), set() if on == "-" else {int(r) for r in on.split(",")}, mark)
    sys.exit(example.main(flags))
