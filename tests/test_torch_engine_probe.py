"""hpcdl.train's start-up probe of a user's torch.nn.Module (hpcdl/torch_engine/probe.py):
modules that cannot train stop every rank with one line naming --model, the cause and what to
do, instead of a traceback from the optimizer or the first step. Real runs under mpirun on a
folder of small JPEGs; the modules are written to a file as a user would."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helpers import folder_job, one_line_error, run_train

torch = pytest.importorskip("torch")

MODELS = """
import torch
from torch import nn


def _linear(shape, k):
    return nn.Linear(shape[0] * shape[1] * shape[2], k)


def frozen(shape, k):
    m = nn.Sequential(nn.Flatten(), _linear(shape, k))
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def pool(shape, k):  # no parameters at all
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())


class Detached(nn.Module):
    def __init__(self, shape, k):
        super().__init__()
        self.fc = _linear(shape, k)

    def forward(self, x):
        return self.fc(x.flatten(1)).detach()


class Integer(Detached):
    def forward(self, x):
        return self.fc(x.flatten(1)).round().long()


class AuxInTraining(Detached):
    def forward(self, x):
        y = self.fc(x.flatten(1))
        return (y, y) if self.training else y


def detached(shape, k):
    return Detached(shape, k)


def integer(shape, k):
    return Integer(shape, k)


def aux(shape, k):
    return AuxInTraining(shape, k)


def meta(shape, k):
    with torch.device("meta"):
        return nn.Sequential(nn.Flatten(), _linear(shape, k))


def batch_norm(shape, k):
    return nn.Sequential(nn.Flatten(), _linear(shape, 8), nn.BatchNorm1d(8), nn.Linear(8, k))
"""


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    """A folder of 48 20x20 JPEGs in 3 classes, and models.py beside it."""
    return folder_job(tmp_path_factory.mktemp("probe"), MODELS)


def train(job: Path, fn: str, *more) -> subprocess.CompletedProcess:
    return run_train(1, "--data", job / "imgs", "--model", f"{job / 'models.py'}:{fn}",
                     "--epochs", 1, "--max-steps", 2, "--workers", 0, "--progress", "none",
                     *more, timeout=180)  # fmt: skip


@pytest.mark.parametrize(
    ("fn", "more", "said"),
    [
        ("frozen", [], "the module has no trainable parameters"),
        ("pool", [], "the module has no trainable parameters"),
        ("meta", [], "its parameters are on the meta device"),
        ("detached", [], "no gradient flows back"),
        ("integer", [], "returns torch.int64 in training mode, not float logits"),
        ("aux", [], "returns tuple in training mode, not a logits tensor"),
        ("batch_norm", ["--batch-size", 1],
         "BatchNorm needs more than 1 sample per rank in training: raise --batch-size"),
    ],
)  # fmt: skip
def test_a_module_that_cannot_train_is_one_line_naming_model(job, fn, more, said):
    line = one_line_error(train(job, fn, *more))
    assert f"--model {job / 'models.py'}:{fn}" in line, line
    assert said in line, line


def test_the_training_mode_probe_leaves_the_start_state_as_it_was(job, tmp_path):
    """The probe runs forward in training mode (BatchNorm updates its running statistics,
    dropout draws from torch's generator); the run still starts from the builder's buffers:
    with --lr 0 and one step, the checkpoint's BatchNorm statistics are one update of the
    fresh ones, not two."""
    from hpcdl import checkpoint  # noqa: PLC0415

    done = train(job, "batch_norm", "--batch-size", 4, "--lr", 0, "--max-steps", 1,
                 "--checkpoint-every", 1, "--checkpoint-dir", tmp_path / "ck")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    saved = checkpoint.load(checkpoint.latest(tmp_path / "ck"))
    assert saved.rng_states[0]["counters"]["2.num_batches_tracked"] == 1, saved.rng_states
