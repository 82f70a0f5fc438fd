"""`python -m PROG NAME ...` to NAME's module's main(argv): one dispatcher for two command sets.

`python -m hpcdl.bench` (the user benchmarks, hpcdl/bench/__main__.py) and `python -m
tools.bench` (the developer harnesses above the package, tools/bench/__main__.py) each hold a
table of names to modules and call run(). A data set a benchmark cannot open (hpcdl.data's
DataError) is bad input, said in one line as every hpcdl command says it, not a traceback.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

from hpcdl.data.dataset import DataError


def describe(prog: str, module: str, name: str) -> str:
    """The first line of a benchmark's docstring, read without importing it (or PyTorch)."""
    spec = importlib.util.find_spec(module)
    source = Path(spec.origin).read_text() if spec and spec.origin else ""
    first = (ast.get_docstring(ast.parse(source)) or "").split("\n")[0]
    return first.removeprefix(f"`{prog} {name}`: ")


def help_text(prog: str, table: dict[str, str], what: str) -> str:
    width = max(map(len, table))
    lines = [f"usage: {prog} NAME [options]", "", f"{what} (`{prog} NAME --help` for the options):"]
    lines += [f"  {name:{width}}  {describe(prog, module, name)}" for name, module in table.items()]
    lines += ["", "Measured figures and how to read them: docs/PERFORMANCE.md, docs/report.md."]
    return "\n".join(lines)


def run(prog: str, table: dict[str, str], what: str, argv: list[str]) -> int:
    """Run NAME = argv[0] with the rest; --help lists the table; status 2 on a wrong name."""
    if argv and argv[0] in ("-h", "--help"):
        print(help_text(prog, table, what))
        return 0
    if not argv:
        print(f"usage: {prog} NAME [options]\n(--help lists the {what})", file=sys.stderr)
        return 2
    if argv[0] not in table:
        names = ", ".join(table)
        print(
            f"{prog}: unknown benchmark {argv[0]!r}; choose one of {names} (--help describes them)",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(table[argv[0]])
    try:
        return int(module.main(argv[1:]) or 0)
    except DataError as exc:
        print(f"{prog} {argv[0]}: error: {exc}", file=sys.stderr)
        return 2
