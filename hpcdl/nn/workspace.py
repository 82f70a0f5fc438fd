"""Workspaces: scratch arrays a layer keeps while their shape, dtype and backend hold.

Large arrays freed every step would be unmapped and page-faulted back in each time on the host,
and on a GPU each fresh one is an allocation from CuPy's pool and a kernel-visible address that
changes (which a captured CUDA graph cannot follow). So a layer asks for its scratch by name:
the same array comes back until the shape, dtype or array module changes. One home for what
Conv2d's im2col matrices, BatchNorm's centred input and its ones vector, and the fast kernels'
buffers (hpcdl.nn.kernels) need.
"""

from __future__ import annotations

import math
from typing import Any

from hpcdl.backend import array_module


class Workspaces:
    """Named scratch arrays, reallocated only when the shape, dtype or backend changes."""

    def __init__(self) -> None:
        self._arrays: dict[str, Any] = {}
        self._held: dict[str, Any] = {}  # arrays a caller owns, kept by reference (hold)

    def get(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: Any,
        xp: Any,
        zeroed: bool = False,
        fill: Any = None,
    ) -> Any:
        """The array `name` of this shape and dtype on xp. zeroed/fill initialise it when it is
        (re)allocated only: callers that rely on the contents keep them as they need."""
        buf = self._arrays.get(name)
        if buf is None or buf.shape != shape or buf.dtype != dtype or array_module(buf) is not xp:
            buf = xp.zeros(shape, dtype=dtype) if zeroed else xp.empty(shape, dtype=dtype)
            if fill is not None:
                buf.fill(fill)
            self._arrays[name] = buf
        return buf

    def at_least(self, name: str, shape: tuple[int, ...], dtype: Any, xp: Any) -> Any:
        """An array of `shape` cut from a flat buffer that only grows, so smaller requests
        (a batch's last, short chunk) reuse the largest one asked for."""
        size = math.prod(shape)
        buf = self._arrays.get(name)
        if buf is None or buf.size < size or buf.dtype != dtype or array_module(buf) is not xp:
            buf = self._arrays[name] = xp.empty(size, dtype=dtype)
        return buf[:size].reshape(shape)

    def last(self, name: str) -> Any:
        """The array last handed out under `name`, or None."""
        return self._arrays.get(name)

    def hold(self, name: str, array: Any) -> Any:
        """Keep `array` (not a copy) under `name` until the next hold of that name: what a
        forward keeps for its backward, such as an input its caller does not change in
        between. get() never hands it out."""
        self._held[name] = array
        return array

    def held(self, name: str) -> Any:
        """The array last held under `name`, or None."""
        return self._held.get(name)
