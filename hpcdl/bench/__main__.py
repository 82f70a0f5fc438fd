"""Dispatch `python -m hpcdl.bench NAME ...` to hpcdl.bench.NAME.main(argv).

These are the benchmarks a user runs on a cluster. The developer harnesses and issue
reproductions (validate, interconnect, staging, the PyTorch peers, ...) are `python -m
tools.bench` in the repository (tools/bench/__main__.py), above this package.
"""

from __future__ import annotations

import sys

from hpcdl.bench import dispatch

BENCHMARKS = {
    "compute": "hpcdl.bench.compute",
    "allreduce": "hpcdl.bench.allreduce",
    "loader": "hpcdl.bench.loader",
    "input": "hpcdl.bench.input",
    "scaling": "hpcdl.bench.scaling",
    "train": "hpcdl.bench.train",
    "calibrate": "hpcdl.bench.calibrate",
    "diag": "hpcdl.bench.diag",
    "torch-sync": "hpcdl.bench.torch_sync",
}
PROG = "python -m hpcdl.bench"


def main(argv: list[str] | None = None) -> int:
    return dispatch.run(PROG, BENCHMARKS, "benchmarks", sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    from hpcdl import cli

    sys.exit(cli.run(main))
