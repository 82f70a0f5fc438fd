"""Fast kernels for BatchNorm (NOTE [fast kernels] in hpcdl/nn/kernels/__init__.py).

Candidates, best first. Where none applies, BatchNorm runs its own GEMV-sum code.
"""

from __future__ import annotations

from typing import Any

KERNELS: list[Any] = []
