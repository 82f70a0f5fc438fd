"""A figure's file: checked before any work, written in one place.

Every command that draws (`hpcdl.report --out`, `report timeline --png`, `bench scaling
--plot`, `bench train --report`) calls check_figure_path on its flag before it reads or
measures anything, and save_figure at the end. matplotlib picks the format from the name's
extension and raises a ValueError for one it does not know; it appends `.png` to a name
without one (so `--out .` would write `./.png` and the command would name a file that is not
there); and a directory, or a file where a folder should be, fails only in savefig. All of
these are refused here in one line, so a bad name cannot cost a whole measurement.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hpcdl.paths import nearest_existing

# pgf is matplotlib's LaTeX code, which it can only write with a TeX installation at hand.
NOT_OFFERED = ("pgf",)
FIRST = ("png", "pdf", "svg")  # named first in a message: what most people want


class FigureFileError(ValueError):
    """A figure cannot be written to this path; the message names the flag, the path and why."""


def figure_formats() -> list[str]:
    """The extensions matplotlib writes (png first), without those hpcdl does not offer."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase  # noqa: PLC0415 (slow import)
    except ImportError:
        raise FigureFileError("drawing needs matplotlib: pip install 'hpcdl[report]'") from None
    known = set(FigureCanvasBase.get_supported_filetypes()) - set(NOT_OFFERED)
    return [f for f in FIRST if f in known] + sorted(known - set(FIRST))


def check_figure_path(path: str, flag: str) -> Path:
    """path as a Path when a figure can be written there (missing folders are made when it is
    saved); FigureFileError naming `flag` and path otherwise."""
    target = Path(path)
    if path.endswith(("/", "\\")) or target.is_dir():
        raise FigureFileError(f"{flag} {path} is a directory; name a file in it, such as "
                              f"{target / 'report.png'}")  # fmt: skip
    folder = nearest_existing(target.parent)
    if not folder.is_dir():
        raise FigureFileError(f"{flag} {path}: {folder} is a file, not a directory")
    formats = figure_formats()
    extension = target.suffix[1:].lower()
    if extension not in formats:
        wrong = f"'{target.suffix}' is not a format matplotlib writes" if extension else (
            "has no extension, which gives the format")  # fmt: skip
        raise FigureFileError(f"{flag} {path}: {wrong}; end the name with one of "
                              f"{', '.join(formats)}")  # fmt: skip
    return target


def checked_or_exit(ap: argparse.ArgumentParser, path: str | None, flag: str) -> Path | None:
    """check_figure_path for a parser's optional flag; on a bad path, the one line
    `hpcdl.CMD: error: ...` and exit status 2 (argparse's usage line would only bury it)."""
    if path is None:
        return None
    try:
        return check_figure_path(path, flag)
    except FigureFileError as exc:
        ap.exit(2, f"{ap.prog.removeprefix('python -m ')}: error: {exc}\n")


def save_figure(fig: Any, path: str | Path, dpi: int) -> None:
    """Write a matplotlib Figure to path (a checked one), making its missing folders; close the
    figure either way. FigureFileError names the path when the file system refuses it."""
    import matplotlib.pyplot as plt  # noqa: PLC0415

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi)
    except OSError as exc:
        raise FigureFileError(f"cannot write {path} ({exc.strerror or exc})") from None
    finally:
        plt.close(fig)
