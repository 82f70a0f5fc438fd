"""`python -m hpcdl.sigterm_blocked CMD [ARGS...]`: run CMD (exec, same pid) with SIGTERM blocked.

NOTE [mpirun and SIGTERM]
Open MPI's mpirun (PRRTE) answers SIGTERM by killing its ranks within about a second, too soon
for hpcdl.train's stop with a checkpoint, and no MCA setting changes that. Slurm's `scancel`
(and its time limit) sends SIGTERM to every process of the job, mpirun included, so the stop
has to come from the ranks' own SIGTERM (or the SIGUSR1 that the batch shell or hpcdl.launch
forwards) while mpirun does not see it. A blocked signal stays blocked across exec, and
PRRTE's handler never runs for it; PRRTE's daemons unblock every signal in the ranks they
start, so the ranks still take SIGTERM as the stop (checked with Open MPI 5.0). SIGKILL (Slurm's,
after KillWait) still ends everything.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def sigterm_blocked() -> Iterator[None]:
    """Block SIGTERM in this thread while the body runs: a child forked inside starts with it
    blocked (its own handler never runs); this process handles a SIGTERM that came meanwhile
    once the body ends."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m hpcdl.sigterm_blocked CMD [ARGS...]", file=sys.stderr)
        return 2
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        print(f"hpcdl.sigterm_blocked: error: cannot start {argv[0]}: {exc.strerror}",
              file=sys.stderr)  # fmt: skip
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
