"""Your own torch.nn.Module trained by hpcdl.train (docs/torch.md, "hpcdl.train with a torch model").

    mpirun -np 2 python -m hpcdl.train --data digits/train --val-data digits/val \\
        --model examples/torch_model.py:small_cnn --epochs 3 --lr 0.05

hpcdl calls small_cnn(input_shape, num_classes) on every rank: input_shape is the (C, H, W) the
loader yields, num_classes the data set's. Rank 0's parameters are broadcast, so every rank
starts from the same weights; torch's generator is seeded from --seed before the call.
"""

from __future__ import annotations

import torch
from torch import nn


class SmallCNN(nn.Module):
    def __init__(self, channels: int, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
        )
        self.dropout = nn.Dropout(0.1)
        self.head = nn.Linear(16 * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(torch.flatten(self.features(x), 1)))


def small_cnn(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    return SmallCNN(input_shape[0], num_classes)
