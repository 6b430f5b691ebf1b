"""MoE block: route -> ExpertBank -> combine (+ shared experts). Router math is fp32.

Legend: T tokens, D hidden, E experts, G expert groups, K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pocketmoe.errors import PocketMoEError
from pocketmoe.layers.experts import ExpertBank
from pocketmoe.layers.linear import QuantLinear
from pocketmoe.layers.mlp import GatedMLP

GATING_SOFTMAX = 1
GATING_SIGMOID = 2
WEIGHT_SUM_MIN = 6.103515625e-5  # smallest normal fp16, as llama.cpp clamps the top-k weight sum


@dataclass(frozen=True)
class RouterConfig:
    n_experts: int
    top_k: int
    gating: int = GATING_SOFTMAX
    n_groups: int = 1
    groups_used: int = 1
    norm: bool = False       # divide the top-k weights by their sum
    scale: float = 1.0       # multiply the weights (skipped when 0 or 1)

    def __post_init__(self) -> None:
        if self.gating not in (GATING_SOFTMAX, GATING_SIGMOID):
            raise PocketMoEError(f"expert gating function {self.gating} is not supported "
                                 f"(1 softmax, 2 sigmoid).")
        if not 0 < self.top_k <= self.n_experts:
            raise PocketMoEError(f"experts per token is {self.top_k} but must be in 1..{self.n_experts}.")
        if self.n_groups > 1:
            per_group = self.n_experts // self.n_groups
            if per_group * self.n_groups != self.n_experts or not 0 < self.groups_used <= self.n_groups:
                raise PocketMoEError(
                    f"{self.n_experts} experts cannot form {self.n_groups} equal groups with "
                    f"{self.groups_used} used.")
            if self.groups_used * per_group < self.top_k:
                raise PocketMoEError(
                    f"{self.groups_used} expert groups of {per_group} hold fewer than the "
                    f"{self.top_k} experts each token needs.")


class Router:
    """probs = gate(x) -> selection (+ bias, group mask) -> top-k ids -> weights = probs[ids] (norm, scale).

    Group score = sum of the top-2 selection scores in the group (llama.cpp `build_moe_ffn`).
    Ids come out in descending selection score: that is the slot order of the combine.
    """

    def __init__(self, gate: QuantLinear, cfg: RouterConfig, bias: torch.Tensor | None = None) -> None:
        self.gate = gate    # weight [E, D]
        self.cfg = cfg
        self.bias = bias    # [E] float32, added for selection only

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> weights [T, K] float32, ids [T, K] int64."""
        c = self.cfg
        logits = self.gate(x.float())  # [T, E]
        probs = logits.softmax(-1) if c.gating == GATING_SOFTMAX else logits.sigmoid()
        select = probs if self.bias is None else probs + self.bias
        if c.n_groups > 1:
            grouped = select.view(-1, c.n_groups, c.n_experts // c.n_groups)  # [T, G, E/G]
            top2 = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [T, G]
            keep = top2.topk(c.groups_used, dim=-1).indices
            mask = torch.zeros_like(top2, dtype=torch.bool).scatter_(1, keep, True)
            select = grouped.masked_fill(~mask[..., None], float("-inf")).view(-1, c.n_experts)
        if select is probs:  # no bias, no group mask: the top-k values are the weights
            weights, ids = probs.topk(c.top_k, dim=-1)  # [T, K], [T, K]
        else:
            ids = select.topk(c.top_k, dim=-1).indices
            weights = probs.gather(1, ids)
        if c.norm:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(WEIGHT_SUM_MIN)
        if c.scale not in (0.0, 1.0):
            weights = weights * c.scale
        return weights, ids


class MoEBlock:
    """The model's view of an MoE FFN: it never learns where the experts live."""

    def __init__(self, router: Router, experts: ExpertBank, shared: GatedMLP | None = None) -> None:
        self.router, self.experts, self.shared = router, experts, shared

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, D] -> [T, D]
        weights, ids = self.router(x)
        y = self.experts(x, ids, weights)
        return y if self.shared is None else y + self.shared(x)
