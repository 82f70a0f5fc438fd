"""Dispatch `python -m tools.bench NAME ...` to tools.bench.NAME.main(argv), from the repository
root. The modules started by path in child processes (torch_ddp, torch_folder) are run with
`python -m tools.bench.NAME` from the same directory."""

from __future__ import annotations

import sys

from hpcdl.bench import dispatch

HARNESSES = {
    "train": "tools.bench.train",
    "validate": "tools.bench.validate",
    "interconnect": "tools.bench.interconnect",
    "staging": "tools.bench.staging",
    "shards": "tools.bench.shards",
    "cleanup": "tools.bench.cleanup",
    "memory": "tools.bench.memory",
    "finetune": "tools.bench.finetune",
    "peer-staging": "tools.bench.peer_staging",
    "peer-ranges": "tools.bench.peer_ranges",
    "on-node-loss": "tools.bench.on_node_loss",
    "torch-sync-nodes": "tools.bench.torch_sync_nodes",
}
PROG = "python -m tools.bench"


def main(argv: list[str] | None = None) -> int:
    return dispatch.run(PROG, HARNESSES, "harnesses", sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    from hpcdl import cli

    sys.exit(cli.run(main))
