"""A torch model (hpcdl.torch_engine) through the parts of a run the other torch-engine tests
leave out: WebDataset tar shards staged to the node, `--shuffle node` (the sampler is not the
engine's), every sample read once an epoch, `--tensorboard` beside the metrics, and
`hpcdl.report` of the run (issue 61, "Everything the run does, for torch models too"). A real
2-rank run under mpirun."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import read_events, run_train
from tarshards_helpers import make_shards

torch = pytest.importorskip("torch")

MODELS = Path(__file__).parent / "torch_models.py"


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """4 tar shards of 12 random 20x16 JPEGs each, 3 classes."""
    root = tmp_path_factory.mktemp("tv-shards") / "train"
    make_shards(root, shards=4, per_shard=12)
    return root


def test_tar_shards_staged_train_a_torch_model_with_tensorboard_and_a_report(shards, tmp_path):
    metrics, tb = tmp_path / "m.jsonl", tmp_path / "tb"
    done = run_train(2, "--data", shards, "--model", f"{MODELS}:small_cnn", "--epochs", 2,
                     "--batch-size", 4, "--workers", 1, "--seed", 1, "--shuffle", "node",
                     "--stage-dir", tmp_path / "stage", "--metrics", metrics,
                     "--metrics-every", 1, "--tensorboard", tb, "--progress", "none",
                     timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    start = read_events(metrics, "start")[0]
    assert start["engine"] == "torch", start
    epochs = read_events(metrics, "epoch")
    assert [e["epoch"] for e in epochs] == [0, 1]
    # 48 samples, 2 ranks x batch 4: 6 steps an epoch, every sample read once an epoch (the
    # node's hits and misses count the run's reads so far, the next epoch's read ahead too:
    # at the end, 2 x 48)
    steps = read_events(metrics, "step")
    assert len(steps) == 12 and all(math.isfinite(s["loss"]) for s in steps)
    (node,) = epochs[-1]["staging_nodes"]
    assert node["hits"] + node["misses"] == 96 and node["files_staged"] == 4, node
    from tbparse import SummaryReader  # noqa: PLC0415

    scalars = SummaryReader(str(tb)).scalars
    loss = scalars[scalars["tag"] == "train/loss"]
    assert loss["step"].tolist() == [s["step"] for s in steps]
    assert loss["value"].tolist() == pytest.approx([s["loss"] for s in steps], rel=1e-6)
    report = subprocess.run([sys.executable, "-m", "hpcdl.report", str(metrics), "--out",
                             str(tmp_path / "r.png")], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert report.returncode == 0, report.stderr[-2000:]
    assert (tmp_path / "r.png").stat().st_size > 0 and "Traceback" not in report.stderr
