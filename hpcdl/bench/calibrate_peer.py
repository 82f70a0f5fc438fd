"""`bench calibrate`'s [peer] table: how fast one stager fetches staged copies from another.

The peer tier's fetch (docs/staging.md, "Peer tier") is timed with the real hpcdl-stage on both
ends: a home stager stages a group of files from a scratch tree and serves them on a socket
bound to this host's address (as a node leader binds it), and a second stager (another stage
dir: another "node") fetches the whole group through its plan's peer section, with one copy
thread and --once, twice (the fastest counts). Its wall time holds its start-up, so groups
of 4 KiB and 4 MiB files of several counts are fetched and a least-squares line through them
gives the fixed cost per fetch (latency) and one thread's bandwidth, as the PFS part fits its
open latency and bandwidth. Where the large files' time hides in the start-up's spread (a fast
loopback), the bandwidth is bounded instead by the fastest group's bytes per second, start-up
included: a lower bound, never the 0 B/s a negative slope would give.

Both stagers run on this host (world rank 0's): the fetch crosses the loopback or the host's
own address, not the link between nodes, which the cluster model takes from [network]
(calibration.peer_figures). Everything lives in a temporary directory inside --stage-dir that
is removed afterwards.
"""

from __future__ import annotations

import secrets
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from hpcdl.clustermodel.calibration import PeerFigures
from hpcdl.comm.failure import UserError
from hpcdl.data.sampler import SamplerSpec
from hpcdl.staging.binary import find_stager_binary
from hpcdl.staging.peers import PeerSources, render_peer_section
from hpcdl.staging.plan import FileTreeDataset, NodePlan, plan_for_node, render_plan
from hpcdl.staging.status import StatusView

SESSION = "calibrate"
# (bytes per file, files): each group fetched by a fresh client; small files give the latency,
# large ones the bandwidth, and the spread of counts the start-up the fit removes.
GROUPS = ((4096, 100), (4096, 200), (4096, 400), (4 << 20, 2), (4 << 20, 4), (4 << 20, 8))
REPEATS = 2  # client runs per group; the fastest counts (the VM's other load only adds)
WAIT_S = 60.0  # a stager that takes longer on a scratch group of a few MB is broken


def measure_peer(stage_dir: Path) -> PeerFigures:
    """Fetch latency and one thread's bandwidth between two stagers on this host: the least
    squares fit of seconds = start-up + files x latency + bytes / bandwidth over GROUPS."""
    with tempfile.TemporaryDirectory(prefix=".hpcdl-calibrate-peer.", dir=stage_dir) as tmp:
        seconds = [fetch_seconds(Path(tmp) / f"g{k}", size, count)
                   for k, (size, count) in enumerate(GROUPS)]  # fmt: skip
    design = np.array([[1.0, count, size * count] for size, count in GROUPS])
    (_, latency, per_byte), *_ = np.linalg.lstsq(design, np.array(seconds), rcond=None)
    if per_byte <= 0:  # the bytes' time is lost in the start-up's spread: bound it from above
        per_byte = min(s / (size * count) for (size, count), s in zip(GROUPS, seconds))
    bandwidth = 1.0 / per_byte
    return PeerFigures(fetch_latency_s=max(float(latency), 1e-6),
                       thread_bandwidth_Bps=float(bandwidth))  # fmt: skip


def fetch_seconds(root: Path, size: int, count: int) -> float:
    """Wall seconds of a --once stager fetching `count` files of `size` bytes from a home."""
    rng = np.random.default_rng(count)
    for i in range(count):
        path = root / "pfs" / f"f{i:05d}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    ds = FileTreeDataset(root / "pfs")
    listener = socket.create_server((host_address(), 0))
    address = f"{listener.getsockname()[0]}:{listener.getsockname()[1]}"
    secret = secrets.token_hex(32)
    write_plan(ds, root / "home", 0, None)
    home = start_stager(root / "home", secret, [], listener)
    listener.close()  # the home holds its own descriptor
    try:
        wait_ready(root / "home", home, count, size * count)
        return min(client_seconds(ds, root / f"client{k}", address, secret, count)
                   for k in range(REPEATS))  # fmt: skip
    finally:
        if home.poll() is None:
            home.send_signal(signal.SIGUSR1)
        home.wait(timeout=WAIT_S)


