"""IQ types: lattice-grid codebooks (IQ1/IQ2/IQ3) and non-linear 4-bit levels (IQ4)."""

from __future__ import annotations

import torch

from pocketmoe.quant.bits import f16, half_from_bits, i32, nibbles, u16, unpack
from pocketmoe.quant.formats import GGMLType, register
from pocketmoe.quant.tables import lookup, tables

_DELTA = 0.125  # IQ1 grid offset


def _ksigns(words: torch.Tensor, t_signs: torch.Tensor) -> torch.Tensor:
    """int32 [..., g] words holding four 7-bit sign indices -> +-1 [..., g, 4, 8]."""
    idx = torch.stack([(words >> s) & 0x7F for s in (0, 7, 14, 21)], dim=-1)
    return lookup(t_signs, idx)


def _bit_signs(x: torch.Tensor) -> torch.Tensor:
    """uint8 [n, k] sign bits -> +-1 float [n, 8k] (a set bit is negative)."""
    return unpack(x, 1).float().mul_(-2).add_(1)


@register(GGMLType.IQ2_XXS, 256, 66)
def iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    n, t = b.shape[0], tables(b.device)
    aux = i32(b, 2, 16).reshape(n, 8, 2)[..., 1]  # per 32 values: 4x7 sign bits, 4-bit scale
    db = (f16(b, 0) * (0.5 + ((aux >> 28) & 0x0F).float()) * 0.25).reshape(n, 8, 1, 1)
    grid = lookup(t.iq2xxs, b[:, 2:66].reshape(n, 8, 8)[..., :4])  # [n, 8, 4, 8]
    return grid.mul_(db).mul_(_ksigns(aux, t.ksigns)).reshape(n, 256)


def _iq2_scales(b: torch.Tensor, off: int) -> torch.Tensor:
    """Eight bytes of 4-bit scales -> d * (0.5 + s) / 4 as [n, 16, 1, 1] (one per 16 values)."""
    s = unpack(b[:, off : off + 8], 4).float()
    return (f16(b, 0) * (0.5 + s) * 0.25).reshape(-1, 16, 1, 1)


@register(GGMLType.IQ2_XS, 256, 74)
def iq2_xs(b: torch.Tensor) -> torch.Tensor:
    n, t = b.shape[0], tables(b.device)
    q = u16(b, 2, 32)  # 9-bit grid index, 7-bit sign index
    grid = lookup(t.iq2xs, q & 0x1FF).reshape(n, 16, 2, 8)
    signs = lookup(t.ksigns, q >> 9).reshape(n, 16, 2, 8)
    return grid.mul_(_iq2_scales(b, 66)).mul_(signs).reshape(n, 256)


@register(GGMLType.IQ2_S, 256, 82)
def iq2_s(b: torch.Tensor) -> torch.Tensor:
    n, t = b.shape[0], tables(b.device)
    idx = b[:, 2:34].int() | (unpack(b[:, 66:74], 2).int() << 8)
    grid = lookup(t.iq2s, idx).reshape(n, 16, 2, 8)
    signs = _bit_signs(b[:, 34:66]).reshape(n, 16, 2, 8)
    return grid.mul_(_iq2_scales(b, 74)).mul_(signs).reshape(n, 256)


@register(GGMLType.IQ3_XXS, 256, 98)
def iq3_xxs(b: torch.Tensor) -> torch.Tensor:
    n, t = b.shape[0], tables(b.device)
    aux = i32(b, 66, 8)  # per 32 values: 4x7 sign bits, 4-bit scale
    db = (f16(b, 0) * (0.5 + ((aux >> 28) & 0x0F).float()) * 0.5).reshape(n, 8, 1, 1)
    grid = lookup(t.iq3xxs, b[:, 2:66]).reshape(n, 8, 4, 8)
    return grid.mul_(db).mul_(_ksigns(aux, t.ksigns)).reshape(n, 256)


