"""`--model torchvision:NAME` takes torchvision's image classifiers only, builds them without
downloading anything, and its start-up probe says in one line what only training mode shows.
Marked `torchvision`: scripts/torchvision-tests.sh runs them where torchvision sits beside
torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import make_folder, mpi_env, one_line_error, run_train

torch = pytest.importorskip("torch")
torchvision = pytest.importorskip("torchvision")

pytestmark = pytest.mark.torchvision


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """48 20x20 JPEGs in 3 classes."""
    root = tmp_path_factory.mktemp("tv") / "imgs"
    make_folder(root, per_class=16, size=(20, 20), classes=("cat", "dog", "fox"), fmt="jpg")
    return root


def train(folder: Path, name: str, *more, home: Path | None = None) -> subprocess.CompletedProcess:
    env = mpi_env()
    if home is not None:  # where torch.hub would download to: ~/.cache/torch
        env = {**env, "HOME": str(home)}
        env.pop("TORCH_HOME", None)
        env.pop("XDG_CACHE_HOME", None)
    return run_train(1, "--data", folder, "--model", f"torchvision:{name}", "--epochs", 1,
                     "--max-steps", 1, "--workers", 0, "--progress", "none", *more, env=env,
                     timeout=300)  # fmt: skip


@pytest.mark.parametrize(
    "name", ["fasterrcnn_resnet50_fpn", "lraspp_mobilenet_v3_large", "raft_small", "r3d_18"]
)
def test_builders_that_are_not_image_classifiers_are_refused_without_a_download(
    folder, tmp_path, name
):
    home = tmp_path / "home"
    home.mkdir()
    line = one_line_error(train(folder, name, home=home))
    assert f"--model torchvision:{name} is not an image classifier" in line, line
    assert not (home / ".cache" / "torch").exists()  # nothing downloaded


def test_googlenets_auxiliary_outputs_in_training_are_one_line(folder):
    line = one_line_error(train(folder, "googlenet"))
    assert (
        "--model torchvision:googlenet: the module returns GoogLeNetOutputs in training mode, "
        "not a logits tensor"
    ) in line, line
    assert "aux_logits=False" in line


def test_batch_norm_with_one_sample_per_rank_is_one_line(folder):
    line = one_line_error(train(folder, "resnet18", "--batch-size", 1))
    assert (
        "--model torchvision:resnet18: BatchNorm needs more than 1 sample per rank in training: "
        "raise --batch-size"
    ) in line, line


def test_squeezenets_convolution_head_says_only_linear_heads_are_re_initialised(folder, tmp_path):
    torch.save(torchvision.models.squeezenet1_1().state_dict(), tmp_path / "squeezenet.pth")
    line = one_line_error(train(folder, "squeezenet1_1", "--init-from",
                                tmp_path / "squeezenet.pth"))  # fmt: skip
    assert "classifier.1.weight is (1000, 512, 1, 1) in the file, (3, 512, 1, 1)" in line, line
    assert "classifier.1 is a Conv2d: only a final nn.Linear of another class count" in line


def test_the_fine_tune_example_without_network_is_one_line(tmp_path):
    """examples/finetune_resnet18.py on a compute node without network: torchvision's download
    fails (here: every HTTPS request goes to a closed port), and the example says what to do in
    one line, exit 2, no traceback and no .pth written."""
    env = {**mpi_env(), "HOME": str(tmp_path), "https_proxy": "http://127.0.0.1:9",
           "HTTPS_PROXY": "http://127.0.0.1:9"}  # fmt: skip
    env.pop("TORCH_HOME", None)
    env.pop("XDG_CACHE_HOME", None)
    out = tmp_path / "r18.pth"
    example = Path(__file__).resolve().parents[1] / "examples" / "finetune_resnet18.py"
    done = subprocess.run([sys.executable, str(example), str(out)], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    line = one_line_error(done)
    assert "could not download" in line and "--random" in line and "copy" in line, line
    assert not out.exists()
