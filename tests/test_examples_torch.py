"""examples/finetune_resnet18.py: the fine-tune from a `.pth` that docs/torch.md shows, run as a
user would (its --random weights: no torchvision here), and examples/torch_ddp.py taking a
builder of an nn.Module as hpcdl.train's --model does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import make_folder, run_train

pytest.importorskip("torch")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_finetune_example_writes_a_pth_that_hpcdl_train_starts_from(tmp_path):
    pth = tmp_path / "resnet18.pth"
    script = [sys.executable, str(EXAMPLES / "finetune_resnet18.py"), str(pth), "--random"]
    done = subprocess.run(script, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    again = subprocess.run(script, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "exists" in again.stderr  # the user's file stays
    make_folder(tmp_path / "train", per_class=4, size=(16, 16))
    done = run_train(
        1, "--data", tmp_path / "train", "--model", f"{EXAMPLES}/finetune_resnet18.py:resnet18",
        "--init-from", pth, "--epochs", 1, "--batch-size", 4, "--workers", 0,
        "--progress", "none", timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"weights from {pth}" in done.stdout
    assert "the final layer is re-initialised for 2 classes" in done.stdout


def test_torch_ddp_example_refuses_a_model_it_does_not_know(tmp_path):
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "torch_ddp.py"), "--data", str(tmp_path), "--model", "vgg"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "give resnet, linear or FILE.py:FN" in done.stderr
