"""hpcdl.messages: the one format of `hpcdl: rank R: ...` lines, and no module writing its own."""

from __future__ import annotations

import ast
from pathlib import Path

from hpcdl import messages

PACKAGE = Path(__file__).resolve().parents[1] / "hpcdl"
OWNERS = ("messages.py",)  # the one module that makes them


def test_lines_name_the_rank_and_the_kind(monkeypatch, capsys):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    assert messages.rank_line("disk full") == "hpcdl: rank 3: disk full"
    assert messages.rank_line("slow", "warning", rank=1) == "hpcdl: rank 1: warning: slow"
    messages.error("bad --lr")
    messages.warn("worker 12 is slow", rank=0)
    messages.crashed("Traceback (most recent call last):\n  ...\nKeyError: 'x'", rank=2)
    err = capsys.readouterr().err.splitlines()
    assert err[:3] == [
        "hpcdl: rank 3: error: bad --lr",
        "hpcdl: rank 0: warning: worker 12 is slow",
        "hpcdl: rank 2 failed:",
    ]
    assert err[-1] == "KeyError: 'x'"


def _literal_start(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values:
        return _literal_start(node.values[0])
    return None


def test_no_module_formats_a_rank_line_by_hand():
    by_hand = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(OWNERS):
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        for node in ast.walk(tree):
            start = _literal_start(node)
            if start and start.startswith("hpcdl: rank") and id(node) not in docstrings:
                by_hand.append(f"{rel}:{node.lineno}")
    assert by_hand == [], f"write these through hpcdl.messages: {by_hand}"
