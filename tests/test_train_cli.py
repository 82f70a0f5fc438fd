"""`mpirun -np 2 python -m hpcdl.train` end to end on the real digits data (real MPI, HDF5)."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import mpi_env, own_lines, read_events, run_train, train_cmd

from hpcdl import checkpoint


def test_cnn_reaches_95_percent_on_digits_with_two_ranks(digits_dir, tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = run_train(
        2,
        "--data",
        digits_dir / "train",
        "--val-data",
        digits_dir / "val",
        "--model",
        "cnn",
        "--epochs",
        15,
        "--batch-size",
        32,
        "--optimizer",
        "adam",
        "--lr",
        0.001,
        "--workers",
        1,
        "--metrics",
        metrics,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_events(metrics, "summary")[0]
    assert summary["world_size"] == 2 and summary["global_batch"] == 64
    assert summary["val_accuracy"] >= 0.95, summary
    assert set(summary["mean_step"]) >= {"t_data", "t_compute", "t_comm_exposed", "t_step"}
    assert len(read_events(metrics, "epoch")) == 15
    assert "Epoch 15/15" in proc.stdout and "val_acc" in proc.stdout


def _rank_pids(marker):
    """pid of each hpcdl.train rank whose command line contains marker, by world rank."""
    pids = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"hpcdl.train" in cmdline and marker.encode() in b" ".join(cmdline):
            for kv in environ:
                if kv.startswith(b"OMPI_COMM_WORLD_RANK="):
                    pids[int(kv.split(b"=")[1])] = int(entry.name)
    return pids


def test_sigterm_to_one_rank_stops_the_job_with_a_checkpoint_and_resume_matches(
    digits_dir, tmp_path
):
    common = [
        "--data",
        digits_dir / "train",
        "--model",
        "mlp",
        "--epochs",
        3,
        "--batch-size",
        16,
        "--lr",
        0.05,
        "--workers",
        0,
        "--seed",
        7,
        "--quiet",
    ]
    # Uninterrupted reference run.
    ref_dir = tmp_path / "ref"
    proc = run_train(2, *common, "--checkpoint-dir", ref_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = checkpoint.load(checkpoint.latest(ref_dir))

    # Interrupted run: SIGTERM to rank 1 only, once training is under way.
    ckpt_dir = tmp_path / "stopped"
    metrics = tmp_path / "stopped.jsonl"
    job = subprocess.Popen(
        train_cmd(
            2, *common, "--checkpoint-dir", ckpt_dir, "--metrics", metrics, "--metrics-every", 1
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=mpi_env(),
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if metrics.exists() and len(read_events(metrics, "step")) >= 20:
            break
        time.sleep(0.05)
    pids = _rank_pids(str(ckpt_dir))
    assert set(pids) == {0, 1}, pids
    signalled = time.monotonic()
    os.kill(pids[1], signal.SIGTERM)
    out, err = job.communicate(timeout=60)
    assert time.monotonic() - signalled < 30
    assert job.returncode != 0
    assert "stopped by signal SIGTERM, checkpoint at" in out, out + err
    stopped = checkpoint.latest(ckpt_dir)
    assert stopped is not None
    stopped_ckpt = checkpoint.load(stopped)
    assert 0 < stopped_ckpt.global_step < reference.global_step
    assert read_events(metrics, "summary")[0]["stopped_by_signal"] is True

    # Resume and compare with the uninterrupted run.
    proc = run_train(2, *common, "--checkpoint-dir", ckpt_dir, "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = checkpoint.load(checkpoint.latest(ckpt_dir))
    assert resumed.global_step == reference.global_step
    np.testing.assert_array_equal(resumed.params, reference.params)


@pytest.fixture
def no_images_h5(tmp_path):
    path = tmp_path / "labels_only.h5"
    with h5py.File(path, "w") as f:
        f["labels"] = np.zeros(10, np.int64)
    return path


@pytest.mark.parametrize(
    "case",
    ["missing_data", "no_images", "batch_too_large", "bad_flag", "unreadable_config"],
)
def test_bad_input_gives_one_message_and_writes_nothing(case, digits_dir, no_images_h5, tmp_path):
    out = tmp_path / "out"
    args = ["--metrics", out / "m.jsonl", "--checkpoint-dir", out / "ckpt", "--epochs", 1]
    expected = {
        "missing_data": (["--data", tmp_path / "nope"], "nope"),
        "no_images": (["--data", no_images_h5], "images"),
        "batch_too_large": (
            ["--data", digits_dir / "train", "--batch-size", 5000],
            "--batch-size 5000 is larger than each rank's shard",
        ),
        "bad_flag": (
            ["--data", digits_dir / "train", "--optimizer", "lamb"],
            "--optimizer must be one of sgd, adam",
        ),
        "unreadable_config": (["--config", tmp_path / "missing.toml"], "missing.toml"),
    }[case]
    proc = run_train(2, *expected[0], *args, timeout=120)
    assert proc.returncode != 0
    # Open MPI may add its own "PMIX ERROR" lines when ranks exit non-zero: count hpcdl's
    lines = [line for line in proc.stderr.splitlines() if line.startswith("hpcdl")]
    assert len(lines) == 1, proc.stderr
    assert expected[1] in lines[0]
    assert not out.exists()


def test_training_with_staging_gives_bitwise_the_same_parameters(digits_dir, tmp_path):
    common = [
        "--data",
        digits_dir / "train",
        "--model",
        "mlp",
        "--epochs",
        2,
        "--batch-size",
        16,
        "--workers",
        1,
        "--seed",
        3,
        "--quiet",
    ]
    plain = run_train(2, *common, "--checkpoint-dir", tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr[-3000:]
    metrics = tmp_path / "staged.jsonl"
    staged = run_train(
        2,
        *common,
        "--checkpoint-dir",
        tmp_path / "staged",
        "--stage-dir",
        tmp_path / "stage",
        "--metrics",
        metrics,
    )
    assert staged.returncode == 0, staged.stderr[-3000:]
    a = checkpoint.load(checkpoint.latest(tmp_path / "plain"))
    b = checkpoint.load(checkpoint.latest(tmp_path / "staged"))
    np.testing.assert_array_equal(a.params, b.params)
    staging = read_events(metrics, "summary")[0]["staging"]
    assert staging["files_staged"] > 0 and staging["hits"] > 0, staging
    assert not (tmp_path / "stage").exists() or not any((tmp_path / "stage").rglob("*.h5"))


def test_help_lists_every_flag():
    proc = subprocess.run(
        [sys.executable, "-m", "hpcdl.train", "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    for flag in ("--data", "--stage-capacity", "--sync", "--bucket-mb", "--resume", "--workers"):
        assert flag in proc.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--augment", "flipp"], "hpcdl.train: error: --augment: unknown op 'flipp' in 'flipp'"),
        (["--device", "gpu"], "hpcdl.train: error: --device gpu needs CuPy and an NVIDIA GPU"),
    ],
    ids=["bad_augment", "no_gpu"],
)
def test_startup_error_is_one_line_from_one_rank_with_status_2(args, message, digits_dir, tmp_path):
    env = {**mpi_env(), "CUDA_VISIBLE_DEVICES": ""}  # no GPU, also on a machine that has one
    metrics = tmp_path / "m.jsonl"
    common = ["--data", digits_dir / "train", "--epochs", 1, "--workers", 0, "--metrics", metrics]
    proc = run_train(2, *common, *args, env=env, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "Traceback" not in output, output
    lines = own_lines(output)
    assert len(lines) <= 2, output
    assert [line for line in lines if "error" in line] == [lines[0]], output
    assert lines[0].startswith(message), output
    assert not metrics.exists()


@pytest.mark.parametrize("validation", [True, False], ids=["val_data", "no_val_data"])
def test_quiet_run_prints_only_the_final_line(validation, digits_dir):
    args = ["--data", digits_dir / "train", "--model", "mlp", "--epochs", 1, "--workers", 0]
    if validation:
        args += ["--val-data", digits_dir / "val"]
    proc = run_train(2, *args, "--quiet", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = (
        r"final val_acc 0\.\d{4}"
        if validation
        else r"final train loss \d+\.\d{4}, train acc [01]\.\d{4}"
    )
    assert re.fullmatch(rf"hpcdl\.train: {final} \(\d+ images/s\)\n", proc.stdout), proc.stdout


def test_run_without_validation_data_ends_with_a_summary_line(digits_dir):
    args = ["--data", digits_dir / "train", "--model", "mlp", "--epochs", 1, "--workers", 0]
    proc = run_train(2, *args, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.splitlines()[-1]
    assert re.fullmatch(r"hpcdl\.train: final train loss .* images/s\)", last), proc.stdout


@pytest.mark.parametrize("augment,validation", [("rrc48+flip", False), ("rcrop32", True)])
def test_crops_train_and_validate_on_a_folder_of_larger_images(augment, validation, tmp_path):
    """Issue 10: the model takes the shape the loader yields, not the stored sample shape.

    The validation images are larger and not square: with a crop they still give S x S."""
    from helpers import make_folder  # noqa: PLC0415

    make_folder(tmp_path / "train", per_class=4, size=(64, 64), fmt="jpg")
    make_folder(tmp_path / "val", per_class=2, size=(90, 70), fmt="jpg", seed=1)
    metrics = tmp_path / "m.jsonl"
    args = ["--data", tmp_path / "train", "--model", "mlp", "--augment", augment]
    args += ["--val-data", tmp_path / "val"] if validation else []
    args += ["--epochs", 1, "--batch-size", 4, "--workers", 1]
    proc = run_train(1, *args, "--metrics", metrics, "--quiet", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_events(metrics, "summary")[0]
    assert summary["steps"] == 2, summary
    if validation:
        assert 0.0 <= summary["val_accuracy"] <= 1.0, summary


def test_validation_data_that_cannot_give_the_training_shape_is_one_error(tmp_path):
    from helpers import make_folder  # noqa: PLC0415

    make_folder(tmp_path / "train", per_class=4, size=(32, 32))
    make_folder(tmp_path / "val", per_class=2, size=(40, 40))
    metrics = tmp_path / "m.jsonl"
    args = ["--data", tmp_path / "train", "--val-data", tmp_path / "val", "--epochs", 1]
    proc = run_train(2, *args, "--batch-size", 2, "--metrics", metrics, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    lines = [line for line in own_lines(output) if "error" in line]
    assert len(lines) == 1, output
    assert "--val-data" in lines[0] and "(3, 40, 40)" in lines[0] and "(3, 32, 32)" in lines[0]
    assert "--augment" in lines[0], lines[0]
    assert not metrics.exists()


USER_MODEL = Path(__file__).resolve().parent / "test_nn_user_models.py"
EXAMPLE_MODEL = Path(__file__).resolve().parents[1] / "examples" / "my_model.py"


@pytest.mark.parametrize(
    "model", ["resnet18", f"{EXAMPLE_MODEL}:build"], ids=["resnet18", "example_user_model"]
)
def test_imagenet_resnet_and_a_users_model_train_from_the_command_line(model, digits_dir, tmp_path):
    metrics = tmp_path / "m.jsonl"
    args = ["--data", digits_dir / "train", "--model", model, "--epochs", 1, "--max-steps", 2]
    proc = run_train(2, *args, "--batch-size", 8, "--workers", 0, "--metrics", metrics)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_events(metrics, "summary")[0]["steps"] == 2


@pytest.mark.parametrize(
    "builder,message",
    [
        ("ends_with_three_outputs", "gives (3,) per sample, not (10,) logits"),
        ("absent", "has no attribute 'absent'"),
    ],
)
def test_a_wrong_user_model_is_one_line_naming_the_flag(builder, message, digits_dir, tmp_path):
    metrics = tmp_path / "m.jsonl"
    args = ["--data", digits_dir / "train", "--model", f"{USER_MODEL}:{builder}", "--epochs", 1]
    proc = run_train(2, *args, "--workers", 0, "--metrics", metrics, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "Traceback" not in output, output
    lines = [line for line in own_lines(output) if "error" in line]
    assert len(lines) == 1, output
    assert lines[0].startswith(f"hpcdl.train: error: --model '{USER_MODEL}:{builder}': "), lines
    assert message in lines[0]
    assert not metrics.exists()


def test_tf32_where_it_changes_nothing_says_so_once(digits_dir, tmp_path):
    """--tf32 is a GPU's (NOTE [TF32]): on a CPU run one line says float32 stays IEEE, and the
    run trains; on a GPU, hpcdl's plain kernels say to add --gpu-kernels; a torch model, or
    hpcdl's engine with --gpu-kernels, says nothing."""
    from types import SimpleNamespace  # noqa: PLC0415

    from hpcdl.config import TrainConfig  # noqa: PLC0415
    from hpcdl.startup import say_settings  # noqa: PLC0415

    proc = run_train(
        1,
        *("--data", digits_dir / "train", "--model", "mlp", "--epochs", 1, "--tf32"),
        *("--batch-size", 32, "--workers", 0, "--max-steps", 2),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = [line for line in proc.stdout.splitlines() if "--tf32" in line]
    assert said == ["hpcdl: --tf32 changes nothing on a CPU: float32 stays IEEE float32"]
    # on a GPU, each engine says it (the seam: startup asks the engine, not which one it is)
    import torch  # noqa: PLC0415

    from hpcdl import nn  # noqa: PLC0415
    from hpcdl.array_engine import ArrayEngine  # noqa: PLC0415
    from hpcdl.torch_engine import TorchEngine  # noqa: PLC0415
    from hpcdl.torch_engine.device import BatchFeed  # noqa: PLC0415

    cfg = TrainConfig(data="x", device="gpu", tf32=True)
    lines = {}
    on_gpu = SimpleNamespace(xp=SimpleNamespace())  # parts whose array module is not NumPy
    for kernels in (False, True):
        nn.kernels.enable(kernels)
        try:
            lines["hpcdl", kernels] = []
            say_settings(cfg, ArrayEngine(on_gpu, None, False), lines["hpcdl", kernels].append)
        finally:
            nn.kernels.enable(False)
    lines["torch", False] = []
    cuda = TorchEngine(None, None, None, None, feed=BatchFeed(torch.device("cuda")))
    say_settings(cfg, cuda, lines["torch", False].append)
    assert lines == {
        ("hpcdl", False): ["hpcdl: --tf32 changes nothing on hpcdl's plain kernels (add "
                           "--gpu-kernels): float32 stays IEEE float32"],
        ("hpcdl", True): [],
        ("torch", False): [],
    }  # fmt: skip
    cpu = TorchEngine(None, None, None, None)
    assert cpu.tf32_line == "hpcdl: --tf32 changes nothing on a CPU: float32 stays IEEE float32"


def test_lr_zero_trains_without_changing_the_parameters_and_says_so_once(digits_dir, tmp_path):
    """PyTorch's optimizers and Keras accept lr=0 (freeze a model, check a weights round trip)."""
    proc = run_train(
        1,
        *("--data", digits_dir / "train", "--model", "mlp", "--epochs", 2, "--lr", 0),
        *("--batch-size", 32, "--workers", 0, "--checkpoint-every", 2),
        *("--max-steps", 4, "--checkpoint-dir", tmp_path / "ckpt"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = [line for line in proc.stdout.splitlines() if "--lr 0" in line]
    assert said == ["hpcdl: --lr 0: the parameters will not change"], proc.stdout
    first, last = map(checkpoint.load, checkpoint.list_checkpoints(tmp_path / "ckpt"))
    assert (first.global_step, last.global_step) == (2, 4)
    assert np.array_equal(first.params, last.params)
