"""SwiGLU feed-forward (dense FFN and shared experts): down(silu(gate(x)) * up(x))."""

from __future__ import annotations

from typing import Any

import torch

from pocketmoe.layers.linear import QuantLinear
from pocketmoe.layers.norm import Residual


class GatedMLP:
    def __init__(self, gate: QuantLinear, up: QuantLinear, down: QuantLinear, ops: Any = None) -> None:
        self.gate, self.up, self.down = gate, up, down
        self.ops = ops
        self.native: object = None  # what a native backend precomputed (False: it cannot run this FFN)

    def __call__(self, x: torch.Tensor, residual: Residual) -> torch.Tensor | None:
        """x [T, D] (normed) -> residual.x += ffn(x); the next sublayer's input (ops.ffn_sublayer)."""
        return self.ops.ffn_sublayer(self, x, residual)
