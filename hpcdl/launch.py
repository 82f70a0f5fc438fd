"""`python -m hpcdl.launch mpirun ... python -m hpcdl.train ...`: the launcher's exit status, but
never 0 for a run that did not finish.

NOTE [a lost node exits 0]
Open MPI 5.0's mpirun (PRRTE 3) exits 0 when it loses a node's daemon (every process on a node
killed, a node that crashes): its error manager records the failure on the daemons' own job,
never in mpirun's exit status, and the ranks it then kills do not count. It ends within some
20 to 60 ms of the loss, before anything in the job could tell it otherwise (hpcdl's node
watch sees the same closed connection at the same moment), and `--with-ft ulfm` changes
nothing: PRRTE 3 ends the job on a lost daemon whatever the fault-tolerance mode. So the rule
"exit 0 only when the run says it finished" cannot live inside the job; it lives here, around
the launcher, as it does in hpcdl.jobs' batch scripts (which read the --metrics record):

- this process runs the launcher with HPCDL_OUTCOME naming a file in the run's own directory
  (--checkpoint-dir, else the directory of --metrics, as flags or in the --config file: where
  rank 0 writes anyway, so it sees the file on any node), else in a private temporary
  directory that it removes (then rank 0 must run on this node, as mpirun and a batch script
  place it by default); mpirun gets `-x HPCDL_OUTCOME`. Directories it makes for the file are
  removed again when the run left them empty (a run that refused its flags creates nothing).
  It forwards the signals a batch system or a user sends (SIGUSR1, SIGUSR2, SIGHUP as they
  are; the first SIGTERM or SIGINT as SIGUSR1, the stop with a checkpoint the ranks handle:
  Open MPI's mpirun answers SIGTERM by killing the ranks within a second, mid-checkpoint; a
  second one passes as it is, a SIGTERM as SIGINT to Open MPI's mpirun, which runs with SIGTERM
  blocked, so that a SIGTERM sent to every process (scancel) does not reach it either: NOTE
  [mpirun and SIGTERM] in hpcdl/sigterm_blocked.py);
- hpcdl.train's rank 0 writes `started` there as it starts and `finished` as it ends with
  nothing left to train (record_outcome);
- the launcher's status is passed on, except a 0 after `started` without `finished`: one line
  and exit status 5 (EXIT_NOT_FINISHED, as a stall shutdown or a silent node: resume with
  --resume auto). A program that writes no outcome (a script of the user's) keeps the
  launcher's status.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

from hpcdl.config import ConfigError, load_toml, resolve_paths
from hpcdl.sigterm_blocked import sigterm_blocked

ENV = "HPCDL_OUTCOME"
EXIT_NOT_FINISHED = 5
STARTED, FINISHED = "started", "finished"
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
AS_STOP = (signal.SIGINT, signal.SIGTERM)  # the first one reaches the ranks as STOP_SIGNAL
STOP_SIGNAL = signal.SIGUSR1  # hpcdl.train: stop all ranks at a step, checkpoint, exit 3
USAGE = (
    "usage: python -m hpcdl.launch LAUNCHER [ARGS...]  (e.g. mpirun -np 4 python -m hpcdl.train "
    "...)\nRuns LAUNCHER and exits with its status, but never 0 for an hpcdl.train run that did "
    "not finish (exit status 5 then).\nThe first SIGTERM or SIGINT reaches the ranks as SIGUSR1: "
    "they checkpoint (with --checkpoint-dir) and exit 3; a second one passes as it is."
)
MPIRUNS = ("mpirun", "mpiexec", "prterun", "orterun")  # take `-x NAME` to pass a variable


def record_outcome(word: str) -> None:
    """Write word (STARTED or FINISHED) to $HPCDL_OUTCOME, if set; call on rank 0 only. A file
    that cannot be written costs the run nothing: the launcher's status then stands."""
    path = os.environ.get(ENV)
    if not path:
        return
    try:
        Path(path).write_text(word + "\n")
    except OSError:
        pass


def launcher_argv(argv: list[str]) -> list[str]:
    """argv with `-x HPCDL_OUTCOME` after an Open MPI launcher's name (mpirun forwards only the
    variables it is told to the other nodes), and `--with-ft ulfm` when the run asks for
    --on-node-loss continue and the command does not choose a mode itself (wants_ulfm); other
    launchers (srun) export the environment and are left as they are."""
    if is_open_mpi(argv):
        ft = ["--with-ft", "ulfm"] if wants_ulfm(argv) else []
        return [argv[0], "-x", ENV, *ft, *argv[1:]]
    return list(argv)


def is_open_mpi(argv: list[str]) -> bool:
    """argv starts an Open MPI launcher (mpirun, mpiexec, prterun, orterun)."""
    return bool(argv) and Path(argv[0]).name.startswith(MPIRUNS)


def wants_ulfm(argv: list[str]) -> bool:
    """The launched run asks for --on-node-loss continue (flag or --config key), which needs
    Open MPI's fault-tolerant mode, and the command names no --with-ft of its own
    (docs/reliability.md, "Training on through lost ranks")."""
    if any(arg == "--with-ft" or arg.startswith("--with-ft=") for arg in argv):
        return False
    flags = _flag_values(argv, ("--config", "--on-node-loss"))
    if "--on-node-loss" in flags:
        return flags["--on-node-loss"] == "continue"
    if "--config" in flags:
        try:
            values = load_toml(flags["--config"])
        except ConfigError:
            return False  # hpcdl.train says so in its own line
        return values.get("on_node_loss", values.get("on-node-loss")) == "continue"
    return False


