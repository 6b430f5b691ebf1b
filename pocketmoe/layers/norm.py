"""RMSNorm over the last dimension, in fp32."""

from __future__ import annotations

import torch


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight = weight  # [D] float32
        self.eps = float(eps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., D]
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
