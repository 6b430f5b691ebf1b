"""Ternary types TQ1_0 (base-3 packed trits) and TQ2_0 (2-bit trits): values d * {-1, 0, 1}."""

from __future__ import annotations

import torch

from pocketmoe.quant.bits import f16, fields
from pocketmoe.quant.formats import GGMLType, register


def _trits(x: torch.Tensor, digits: int) -> torch.Tensor:
    """Bytes [n, k] holding `digits` base-3 digits each -> digits 0..2 as [n, digits * k], digit-major.

    A byte is the fixed-point fraction 256 * v / 243; digit j is the integer part of 3 * (byte * 3**j mod 256) / 256.
    """
    x = x.int()
    return torch.cat([((((x * 3**j) & 0xFF) * 3) >> 8) for j in range(digits)], dim=-1)


@register(GGMLType.TQ1_0, 256, 54)
def tq1_0(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    parts = [
        _trits(b[:, 0:32].reshape(n, 1, 32), 5),
        _trits(b[:, 32:48].reshape(n, 1, 16), 5),
        _trits(b[:, 48:52].reshape(n, 1, 4), 4),
    ]
    q = torch.cat([p.reshape(n, p.shape[-1]) for p in parts], dim=-1)
    return (q - 1).float().mul_(f16(b, 52))


@register(GGMLType.TQ2_0, 256, 66)
def tq2_0(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    q = fields(b[:, 0:64].reshape(n, 2, 32), 2).reshape(n, 256)
    return (q.view(torch.int8) - 1).float().mul_(f16(b, 64))
