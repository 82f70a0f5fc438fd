"""examples/torch_ddp.py --save FILE refuses a FILE that exists, before training, in one line
with exit status 2 (as examples/finetune_resnet18.py and hpcdl.export do), and leaves it as it
was; a new FILE is still written (tests/test_torch_ddp.py trains and compares it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import one_line_error

from hpcdl.data.convert import write_dataset

pytest.importorskip("torch")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torch_ddp.py"


def test_an_existing_save_file_is_refused_before_training_and_kept(tmp_path):
    x = np.zeros((64, 8, 8, 1), np.uint8)
    write_dataset(tmp_path / "d", {"train": (x, np.arange(64) % 2)}, ["a", "b"])
    mine = tmp_path / "mine.pt"
    mine.write_text("keep\n")
    cmd = [sys.executable, str(EXAMPLE), "--data", str(tmp_path / "d" / "train"), "--epochs",
           "1", "--save", str(mine)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    line = one_line_error(done)
    assert f"--save {mine} exists" in line and "new file name" in line, line
    assert "epoch" not in done.stdout, done.stdout  # refused before training
    assert mine.read_text() == "keep\n"
