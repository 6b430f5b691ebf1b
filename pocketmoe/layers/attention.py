"""Multi-head latent attention (DeepSeek MLA) over a cache of compressed latents.

The cache holds, per token, c_kv (normed, C values) and the roped k_pe (R values). Two weight layouts:
absorbed (attn_k_b / attn_v_b: attention runs in latent space as llama.cpp does) and legacy
(attn_kv_b: per-head k_nope / v are expanded from the cached latents each call).

Legend: T query tokens, S cached tokens (incl. these), D hidden, H heads, N qk_nope dims,
R rope dims, V v_head dims, C kv_lora_rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pocketmoe.layers.linear import QuantLinear
from pocketmoe.layers.norm import RMSNorm
from pocketmoe.layers.rotary import rope_pairs


class LatentCache(Protocol):
    def update(self, layer: int, start: int, latent: torch.Tensor) -> torch.Tensor:
        """Store latent [T, C+R] at positions start.. and return all of [0, start+T) as [S, C+R]."""
        ...


@dataclass(frozen=True)
class MLAConfig:
    n_head: int
    qk_nope: int
    qk_rope: int
    v_head: int
    kv_lora: int
    scale: float  # softmax scale: mscale^2 / sqrt(qk_nope + qk_rope)


def causal_mask(t: int, start: int) -> torch.Tensor | None:
    """[T, S] additive mask: query t (at position start+t) sees keys 0..start+t."""
    if t == 1:
        return None
    s = torch.arange(start + t)
    q = torch.arange(t)[:, None] + start
    return torch.zeros(t, start + t).masked_fill_(s[None, :] > q, float("-inf"))


class MLAttention:
    def __init__(self, cfg: MLAConfig, *, wkv_a: QuantLinear, kv_a_norm: RMSNorm, wo: QuantLinear,
                 wq: QuantLinear | None = None, wq_a: QuantLinear | None = None,
                 q_a_norm: RMSNorm | None = None, wq_b: QuantLinear | None = None,
                 k_b: QuantLinear | None = None, v_b: QuantLinear | None = None,
                 wkv_b: QuantLinear | None = None) -> None:
        if (wq is None) == (wq_b is None):
            raise ValueError("MLA needs either wq or the q LoRA pair wq_a/wq_b")
        if (k_b is None) == (wkv_b is None):
            raise ValueError("MLA needs either k_b/v_b (absorbed) or wkv_b (legacy)")
        self.cfg = cfg
        self.wq, self.wq_a, self.q_a_norm, self.wq_b = wq, wq_a, q_a_norm, wq_b
        self.wkv_a, self.kv_a_norm, self.wo = wkv_a, kv_a_norm, wo
        self.k_b, self.v_b, self.wkv_b = k_b, v_b, wkv_b  # k_b [H, C, N], v_b [H, V, C], wkv_b [H*(N+V), C]

    @property
    def absorbed(self) -> bool:
        return self.k_b is not None

    def query(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, D] -> [T, H, N+R]
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_a_norm(self.wq_a(x)))
        return q.view(x.shape[0], self.cfg.n_head, -1)

    def latent(self, x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> cache rows [T, C+R]: normed c_kv, then roped k_pe."""
        c_kv, k_pe = self.wkv_a(x).split([self.cfg.kv_lora, self.cfg.qk_rope], dim=-1)
        return torch.cat([self.kv_a_norm(c_kv), rope_pairs(k_pe, cos2, sin2)], dim=-1)

    def __call__(self, x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor,
                 cache: LatentCache | None, layer: int, start: int) -> torch.Tensor:
        """x [T, D], cos2/sin2 [T, R] (Rotary.span) for positions start.. -> [T, D]."""
        c = self.cfg
        t = x.shape[0]
        q_nope, q_pe = self.query(x).split([c.qk_nope, c.qk_rope], dim=-1)
        q_pe = rope_pairs(q_pe, cos2[:, None], sin2[:, None])
        lat = self.latent(x, cos2, sin2)
        if cache is not None:
            lat = cache.update(layer, start, lat)
        elif start != 0:
            raise ValueError("attention without a cache must start at position 0")
        q_nope, q_pe = q_nope.transpose(0, 1), q_pe.transpose(0, 1)  # [H, T, *]
        mask = causal_mask(t, start)
        if self.absorbed:
            qa = self.k_b.batched(q_nope.contiguous())  # [H, T, C]
            # one GEMM against whole cache rows: [c_kv, k_pe] . [qa, q_pe] = qa.c_kv + q_pe.k_pe
            scores = torch.cat([qa, q_pe], dim=-1).view(c.n_head * t, -1) @ lat.t()  # [H*T, S]
            probs = self._softmax(scores.view(c.n_head, t, -1), mask)
            o_lat = probs.view(c.n_head * t, -1) @ lat[:, :c.kv_lora]  # [H*T, C]
            o = self.v_b.batched(o_lat.view(c.n_head, t, -1))  # [H, T, V]
        else:
            c_all, kpe_all = lat.split([c.kv_lora, c.qk_rope], dim=-1)  # [S, C], [S, R]
            kv = self.wkv_b(c_all).view(-1, c.n_head, c.qk_nope + c.v_head)  # [S, H, N+V]
            k_nope, v = kv.permute(1, 0, 2).split([c.qk_nope, c.v_head], dim=-1)  # [H, S, *]
            scores = q_nope @ k_nope.transpose(1, 2) + q_pe @ kpe_all.t()  # [H, T, S]
            o = self._softmax(scores, mask) @ v  # [H, T, V]
        return self.wo(o.transpose(0, 1).reshape(t, c.n_head * c.v_head))

    def _softmax(self, scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        scores = scores * self.cfg.scale
        if mask is not None:
            scores = scores + mask
        return scores.softmax(-1)