def client_seconds(
    ds: FileTreeDataset, stage: Path, address: str, secret: str, count: int
) -> float:
    """Wall seconds of one --once client fetching every file of ds from the home."""
    write_plan(ds, stage, 1, address)
    began = time.perf_counter()
    client = start_stager(stage, secret, ["--once"], None)
    _, err = client.communicate(timeout=WAIT_S)
    seconds = time.perf_counter() - began
    fetched = StatusView(status_path(stage))
    if client.returncode != 0 or not fetched.open() or fetched.field("peer_files") != count:
        raise UserError(f"bench calibrate: the peer fetch test failed: {err.strip()[-300:]}")
    return seconds


def host_address() -> str:
    """This host's address as the peer tier binds it (its hostname's), else the loopback."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def status_path(stage: Path) -> Path:
    return stage / ".hpcdl" / "sessions" / SESSION / "status"


def write_plan(
    ds: FileTreeDataset,
    stage: Path,
    node: int,
    peer: str | None,
    session: str = SESSION,
    batch_size: int = 1,
    ready: dict[int, int] | None = None,
) -> NodePlan:
    """One node's one-rank, one-epoch plan of every file of ds into stage's session dir (copies
    under `k/`); with peer ("ip:port"), every file is planned from node 0 at that address, from
    step 0, or from `ready[entry]` (the home's read tick; the peer tier's plan section).
    Returns the plan."""
    spec = SamplerSpec(num_samples=len(ds), world_size=1, seed=0, shuffle="global")
    plan = plan_for_node(ds, spec, batch_size, (0, 1), (0,), node)
    lines: list[str] = []
    if peer:
        ticks = np.zeros(plan.files, np.int64)
        for entry, tick in (ready or {}).items():
            ticks[entry] = tick
        homes = np.zeros(plan.files, np.int32)
        lines = render_peer_section(plan, PeerSources(homes, ticks), [peer])
    meta = stage / ".hpcdl" / "sessions" / session
    meta.mkdir(parents=True, mode=0o700)
    (meta / "plan").write_text(render_plan(plan, ds, dest_prefix="k", peer_lines=lines))
    return plan


def start_stager(
    stage: Path, secret: str, flags: list[str], listener: socket.socket | None, threads: int = 1
) -> subprocess.Popen:
    cmd = [str(find_stager_binary()), "--stage-dir", str(stage), "--session", SESSION,
           "--threads", str(threads), "--peer", *flags]  # fmt: skip
    fds: tuple[int, ...] = ()
    if listener is not None:
        cmd += ["--peer-listen-fd", str(listener.fileno())]
        fds = (listener.fileno(),)
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            pass_fds=fds)  # fmt: skip
    assert proc.stdin is not None
    proc.stdin.write(secret + "\n")  # the job's secret, on a pipe as the node leader hands it
    proc.stdin.close()
    proc.stdin = None
    return proc


def wait_ready(stage: Path, proc: subprocess.Popen, count: int, nbytes: int) -> None:
    """Until the home has staged every file of its plan (count files, nbytes in all), and so
    serves them. A home that cannot (it ended, its capacity is short of nbytes, or WAIT_S
    passed) is stopped, and the error holds what it said."""
    view = StatusView(status_path(stage))
    deadline = time.monotonic() + WAIT_S
    while not (view.open() and view.field("plan_ready") >= count):
        why = ""
        if proc.poll() is not None:
            why = f"it ended with status {proc.returncode}"
        elif view.open() and view.field("heartbeat_ns") and view.field("capacity") < nbytes:
            # (the capacity is set before the first heartbeat; 0 until then)
            why = (
                f"its capacity is {view.field('capacity')} B for {nbytes} B: give --stage-dir "
                "more free space than hpcdl-stage keeps free, max(5 %, 1 GiB) of its disk"
            )
        elif time.monotonic() > deadline:
            why = f"not within {WAIT_S:.0f} s"
        if why:
            said = stopped_saying(proc, signal.SIGUSR1, WAIT_S / 4).strip().splitlines()
            said = " / ".join(said[-3:]) or "nothing"
            raise UserError(f"bench calibrate: the home stager in {stage} did not stage its "
                            f"{count} files ({why}); it said: {said}")  # fmt: skip
        time.sleep(0.02)


def stopped_saying(proc: subprocess.Popen, sig: int, timeout: float) -> str:
    """A stager's standard error, once it has ended: sig to one still running (SIGUSR1: as
    when the job ends; SIGTERM), killed if it has not ended within timeout."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err or ""
