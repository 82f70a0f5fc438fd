"""Training runs that must fail: one clear message, non-zero exit, no hang, no claimed success.

Each test starts the real trainer (`mpirun -np 2 python -m hpcdl.train`, or a singleton) on small
real HDF5 data and checks stderr, the exit status, the metrics file and the checkpoint directory.
"""

import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
from helpers import mpi_env, mpirun_cmd, read_events

from hpcdl import checkpoint

TIMEOUT_S = 120  # a hang shows up as subprocess.TimeoutExpired, i.e. a failed test


def train_args(*args):
    return [sys.executable, "-m", "hpcdl.train", *map(str, args)]


def run_train(ranks, *args):
    """ranks=None: a singleton run without mpirun. Returns (process, seconds)."""
    cmd = train_args(*args) if ranks is None else [*mpirun_cmd(ranks), *train_args(*args)]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), timeout=TIMEOUT_S)
    return proc, time.monotonic() - start


def error_lines(stderr):
    """hpcdl's error lines. Not every line with "error": when ranks exit non-zero, Open MPI's
    PMIx sometimes adds "[host:pid] PMIX ERROR: PMIX_ERR_UNREACH ..." (launcher noise)."""
    return [line for line in stderr.splitlines() if line.startswith("hpcdl") and "error" in line]


def write_h5(path, images, num_classes=10):
    with h5py.File(path, "w") as f:
        f["images"] = images
        f["labels"] = (np.arange(len(images)) % num_classes).astype(np.int64)
    return path


COMMON = ["--model", "mlp", "--epochs", 1, "--workers", 0, "--seed", 1]


# --- NaN loss ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ranks", "nan_in", "every"),
    [
        (2, "every_sample", 1),
        (2, "one_sample", 1),
        (None, "every_sample", 1),
        (2, "one_sample", 3),
        (None, "every_sample", 3),
    ],
    ids=[
        "2ranks-all-nan",
        "2ranks-one-nan-sample",
        "singleton-all-nan",
        "2ranks-one-nan-sample-read-every-3",
        "singleton-all-nan-read-every-3",
    ],
)
def test_nan_loss_stops_with_one_line_and_claims_no_success(ranks, nan_in, every, tmp_path):
    """The loss flag is read every --metrics-every steps (NOTE [device scalars]): however late,
    the run stops before it writes a record or a checkpoint, naming the step it began at."""
    images = np.random.default_rng(0).standard_normal((64, 1, 8, 8)).astype(np.float32)
    if nan_in == "every_sample":
        images[:, 0, 3, 3] = np.nan  # every rank sees a NaN loss at its first step
    else:
        images[37, 0, 3, 3] = np.nan  # one rank sees it, at some step of the epoch
    data = write_h5(tmp_path / "nan.h5", images)
    metrics, ckpt_dir = tmp_path / "m.jsonl", tmp_path / "ckpt"
    proc, seconds = run_train(
        ranks,
        "--data",
        data,
        *COMMON,
        "--batch-size",
        8,
        "--metrics",
        metrics,
        "--metrics-every",
        every,
        "--checkpoint-dir",
        ckpt_dir,
        "--checkpoint-every",
        2,
    )
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert seconds < 60
    lines = [line for line in proc.stderr.splitlines() if "loss became nan" in line]
    assert len(lines) == 1, proc.stderr
    assert lines == error_lines(proc.stderr), proc.stderr  # hpcdl's error line, not a traceback
    assert "lower --lr or check the input data" in lines[0]
    if nan_in == "every_sample":
        assert "at step 1 (epoch 1)" in lines[0]  # the first step, numbered as the metrics
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "final val_acc" not in proc.stdout
    # Nothing claims success: no epoch or summary event, no checkpoint (the NaN comes first).
    assert metrics.exists()  # the run got as far as training: the check above is meaningful
    assert read_events(metrics, "epoch") == [] and read_events(metrics, "summary") == []
    assert all(np.isfinite(e["loss"]) for e in read_events(metrics, "step"))
    assert checkpoint.list_checkpoints(ckpt_dir) == []


# --- resuming another model's checkpoint ------------------------------------------------------


