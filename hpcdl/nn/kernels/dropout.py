"""Fast kernels for Dropout (NOTE [fast kernels] in hpcdl/nn/kernels/__init__.py).

Candidates, best first. Where none applies, Dropout draws its mask from a generator seeded per
mask (its reference).
"""

from __future__ import annotations

from typing import Any

KERNELS: list[Any] = []
