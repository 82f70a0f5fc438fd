"""Dispatch `python -m hpcdl.bench NAME ...` to hpcdl.bench.NAME.main(argv)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

BENCHMARKS = {
    "compute": "hpcdl.bench.compute",
    "allreduce": "hpcdl.bench.allreduce",
    "interconnect": "hpcdl.bench.interconnect",
    "loader": "hpcdl.bench.loader",
    "staging": "hpcdl.bench.staging",
    "cleanup": "hpcdl.bench.cleanup",
    "scaling": "hpcdl.bench.scaling",
    "train": "hpcdl.bench.train",
    "finetune": "hpcdl.bench.finetune",
    "calibrate": "hpcdl.bench.calibrate",
    "validate": "hpcdl.bench.validate",
    "memory": "hpcdl.bench.memory",
    "torch-sync": "hpcdl.bench.torch_sync",
}
USAGE = "usage: python -m hpcdl.bench NAME [options]"


def describe(name: str) -> str:
    """The first line of a benchmark's docstring, read without importing it (or PyTorch)."""
    spec = importlib.util.find_spec(BENCHMARKS[name])
    source = Path(spec.origin).read_text() if spec and spec.origin else ""
    first = (ast.get_docstring(ast.parse(source)) or "").split("\n")[0]
    return first.removeprefix(f"`python -m hpcdl.bench {name}`: ")


def help_text() -> str:
    width = max(map(len, BENCHMARKS))
    lines = [USAGE, "", "benchmarks (`python -m hpcdl.bench NAME --help` for the options):"]
    lines += [f"  {name:{width}}  {describe(name)}" for name in BENCHMARKS]
    lines += ["", "Measured figures and how to read them: docs/PERFORMANCE.md, docs/report.md."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(help_text())
        return 0
    if not argv:
        print(f"{USAGE}\n(--help lists the benchmarks)", file=sys.stderr)
        return 2
    if argv[0] not in BENCHMARKS:
        names = ", ".join(BENCHMARKS)
        print(
            f"python -m hpcdl.bench: unknown benchmark {argv[0]!r}; choose one of {names} "
            "(--help describes them)",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(BENCHMARKS[argv[0]])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    from hpcdl import cli

    sys.exit(cli.run(main))
