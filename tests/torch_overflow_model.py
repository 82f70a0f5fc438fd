"""A test-only torch model whose gradients overflow on one rank at chosen steps
(`--model tests/torch_overflow_model.py:overflows_on_rank_1`), for --precision fp16's rule:
every rank skips a step when any rank's gradients overflowed.

HPCDL_TORCH_OVERFLOW_STEPS=2,5: on rank 1 (OMPI_COMM_WORLD_RANK), the backward of those training
forwards (counted from 1) turns the gradients into inf; the loss stays finite.
"""

from __future__ import annotations

import os

import torch
from torch import nn


class _Blowup(torch.autograd.Function):
    """The identity forward; its backward multiplies the gradient by inf."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf")


class OverflowingMLP(nn.Module):
    def __init__(self, features: int, num_classes: int) -> None:
        super().__init__()
        self.hidden = nn.Linear(features, 32)
        self.head = nn.Linear(32, num_classes)
        self.forwards = 0
        steps = os.environ.get("HPCDL_TORCH_OVERFLOW_STEPS", "")
        self.steps = {int(s) for s in steps.split(",") if s}
        self.rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.head(torch.relu(self.hidden(torch.flatten(x, 1))))
        if not self.training:
            return y
        self.forwards += 1
        if self.rank == 1 and self.forwards in self.steps:
            y = _Blowup.apply(y)
        return y


def overflows_on_rank_1(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    c, h, w = input_shape
    return OverflowingMLP(c * h * w, num_classes)
