"""DeepSeek-V4's MoE FFN: sqrt(softplus) gating, expert ids from a token hash table (the first layers) or the
top-k of the biased scores, weights renormalised and scaled; a SwiGLU clamp on routed and shared experts.

llama.cpp clamps the shared expert too (swiglu_clamp_shexp, build_ffn), the DeepSeek reference does not
(SPECS.md 3.5): we follow llama.cpp. The clamp: silu(min(gate, L)) * clamp(up, -L, L). The math is
ops.dsv4_moe.

Legend: T tokens, D hidden, E experts, K experts per token, F expert FFN width.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from pocketmoe.layers.experts import ExpertBank
from pocketmoe.layers.linear import QuantLinear

if TYPE_CHECKING:
    from pocketmoe.layers.mlp import GatedMLP

CLAMP_MIN = 1e-6  # llama.cpp: a limit at or below this is no clamp


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit); plain SwiGLU when limit <= CLAMP_MIN."""
    if limit > CLAMP_MIN:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate.double()).float() * up  # float64: the same for a row whatever the tensor's size


class DSV4MoE:
    """Router weights, the expert bank, the shared experts; `tid2eid` [V, K] for a hash-routed layer, else the
    selection `bias` [E]."""

    def __init__(self, ops: Any, gate: QuantLinear, experts: ExpertBank, shared: GatedMLP | None, *, top_k: int,
                 norm: bool, scale: float, shared_limit: float, tid2eid: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> None:
        if (tid2eid is None) == (bias is None):
            raise ValueError("a DeepSeek-V4 MoE layer routes by its tid2eid table or by its biased top-k, not both")
        self.ops, self.gate, self.experts, self.shared = ops, gate, experts, shared
        self.top_k, self.norm, self.scale, self.shared_limit = top_k, norm, float(scale), float(shared_limit)
        self.tid2eid, self.bias = tid2eid, bias
        self.native: Any = None  # the backend's handle of the whole sublayer, made at first use

    def __call__(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """x [T, D] (normed), tokens [T] -> routed + shared [T, D]."""
        return self.ops.dsv4_moe(self, x, tokens)
