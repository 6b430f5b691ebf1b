"""K-quants: 256-value super-blocks with packed sub-block scales (ggml-common.h layouts)."""

from __future__ import annotations

import torch

from pocketmoe.quant.bits import f16, f32, fields, nibbles
from pocketmoe.quant.formats import GGMLType, register


def scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K scales[12] -> (scale, min), each uint8 [n, 8] of 6-bit values."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


@register(GGMLType.Q2_K, 256, 84)
def q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc = b[:, 0:16]
    dl = (f16(b, 80) * (sc & 0x0F).float()).unsqueeze(-1)  # [n, 16, 1]
    ml = (f16(b, 82) * (sc >> 4).float()).unsqueeze(-1)
    q = fields(b[:, 16:80].reshape(n, 2, 32), 2).reshape(n, 16, 16).float()
    return q.mul_(dl).sub_(ml).reshape(n, 256)


@register(GGMLType.Q3_K, 256, 110)
def q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    s = b[:, 96:108]
    low = nibbles(s[:, 0:8])  # [n, 16]
    high = fields(s[:, 8:12], 2).reshape(n, 16)
    sc = ((low | (high << 4)).int() - 32).float()
    dl = (f16(b, 108) * sc).unsqueeze(-1)
    ql = fields(b[:, 32:96].reshape(n, 2, 32), 2).reshape(n, 16, 16)
    hm = fields(b[:, 0:32], 1).reshape(n, 16, 16)  # bit j of hmask[i] -> value 32j + i
    q = (ql.view(torch.int8) - ((hm ^ 1) << 2).view(torch.int8)).float()  # a clear hmask bit: -4
    return q.mul_(dl).reshape(n, 256)


def _k4_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sc, mn = scale_min_k4(b[:, 4:16])
    d = (f16(b, 0) * sc.float()).unsqueeze(-1)  # [n, 8, 1]
    dm = (f16(b, 2) * mn.float()).unsqueeze(-1)
    return d, dm


@register(GGMLType.Q4_K, 256, 144)
def q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dm = _k4_scales(b)
    q = nibbles(b[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32).float()
    return q.mul_(d).sub_(dm).reshape(n, 256)


@register(GGMLType.Q5_K, 256, 176)
def q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dm = _k4_scales(b)
    ql = nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    qh = fields(b[:, 16:48], 1)  # [n, 8, 32]: bit j of qh[i] -> sub-block j
    q = (ql | (qh << 4)).float()
    return q.mul_(d).sub_(dm).reshape(n, 256)


@register(GGMLType.Q6_K, 256, 210)
def q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = (f16(b, 208) * b[:, 192:208].view(torch.int8).float()).unsqueeze(-1)  # [n, 16, 1]
    ql = nibbles(b[:, 0:128].reshape(n, 2, 64))  # [n, 2, 128]
    qh = fields(b[:, 128:192].reshape(n, 2, 32), 2).reshape(n, 2, 128)
    q = ((ql | (qh << 4)).view(torch.int8) - 32).float().reshape(n, 16, 16)
    return q.mul_(d).reshape(n, 256)


@register(GGMLType.Q8_K, 256, 292)
def q8_k(b: torch.Tensor) -> torch.Tensor:
    # f32 d, int8 qs[256], int16 bsums[16] (the sums are redundant for dequantizing)
    return b[:, 4:260].view(torch.int8).float().mul_(f32(b, 0))
