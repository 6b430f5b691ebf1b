"""Microscaling FP4 types: MXFP4 (E8M0 scale per 32) and NVFP4 (UE4M3 scale per 16), E2M1 values."""

from __future__ import annotations

import torch

from pocketmoe.quant.bits import nibbles, pow2
from pocketmoe.quant.formats import GGMLType, register
from pocketmoe.quant.tables import lookup, tables


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent byte -> 2**(e - 128) as float32 (half the scale: the E2M1 table is doubled)."""
    e = e.int()
    return torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32)


def ue4m3_half(x: torch.Tensor) -> torch.Tensor:
    """Unsigned E4M3 scale byte -> half its value as float32; 0x00 and 0x7F (NaN) read as 0."""
    x = x.int()
    exp, man = (x >> 3) & 0x0F, (x & 7).float()
    value = torch.where(exp == 0, man * 2.0**-9, (1 + man / 8) * pow2(exp - 7))
    return torch.where((x == 0) | (x == 0x7F), 0.0, value * 0.5)


@register(GGMLType.MXFP4, 32, 17)
def mxfp4(b: torch.Tensor) -> torch.Tensor:
    return lookup(tables(b.device).e2m1, nibbles(b[:, 1:17])).mul_(e8m0_half(b[:, 0:1]))


@register(GGMLType.NVFP4, 64, 36)
def nvfp4(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = ue4m3_half(b[:, 0:4]).unsqueeze(-1)  # [n, 4, 1], one scale per 16 values
    v = lookup(tables(b.device).e2m1, nibbles(b[:, 4:36].reshape(n, 4, 8)))  # [n, 4, 16]
    return v.mul_(d).reshape(n, 64)
