"""Every flag of every hpcdl command has help text; flags with a default say what it is."""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Every module that builds an argparse parser, found by reading the sources (the harnesses of
# tools/ included).
PARSER_MODULES = sorted(
    ".".join(path.relative_to(REPO).with_suffix("").parts)
    for root in (REPO / "hpcdl", REPO / "tools")
    for path in root.rglob("*.py")
    if "add_argument" in path.read_text() and path.name != "helpformat.py"
)
# The user-facing commands the issue names, plus doctor; each must be among PARSER_MODULES.
COMMANDS = {
    "hpcdl.config": "hpcdl.train",
    "hpcdl.stage": "hpcdl.stage",
    "hpcdl.jobs.__main__": "hpcdl.jobs",
    "hpcdl.data.__main__": "hpcdl.data",
    "hpcdl.report": "hpcdl.report",
    "hpcdl.doctor.__main__": "hpcdl.doctor",
    "hpcdl.bench.compute": "hpcdl.bench compute",
    "hpcdl.bench.allreduce": "hpcdl.bench allreduce",
    "hpcdl.bench.loader": "hpcdl.bench loader",
    "tools.bench.staging": "tools.bench staging",
    "hpcdl.bench.scaling": "hpcdl.bench scaling",
    "hpcdl.bench.train": "hpcdl.bench train",
    "tools.bench.train": "tools.bench train",
}


def walk(parser: argparse.ArgumentParser, name: str):
    """(command name, parser, action) for every argument, subcommands included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from walk(sub, f"{name} {sub_name}")
        elif not isinstance(action, argparse._HelpAction):
            yield name, parser, action


def all_arguments():
    for module in sorted(set(PARSER_MODULES) | set(COMMANDS)):
        parser = importlib.import_module(module).build_parser()
        yield from walk(parser, COMMANDS.get(module, module))


def expanded_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text as --help prints it (the formatter may add the default)."""
    return parser._get_formatter()._expand_help(action)


def test_every_parser_module_is_walked():
    assert set(COMMANDS) <= set(PARSER_MODULES), set(COMMANDS) - set(PARSER_MODULES)
    assert "hpcdl.train" not in PARSER_MODULES  # its parser lives in hpcdl.config
    assert len(PARSER_MODULES) >= 14, PARSER_MODULES


def test_every_argument_has_help():
    missing = [
        f"{name} {action.option_strings or action.dest}"
        for name, _, action in all_arguments()
        if not action.help or action.help == argparse.SUPPRESS
    ]
    assert not missing, "arguments without help: " + ", ".join(missing)


def test_every_flag_with_a_default_names_it():
    missing = []
    for name, parser, action in all_arguments():
        takes_value = action.option_strings and action.nargs != 0
        if takes_value and action.default not in (None, argparse.SUPPRESS):
            if "default" not in expanded_help(parser, action):
                missing.append(f"{name} {action.option_strings[0]}")
    assert not missing, "flags whose help hides their default: " + ", ".join(missing)


def test_every_train_flag_names_its_default():
    """hpcdl.train's parser defaults are None (a TOML file may fill them): the help says them."""
    parser = importlib.import_module("hpcdl.config").build_parser()
    missing = [
        action.option_strings[0]
        for _, _, action in walk(parser, "hpcdl.train")
        if action.option_strings != ["--config"] and "default" not in (action.help or "")
    ]
    assert not missing, missing


@pytest.mark.parametrize("flag,pattern", [("--bucket-mb", r"MiB"), ("--loader-timeout", "second")])
def test_train_help_gives_units(flag, pattern):
    parser = importlib.import_module("hpcdl.config").build_parser()
    action = next(a for a in parser._actions if flag in a.option_strings)
    assert re.search(pattern, action.help), action.help


def test_training_guide_lists_every_train_flag():
    guide = (REPO / "docs" / "training.md").read_text()
    parser = importlib.import_module("hpcdl.config").build_parser()
    flags = [a.option_strings[0] for _, _, a in walk(parser, "hpcdl.train")]
    assert [flag for flag in flags if not re.search(f"`{flag}[` ]", guide)] == []
