"""Test-only torch models for hpcdl.train's torch engine (`--model tests/torch_models.py:FN`).

- small_cnn: convolution, BatchNorm, dropout and a linear head: every kind of state the engine
  keeps (parameters, float and integer buffers, the dropout generator).
- HPCDL_TORCH_DIGESTS=DIR: every inference forward (the zero-sample check at start-up, each
  validation batch) appends a digest of the module's parameters and buffers to DIR/rank-R.txt
  (R: OMPI_COMM_WORLD_RANK), so the last line is what the rank finished with.
- HPCDL_TORCH_SLOW=SECONDS[:CKPT_DIR]: every training forward sleeps SECONDS, so a test can
  signal or kill a run while it trains (no effect on what it computes). With CKPT_DIR, only a
  module built while CKPT_DIR held no checkpoint sleeps: the survivors of a killed rank rebuild
  it from the checkpoint they resume (--on-node-loss continue) and train on at full speed.
- not_a_model: returns a string, which is neither kind of model.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import torch
from torch import nn

from hpcdl import checkpoint


class SmallCNN(nn.Module):
    def __init__(self, channels: int, num_classes: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.dropout = nn.Dropout(0.2)
        self.head = nn.Linear(8 * 4 * 4, num_classes)
        self.sleep_s = slow_seconds()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            self.record()
        elif self.sleep_s:
            time.sleep(self.sleep_s)
        y = nn.functional.adaptive_avg_pool2d(torch.relu(self.norm(self.conv(x))), 4)
        return self.head(self.dropout(torch.flatten(y, 1)))

    def record(self) -> None:
        where = os.environ.get("HPCDL_TORCH_DIGESTS")
        if not where:
            return
        h = hashlib.sha256()
        for tensor in self.state_dict().values():
            h.update(tensor.detach().contiguous().numpy().tobytes())
        rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
        with open(Path(where) / f"rank-{rank}.txt", "a") as f:
            f.write(h.hexdigest() + "\n")


def slow_seconds() -> float:
    """The sleep of each training forward that HPCDL_TORCH_SLOW asks of a module built now."""
    seconds, _, ckpt_dir = os.environ.get("HPCDL_TORCH_SLOW", "").partition(":")
    if not seconds or (ckpt_dir and checkpoint.list_checkpoints(ckpt_dir)):
        return 0.0
    return float(seconds)


def small_cnn(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    return SmallCNN(input_shape[0], num_classes)


def not_a_model(input_shape: tuple[int, int, int], num_classes: int) -> str:
    return "a string"
