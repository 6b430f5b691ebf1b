"""Multi-head latent attention (DeepSeek MLA) over a paged cache of compressed latents.

The cache holds, per token, c_kv (normed, C values) and the roped k_pe (R values). Two weight layouts:
absorbed (attn_k_b / attn_v_b: attention runs in latent space as llama.cpp does) and legacy
(attn_kv_b: per-head k_nope / v are expanded from the cached latents). Backends that only run the
absorbed form (`ops.absorbs_legacy_mla`) get k_b / v_b split from attn_kv_b at load.

Legend: T query tokens, D hidden, H heads, N qk_nope dims, R rope dims, V v_head dims, C kv_lora_rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pocketmoe.layers.linear import F32, QuantLinear, float_weight
from pocketmoe.layers.norm import Residual

if TYPE_CHECKING:
    from pocketmoe.engine.step import StepContext


@dataclass(frozen=True)
class MLAConfig:
    n_head: int
    qk_nope: int
    qk_rope: int
    v_head: int
    kv_lora: int
    scale: float  # softmax scale: mscale^2 / sqrt(qk_nope + qk_rope)


class MLAttention:
    """Weights of one MLA layer and its forward pass over the ops."""

    def __init__(self, cfg: MLAConfig, ops: Any, *, wkv_a: QuantLinear, kv_a_norm: torch.Tensor, eps: float,
                 wo: QuantLinear, wq: QuantLinear | None = None, wq_a: QuantLinear | None = None,
                 q_a_norm: torch.Tensor | None = None, wq_b: QuantLinear | None = None,
                 k_b: QuantLinear | None = None, v_b: QuantLinear | None = None,
                 wkv_b: QuantLinear | None = None) -> None:
        if (wq is None) == (wq_b is None):
            raise ValueError("MLA needs either wq or the q LoRA pair wq_a/wq_b")
        if (k_b is None) == (wkv_b is None):
            raise ValueError("MLA needs either k_b/v_b (absorbed) or wkv_b (legacy)")
        self.cfg, self.ops, self.eps = cfg, ops, float(eps)
        self.wq, self.wq_a, self.q_a_norm, self.wq_b = wq, wq_a, q_a_norm, wq_b
        self.wkv_a, self.kv_a_norm, self.wo = wkv_a, kv_a_norm, wo
        self.k_b, self.v_b, self.wkv_b = k_b, v_b, wkv_b  # k_b [H, C, N], v_b [H, V, C], wkv_b [H*(N+V), C]
        self.native: object = None  # what a native backend precomputed for this layer (its shape)
        self.native_sublayer: object = None  # and the whole sublayer, or False when it cannot run it
        if wkv_b is not None and ops.absorbs_legacy_mla:
            self.k_b, self.v_b = absorbed_from_kv_b(wkv_b, cfg)
            self.wkv_b = None

    @property
    def absorbed(self) -> bool:
        return self.k_b is not None

    def __call__(self, x: torch.Tensor, ctx: StepContext, layer: int, residual: Residual) -> torch.Tensor | None:
        """x [T, D] (normed) -> residual.x += attention(x); the next sublayer's input (ops.mla_sublayer)."""
        return self.ops.mla_sublayer(self, x, ctx, layer, residual)

    def project_q_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> q [T, H*(N+R)] (directly or through the q LoRA pair), kv [T, C+R] (kv_a)."""
        ops = self.ops
        if self.wq is not None:
            q, kv = ops.linear_multi((self.wq, self.wkv_a), x)
            return q, kv
        qa, kv = ops.linear_multi((self.wq_a, self.wkv_a), x)
        return ops.linear(self.wq_b, ops.rms_norm(qa, self.q_a_norm, self.eps)), kv


def absorbed_from_kv_b(wkv_b: QuantLinear, c: MLAConfig) -> tuple[QuantLinear, QuantLinear]:
    """Legacy attn_kv_b [H*(N+V), C] -> k_b [H, C, N] and v_b [H, V, C] as float32 weights.

    Per head, kv_b's first N rows map c_kv to k_nope and the next V rows to v; the absorbed form needs
    k_b transposed, which quantized blocks cannot be without requantizing, hence float32 (V2-Lite: 216 MiB).
    """
    kv = float_weight(wkv_b.raw, wkv_b.ggml_type, wkv_b.shape).reshape(c.n_head, c.qk_nope + c.v_head, c.kv_lora)
    k_b = kv[:, :c.qk_nope, :].transpose(1, 2).contiguous()  # [H, C, N]
    v_b = kv[:, c.qk_nope:, :].contiguous()                    # [H, V, C]
    return (QuantLinear(k_b.view(torch.uint8).view(c.n_head, c.kv_lora, -1), F32, (c.n_head, c.kv_lora, c.qk_nope),
                        backend=wkv_b.backend, name=wkv_b.name + " (k_b)"),
            QuantLinear(v_b.view(torch.uint8).view(c.n_head, c.v_head, -1), F32, (c.n_head, c.v_head, c.kv_lora),
                        backend=wkv_b.backend, name=wkv_b.name + " (v_b)"))
