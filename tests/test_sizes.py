"""Rooms stay small (STYLE.md; issue 50's goals): no module over 600 lines in hpcdl/, no file
over 700 in staging/src/, no function over 60 lines in either.

Python functions are measured with ast (decorators excluded, docstring included). C++ function
bodies are found by counting braces: a definition is a line that opens a brace after a closing
parenthesis at the top of a namespace or class (not a control statement, a namespace, a class
or an enum), and it ends where that brace closes; a lambda inside counts toward its function.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODULE_LINES, CPP_FILE_LINES, FUNCTION_LINES = 600, 700, 60

_DEFINITION = re.compile(r"\)\s*(const\s*)?(noexcept\s*)?(override\s*)?(->\s*[\w:<>]+\s*)?(:.*)?\{")
_NOT_A_FUNCTION = re.compile(
    r"^\s*(}\s*)?(if|for|while|switch|else|do|catch)\b|\b(namespace|class|struct|enum)\b"
)  # noqa: E501


def python_functions(source: str) -> list[tuple[int, str, int]]:
    """(line, name, lines) of every function and method in source."""
    return [
        (node.lineno, node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ]


def cpp_functions(source: str) -> list[tuple[int, str, int]]:
    """(line, the definition's line, lines) of every function body in C++ source."""
    found, depth, start = [], 0, None
    for number, raw in enumerate(source.splitlines(), 1):
        line = re.sub(r'"(\\.|[^"\\])*"', '""', raw)  # braces in strings and chars do not count
        line = re.sub(r"'(\\.|[^'\\])'", "''", line).split("//")[0]
        for ch in line:
            if ch == "{":
                if start is None and _DEFINITION.search(line) and not _NOT_A_FUNCTION.search(line):
                    start = (number, line.strip(), depth)
                depth += 1
            elif ch == "}":
                depth -= 1
                if start is not None and depth == start[2]:
                    found.append((start[0], start[1], number - start[0] + 1))
                    start = None
    return found


def test_no_module_or_function_is_too_long():
    long = []
    for path in sorted((REPO / "hpcdl").rglob("*.py")):
        source, name = path.read_text(), path.relative_to(REPO)
        if source.count("\n") > MODULE_LINES:
            long.append(f"{name}: {source.count(chr(10))} lines")
        long += [
            f"{name}:{line} {func}: {lines} lines"
            for line, func, lines in python_functions(source)
            if lines > FUNCTION_LINES
        ]
    for path in sorted((REPO / "staging" / "src").glob("*.[ch]*")):
        source, name = path.read_text(), path.relative_to(REPO)
        if source.count("\n") > CPP_FILE_LINES:
            long.append(f"{name}: {source.count(chr(10))} lines")
        long += [
            f"{name}:{line} {head}: {lines} lines"
            for line, head, lines in cpp_functions(source)
            if lines > FUNCTION_LINES
        ]
    assert long == [], "over the limits (split the idea in two):\n" + "\n".join(long)


def test_the_counters_find_what_they_measure():
    """Both counters see functions, methods, multi-line signatures and nested braces."""
    python = "def a():\n    pass\n\n\nclass B:\n    def c(self):\n        x = 1\n        return x\n"
    assert python_functions(python) == [(1, "a", 2), (6, "c", 3)]
    cpp = (
        "namespace hpcdl {\n"  # 1
        "int add(int a,\n"  # 2
        "        int b) {\n"  # 3
        '  if (a) { return a + b; }  // "}" in a comment\n'  # 4
        '  const char* s = "{";\n'  # 5
        "  auto f = [&] { return b; };\n"  # 6
        "  return f();\n"  # 7
        "}\n"  # 8
        "class C {\n"  # 9
        " public:\n"  # 10
        "  int get() const { return 1; }\n"  # 11
        "};\n"  # 12
        "}  // namespace hpcdl\n"
    )
    assert [(line, lines) for line, _, lines in cpp_functions(cpp)] == [(3, 6), (11, 1)]
