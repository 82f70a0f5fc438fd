"""Fast kernels for MaxPool2d (NOTE [fast kernels] in hpcdl/nn/kernels/__init__.py).

None yet: a pooling kernel (cuDNN's, or a CuPy RawKernel that keeps the arg-max) goes in
KERNELS. Until then MaxPool2d runs its strided-view reference everywhere.
"""

from __future__ import annotations

from typing import Any

KERNELS: list[Any] = []