@register(GGMLType.IQ3_S, 256, 110)
def iq3_s(b: torch.Tensor) -> torch.Tensor:
    n, t = b.shape[0], tables(b.device)
    db = (f16(b, 0) * (1 + 2 * unpack(b[:, 106:110], 4).float())).reshape(n, 8, 1, 1)
    idx = b[:, 2:66].int() | (unpack(b[:, 66:74], 1).int() << 8)
    grid = lookup(t.iq3s, idx).reshape(n, 8, 4, 8)
    signs = _bit_signs(b[:, 74:106]).reshape(n, 8, 4, 8)
    return grid.mul_(db).mul_(signs).reshape(n, 256)


def _iq1_grid(qs: torch.Tensor, high: torch.Tensor, t_grid: torch.Tensor) -> torch.Tensor:
    """8-bit low and 3-bit high index parts -> grid rows [n, 32, 8] in {-1, 0, 1}."""
    return lookup(t_grid, qs.int() | ((high & 7) << 8))


@register(GGMLType.IQ1_S, 256, 50)
def iq1_s(b: torch.Tensor) -> torch.Tensor:
    n, t = b.shape[0], tables(b.device)
    qh = u16(b, 34, 8)  # per 32 values: 4x3 index bits, 3-bit scale, delta sign
    dl = (f16(b, 0) * (2 * ((qh >> 12) & 7) + 1).float()).reshape(n, 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, _DELTA, -_DELTA).reshape(n, 8, 1, 1)
    high = torch.stack([qh >> s for s in (0, 3, 6, 9)], dim=-1).reshape(n, 32)
    grid = _iq1_grid(b[:, 2:34], high, t.iq1s).reshape(n, 8, 4, 8)
    return grid.add_(delta).mul_(dl).reshape(n, 256)


@register(GGMLType.IQ1_M, 256, 56)
def iq1_m(b: torch.Tensor) -> torch.Tensor:
    n, t = b.shape[0], tables(b.device)
    sc = u16(b, 48, 4)  # 4x3-bit scales each; the fp16 d is spread over the four top nibbles
    bits = (
        (sc[:, 0:1] >> 12) | ((sc[:, 1:2] >> 8) & 0xF0) | ((sc[:, 2:3] >> 4) & 0xF00) | (sc[:, 3:4] & 0xF000)
    )
    s = torch.stack([(sc >> k) & 7 for k in (0, 3, 6, 9)], dim=-1).reshape(n, 16)
    dl = (half_from_bits(bits) * (2 * s + 1).float()).reshape(n, 8, 2, 1, 1)
    qh = unpack(b[:, 32:48], 4).int()  # per 8 values: 3 index bits, delta sign
    delta = torch.where((qh & 8) == 0, _DELTA, -_DELTA).reshape(n, 8, 2, 2, 1)
    grid = _iq1_grid(b[:, 0:32], qh, t.iq1s).reshape(n, 8, 2, 2, 8)
    return grid.add_(delta).mul_(dl).reshape(n, 256)


@register(GGMLType.IQ4_NL, 32, 18)
def iq4_nl(b: torch.Tensor) -> torch.Tensor:
    return lookup(tables(b.device).iq4nl, nibbles(b[:, 2:18])).mul_(f16(b, 0))


@register(GGMLType.IQ4_XS, 256, 136)
def iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sh = u16(b, 2, 1)
    high = torch.cat([(sh >> (2 * i)) & 3 for i in range(8)], dim=-1)
    sc = (unpack(b[:, 4:8], 4).int() | (high << 4)) - 32
    dl = (f16(b, 0) * sc.float()).unsqueeze(-1)  # [n, 8, 1]
    q = nibbles(b[:, 8:136].reshape(n, 8, 16))  # [n, 8, 32]
    return lookup(tables(b.device).iq4nl, q).mul_(dl).reshape(n, 256)
