"""What every user-facing `python -m hpcdl.X` does at the end: exit with main's status, and end
quietly when the reader of its output went away (`python -m hpcdl.nn summary ... | head`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a tool killed by SIGPIPE


def run(main: Callable[[], int | None]) -> int | str | None:
    """main()'s status; EXIT_BROKEN_PIPE, without a traceback, when stdout's pipe is closed."""
    try:
        try:
            status = main()
        except SystemExit as exc:  # argparse's --help and usage errors: their output too
            status = exc.code
        sys.stdout.flush()  # a late broken pipe shows here, not at interpreter exit
        return status
    except BrokenPipeError:
        # Python would try to flush stdout once more at exit and report that failure too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
