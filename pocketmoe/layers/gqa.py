"""Grouped-query attention (MiniMax-M2 and the like) over a paged cache of per-token K and V.

The cache row of a token holds its roped K of every KV head, then its V: `n_head_kv * (head_dim + v_dim)`
values. Optional RMSNorm over the whole q and k projections (MiniMax-M2's qk_norm), partial rope on the
first `n_rot` dims of each head (NeoX pairs or normal pairs).

Legend: T tokens, D hidden, H query heads, G KV heads, Dh head dims, Dv value dims.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pocketmoe.layers.linear import QuantLinear
from pocketmoe.layers.norm import Residual

if TYPE_CHECKING:
    from pocketmoe.engine.step import StepContext


@dataclass(frozen=True)
class GQAConfig:
    n_head: int
    n_head_kv: int
    head_dim: int
    v_dim: int
    n_rot: int
    neox: bool
    scale: float  # softmax scale, 1/sqrt(head_dim)

    @property
    def kv_width(self) -> int:
        """Cache values per token and layer."""
        return self.n_head_kv * (self.head_dim + self.v_dim)


class GQAttention:
    """Weights of one GQA layer and its forward pass over the ops."""

    def __init__(self, cfg: GQAConfig, ops: Any, *, wq: QuantLinear, wk: QuantLinear, wv: QuantLinear,
                 wo: QuantLinear, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                 eps: float = 1e-6) -> None:
        if cfg.n_head % cfg.n_head_kv:
            raise ValueError(f"{cfg.n_head} query heads are not a multiple of {cfg.n_head_kv} KV heads")
        self.cfg, self.ops, self.eps = cfg, ops, float(eps)
        self.wq, self.wk, self.wv, self.wo, self.q_norm, self.k_norm = wq, wk, wv, wo, q_norm, k_norm
        self.native: object = None  # what a native backend precomputed for this layer (its shape)
        self.native_sublayer: object = None  # and the whole sublayer, or False when it cannot run it

    def __call__(self, x: torch.Tensor, ctx: StepContext, layer: int, residual: Residual) -> torch.Tensor | None:
        """x [T, D] (normed) -> residual.x += attention(x); the next sublayer's input (ops.gqa_sublayer)."""
        return self.ops.gqa_sublayer(self, x, ctx, layer, residual)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> q [T, H*Dh], k [T, G*Dh], v [T, G*Dv], with the q / k norms applied."""
        ops = self.ops
        q, k, v = ops.linear_multi((self.wq, self.wk, self.wv), x)
        if self.q_norm is not None:
            q = ops.rms_norm(q, self.q_norm, self.eps)
        if self.k_norm is not None:
            k = ops.rms_norm(k, self.k_norm, self.eps)
        return q, k, v
