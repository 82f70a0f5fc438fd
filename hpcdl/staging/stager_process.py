"""StagerProcess: one node's hpcdl-stage as one rank sees it: launched, running, alive, stopped.

On the rank that starts it (local rank 0 of a training job, or `python -m hpcdl.stage`) it
owns the child process: the command line, the peer tier's secret on its stdin, the wait until
it publishes RUNNING, the stop signal. On the node's other local ranks there is no child: the
stager is watched through its status map alone (pid and heartbeat, status.stager_alive).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from hpcdl.config import STAGE_NICE, STAGE_NICE_LATER
from hpcdl.data.worker_cores import spawning_on
from hpcdl.staging.peer_tier import PeerTier
from hpcdl.staging.status import StatusView, stager_alive

START_TIMEOUT_S = 30.0
HEARTBEAT_TIMEOUT_S = 5.0
CHECK_EVERY_S = 1.0  # how often the trainer's calls look at a stager's liveness at most


def nice_flags(nice: str) -> list[str]:
    """hpcdl-stage's flags for --stage-nice: auto is --nice-later STAGE_NICE_LATER (below the
    ranks once they pass the run's first epoch), N is --nice N (from the start)."""
    if str(nice) == "auto":
        return ["--nice-later", str(STAGE_NICE_LATER)]
    return ["--nice", str(int(nice))]


class StagerProcess:
    """The node's stager: its child process (None where another rank started it) and whether
    it still serves the session (running: seen RUNNING, not found gone since)."""

    def __init__(self, proc: subprocess.Popen | None = None):
        self.proc = proc  # hpcdl-stage, on the rank that launched it
        self.status: StatusView | None = None  # the session's status map, once watched
        self.running = False  # RUNNING seen and no death found since
        self.since = 0.0  # monotonic time the ranks began to watch it (watch)
        self._last_check = 0.0  # monotonic time of the last liveness look (lost)

    @classmethod
    def launch(
        cls,
        binary: Path,
        stage_dir: Path,
        session: str,
        threads: int,
        capacity: int | None,
        verify: bool,
        peer: PeerTier | None = None,
        once: bool = False,
        quiet: bool = False,
        nice: str = STAGE_NICE,
        cores: frozenset[int] | None = None,
    ) -> StagerProcess:
        """Start hpcdl-stage for `session` in stage_dir; with `peer`, the job's secret goes to
        its stdin (a pipe) and its listening socket is inherited (docs/staging.md, "Peer
        tier"). capacity None: the stager's default. once: stage the plan and exit. cores: the
        CPUs it runs on (None: this thread's; hpcdl.data.worker_cores.spawning_on)."""
        cmd = [str(binary), "--stage-dir", str(stage_dir), "--session", session]
        cmd += ["--threads", str(int(threads)), "--parent-pid", str(os.getpid())]
        cmd += nice_flags(nice)
        if capacity is not None:  # else the stager's default
            cmd += ["--capacity", str(int(capacity))]
        for flag, on in (("--verify", verify), ("--once", once), ("--quiet", quiet)):
            if on:
                cmd.append(flag)
        if peer is None:
            with spawning_on(cores):
                return cls(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))
        args, fds = peer.stager_args()
        with spawning_on(cores):
            proc = subprocess.Popen(cmd + args, stdin=subprocess.PIPE, pass_fds=fds)
        try:
            proc.stdin.write(peer.secret_hex.encode() + b"\n")
            proc.stdin.close()
        except OSError:
            pass  # the stager exited at once: wait_running reports it
        return cls(proc)

    def wait_running(self, status_path: Path) -> tuple[bool, str]:
        """(True, "") once the stager publishes RUNNING in status_path, else (False, why) when
        it exits first or START_TIMEOUT_S passes."""
        proc, view = self.proc, StatusView(status_path)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                code = proc.poll()
                if view.open() and view.field("pid") == proc.pid and view.run_state() != "STARTING":
                    return True, ""
                if code is not None:
                    return False, f"hpcdl-stage exited with code {code}; see its message above"
                if view.mapped and view.field("pid") != proc.pid:
                    view.close()  # an older status file; the stager replaces it
                time.sleep(0.01)
            return False, f"hpcdl-stage did not report RUNNING within {START_TIMEOUT_S:.0f} s"
        finally:
            view.close()

    def watch(self, status: StatusView | None, running: bool) -> None:
        """Every local rank: from now on, liveness is read from `status` (the session's map;
        None when staging is off) and the child, if any; running: it reported RUNNING."""
        self.status, self.running = status, running
        self.since = time.monotonic()

    def lost(self, min_interval_s: float = 0.0) -> bool:
        """True exactly once: when a running stager is first found gone (its child exited, or
        its heartbeat is older than HEARTBEAT_TIMEOUT_S). Looks at most every min_interval_s."""
        now = time.monotonic()
        if not self.running or now - self._last_check < min_interval_s:
            return False
        self._last_check = now
        alive = self.proc is None or self.proc.poll() is None
        if alive and self.status is not None:
            alive = stager_alive(self.status, HEARTBEAT_TIMEOUT_S)
        self.running = alive
        return not alive

    def ended_on_its_own(self) -> bool:
        """The stager left the session by its own decision (a signal: the job's stop, Slurm's
        time limit; its parent gone), marked STOPPED, and its last line on stderr said why; not
        a stager that crashed, was killed or hangs."""
        return (
            self.status is not None
            and self.status.open()
            and (self.status.run_state() == "STOPPED")
        )

    def stop(self, stop_signal: int, timeout_s: float = 10.0) -> None:
        """Signal the child (if this rank has one and it runs) and reap it; SIGKILL after
        timeout_s. SIGUSR1: the job ended (its last line says it finished); SIGTERM: stopped."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(stop_signal)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
