"""--init-from for a torch model (hpcdl/torch_engine/specs.py): files that cannot start the run
are one line saying what is wrong with them. Real runs under mpirun on small JPEGs; the
weights are torch.save files."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest
from helpers import folder_job, one_line_error, run_train

torch = pytest.importorskip("torch")

MODELS = """
from torch import nn


def conv_head(shape, k):  # squeezenet's head: a 1x1 convolution to k channels, then a pool
    return nn.Sequential(nn.Conv2d(shape[0], 8, 3), nn.ReLU(), nn.Conv2d(8, k, 1),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten())


def linear_head(shape, k):
    return nn.Sequential(nn.Conv2d(shape[0], 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, k))
"""


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    """A folder of 48 20x20 JPEGs in 3 classes, and models.py beside it."""
    return folder_job(tmp_path_factory.mktemp("init_from"), MODELS)


def train(job: Path, fn: str, weights: Path) -> subprocess.CompletedProcess:
    return run_train(1, "--data", job / "imgs", "--model", f"{job / 'models.py'}:{fn}",
                     "--init-from", weights, "--epochs", 1, "--max-steps", 1, "--workers", 0,
                     "--progress", "none", timeout=180)  # fmt: skip


def state_of(fn: str, classes: int) -> dict:
    namespace: dict = {}
    exec(textwrap.dedent(MODELS), namespace)
    return namespace[fn]((3, 20, 20), classes).state_dict()


def test_weights_with_nan_are_refused_at_load_naming_the_key(job, tmp_path):
    state = state_of("linear_head", 3)
    state["0.bias"][1] = float("nan")
    torch.save(state, tmp_path / "nan.pth")
    line = one_line_error(train(job, "linear_head", tmp_path / "nan.pth"))
    assert f"--init-from {tmp_path / 'nan.pth'}: 0.bias holds NaN or infinite values" in line


def test_a_directory_is_said_to_be_a_directory(job, tmp_path):
    (tmp_path / "adir.pth").mkdir()
    line = one_line_error(train(job, "linear_head", tmp_path / "adir.pth"))
    assert f"--init-from {tmp_path / 'adir.pth'} is a directory" in line


def test_a_convolution_head_of_another_class_count_says_only_linear_heads_are_re_initialised(
    job, tmp_path
):
    torch.save(state_of("conv_head", 1000), tmp_path / "imagenet.pth")
    line = one_line_error(train(job, "conv_head", tmp_path / "imagenet.pth"))
    assert "2.weight is (1000, 8, 1, 1) in the file, (3, 8, 1, 1) in the model" in line
    assert "a Conv2d: only a final nn.Linear of another class count is re-initialised" in line


def test_a_linear_head_of_another_class_count_is_still_re_initialised(job, tmp_path):
    torch.save(state_of("linear_head", 1000), tmp_path / "imagenet.pth")
    done = train(job, "linear_head", tmp_path / "imagenet.pth")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the final layer is re-initialised for 3 classes" in done.stdout
