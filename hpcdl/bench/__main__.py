"""Dispatch `python -m hpcdl.bench NAME ...` to hpcdl.bench.NAME.main(argv)."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "compute": "hpcdl.bench.compute",
    "allreduce": "hpcdl.bench.allreduce",
    "loader": "hpcdl.bench.loader",
    "staging": "hpcdl.bench.staging",
    "scaling": "hpcdl.bench.scaling",
    "train": "hpcdl.bench.train",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BENCHMARKS:
        names = ", ".join(BENCHMARKS)
        print(f"usage: python -m hpcdl.bench {{{names}}} [options]", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[argv[0]])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
