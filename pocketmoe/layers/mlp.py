"""SwiGLU feed-forward (dense FFN and shared experts): down(silu(gate(x)) * up(x))."""

from __future__ import annotations

from typing import Any

import torch

from pocketmoe.layers.linear import QuantLinear


class GatedMLP:
    def __init__(self, gate: QuantLinear, up: QuantLinear, down: QuantLinear, ops: Any = None) -> None:
        self.gate, self.up, self.down = gate, up, down
        self.ops = ops

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, D] -> [T, D]
        return self.ops.ffn(self, x)
