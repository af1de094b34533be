"""Gradient compression for DistributedOptimizer and allreduce: ``Compression.none`` and ``Compression.fp16``."""

from __future__ import annotations

from typing import Any

import torch


class Compressor:
    """Subclass and give static ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)``."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The tensor to communicate and what decompress needs."""
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Undo :meth:`compress`."""
        return tensor


class NoneCompressor(Compressor):
    """Communicate tensors as they are."""


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 and come back in their own dtype."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.to(ctx) if ctx is not None else tensor


class Compression:
    """Horovod's namespace of compressors."""

    none = NoneCompressor
    fp16 = FP16Compressor
