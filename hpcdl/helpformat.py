"""The help format of every hpcdl command: each flag that takes a value shows its default."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends "(default: X)" to a flag's help unless the text already names its default.

    Unlike argparse.ArgumentDefaultsHelpFormatter it leaves out defaults that say nothing
    (None, and the False of an on/off switch), and keeps descriptions as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and action.nargs != 0
            and default not in (None, argparse.SUPPRESS)
            and "default" not in text
        ):
            text += " (default: %(default)s)"
        return text
