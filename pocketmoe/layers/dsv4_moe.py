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

from pocketmoe.layers.experts import ExpertBank, ExpertWeights, per_expert
from pocketmoe.layers.linear import QuantLinear

if TYPE_CHECKING:
    from pocketmoe.layers.mlp import GatedMLP

CLAMP_MIN = 1e-6  # llama.cpp: a limit at or below this is no clamp


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit); plain SwiGLU when limit <= CLAMP_MIN."""
    if limit > CLAMP_MIN:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate.double()).float() * up  # float64: the same for a row whatever the tensor's size


class ClampedExperts:
    """Routed experts with the SwiGLU clamp for banks other than the native host one (which clamps in its fused
    op, NativeExperts.clamped): each expert's GEMMs run by the op backend's linears. Per active expert: its
    tokens' gate and up, the clamped SwiGLU, down; then the slot-order combine. Batch-invariant as the linears are."""

    def __init__(self, gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights, limit: float, ops: Any) -> None:
        self.weights, self.limit, self.ops = (gate, up, down), float(limit), ops
        self._experts: dict[int, tuple[QuantLinear, ...]] = {}

    @property
    def n_experts(self) -> int:
        return self.weights[0].shape[0]

    def expert(self, e: int) -> tuple[QuantLinear, ...]:
        """gate, up, down of expert e as linears over its own blocks (views, made on first use)."""
        if e not in self._experts:
            self._experts[e] = tuple(QuantLinear(w.raw[e], w.ggml_type, w.shape[1:], backend=self.ops,
                                                 name=f"expert {e}") for w in self.weights)
        return self._experts[e]

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:  # x: [n, D] -> [n, D]
        gate, up, down = self.expert(e)
        g, u = self.ops.linear_multi((gate, up), x)
        return self.ops.linear(down, clamped_swiglu(g, u, self.limit))

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return per_expert(x, ids, weights, self.expert_forward)


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

    def __call__(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """x [T, D] (normed), tokens [T] -> routed + shared [T, D]."""
        return self.ops.dsv4_moe(self, x, tokens)
