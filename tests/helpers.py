"""What several test modules share (no test module imports another; conftest.py holds only
fixtures and hooks): mpirun and `python -m hpcdl.train` as a user runs them, waiting on a
condition with a deadline (never a fixed sleep), small real data sets on disk (file trees, image
folders), a staging session and its stager, the processes a test started, hpcdl's own output
lines, `python -m hpcdl.stage` run as a user would, the session dirs killed Open MPI
launchers and daemons leave behind, and which tests may run beside which (xdist_scope)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from hpcdl.data.dataset import FileTable
from hpcdl.data.sampler import SamplerSpec
from hpcdl.staging import StageOptions, StagingSession
from hpcdl.staging import status as stager_status  # constants read when used: wait_for_status
from hpcdl.staging.status import StatusView

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def mpi_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def mpirun_cmd(np_: int) -> list[str]:
    """mpirun from the environment this Python belongs to, allowed to oversubscribe."""
    mpirun = BIN / "mpirun"
    return [str(mpirun if mpirun.exists() else "mpirun"), "-np", str(np_), "--oversubscribe"]


def train_cmd(ranks: int, *args) -> list[str]:
    """`mpirun -np ranks python -m hpcdl.train args...` (args converted to str)."""
    return [*mpirun_cmd(ranks), sys.executable, "-m", "hpcdl.train", *map(str, args)]


def run_train(ranks: int, *args, env: dict[str, str] | None = None, timeout: float = 600):
    """Run train_cmd to completion; a hang fails the test through TimeoutExpired."""
    return subprocess.run(
        train_cmd(ranks, *args),
        capture_output=True,
        text=True,
        env=env or mpi_env(),
        timeout=timeout,
    )


def read_events(path, event: str) -> list[dict]:
    """The records of one event type from a metrics JSON-lines file."""
    return [r for r in map(json.loads, Path(path).read_text().splitlines()) if r["event"] == event]


def wait_until(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "") -> Any:
    """Poll predicate until it returns a true value, which is returned; AssertionError naming
    `what` (or the predicate) when `timeout` seconds pass first. The one way tests wait."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what or predicate}")
        time.sleep(0.01)


class ShardDataset:
    """Minimal data set per docs/internals.md: `per_file` consecutive samples per file."""

    def __init__(self, root: Path, files: list[str], per_file: int = 1):
        self.root = Path(root)
        sizes = [(self.root / r).stat().st_size for r in files]
        self.files = FileTable.from_entries(files, sizes)
        self.per_file = per_file

    def __len__(self) -> int:
        return len(self.files) * self.per_file

    def file_ids(self, indices):
        return np.asarray(indices, dtype=np.int64) // self.per_file


def make_tree(root: Path, n: int, size: int, seed: int = 0, dirs: int = 4) -> ShardDataset:
    rng = np.random.default_rng(seed)
    names = []
    for i in range(n):
        rel = f"d{i % dirs}/f{i:05d}.bin"
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.integers(0, 256, size + i % 7, dtype=np.uint8).tobytes())
        names.append(rel)
    return ShardDataset(root, names)


def temp_files(stage_dir: Path) -> list[str]:
    """The stager's temporary copies ('tmp.<thread>' in a session dir) anywhere below."""
    return [
        os.path.join(d, f)
        for d, _, fs in os.walk(stage_dir)
        for f in fs
        if f.startswith("tmp.") and Path(d).parent.name == "sessions"
    ]


def stage_bytes(stage: Path) -> int:
    """Bytes on disk in a stage dir: staged copies and the stager's temporaries, not .hpcdl's
    control files (files may vanish while it counts). Counted once per inode: a copy being
    published is linked under its temporary name and its destination for a moment."""
    seen: dict[tuple[int, int], int] = {}
    for d, _, names in os.walk(stage):
        meta = ".hpcdl" in Path(d).relative_to(stage).parts
        for name in names:
            if meta and not name.startswith("tmp."):  # temporaries live in session dirs
                continue
            try:
                st = os.lstat(os.path.join(d, name))
            except FileNotFoundError:
                continue
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def make_folder(root, per_class=3, size=(20, 16), classes=("cat", "dog"), fmt="png", seed=0):
    """root/<class>/<i>.<fmt> random RGB images (w, h) = size; returns {relpath: HWC array}."""
    rng = np.random.default_rng(seed)
    images = {}
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            rel = f"{c}/{i}.{fmt}"
            Image.fromarray(arr).save(root / rel, quality=95)
            images[rel] = np.asarray(Image.open(root / rel).convert("RGB"))
    return images


def torchvision_eval(img: np.ndarray, crop: int, resize: int | None) -> np.ndarray:
    """torchvision's eval transform on an (h, w, C) uint8 image, written from its definitions:
    Resize(resize) (shorter side to resize, longer int(resize * long / short), PIL bilinear),
    then CenterCrop(crop) (top int(round((h - crop) / 2)))."""
    h, w = img.shape[:2]
    if resize is not None:
        if h <= w:
            h, w = resize, int(resize * w / h)
        else:
            h, w = int(resize * h / w), resize
        img = np.asarray(Image.fromarray(img).resize((w, h), Image.BILINEAR))
    top, left = int(round((h - crop) / 2.0)), int(round((w - crop) / 2.0))
    return img[top : top + crop, left : left + crop]


