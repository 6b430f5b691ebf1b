"""RMSNorm over the last dimension, in fp32, and the residual update that closes a sublayer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight = weight  # [D] float32
        self.eps = float(eps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., D]
        # one fused op; on CPU fp32 it matched weight * (x * rsqrt(mean(x^2) + eps)) bit for bit (D 48..2048)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


@dataclass(frozen=True, slots=True)
class Residual:
    """How a sublayer closes: x += its output (the residual stream [T, D], in place), then the next
    sublayer's input rms_norm(x) * norm (none when `norm` is None: the last sublayer)."""

    x: torch.Tensor
    norm: torch.Tensor | None
    eps: float
