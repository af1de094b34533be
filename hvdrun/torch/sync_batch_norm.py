"""SyncBatchNorm: batch normalization with statistics over the whole distributed batch.

In training, each rank's per-channel sum, sum of squares and count are allreduced, so every rank
normalizes with the mean and variance of all ranks' samples; backward allreduces the per-channel
sums of the upstream gradient and of its product with the normalized input. Evaluation with
running statistics, and jobs of one rank, use plain batch norm. Unlike Horovod's, it also runs on CPU.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from hvdrun.runtime import context
from hvdrun.torch.ops import Sum, allreduce


def _channel_dims(x: torch.Tensor) -> list[int]:
    return [d for d in range(x.dim()) if d != 1]


def _per_channel(values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return values.reshape([1, -1] + [1] * (x.dim() - 2))


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, eps: float,
                momentum: float) -> torch.Tensor:
        dims, channels = _channel_dims(x), x.shape[1]
        local = torch.cat([x.sum(dims), (x * x).sum(dims), torch.tensor([x.numel() / channels], dtype=x.dtype)])
        total = allreduce(local.double(), op=Sum, name=None)
        count = total[-1]
        mean = total[:channels] / count
        var = total[channels:2 * channels] / count - mean * mean
        if running_mean is not None and running_var is not None:
            running_mean.mul_(1 - momentum).add_(momentum * mean.to(running_mean.dtype))
            running_var.mul_(1 - momentum).add_(momentum * (var * count / max(count.item() - 1, 1)).to(
                running_var.dtype))
        invstd = torch.rsqrt(var + eps).to(x.dtype)
        normalized = (x - _per_channel(mean.to(x.dtype), x)) * _per_channel(invstd, x)
        ctx.save_for_backward(normalized, invstd, weight)
        ctx.count = count.item()
        output = normalized
        if weight is not None:
            output = output * _per_channel(weight, x)
        if bias is not None:
            output = output + _per_channel(bias, x)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        normalized, invstd, weight = ctx.saved_tensors
        dims, channels = _channel_dims(grad), grad.shape[1]
        sum_dy, sum_dy_xhat = grad.sum(dims), (grad * normalized).sum(dims)
        total = allreduce(torch.cat([sum_dy, sum_dy_xhat]).double(), op=Sum, name=None).to(grad.dtype)
        scale = invstd if weight is None else invstd * weight
        grad_input = _per_channel(scale / ctx.count, grad) * (
            ctx.count * grad - _per_channel(total[:channels], grad)
            - normalized * _per_channel(total[channels:], grad))
        grad_weight = sum_dy_xhat if weight is not None else None
        grad_bias = sum_dy if weight is not None else None
        return grad_input, grad_weight, grad_bias, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the whole distributed batch (Horovod's ``hvd.SyncBatchNorm``)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        using_batch_stats = self.training or not self.track_running_stats
        if not using_batch_stats or context.current().world.size == 1:
            return super().forward(input)
        momentum = self.momentum if self.momentum is not None else 0.0
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                momentum = 1.0 / float(self.num_batches_tracked)
        running_mean = self.running_mean if self.training and self.track_running_stats else None
        running_var = self.running_var if self.training and self.track_running_stats else None
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean, running_var, self.eps,
                                            momentum)