def own_lines(output: str) -> list[str]:
    """Non-empty output lines, without Open MPI's framed reports (between lines of dashes).

    mpirun adds one when a rank exits non-zero ("prterun detected that one or more processes
    exited with non-zero status"); it is the launcher's, not hpcdl's, and cannot be turned off
    without also losing the exit status. Under load Open MPI's PMIx also adds, at times,
    "[host:pid] PMIX ERROR: PMIX_ERR_UNREACH ..." as a rank exits: launcher noise too, as is
    the NUL byte its framed report can leave at the start of the next line."""
    lines, framed = [], False
    for line in output.replace("\0", "").splitlines():
        if line.startswith("-" * 40):
            framed = not framed
        elif line.strip() and not framed and not re.match(r"\[[^\]]*\] PMIX ERROR: ", line):
            lines.append(line)
    return lines


def one_line_error(done: subprocess.CompletedProcess, status: int | None = 2) -> str:
    """The one `error:` line a command that refused its input printed, no traceback; status:
    the exit status it must have (None: any but 0)."""
    if status is None:
        assert done.returncode != 0, done.stdout
    else:
        assert done.returncode == status, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, done.stderr
    return errors[0]


def folder_job(root: Path, models: str) -> Path:
    """root with imgs/, 48 20x20 JPEGs in 3 classes, and models.py (models: its source) beside
    it: a user's torch.nn.Module file and the data it trains on."""
    make_folder(root / "imgs", per_class=16, size=(20, 20), classes=("cat", "dog", "fox"),
                fmt="jpg")  # fmt: skip
    (root / "models.py").write_text(textwrap.dedent(models))
    return root


def job_pids(marker: str) -> list[int]:
    """Processes whose environment carries this test's marker (ranks, workers, stager)."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if f"HPCDL_TEST_MARKER={marker}".encode() in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def rank_pid(marker: str, rank: int) -> int:
    """The pid of one world rank of the marked job (its OMPI_COMM_WORLD_RANK)."""
    for pid in job_pids(marker):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"rank {rank} of the job not found")


def children() -> set[int]:
    """Live (non-zombie) child processes of this process."""
    me, out = os.getpid(), set()
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me and fields[0] != "Z":
                out.add(int(p.name))
    return out


def digest(a) -> str:
    """sha256 of an array's bytes: equal digests on every rank mean bitwise-equal arrays."""
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def contention_from_note(note: str, what: str, most: int = 10**9) -> tuple[float, float]:
    """bench calibrate's contention figure recomputed from its note (hpcdl.bench.calibrate_
    contention: "step L ms over S steps while N <what> per node landed in T s, Q ms quiet"):
    (seconds per file, what the note's rounding can make it differ by). N must be within
    [1, most]."""
    found = re.search(rf"step ([\d.]+) ms over (\d+) steps while ([\d.]+) {what} per node "
                      r"landed in [\d.]+ s, ([\d.]+) ms quiet", note)  # fmt: skip
    assert found, note
    loaded, steps, landed, quiet = float(found[1]), int(found[2]), float(found[3]), float(found[4])
    assert 1 <= landed <= most, note
    lost = max(0.0, loaded - quiet) * 1e-3 * steps  # seconds the copies cost the steps
    return lost / landed, 0.1e-3 * steps / landed + 1e-6  # the steps are shown to 0.1 ms


