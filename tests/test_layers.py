"""The house plan holds: hpcdl's layers (docs/internals.md, "Layers"), and tests share helpers.

Every import of every module under hpcdl/ and tools/ is read with ast, the ones inside
functions (lazy) included, so an import that only runs later still counts. There must be no
import cycle between modules and no import from a lower layer to a higher one; PyTorch is
imported only in the layers that may (hpcdl.torch, hpcdl.torch_engine: hpcdl.train's torch
engine, hpcdl.bench above it, and tools/).
tools/, the developer harnesses, sits above the package: it may import hpcdl, and hpcdl never
imports it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "hpcdl"
TOOLS = REPO / "tools"
TESTS = REPO / "tests"

# Lowest first. A module may import modules of its own layer or of a lower one. A name is the
# module or the package that heads it (hpcdl.nn covers hpcdl.nn.*; "hpcdl" is only the
# package's own __init__, so a new module has no layer until it is written down here).
LAYERS: tuple[tuple[str, ...], ...] = (
    # base utilities: no hpcdl import above this line (hpcdl.diag: the diagnostics' event ring)
    (
        "hpcdl",
        "hpcdl.messages",
        "hpcdl.fsync",
        "hpcdl.atomic",
        "hpcdl.helpformat",
        "hpcdl.cli",
        "hpcdl.tensorboard_events",
        "hpcdl.diag",
        "hpcdl.mpi_threads",
        "hpcdl.mpi_errors",
        "hpcdl.paths",
        "hpcdl.figure_file",
        "hpcdl.units",
        "hpcdl.sigterm_blocked",
        "hpcdl.stop_signals",
    ),  # fmt: skip
    ("hpcdl.backend", "hpcdl.nn"),  # arrays and models: no MPI, no data loading
    ("hpcdl.data", "hpcdl.comm"),  # data sets, sampler, loader; MPI world, reducer, failure
    # TrainConfig, validated; its path keys; the stager's flag ranges
    ("hpcdl.config", "hpcdl.config_paths", "hpcdl.stage_flags"),
    ("hpcdl.staging",),  # the stage dir, plans, the stager session
    # what a run writes and what predicts it
    ("hpcdl.checkpoint", "hpcdl.metrics", "hpcdl.metrics_file", "hpcdl.clustermodel"),
    # a run's resources; checkpoints in and out of a run; the seam to its engine (hpcdl.engine)
    ("hpcdl.run", "hpcdl.resume", "hpcdl.engine", "hpcdl.run_outputs", "hpcdl.resume_changes"),
    # a Run from a TrainConfig, and the two engines behind the seam (hpcdl.engines picks one)
    (
        "hpcdl.startup",
        "hpcdl.startup_checks",
        "hpcdl.startup_input",
        "hpcdl.engines",
        "hpcdl.array_engine",
        "hpcdl.torch_engine",
    ),  # fmt: skip
    # commands (every package's __main__ counts here, at least)
    (
        "hpcdl.train",
        "hpcdl.export",
        "hpcdl.stage",
        "hpcdl.report",
        "hpcdl.report_diag",
        "hpcdl.doctor",
        "hpcdl.jobs",
        "hpcdl.launch",
    ),  # fmt: skip
    ("hpcdl.torch",),  # the PyTorch adapter for scripts
    ("hpcdl.bench",),  # `python -m hpcdl.bench`: may use everything, torch lazily
    ("tools",),  # harnesses outside the package (python -m tools.bench); hpcdl never imports it
)
COMMANDS = next(i for i, names in enumerate(LAYERS) if "hpcdl.train" in names)
# The only places that may import PyTorch (NOTE in hpcdl/torch/__init__.py).
TORCH_IMPORTERS = ("hpcdl.torch", "hpcdl.torch_engine", "hpcdl.bench", "tools")
# Dynamic imports of an optional package by a literal name count as imports of it.
DYNAMIC_IMPORTS = ("import_module", "optional_import", "__import__")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    """hpcdl's modules and tools/'s (the top layer), by dotted name."""
    paths = sorted(PACKAGE.rglob("*.py")) + sorted(TOOLS.rglob("*.py"))
    return {module_name(p, REPO): p for p in paths}


def imported_names(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """(absolute module name, line) of every import in the file, lazy ones included."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            yield base, node.lineno
            yield from ((f"{base}.{alias.name}", node.lineno) for alias in node.names)
        elif isinstance(node, ast.Call) and _called_name(node) in DYNAMIC_IMPORTS:
            if node.args and isinstance(node.args[0], ast.Constant):
                if isinstance(node.args[0].value, str):
                    yield node.args[0].value, node.lineno


