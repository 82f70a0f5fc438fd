"""Horovod's gradient compression: Compression.none and Compression.fp16.

fp16 casts floating-point tensors to float16 before the collective and back to their dtype
after it (half the bytes on the wire, float16's precision and range for the sum); other
tensors pass unchanged. DistributedOptimizer applies it to its gradient buckets.
"""

from __future__ import annotations

from typing import Any


class Compressor:
    """compress(tensor) -> (tensor, ctx); decompress(tensor, ctx) -> tensor."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression (the default)."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        import torch  # noqa: PLC0415

        if tensor.dtype.is_floating_point:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        if ctx is not None and ctx.is_floating_point:
            return tensor.to(ctx)
        return tensor


class Compression:
    """The compressors by Horovod's names."""

    none = NoneCompressor
    fp16 = FP16Compressor
