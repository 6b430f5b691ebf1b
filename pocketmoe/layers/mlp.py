"""SwiGLU feed-forward (dense FFN and shared experts): down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pocketmoe.layers.linear import QuantLinear


class GatedMLP:
    def __init__(self, gate: QuantLinear, up: QuantLinear, down: QuantLinear) -> None:
        self.gate, self.up, self.down = gate, up, down

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, D] -> [T, D]
        return self.down(F.silu(self.gate(x)) * self.up(x))
