"""Fused optimizer updates (NOTE [fast kernels] in hpcdl/nn/kernels/__init__.py).

An optimizer kernel has `applies(optimizer, params)` and `step(optimizer, lr)` in place of
forward and backward. None yet: a fused update (one CuPy ElementwiseKernel for SGD's decay,
momentum and step instead of five passes over the flat buffer) goes in KERNELS; until then
hpcdl.nn.optim's vectorised passes run everywhere.
"""

from __future__ import annotations

from typing import Any

KERNELS: list[Any] = []
