"""Legacy 32-value block types (Q4_0 .. Q8_0) and Q1_0; arithmetic order as in ggml."""

from __future__ import annotations

import torch

from pocketmoe.quant.bits import f16, nibbles, unpack
from pocketmoe.quant.formats import GGMLType, declare, register


def _q5(b: torch.Tensor, off: int) -> torch.Tensor:
    """5-bit values: qh[4] at `off`, qs[16] after it -> float32 [n, 32] in 0..31."""
    high = unpack(b[:, off : off + 4], 1)
    return (nibbles(b[:, off + 4 : off + 20]) | (high << 4)).float()


@register(GGMLType.Q4_0, 32, 18)
def q4_0(b: torch.Tensor) -> torch.Tensor:
    return nibbles(b[:, 2:]).float().sub_(8).mul_(f16(b, 0))


@register(GGMLType.Q4_1, 32, 20)
def q4_1(b: torch.Tensor) -> torch.Tensor:
    return nibbles(b[:, 4:]).float().mul_(f16(b, 0)).add_(f16(b, 2))


@register(GGMLType.Q5_0, 32, 22)
def q5_0(b: torch.Tensor) -> torch.Tensor:
    return _q5(b, 2).sub_(16).mul_(f16(b, 0))


@register(GGMLType.Q5_1, 32, 24)
def q5_1(b: torch.Tensor) -> torch.Tensor:
    return _q5(b, 4).mul_(f16(b, 0)).add_(f16(b, 2))


@register(GGMLType.Q8_0, 32, 34)
def q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].view(torch.int8).float().mul_(f16(b, 0))


@register(GGMLType.Q1_0, 128, 18)
def q1_0(b: torch.Tensor) -> torch.Tensor:
    # bit set -> +d, clear -> -d
    return unpack(b[:, 2:], 1).float().mul_(2).sub_(1).mul_(f16(b, 0))


# Q8_1 is an activation-only type (never stored in model files); gguf 0.19 sizes it with f32 d and s.
declare(GGMLType.Q8_1, 32, 40)