def test_resume_from_another_models_checkpoint_names_both_models(digits_dir, tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    args = ["--data", digits_dir / "train", "--batch-size", 16, "--epochs", 1, "--workers", 0]
    proc, _ = run_train(2, *args, "--model", "mlp", "--checkpoint-dir", ckpt_dir, "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = checkpoint.list_checkpoints(ckpt_dir)
    assert len(saved) == 1 and checkpoint.load(saved[0]).model == "mlp"
    before = saved[0].read_bytes()

    metrics = tmp_path / "resumed.jsonl"
    proc, seconds = run_train(
        2,
        *args,
        "--model",
        "cnn",
        "--checkpoint-dir",
        ckpt_dir,
        "--resume",
        "auto",
        "--metrics",
        metrics,
    )
    assert proc.returncode != 0
    assert seconds < 60
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert "'mlp'" in lines[0] and "'cnn'" in lines[0], lines[0]
    assert saved[0].name in lines[0]
    assert "Traceback" not in proc.stderr
    # The mismatch is found before anything is written; the old checkpoint is untouched.
    assert not metrics.exists()
    assert checkpoint.list_checkpoints(ckpt_dir) == saved
    assert saved[0].read_bytes() == before


# --- validation data of another sample shape --------------------------------------------------


@pytest.mark.parametrize(
    ("stored", "model_input"),
    [((12, 12, 1), (1, 12, 12)), ((8, 8, 3), (3, 8, 8))],
    ids=["other-size", "other-channels"],
)
def test_val_data_of_another_shape_gives_one_message_and_writes_nothing(
    stored, model_input, digits_dir, tmp_path
):
    rng = np.random.default_rng(0)
    val = write_h5(tmp_path / "val.h5", rng.integers(0, 256, (40, *stored), dtype=np.uint8))
    out = tmp_path / "out"
    proc, seconds = run_train(
        2,
        "--data",
        digits_dir / "train",
        "--val-data",
        val,
        *COMMON,
        "--batch-size",
        16,
        "--metrics",
        out / "m.jsonl",
        "--checkpoint-dir",
        out / "ckpt",
    )
    assert proc.returncode != 0
    assert seconds < 60
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert f"--val-data {val}" in lines[0], lines[0]
    assert str(model_input) in lines[0] and "(1, 8, 8)" in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
    assert not out.exists()


# --- ranks started with different flags -------------------------------------------------------


def test_ranks_started_with_different_flags_all_stop_with_one_message(digits_dir, tmp_path):
    out = tmp_path / "out"
    common = ["--data", digits_dir / "train", *COMMON, "--batch-size", 16, "--quiet"]
    common += ["--metrics", out / "m.jsonl", "--checkpoint-dir", out / "ckpt"]
    # MPMD launch: rank 0 and rank 1 get different learning rates.
    cmd = [*mpirun_cmd(1), *train_args(*common, "--lr", 0.1)]
    cmd += [":", "-np", "1", *train_args(*common, "--lr", 0.2)]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), timeout=TIMEOUT_S)
    assert proc.returncode != 0
    assert time.monotonic() - start < 60
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert "ranks [1] run a different model or configuration than rank 0" in lines[0]
    assert "Traceback" not in proc.stderr
    assert not out.exists()


# --- a sample that cannot be read mid-run -----------------------------------------------------


@pytest.mark.parametrize("workers", [0, 1])
def test_an_unreadable_sample_mid_run_is_one_line_with_the_file_and_the_fix(tmp_path, workers):
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in ("cat", "dog"):
        (tmp_path / "d" / c).mkdir(parents=True)
        for i in range(12):
            arr = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
            Image.fromarray(arr).save(tmp_path / "d" / c / f"{i}.png")
    (tmp_path / "d" / "dog" / "junk.png").write_bytes(b"not an image")
    args = ["--data", tmp_path / "d", "--model", "mlp", "--epochs", 2, "--batch-size", 4]
    proc, seconds = run_train(2, *args, "--workers", workers, "--seed", 1, "--quiet")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "junk.png" in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "sample " in lines[0] and "--skip-bad-samples" in lines[0], lines[0]
    assert "final" not in proc.stdout
