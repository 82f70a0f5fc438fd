"""Every way a staged training run ends leaves node-local disk as the user asked.

Two ranks, the real hpcdl-stage, real MPI and files. For each exit path (success, SIGTERM to one
rank, a NaN loss, a corrupt sample mid-run, an exception in model code on either rank) and with
and without --keep-staged: without it nothing hpcdl created is left in the stage dir (hpcdl
created the stage dir, so it is gone too); with it every staged file the manifest lists is
still there. In both cases no process of the job (stager, loader workers) outlives mpirun, and
no shared-memory slot file is left in the job's private $HPCDL_SHM_DIR.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import job_pids, mpi_env, mpirun_cmd, read_events, train_cmd, wait_until
from PIL import Image

from hpcdl.data import open_dataset
from hpcdl.data.sampler import DistributedSampler
from hpcdl.staging.manifest import read_manifest

TIMEOUT_S = 240
TESTS = Path(__file__).resolve().parent
BATCH = 8
SEED = 4
PATHS = ["success", "sigterm", "nan_loss", "data_error", "model_bug_rank0", "model_bug_rank1"]
EXPECTED_STATUS = {
    "success": 0,
    "sigterm": 3,
    "nan_loss": 2,
    "data_error": 1,
    "model_bug_rank0": 1,
    "model_bug_rank1": 1,
}


@pytest.fixture(scope="module")
def folder(digits_dir, tmp_path_factory) -> Path:
    """The digits training shards as an image folder root/<class>/<i>.png (300 images)."""
    root = tmp_path_factory.mktemp("digits-folder") / "train"
    with h5py.File(sorted((digits_dir / "train").glob("*.h5"))[0], "r") as f:
        images, labels = f["images"][:300], f["labels"][:300]
    for i, (image, label) in enumerate(zip(images, labels)):
        (root / str(label)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.asarray(image, np.uint8).squeeze()).save(root / f"{label}/{i:04d}.png")
    return root


def corrupt_copy(folder: Path, dest: Path, rank: int, step: int) -> tuple[Path, str]:
    """A copy of folder whose sample read by `rank` at `step` of epoch 0 is a cut-off PNG;
    returns the copy and the corrupt file's path in it."""
    subprocess.run(["cp", "-r", str(folder), str(dest)], check=True)
    ds = open_dataset(dest)
    sampler = DistributedSampler(len(ds), 2, rank, SEED, "global")
    sample = int(sampler.batches(0, BATCH)[step][3])
    path = dest / ds.files[sample].relpath
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # header intact, image data cut
    return dest, ds.files[sample].relpath


def rank_pid(marker: str, rank: int) -> int:
    for pid in job_pids(marker):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"hpcdl.train" in cmdline and f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"rank {rank} of the job not found")


def staged_files(stage: Path) -> set[str]:
    """Data files under the stage dir (not hpcdl's metadata), relative to it."""
    return {
        str(p.relative_to(stage))
        for p in stage.rglob("*")
        if p.is_file() and p.relative_to(stage).parts[0] != ".hpcdl"
    }


@pytest.mark.parametrize("keep", [False, True], ids=["remove", "keep"])
@pytest.mark.parametrize("path", PATHS)
def test_every_exit_path_leaves_the_stage_dir_as_asked(path, keep, folder, tmp_path):
    stage, shm = tmp_path / "node-local" / "stage", tmp_path / "shm"
    shm.mkdir()
    marker = str(tmp_path)
    env = dict(mpi_env(), HPCDL_SHM_DIR=str(shm), HPCDL_TEST_MARKER=marker)
    data, bad_file = folder, ""
    if path == "data_error":
        data, bad_file = corrupt_copy(folder, tmp_path / "corrupt", rank=1, step=12)
    metrics = tmp_path / "m.jsonl"
    flags = ["--data", data, "--model", "mlp", "--epochs", 3, "--batch-size", BATCH]
    flags += ["--workers", 1, "--seed", SEED, "--stage-dir", stage, "--quiet"]
    flags += ["--metrics", metrics, "--metrics-every", 1, "--checkpoint-dir", tmp_path / "ckpt"]
    flags += ["--lr", 1e9 if path == "nan_loss" else 0.05, "--momentum", 0.9]
    flags += ["--keep-staged"] if keep else []
    if path.startswith("model_bug"):
        cmd = [*mpirun_cmd(2), sys.executable, TESTS / "raise_in_model.py", 12, path[-1], "--"]
        cmd = [str(c) for c in cmd + flags]
    else:
        cmd = train_cmd(2, *flags)
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        if path == "sigterm":
            deadline = time.monotonic() + TIMEOUT_S
            while not (metrics.exists() and len(read_events(metrics, "step")) >= 12):
                assert time.monotonic() < deadline and job.poll() is None, job.communicate()
                time.sleep(0.05)
            os.kill(rank_pid(marker, 1), signal.SIGTERM)
        out, err = job.communicate(timeout=TIMEOUT_S)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()

    assert job.returncode == EXPECTED_STATUS[path], out + err
    expected_line = {
        "success": "final train loss",
        "sigterm": "stopped by signal SIGTERM",
        "nan_loss": "loss became",
        "data_error": bad_file,
        "model_bug_rank0": "ModelBug",
        "model_bug_rank1": "ModelBug",
    }[path]
    assert expected_line in out + err, out + err
    if path != "success":  # the run had really started training when it ended
        assert len(read_events(metrics, "step")) >= 1, out + err

    # mpirun has returned; its children are going
    wait_until(lambda: job_pids(marker) == [], 10, "the job's processes to end with it")
    assert list(shm.iterdir()) == []
    if not keep:
        assert not stage.exists(), sorted(map(str, stage.rglob("*")))
        assert list(stage.parent.iterdir()) == []
        return
    manifest = read_manifest(stage / ".hpcdl" / "manifest")
    listed = {r.dest for r in manifest if r.kind == "f"}
    assert listed, "nothing was staged before the run ended: the check below would be empty"
    assert staged_files(stage) == listed
    for record in manifest:
        if record.kind == "f":
            assert (stage / record.dest).stat().st_ino == record.copy_ino
