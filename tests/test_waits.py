"""Tests wait on conditions, not clocks: no fixed `time.sleep(...)` followed by an assert.

A sleep that an assert follows either flakes under load or passes without having tested
(STYLE.md, "Tests wait on conditions"). Every test module is read with ast: a sleep is flagged
when an assert (or pytest.raises) runs after it, in its block or after the loops around it,
before anything that waits on a condition (a call named wait*, join, communicate or
synchronize). A sleep inside a `while` loop polls a condition and is not flagged; neither is
one with a comment on its line or the line above, which says why a fixed wait is right there.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
WAITS = ("join", "communicate", "synchronize")


def _name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _waits(stmt: ast.AST) -> bool:
    calls = (n for n in ast.walk(stmt) if isinstance(n, ast.Call))
    return any(_name(c).startswith("wait") or _name(c) in WAITS for c in calls)


def _asserts(stmt: ast.AST) -> bool:
    raises = (
        isinstance(n, ast.With)
        and any(
            isinstance(i.context_expr, ast.Call) and _name(i.context_expr) == "raises"
            for i in n.items
        )  # fmt: skip
        for n in ast.walk(stmt)
    )
    return any(isinstance(n, ast.Assert) for n in ast.walk(stmt)) or any(raises)


def sleeps_before_asserts(source: str) -> list[int]:
    """Lines of the uncommented fixed sleeps in source that an assert follows."""
    tree, lines = ast.parse(source), source.splitlines()
    place: dict[int, tuple[ast.AST, list[ast.stmt], int]] = {}
    for node in ast.walk(tree):
        for name in ("body", "orelse", "finalbody"):
            body = getattr(node, name, None)
            for i, stmt in enumerate(body if isinstance(body, list) else []):
                place[id(stmt)] = (node, body, i)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
            continue
        if _name(node.value) != "sleep" or "#" in lines[node.lineno - 1]:
            continue
        if node.lineno > 1 and lines[node.lineno - 2].strip().startswith("#"):
            continue
        stmt, verdict = node, None
        while verdict is None and id(stmt) in place:
            parent, body, i = place[id(stmt)]
            if isinstance(parent, ast.While):
                verdict = "polls"
            for later in [] if verdict else body[i + 1 :]:
                if _waits(later):
                    verdict = "waits"
                    break
                if _asserts(later):
                    verdict = "asserts"
                    break
            if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
                break
            stmt = parent
        if verdict == "asserts":
            found.append(node.lineno)
    return sorted(found)


def test_no_test_sleeps_before_an_assert():
    found = [
        f"{path.name}:{line}"
        for path in sorted(TESTS.glob("*.py"))
        for line in sleeps_before_asserts(path.read_text())
    ]
    assert found == [], "fixed sleeps followed by an assert (wait on a condition): " + str(found)


def test_the_check_catches_what_it_is_for():
    """A sleep then an assert is caught, directly or after its loop; a poll, a wait in between
    and a comment are not."""
    # Source text for the check to read, never run: its sleeps are the shapes under test, so no
    # comment may go on them (a comment is what lets a sleep pass). They are written SLEEP( and
    # made real below, so that a reader of this file's own text finds no sleep to flag.
    caught = """
def test_a():
    start()
    SLEEP(1)
    assert done()

def test_b():
    for _ in range(3):
        step()
        SLEEP(0.1)
    with pytest.raises(ValueError):
        check()
"""
    left = """
def test_c():
    while not done():
        SLEEP(0.1)
    assert done()

def test_d():
    SLEEP(1)
    wait_until(done)
    assert done()

def test_e():
    SLEEP(1)  # the stager reads its progress every 0.2 s and no event says it did
    assert done()
"""
    caught, left = (text.replace("SLEEP(", "time." + "sleep(") for text in (caught, left))
    assert sleeps_before_asserts(caught) == [4, 10]
    assert sleeps_before_asserts(left) == []
