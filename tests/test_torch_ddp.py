"""examples/torch_ddp.py on 2 ranks on CPU under mpirun and torchrun: the same parameters with
hpcdl.torch (staged or in place) as with torch's DataLoader in hpcdl's order, and every way a
run ends (an exception in the training loop, Ctrl-C, SIGTERM, a killed loader worker, a killed
stager) leaves no process, no shared-memory file and no staged file of the run (unless
--keep-staged). Real Open MPI, torch.distributed (gloo), hpcdl-stage, files and signals.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import BIN, job_pids, mpi_env, mpirun_cmd, wait_until

from hpcdl.staging.manifest import read_manifest

TIMEOUT_S = 240
REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "torch_ddp.py"
HOOKS = REPO / "tests" / "torch_loop_hooks.py"
TINY = ["--blocks", 1, "--width", 4, "--batch-size", 16, "--workers", 1, "--augment", "crop1+flip"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(launcher: str, script: list, marker: str, shm: Path) -> list[str]:
    """`mpirun -np 2 python SCRIPT...` or `torchrun --nproc-per-node 2 SCRIPT...`."""
    if launcher == "mpirun":
        head = [*mpirun_cmd(2), sys.executable]
    else:
        head = [str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-port", str(free_port())]
    return [str(c) for c in head + script]


def job_env(marker: str, shm: Path) -> dict[str, str]:
    env = dict(mpi_env(), HPCDL_TEST_MARKER=marker, HPCDL_SHM_DIR=str(shm))
    env.update(MASTER_PORT=str(free_port()), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    return env


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def assert_nothing_left(marker: str, shm: Path) -> None:
    # the launcher has returned; its children are going
    left = lambda: [cmdline(p) for p in job_pids(marker)]  # noqa: E731
    with contextlib.suppress(AssertionError):
        wait_until(lambda: not left(), 10)
    assert left() == [], "processes of the job outlived it"
    assert list(shm.iterdir()) == []


def run_example(launcher: str, data: Path, tmp: Path, *flags) -> tuple[dict, str]:
    shm = tmp / "shm"
    shm.mkdir(exist_ok=True)
    marker = str(tmp / launcher)
    script = [EXAMPLE, "--data", data, "--epochs", 2, *TINY, *flags, "--save", tmp / "params.pt"]
    cmd = launch(launcher, script, marker, shm)
    done = subprocess.run(
        cmd, capture_output=True, text=True, env=job_env(marker, shm), timeout=TIMEOUT_S
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert_nothing_left(marker, shm)
    return torch.load(tmp / "params.pt"), done.stdout


def test_same_parameters_as_torch_dataloader_in_hpcdls_order(digits_dir, tmp_path):
    """Bitwise: the same samples in the same order, with the same per-sample work; staged under
    mpirun, in place under torchrun."""
    data = digits_dir / "train"
    runs = {}
    for name, launcher, flags in [
        ("dataloader", "torchrun", ["--dataloader"]),
        ("staged", "mpirun", ["--stage-dir", tmp_path / "stage"]),
        ("in place", "torchrun", []),
    ]:
        out_dir = tmp_path / name.replace(" ", "-")
        out_dir.mkdir()
        runs[name], out = run_example(launcher, data, out_dir, *flags)
        assert f'"loader": "{"dataloader" if name == "dataloader" else "hpcdl"}"' in out
        if name != "dataloader":
            assert f'"staging": {str(name == "staged").lower()}' in out
    want = runs.pop("dataloader")
    for name, got in runs.items():
        assert got.keys() == want.keys()
        assert [k for k in want if not torch.equal(got[k], want[k])] == [], name
    assert not (tmp_path / "stage").exists()


# --- every way a run ends ---------------------------------------------------------------------

FAULTS = {  # how the run is ended: (launcher, what the test does once training is under way)
    "loop_exception": ("mpirun", "rank 1 raises in its training loop"),
    "loop_exception_keep": ("torchrun", "the same, with --keep-staged"),
    "ctrl_c": ("torchrun", "SIGINT to the launcher's process group, as Ctrl-C sends"),
    "sigterm": ("mpirun", "SIGTERM to every rank, as Slurm sends at the time limit"),
    "killed_worker": ("torchrun", "SIGKILL to a loader worker"),
    "killed_stager": ("mpirun", "SIGKILL to hpcdl-stage: the run goes on from the PFS"),
}
EXPECTED_LINE = {
    "loop_exception": "LoopBug: bug in the training loop at step 12 on rank 1",
    "loop_exception_keep": "LoopBug: bug in the training loop at step 12 on rank 1",
    "ctrl_c": "KeyboardInterrupt",
    "sigterm": "stopped by signal SIGTERM",
    "killed_worker": "died (killed by SIGKILL)",
    "killed_stager": "the staging process stopped; files not yet staged",
}


def wait_for(path: Path, job: subprocess.Popen) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not path.exists():
        assert job.poll() is None, job.communicate()
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.05)


def rank_pids(marker: str) -> list[int]:
    """The training processes of the job (not the launcher, not the loader workers)."""
    python, hooks = sys.executable.encode(), str(HOOKS).encode()
    pids = [p for p in job_pids(marker) if cmdline(p).split(b"\0")[:2] == [python, hooks]]
    assert len(pids) == 2, [cmdline(p) for p in job_pids(marker)]
    return pids


def child_of_job(marker: str, name: bytes) -> int:
    pids = [p for p in job_pids(marker) if name in cmdline(p)]
    assert pids, f"no {name!r} process in the job"
    return pids[0]


@pytest.mark.parametrize("fault", list(FAULTS))
def test_every_way_a_run_ends_leaves_nothing_of_it(fault, digits_dir, tmp_path):
    launcher, _ = FAULTS[fault]
    stage, shm, mark = tmp_path / "stage", tmp_path / "shm", tmp_path / "training"
    shm.mkdir()
    marker = str(tmp_path)
    raise_on = "1" if fault.startswith("loop_exception") else "-"
    # Long enough to be ended while training; the killed stager's run ends on its own, and
    # its loader.stats() at the end notices the dead stager if training has not yet.
    epochs = 6 if fault == "killed_stager" else 30
    flags = ["--data", digits_dir / "train", "--epochs", epochs, *TINY, "--stage-dir", stage]
    flags += ["--keep-staged"] if fault.endswith("keep") else []
    script = [HOOKS, 12, raise_on, mark, "--", *flags]
    job = subprocess.Popen(
        launch(launcher, script, marker, shm),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=job_env(marker, shm),
        start_new_session=True,  # its own process group, as a job started from a shell
    )
    try:
        wait_for(mark, job)
        if fault == "ctrl_c":
            os.killpg(job.pid, signal.SIGINT)
        elif fault == "sigterm":
            for pid in rank_pids(marker):
                os.kill(pid, signal.SIGTERM)
        elif fault == "killed_worker":
            os.kill(child_of_job(marker, b"hpcdl.data.worker"), signal.SIGKILL)
        elif fault == "killed_stager":
            os.kill(child_of_job(marker, b"hpcdl-stage"), signal.SIGKILL)
        out, err = job.communicate(timeout=TIMEOUT_S)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    assert (job.returncode == 0) == (fault == "killed_stager"), out + err[-4000:]
    assert EXPECTED_LINE[fault] in err, err[-4000:]
    if fault == "killed_worker":  # hpcdl's one line, not a traceback of the loader's insides
        line = next(x for x in err.splitlines() if EXPECTED_LINE[fault] in x)
        assert line.startswith("hpcdl: rank ") and ": error: loader worker pid " in line, line
    assert_nothing_left(marker, shm)
    if not fault.endswith("keep"):
        assert not stage.exists(), sorted(map(str, stage.rglob("*")))
        return
    listed = {r.dest for r in read_manifest(stage / ".hpcdl" / "manifest") if r.kind == "f"}
    staged = {str(p.relative_to(stage)) for p in stage.rglob("*.h5")}
    assert listed and staged == listed
