"""A private single-host Slurm for the `slurm`-marked tests: munged, slurmctld and slurmd.

`SlurmCluster.start()` writes a munge key and a slurm.conf into a fresh directory (own ports,
own munge socket, own state and spool directories), starts the three daemons in the
foreground as child processes and waits until the node is idle. `stop()` cancels every job,
ends what the daemons left behind (found by this cluster's SLURM_CONF in their environment),
stops the daemons and removes the directory. Clients find the cluster through `env`
(SLURM_CONF). Needs root (slurmd starts jobs as the submitting user) and the Debian packages
`slurm-wlm munge` (`bash scripts/install-slurm.sh`).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
TERMINAL_STATES = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
}
INSTALL_HINT = (
    "run `bash scripts/install-slurm.sh` as root (Debian packages slurm-wlm and munge), "
    "or set HPCDL_NO_SLURM=1 to skip the Slurm tests"
)


class SlurmError(RuntimeError):
    """The private Slurm did not start or a job did not behave; carries daemon log tails."""


CLIENTS = ("sbatch", "scontrol", "scancel", "munge", "mungekey")
_SEARCH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin"])


def binary(name: str) -> str:
    """Absolute path of a Slurm/munge program; daemons live in sbin, often not on PATH."""
    return shutil.which(name, path=_SEARCH) or name


def missing_binaries() -> list[str]:
    return [b for b in (*DAEMONS, *CLIENTS) if shutil.which(b, path=_SEARCH) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _memory_mb() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 1024


class SlurmCluster:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="hpcdl-slurm-"))
        self.root.chmod(0o755)  # munged runs as the munge user and must reach its directory
        self.conf = self.root / "slurm.conf"
        self.node = socket.gethostname().split(".")[0]
        self.cpus = os.cpu_count() or 1
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        for key in [k for k in self.env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            del self.env[key]  # a surrounding allocation must not leak into test jobs

    # --- start ---------------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> None:
        try:
            self._start_munge(timeout)
            self._write_conf()
            self._start_slurm(timeout)
        except BaseException:
            self.stop()
            raise

    def _start_slurm(self, timeout: float) -> None:
        self._spawn("slurmctld", [binary("slurmctld"), "-D", "-f", str(self.conf)])
        self._wait(self._controller_up, timeout, "slurmctld up")
        self._spawn("slurmd", [binary("slurmd"), "-D", "-f", str(self.conf), "-N", self.node])
        self._wait(lambda: self._node_idle(self.node), timeout, f"node {self.node} idle")

    def client(self, argv: list[str]) -> list[str]:
        """argv that runs a Slurm client program where it reaches slurmctld (here: directly)."""
        return argv

    def _start_munge(self, timeout: float) -> None:
        self.munge_socket = self._spawn_munged("munged", self._create_munge_key(), timeout)

    def _create_munge_key(self) -> Path:
        """root/munge with a new munge.key, both owned by the munge user; returns the directory."""
        munge = self.root / "munge"
        munge.mkdir()
        munge.chmod(0o711)  # munged wants its socket directory executable by all
        self.munge_key = munge / "munge.key"
        subprocess.run(
            [binary("mungekey"), "--create", "--keyfile", str(self.munge_key)],
            check=True,
            capture_output=True,
        )
        shutil.chown(munge, "munge", "munge")
        shutil.chown(self.munge_key, "munge", "munge")
        self.munge_key.chmod(0o400)
        return munge

    def _spawn_munged(self, name: str, directory: Path, timeout: float) -> Path:
        """Start a munged with the cluster's key, its socket and files in `directory`."""
        socket_path = directory / "munge.socket"
        self._spawn(
            name,
            [
                binary("munged"),
                "--foreground",
                f"--socket={socket_path}",
                f"--key-file={self.munge_key}",
                f"--pid-file={directory / 'munged.pid'}",
                f"--seed-file={directory / 'munged.seed'}",
                f"--log-file={directory / 'munged.log'}",
            ],
            user="munge",
        )
        self._wait(
            lambda: self._ok([binary("munge"), "-n", "-S", str(socket_path)], ""),
            timeout,
            f"{name} answering",
        )
        return socket_path

    def _write_conf(self) -> None:
        for d in ("state", "spool", "log"):
            (self.root / d).mkdir()
        places, nodes = self._topology()
        r = self.root
        self.conf.write_text(
            f"""\
ClusterName=hpcdltest
{places}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={r}/state
SlurmctldPidFile={r}/slurmctld.pid
SlurmctldLogFile={r}/log/slurmctld.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SchedulerParameters=sched_interval=2
MinJobAge=600
KillWait=10
InactiveLimit=0
{nodes}
"""
        )

    def _topology(self) -> tuple[str, str]:
        """slurm.conf lines: (where the daemons listen and keep their files, nodes + partition)."""
        memory = max(256, min(_memory_mb() // 2, 4096))  # understated: slurmd must not object
        r = self.root
        places = f"""\
SlurmctldHost={self.node}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmdSpoolDir={r}/spool
SlurmdPidFile={r}/slurmd.pid
SlurmdLogFile={r}/log/slurmd.log"""
        nodes = f"""\
NodeName={self.node} CPUs={self.cpus} RealMemory={memory} State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP"""
        return places, nodes

    def _spawn(self, name: str, argv: list[str], user: str | None = None) -> None:
        log = open(self.root / f"{name}.console", "wb")
        self.procs[name] = subprocess.Popen(
            argv,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            user=user,
            start_new_session=True,  # Ctrl-C in pytest must not hit the daemons first
        )
        log.close()

    def _ok(self, argv: list[str], needle: str) -> bool:
        r = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30)
        return r.returncode == 0 and needle in r.stdout

    def _controller_up(self) -> bool:
        return self._ok(self.client([binary("scontrol"), "ping"]), "UP")

    def _node_idle(self, node: str) -> bool:
        r = self.scontrol("show", "node", node, check=False)
        return bool(re.search(r"State=IDLE\b", r))

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SlurmError(
                        f"{name} exited ({proc.returncode}) before {what}\n" + self.logs()
                    )
            if ready():
                return
            time.sleep(0.5)
        raise SlurmError(f"timed out after {timeout:.0f} s waiting for {what}\n" + self.logs())

    # --- clients -------------------------------------------------------------------------------
    def scontrol(self, *args: str, check: bool = True) -> str:
        r = subprocess.run(
            self.client([binary("scontrol"), *args]),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        if check and r.returncode != 0:
            raise SlurmError(f"scontrol {' '.join(args)} failed: {r.stderr.strip()}")
        return r.stdout

    def sbatch(
        self,
        script: Path | str,
        *options: str,
        env: dict[str, str] | None = None,
        cwd: Path | str | None = None,
    ) -> int:
        """Submit a script; returns the job id."""
        r = subprocess.run(
            self.client([binary("sbatch"), "--parsable", *options, str(script)]),
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=30,
            cwd=cwd,
        )
        if r.returncode != 0:
            raise SlurmError(f"sbatch {script} failed: {r.stderr.strip()}")
        return int(r.stdout.strip().split(";")[0])

    def scancel(self, job_id: int, *options: str) -> None:
        subprocess.run(
            self.client([binary("scancel"), *options, str(job_id)]),
            env=self.env,
            check=True,
            capture_output=True,
            timeout=30,
        )

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Reason, StdOut, ...)."""
        out = self.scontrol("show", "job", "--oneliner", str(job_id))
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_state(self, job_id: int, states: set[str], timeout: float) -> dict[str, str]:
        """Poll until the job's state is in `states` (or terminal); returns its fields."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states or info.get("JobState") in TERMINAL_STATES:
                return info
            time.sleep(1.0)
        raise SlurmError(
            f"job {job_id} still {info.get('JobState')} after {timeout:.0f} s "
            f"(wanted {', '.join(sorted(states))})\n" + self.logs()
        )

    def wait_done(self, job_id: int, timeout: float) -> dict[str, str]:
        return self.wait_state(job_id, TERMINAL_STATES, timeout)

    def logs(self, lines: int = 15) -> str:
        parts = []
        for path in sorted(
            [
                *self.root.glob("*.console"),
                *self.root.glob("log/*.log"),
                *self.root.glob("munge/**/*.log"),
            ]
        ):
            try:
                tail = path.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            parts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    # --- stop ----------------------------------------------------------------------------------
    def stop(self) -> None:
        """Cancel jobs, end leftovers and daemons started here, and remove the state directory."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            subprocess.run(
                self.client([binary("scancel"), "--full", "--user", str(os.getuid())]),
                env=self.env,
                capture_output=True,
                timeout=30,
            )
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and self._job_processes():
                time.sleep(0.5)
        for pid in self._job_processes():
            _kill(pid, signal.SIGKILL)
        for name in reversed(list(self.procs)):  # slurmd(s), slurmctld, munged
            proc = self.procs.pop(name)
            if proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        shutil.rmtree(self.root, ignore_errors=True)

    def _job_processes(self) -> list[int]:
        """Processes slurmd started for this cluster (slurmstepd, job scripts, their children)."""
        daemons = {p.pid for p in self.procs.values()}
        marker = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in daemons:
                continue
            try:
                environ = (entry / "environ").read_bytes()
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            # slurmctld's own helper (slurmscriptd) ends with it; everything else is a job's.
            if ppid not in daemons and marker in environ.split(b"\0"):
                found.append(int(entry.name))
        return found


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