def _called_name(node: ast.Call) -> str | None:
    func = node.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {hpcdl module it imports: first line}; a package's own __init__ is no edge."""
    modules = package_modules()
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for name, line in imported_names(module, path):
            target = name
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != module and not module.startswith(target + "."):
                edges.setdefault(target, line)
    return graph


def layer_of(module: str) -> int:
    """Index in LAYERS of the longest name that heads module; a __main__ is a command."""
    best, index = "", -1
    for i, names in enumerate(LAYERS):
        for name in names:
            heads = module == name or (name != "hpcdl" and module.startswith(name + "."))
            if heads and len(name) > len(best):
                best, index = name, i
    assert index >= 0, f"{module} has no layer: add it to LAYERS and to docs/internals.md"
    return max(index, COMMANDS) if module.endswith(".__main__") else index


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif target not in index:
                index[target] = low[target] = len(index)
                stack.append(target)
                on_stack.add(target)
                work.append((target, iter(graph[target])))
            elif target in on_stack:
                low[node] = min(low[node], index[target])
    return found


def test_every_module_has_a_layer():
    unplaced = []
    for module in package_modules():
        try:
            layer_of(module)
        except AssertionError:
            unplaced.append(module)
    assert unplaced == [], f"modules outside every layer of LAYERS: {unplaced}"


def test_no_import_cycle_between_modules():
    assert cycles(import_graph()) == []


def test_no_import_points_up():
    graph = import_graph()
    upward = [
        f"{module} imports {target} (line {line}): layer {layer_of(module)} -> {layer_of(target)}"
        for module, edges in graph.items()
        for target, line in edges.items()
        if layer_of(target) > layer_of(module)
    ]
    assert upward == [], "\n".join(upward)


def test_the_package_never_imports_tools():
    """tools/ is not installed: an import of it from hpcdl would fail on a user's machine."""
    into_tools = [
        f"{module} imports {target} (line {line})"
        for module, edges in import_graph().items()
        if module.startswith("hpcdl")
        for target, line in edges.items()
        if target.split(".")[0] == "tools"
    ]
    assert [m for m in package_modules() if m.startswith("tools.")], "tools/ was not read"
    assert into_tools == [], "\n".join(into_tools)


def test_tools_imports_from_the_repository_root_without_an_install(tmp_path):
    """As CI and a developer run it: `python -m tools.bench` from the root, nothing on the path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-m", "tools.bench", "--help"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "python -m tools.bench NAME" in done.stdout and "validate" in done.stdout


def test_torch_is_imported_only_by_the_torch_adapter_and_the_benchmarks():
    bad = [
        f"{module}:{line} imports {name}"
        for module, path in package_modules().items()
        for name, line in imported_names(module, path)
        if name.split(".")[0] == "torch"
        and not any(module == t or module.startswith(t + ".") for t in TORCH_IMPORTERS)
    ]
    assert bad == [], "\n".join(bad)


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The reader sees lazy and dynamic imports, and Tarjan finds a circle (no vacuous pass)."""
    lazy = tmp_path / "lazy.py"
    lazy.write_text(
        "def f():\n    from hpcdl.bench import compute\n"
        "def g():\n    return optional_import('torch', 'torch', 'x')\n"
    )
    names = {name for name, _ in imported_names("hpcdl.nn.lazy", lazy)}
    assert {"hpcdl.bench", "hpcdl.bench.compute", "torch"} <= names
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
    assert layer_of("hpcdl.nn.__main__") == COMMANDS > layer_of("hpcdl.nn.step")
    assert layer_of("hpcdl.bench.__main__") == layer_of("hpcdl.bench") > COMMANDS
    assert layer_of("tools.bench.train") > layer_of("hpcdl.bench.train")
    with pytest.raises(AssertionError, match="has no layer"):
        layer_of("hpcdl.not_written_down")


def test_no_test_module_imports_another():
    """Shared helpers live in tests/helpers.py (and gradcheck.py, slurm_jobs.py); conftest.py
    holds fixtures and hooks, which pytest hands to the tests, so nothing imports it either."""
    tests = {p.stem for p in TESTS.glob("test_*.py")}
    crossing = sorted(
        {
            f"{path.name}:{line} imports {name.split('.')[0]}"
            for path in TESTS.glob("*.py")
            for name, line in imported_names(path.stem, path)
            if name.split(".")[0] in (tests | {"conftest"}) - {path.stem}
        }
    )
    assert crossing == [], "\n".join(crossing)