def stage_cli(*args, env=None, cwd=None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m hpcdl.stage args...` (args converted to str), its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "hpcdl.stage", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=timeout,
    )


def write_peer_plan(
    ds, stage: Path, session: str, node: int, peer: str | None, batch_size: int = 4, ready=None
):
    """hpcdl.bench.calibrate_peer.write_plan's plan (every file, one epoch; with peer, from
    node 0 at "ip:port", from step 0 or ready[entry]), in stage's session dir; returns it."""
    from hpcdl.bench.calibrate_peer import write_plan

    return write_plan(ds, stage, node, peer, session, batch_size, ready)


def wait_for_status(stage: Path, job: subprocess.Popen, timeout: float = 120) -> Path:
    """The status map of the job's session in one node's stage dir, once its stager runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and job.poll() is None:
        for path in stage.glob(".hpcdl/sessions/*/status"):
            view = StatusView(path)
            # RUN_RUNNING comes from the stager binary's layout: looked up here, not at import,
            # so tests that start no stager (the GPU ones, where it may be unbuilt) import this
            running = view.open() and view.field("run_state") >= stager_status.RUN_RUNNING
            view.close()
            if running:
                return path
        time.sleep(0.005)
    raise AssertionError(f"no running stager appeared in {stage} (job exit {job.poll()})")


def remove_stale_session_dirs(tmp: Path) -> list[Path]:
    """Remove Open MPI's session dirs (`ompi.<launcher pid>`, and `prted.<daemon pid>` of the
    daemon on every other node; this user's) in tmp whose process is gone: its pid runs no
    process, or a process started after the dir last changed (the pid was reused). A launcher
    or daemon killed with SIGKILL leaves its dir, and the next one that draws the same pid
    cannot start: "The PMIx server's listener thread failed to start", exit 213
    (openpmix/openpmix#4022, fixed in PMIx after the one Open MPI 5.0 bundles). Returns them."""
    import shutil

    boot = time.time() - float(Path("/proc/uptime").read_text().split()[0])
    ticks = os.sysconf("SC_CLK_TCK")
    removed = []
    for entry in tmp.iterdir():
        kind, _, pid = entry.name.partition(".")
        if kind not in ("ompi", "prted") or not pid.isdigit():
            continue
        try:
            info = entry.lstat()
        except OSError:
            continue
        if not entry.is_dir() or entry.is_symlink() or info.st_uid != os.getuid():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            started = boot + int(stat.rsplit(")", 1)[1].split()[19]) / ticks
            if started <= info.st_mtime + 1.0:
                continue  # its launcher, or a process as old as the dir: leave it
        except FileNotFoundError:
            pass  # no such process any more
        except OSError:
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def niceness(pid: int) -> set[int]:
    """The niceness of each thread of a process (/proc/PID/task/*/stat, field 19)."""
    values = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/stat") as f:
            values.add(int(f.read().rsplit(")", 1)[1].split()[16]))
    return values


def start_session(ds, stage: Path, batch: int = 4, epochs=(0, 2), **options) -> StagingSession:
    """A single-process StagingSession of ds into stage (a global shuffle, seed 0): the start
    the staging tests share. options: StageOptions' fields (threads 4 unless given)."""
    spec = SamplerSpec(num_samples=len(ds), world_size=1, seed=0, shuffle="global")
    options.setdefault("threads", 4)
    return StagingSession.start(None, ds, spec, batch, epochs, StageOptions(stage, **options))


def wait_ready(session: StagingSession, files: int, timeout: float = 30.0) -> None:
    """Until the session's stager has staged `files` files of its plan (plan_ready)."""
    status = session.status
    wait_until(lambda: status.open() and status.field("plan_ready") >= files, timeout,
               f"{files} files staged (plan_ready {status.field('plan_ready')})")  # fmt: skip


def stager_ran_on(view: StatusView, seconds: float, timeout: float = 30.0) -> None:
    """Until the stager has kept running its loop for `seconds` from now, by its own heartbeat
    (stamped at the top of each loop, every 20 ms or less), and one loop more so that the last
    is complete: a positive sign that it looked (at the ranks' progress every 0.2 s, at its
    plan, its peers) in that time. A fixed sleep could pass while the stager never ran."""
    start = time.time_ns()
    wait_until(lambda: view.field("heartbeat_ns") > start + seconds * 1e9, timeout,
               f"the stager's heartbeat {seconds} s on")  # fmt: skip
    last = view.field("heartbeat_ns")
    wait_until(lambda: view.field("heartbeat_ns") > last, timeout, "one more stager loop")


def finished_metrics(path: Path) -> Path:
    """path: a small finished run's metrics, as hpcdl.train writes them (start, 4 steps, an
    epoch and the summary)."""
    records: list[dict] = [{"event": "start", "time": 0.0, "world_size": 1, "global_batch": 32}]
    for i in range(4):
        records.append({"event": "step", "step": i + 1, "epoch": 0, "time": 0.1 * (i + 1),
                        "t_data": 0.01, "t_compute": 0.07, "t_comm_exposed": 0.01,
                        "t_update": 0.01, "t_step": 0.1})  # fmt: skip
    records.append({"event": "epoch", "epoch": 0, "loss": 1.0, "acc": 0.5, "seconds": 0.4,
                    "images_per_s": 320.0})  # fmt: skip
    records.append({"event": "summary", "world_size": 1, "global_batch": 32,
                    "images_per_s": 320.0})  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# The test modules that start this host's one Slurm (its ports) or emulated nodes (their network
# namespaces): never two at once, so under pytest-xdist they share one worker (conftest.py's
# pytest_xdist_make_scheduler). Every module with a test marked slurm or multinode is here
# (test_test_workers.py checks).
ONE_AT_A_TIME = frozenset(
    f"tests/{name}.py"
    for name in (
        "test_bench_torch_sync",
        "test_cluster_model_multinode",
        "test_data_tarshards_training",
        "test_diag_multinode",
        "test_jobs_slurm",
        "test_jobs_slurm_nodes",
        "test_jobs_slurm_stop",
        "test_multinode",
        "test_multinode_peers",
        "test_node_loss",
    )
)
ONE_AT_A_TIME_GROUP = "slurm-and-emulated-nodes"


def xdist_scope(nodeid: str) -> str:
    """The xdist scope of a test: its module, or the one group of ONE_AT_A_TIME's modules."""
    module = nodeid.split("::", 1)[0]
    return ONE_AT_A_TIME_GROUP if module in ONE_AT_A_TIME else module