def run_directory(argv: list[str]) -> Path | None:
    """The launched run's own directory: its --checkpoint-dir, else the directory of its
    --metrics (flags first, then the keys of its --config file); None when it names neither."""
    flags = _flag_values(argv, ("--config", "--checkpoint-dir", "--metrics"))
    values: dict = {}
    if "--config" in flags:
        try:
            values = resolve_paths(load_toml(flags["--config"]), flags["--config"])
        except ConfigError:
            values = {}  # hpcdl.train says so in its own line
    values = {key.replace("-", "_"): value for key, value in values.items()}
    checkpoint_dir = flags.get("--checkpoint-dir") or values.get("checkpoint_dir")
    metrics = flags.get("--metrics") or values.get("metrics")
    if isinstance(checkpoint_dir, str) and checkpoint_dir:
        return Path(checkpoint_dir)
    if isinstance(metrics, str) and metrics:
        return Path(metrics).parent
    return None


def _flag_values(argv: list[str], names: tuple[str, ...]) -> dict[str, str]:
    """The last value of each flag in names, as `--flag value` or `--flag=value`."""
    found = {}
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in names and eq:
            found[name] = value
        elif arg in names and i + 1 < len(argv):
            found[arg] = argv[i + 1]
    return found


def outcome_file(argv: list[str]) -> tuple[Path, Path | None, list[Path]]:
    """A new, empty outcome file that this process created (never a name that existed: a file
    of the user's, or another launch's in a shared directory, is left alone), a temporary
    directory to remove at the end (None when the file lies in the run's directory, module
    notes), and the directories made for the file, deepest first (remove_if_empty)."""
    directory = run_directory(argv)
    if directory is not None:
        made = [d for d in (directory, *directory.parents) if not d.exists()]
        try:
            directory.mkdir(parents=True, exist_ok=True)  # hpcdl.train would make it too
            fd, name = tempfile.mkstemp(prefix=".hpcdl-outcome-", dir=directory)
            os.close(fd)
            return Path(name), None, made
        except OSError:
            remove_if_empty(made)  # hpcdl.train names the directory in its own line
    private = Path(tempfile.mkdtemp(prefix="hpcdl-launch-"))
    path = private / "outcome"
    path.touch(exist_ok=False)
    return path, private, []


def remove_if_empty(made: list[Path]) -> None:
    """Remove the directories this process made (deepest first) that the run left empty: a run
    that refused its flags leaves no trace of its --checkpoint-dir or --metrics directory."""
    for directory in made:
        try:
            directory.rmdir()
        except OSError:
            return  # not empty (the run wrote there), or gone: the ones above stay too


def run_launcher(args: list[str], path: Path) -> tuple[int | None, str | None]:
    """Run the launcher with the outcome file named, forwarding signals; its status (None when
    it cannot start: one line said so) and the outcome the run wrote (None for none)."""
    argv = launcher_argv(args)
    if "--with-ft" in argv and "--with-ft" not in args:
        print("hpcdl.launch: added --with-ft ulfm to the launcher: --on-node-loss continue "
              "needs MPI's fault-tolerant mode", file=sys.stderr, flush=True)  # fmt: skip
    open_mpi = is_open_mpi(argv)
    try:
        with sigterm_blocked() if open_mpi else nullcontext():  # NOTE [mpirun and SIGTERM]
            child = subprocess.Popen(argv, env={**os.environ, ENV: str(path)})
    except OSError as exc:
        print(f"hpcdl.launch: error: cannot start {args[0]}: {exc.strerror}", file=sys.stderr)
        return None, None
    stopping = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        if signum in AS_STOP and not stopping:
            stopping = True
            print(f"hpcdl.launch: got {signal.Signals(signum).name}, asking all ranks to "
                  f"checkpoint and stop ({STOP_SIGNAL.name}); send it again to end them at once",
                  file=sys.stderr, flush=True)  # fmt: skip
            signum = STOP_SIGNAL
        elif signum == signal.SIGTERM and open_mpi:
            signum = signal.SIGINT  # mpirun's SIGTERM is blocked; it ends the ranks on SIGINT
        child.send_signal(signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    status = child.wait()
    try:
        return status, path.read_text().strip() or None
    except OSError:
        return status, None


def decide(launcher_status: int, outcome: str | None) -> tuple[int, str | None]:
    """The exit status, and the line that explains a changed one."""
    if launcher_status == 0 and outcome == STARTED:
        return EXIT_NOT_FINISHED, (
            "hpcdl: the launcher exited 0, but the run did not finish (it never said so: a lost "
            f"node?, see the lines above); exit status {EXIT_NOT_FINISHED}. Resume with "
            "--resume auto"
        )
    return launcher_status, None


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if args[:1] in (["--help"], ["-h"]):
        print(USAGE)
        return 0
    if not args:
        print(USAGE, file=sys.stderr)
        return 2
    path, private, made = outcome_file(args)
    try:
        status, outcome = run_launcher(args, path)
    finally:
        path.unlink(missing_ok=True)
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)
        remove_if_empty(made)
    if status is None:
        return 127
    status = 128 - status if status < 0 else status  # killed by a signal: as a shell says it
    status, line = decide(status, outcome)
    if line:
        print(line, file=sys.stderr, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
