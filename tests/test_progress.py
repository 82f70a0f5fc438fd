"""Progress output: --progress auto|bar|epoch|none, and what a job log receives."""

from __future__ import annotations

import io
import os
import pty
import re
import subprocess
import sys

import pytest
from helpers import mpi_env, mpirun_cmd, train_cmd

from hpcdl.config import ConfigError, parse_args
from hpcdl.metrics import Progress, RunningMean, resolve_progress

SEEN = RunningMean(steps=2, samples=8, loss_sum=1.0, correct=2)  # loss 0.5, acc 0.25


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_epochs(progress: Progress, epochs: int = 2, steps: int = 4) -> str:
    for epoch in range(epochs):
        progress.start_epoch(epoch)
        for step in range(1, steps + 1):
            progress.update(step, SEEN)
        progress.end_epoch(steps, {"loss": 0.5, "acc": 0.25})
    return progress.stream.getvalue()


def test_epoch_mode_writes_one_line_per_epoch_even_on_a_terminal():
    text = run_epochs(Progress(2, 4, enabled=True, stream=FakeTerminal(), mode="epoch"))
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 2, text
    assert re.fullmatch(
        r"Epoch 1/2 - 4/4 - \d+s \d+ms/step - loss: 0\.5000 - acc: 0\.2500", lines[0]
    )


def test_bar_mode_redraws_one_line_with_carriage_returns():
    text = run_epochs(Progress(2, 4, enabled=True, stream=io.StringIO(), mode="bar"))
    assert text.count("Epoch ") == 2 and "\r" in text
    assert text.split("\n")[1].endswith("loss: 0.5000 - acc: 0.2500")  # the bar, redrawn


@pytest.mark.parametrize("mode", ["none", "epoch", "bar"])
def test_disabled_progress_writes_nothing(mode):
    assert run_epochs(Progress(2, 4, enabled=False, stream=FakeTerminal(), mode=mode)) == ""


def test_none_mode_writes_no_progress_but_keeps_start_up_lines():
    progress = Progress(2, 4, enabled=True, stream=io.StringIO(), mode="none")
    progress.say("hpcdl: 2 rank(s)")
    assert run_epochs(progress) == "hpcdl: 2 rank(s)\n"


def test_auto_follows_the_stream_without_a_launcher():
    env: dict[str, str] = {}
    assert resolve_progress("auto", FakeTerminal(), env) == "bar"
    assert resolve_progress("auto", io.StringIO(), env) == "epoch"
    assert resolve_progress("epoch", FakeTerminal(), env) == "epoch"


def test_auto_takes_hpcdl_progress_from_the_environment():
    assert resolve_progress("auto", FakeTerminal(), {"HPCDL_PROGRESS": "epoch"}) == "epoch"
    assert resolve_progress("bar", FakeTerminal(), {"HPCDL_PROGRESS": "epoch"}) == "bar"
    with pytest.raises(ConfigError, match="HPCDL_PROGRESS must be one of auto, bar, epoch, none"):
        resolve_progress("auto", FakeTerminal(), {"HPCDL_PROGRESS": "lines"})


def test_progress_flag_and_toml_key(tmp_path):
    assert parse_args(["--data", "x"]).progress == "auto"
    assert parse_args(["--data", "x", "--progress", "epoch"]).progress == "epoch"
    toml = tmp_path / "job.toml"
    toml.write_text('data = "x"\nprogress = "none"\n')
    assert parse_args(["--config", str(toml)]).progress == "none"
    with pytest.raises(ConfigError, match="--progress must be one of auto, bar, epoch, none"):
        parse_args(["--data", "x", "--progress", "lines"])


@pytest.mark.parametrize("staging", [False, True], ids=["plain", "staging"])
def test_two_rank_run_into_a_file_writes_one_line_per_epoch(staging, digits_dir, tmp_path):
    """Under mpirun every rank's stdout is a pty; the launcher's is the file: auto picks epoch.
    With staging, the node's stager adds a start and a stop line, nothing per epoch."""
    log = tmp_path / "job.log"
    args = ["--data", digits_dir / "train", "--val-data", digits_dir / "val", "--model", "mlp"]
    args += ["--epochs", 3, "--workers", 0]
    if staging:
        args += ["--stage-dir", tmp_path / "stage"]
    env = {k: v for k, v in mpi_env().items() if k != "HPCDL_PROGRESS"}
    with open(log, "w") as out:
        proc = subprocess.run(
            train_cmd(2, *args), stdout=out, stderr=subprocess.STDOUT, env=env, timeout=300
        )
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "\r" not in text, repr(text[-2000:])
    epoch_lines = [line for line in text.splitlines() if line.startswith("Epoch ")]
    assert [line.split(" - ")[0] for line in epoch_lines] == ["Epoch 1/3", "Epoch 2/3", "Epoch 3/3"]
    assert all("val_acc: " in line for line in epoch_lines), text
    assert not [line for line in text.splitlines() if re.match(r"\s*\d+/\d+ \[", line)], text
    stager = [line for line in text.splitlines() if line.startswith("hpcdl-stage")]
    assert len(stager) == (2 if staging else 0), text
    assert "plan" not in text.lower(), text


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "file"])
def test_auto_under_mpirun_asks_the_launchers_stdout(terminal, tmp_path):
    """Each rank's own stdout is a pty either way; mpirun's stdout decides."""
    probe = (
        "import sys; from hpcdl.metrics import resolve_progress as r; print(r('auto', sys.stdout))"
    )
    env = {k: v for k, v in mpi_env().items() if k != "HPCDL_PROGRESS"}
    cmd = [*mpirun_cmd(1), sys.executable, "-c", probe]
    if terminal:
        parent, child = pty.openpty()
        proc = subprocess.run(cmd, stdout=child, stderr=child, env=env, timeout=120)
        os.close(child)
        text = os.read(parent, 4096).decode()
        os.close(parent)
    else:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        text = proc.stdout
    assert proc.returncode == 0, text
    assert text.split() == (["bar"] if terminal else ["epoch"]), text


def test_bad_hpcdl_progress_is_one_line_before_training(digits_dir):
    env = {**mpi_env(), "HPCDL_PROGRESS": "lines"}
    args = ["--data", digits_dir / "train", "--model", "mlp", "--epochs", 1, "--workers", 0]
    proc = subprocess.run(train_cmd(2, *args), capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors == [
        "hpcdl.train: error: HPCDL_PROGRESS must be one of auto, bar, epoch, none, got 'lines'"
    ], proc.stderr
