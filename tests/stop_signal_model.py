"""What tests/test_stop_signal_*.py share: a user's torch model file (examples/torch_model.py's
kind) whose builder can hold a rank at a known moment of hpcdl.train, and the run around it.

The file it writes holds each rank, when asked (a file `hold-start` or `hold-exit` beside it), in
the builder (start-up: the engine is being built; the loaders, the resume and the stop
agreement are still to come) or in an atexit function (after the run's last line), writes
`start-PID` or `exit-PID` there, and goes on once the test writes `go-start` or `go-exit`. So a
test signals a rank at that moment, never by timing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from helpers import mpi_env, mpirun_cmd, wait_until

MODEL = """\
import atexit
import os
import time
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).parent


def hold(moment):
    (HERE / f"{moment}-{os.getpid()}").touch()
    while not (HERE / f"go-{moment}").exists():
        time.sleep(0.01)


class SmallCNN(nn.Module):
    def __init__(self, channels, num_classes):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
        )
        self.dropout = nn.Dropout(0.1)
        self.head = nn.Linear(8 * 2 * 2, num_classes)

    def forward(self, x):
        return self.head(self.dropout(torch.flatten(self.features(x), 1)))


def small_cnn(input_shape, num_classes):
    if (HERE / "hold-start").exists():
        hold("start")
    if (HERE / "hold-exit").exists():
        atexit.register(hold, "exit")
    return SmallCNN(input_shape[0], num_classes)
"""
TIMEOUT_S = 300


def model_dir(tmp_path: Path, *holds: str) -> Path:
    """A directory with the model file, holding the ranks at each moment in holds."""
    where = tmp_path / "model"
    where.mkdir()
    (where / "cnn_model.py").write_text(MODEL)
    for moment in holds:
        (where / f"hold-{moment}").touch()
    return where


def train_argv(where: Path, data: Path, ck: Path, *args: str) -> list[str]:
    """`mpirun -np 2 python -m hpcdl.train` of the model in where (argv after the launcher)."""
    return [*mpirun_cmd(2), sys.executable, "-m", "hpcdl.train", "--data", str(data),
            "--model", f"{where / 'cnn_model.py'}:small_cnn", "--batch-size", "16",
            "--workers", "1", "--progress", "none", "--seed", "4", "--lr", "0.05",
            "--checkpoint-dir", str(ck), *args]  # fmt: skip


def start(argv: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=mpi_env(), cwd=cwd)  # fmt: skip


def held_ranks(job: subprocess.Popen, where: Path, moment: str) -> list[int]:
    """The pids of both ranks, once both are held at moment."""

    def held() -> list[int]:
        assert job.poll() is None, job.communicate()
        return [int(p.name.split("-")[1]) for p in where.glob(f"{moment}-*")]

    return wait_until(lambda: len(held()) == 2 and held(), TIMEOUT_S, f"both ranks at {moment}")


def release(job: subprocess.Popen, where: Path, moment: str) -> tuple[str, str]:
    """Let the held ranks go on; the job's (stdout, stderr) once it ended."""
    (where / f"go-{moment}").touch()
    try:
        return job.communicate(timeout=TIMEOUT_S)
    finally:
        job.kill()


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        os.kill(pid, sig)
