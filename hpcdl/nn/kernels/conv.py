"""Fast kernels for Conv2d (NOTE [fast kernels] in hpcdl/nn/kernels/__init__.py).

Candidates, best first. Where none applies, Conv2d runs its own im2col / Winograd code.
"""

from __future__ import annotations

from typing import Any

KERNELS: list[Any] = []
