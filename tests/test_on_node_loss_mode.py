"""--on-node-loss continue where MPI was not started in its fault-tolerant mode (issue 61): one
line at start, and hpcdl.launch adds `--with-ft ulfm` itself. Real mpirun, both engines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import mpi_env, mpirun_cmd

from hpcdl.launch import launcher_argv, wants_ulfm

NEEDS = "hpcdl: --on-node-loss continue needs `mpirun --with-ft ulfm`"
ADDED = "hpcdl.launch: added --with-ft ulfm to the launcher"
TORCH_CNN = f"{Path(__file__).parent / 'torch_models.py'}:small_cnn"


def train_args(digits: Path, ckpt: Path, model: str) -> list[str]:
    return ["-m", "hpcdl.train", "--data", str(digits / "train"), "--model", model,
            "--max-steps", "2", "--workers", "0", "--batch-size", "16", "--quiet",
            "--checkpoint-dir", str(ckpt), "--on-node-loss", "continue"]  # fmt: skip


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), timeout=300)


@pytest.mark.parametrize("model", ["mlp", TORCH_CNN], ids=["hpcdl", "torch"])
def test_continue_under_a_plain_mpirun_says_a_lost_rank_will_end_the_job(
    digits_dir, tmp_path, model
):
    if model == TORCH_CNN:
        pytest.importorskip("torch")
    done = run([*mpirun_cmd(2), sys.executable, *train_args(digits_dir, tmp_path / "ck", model)])
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.startswith(NEEDS)]
    assert said == [
        "hpcdl: --on-node-loss continue needs `mpirun --with-ft ulfm` (or hpcdl.launch, which "
        "adds it); this job was started without it, so a lost rank will end this job"
    ], done.stderr


def test_continue_under_mpirun_with_ft_ulfm_says_nothing_of_it(digits_dir, tmp_path):
    cmd = [*mpirun_cmd(2), "--with-ft", "ulfm", sys.executable,
           *train_args(digits_dir, tmp_path / "ck", "mlp")]  # fmt: skip
    done = run(cmd)
    assert done.returncode == 0, done.stderr[-3000:]
    assert NEEDS not in done.stderr


def test_hpcdl_launch_adds_with_ft_ulfm_for_continue(digits_dir, tmp_path):
    cmd = [sys.executable, "-m", "hpcdl.launch", *mpirun_cmd(2), sys.executable,
           *train_args(digits_dir, tmp_path / "ck", "mlp")]  # fmt: skip
    done = run(cmd)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ADDED in done.stderr and NEEDS not in done.stderr  # the ranks run fault-tolerant


def test_which_commands_get_with_ft_ulfm(tmp_path):
    mpirun = ["mpirun", "-np", "2", "python", "-m", "hpcdl.train"]
    assert wants_ulfm([*mpirun, "--on-node-loss", "continue"])
    assert wants_ulfm([*mpirun, "--on-node-loss=continue"])
    assert not wants_ulfm([*mpirun, "--on-node-loss", "stop"])
    assert not wants_ulfm([*mpirun])
    assert not wants_ulfm(["mpirun", "--with-ft", "ulfm", *mpirun[1:], "--on-node-loss",
                           "continue"])  # fmt: skip
    config = tmp_path / "run.toml"
    config.write_text('on_node_loss = "continue"\n')
    assert wants_ulfm([*mpirun, "--config", str(config)])
    assert not wants_ulfm([*mpirun, "--config", str(tmp_path / "missing.toml")])
    assert launcher_argv([*mpirun, "--on-node-loss", "continue"])[:5] == [
        "mpirun",
        "-x",
        "HPCDL_OUTCOME",
        "--with-ft",
        "ulfm",
    ]
    assert "--with-ft" not in launcher_argv(["srun", "-n", "2", "--on-node-loss", "continue"])
