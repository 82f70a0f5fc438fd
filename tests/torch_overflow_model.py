"""A test-only torch model whose gradients overflow on one rank at chosen steps
(`--model tests/torch_overflow_model.py:overflows_on_rank_1`), for --precision fp16's rule:
every rank skips a step when any rank's gradients overflowed.

HPCDL_TORCH_OVERFLOW_STEPS=2,5: on rank 1 (OMPI_COMM_WORLD_RANK), those backwards (counted from
1: the steps; hpcdl's start-up probe runs a training forward but no backward) turn the gradients
into inf; the loss stays finite.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn


class _Blowup(torch.autograd.Function):
    """The identity forward; its backward counts the model's backwards and multiplies the
    gradient by inf at the chosen ones."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, model: OverflowingMLP) -> torch.Tensor:
        ctx.model = model
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        model = ctx.model
        model.backwards += 1
        if model.rank == 1 and model.backwards in model.steps:
            return grad * float("inf"), None
        return grad, None


class OverflowingMLP(nn.Module):
    def __init__(self, features: int, num_classes: int) -> None:
        super().__init__()
        self.hidden = nn.Linear(features, 32)
        self.head = nn.Linear(32, num_classes)
        self.backwards = 0
        steps = os.environ.get("HPCDL_TORCH_OVERFLOW_STEPS", "")
        self.steps = {int(s) for s in steps.split(",") if s}
        self.rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.head(torch.relu(self.hidden(torch.flatten(x, 1))))
        return _Blowup.apply(y, self) if self.training else y


def overflows_on_rank_1(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    c, h, w = input_shape
    return OverflowingMLP(c * h * w, num_classes)
