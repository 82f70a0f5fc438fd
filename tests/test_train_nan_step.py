"""The NaN line names the step as the metrics and TensorBoard number it (from 1): the step after
the last one logged with a finite loss, in either engine and with fp16's loss scaling."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import mpi_env, mpirun_cmd

TORCH_MODEL = str(Path(__file__).parent / "torch_models.py") + ":small_cnn"
NAN_LINE = re.compile(r"loss became (nan|inf|-inf) at step (\d+) \(epoch (\d+)\)")


@pytest.mark.parametrize(
    ("ranks", "engine_args"),
    [
        (None, ["--model", "mlp", "--lr", "1e6"]),
        (2, ["--model", "mlp", "--lr", "1e6"]),
        (None, ["--model", "mlp", "--lr", "1e6", "--precision", "fp16"]),
        (None, ["--model", TORCH_MODEL, "--lr", "1e20"]),
        (None, ["--model", TORCH_MODEL, "--lr", "1e6", "--precision", "fp16"]),
    ],
    ids=["hpcdl", "hpcdl-2ranks", "hpcdl-fp16", "torch", "torch-fp16"],
)
def test_the_nan_line_names_the_step_the_metrics_would_have(digits_dir, tmp_path, ranks,
                                                            engine_args):  # fmt: skip
    if TORCH_MODEL in engine_args:
        pytest.importorskip("torch")
    metrics = tmp_path / "n.jsonl"
    train = [sys.executable, "-m", "hpcdl.train", "--data", str(digits_dir / "train"),
             "--epochs", "1", "--batch-size", "32", "--workers", "0", "--seed", "1",
             "--metrics", str(metrics), "--metrics-every", "1", "--quiet",
             *engine_args]  # fmt: skip
    cmd = train if ranks is None else [*mpirun_cmd(ranks), *train]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=mpi_env())
    assert done.returncode != 0, done.stdout[-2000:]
    found = NAN_LINE.findall(done.stderr)
    assert len(found) == 1, done.stderr[-3000:]
    step = int(found[0][1])
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    logged = [r for r in records if r["event"] == "step"]
    assert logged, "the loss must stay finite for a step or more, or the test shows nothing"
    assert [r["step"] for r in logged] == list(range(1, len(logged) + 1))
    assert all(np.isfinite(r["loss"]) for r in logged)
    assert step == logged[-1]["step"] + 1, (step, logged[-1])
