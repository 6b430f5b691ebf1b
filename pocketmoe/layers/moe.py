"""MoE block: route -> ExpertBank (+ shared experts) -> finalize. Router math is fp32.

Legend: T tokens, D hidden, E experts, G expert groups, K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pocketmoe.errors import PocketMoEError
from pocketmoe.layers.experts import ExpertBank
from pocketmoe.layers.linear import QuantLinear
from pocketmoe.layers.mlp import GatedMLP
from pocketmoe.layers.norm import Residual

# The one definition of these; the native route op is handed them (ops/cpu.py).
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
                                 f"({GATING_SOFTMAX} softmax, {GATING_SIGMOID} sigmoid).")
        if not 0 < self.top_k <= self.n_experts:
            raise PocketMoEError(f"experts per token is {self.top_k} but must be in 1..{self.n_experts}.")
        if self.n_groups < 1:
            raise PocketMoEError(f"expert group count is {self.n_groups} but must be >= 1.")
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

    def __init__(self, gate: QuantLinear, cfg: RouterConfig, bias: torch.Tensor | None = None,
                 ops: Any = None) -> None:
        if gate.out_features != cfg.n_experts:
            raise PocketMoEError(f"the router has {gate.out_features} outputs for {cfg.n_experts} experts.")
        self.gate = gate    # weight [E, D]
        self.cfg = cfg
        self.bias = bias    # [E] float32, added for selection only
        self.ops = ops
        self.native: object = None  # what a native backend precomputed

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> weights [T, K] float32, ids [T, K]."""
        return self.ops.route(self, x)


class MoEBlock:
    """The model's view of an MoE FFN: it never learns where the experts live."""

    def __init__(self, router: Router, experts: ExpertBank, shared: GatedMLP | None = None) -> None:
        self.router, self.experts, self.shared = router, experts, shared
        self.native: object = None  # what a native backend precomputed (False: it cannot run this block)

    def __call__(self, x: torch.Tensor, residual: Residual) -> torch.Tensor | None:
        """x [T, D] (normed) -> residual.x += routed(x) + shared(x); the next sublayer's input
        (ops.moe_sublayer: route, the ExpertBank, the shared experts, finalize)."""
        return self.router.ops.moe_sublayer(self, x, residual)
