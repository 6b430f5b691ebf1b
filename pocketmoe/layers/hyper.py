"""Manifold-constrained hyper-connections (DeepSeek-V4's mHC): the residual is `n` streams [T, n, D].

Before a sublayer, `pre` mixes the streams into its input; after it, `post` spreads the sublayer's output
over the streams and a doubly-stochastic `comb` (Sinkhorn-normalised) mixes the old streams in. The head
mixes the streams once more with its own `pre`. The math is ops.hc_pre / hc_post / hc_head (SPECS.md 3.4).

Legend: T tokens, n streams, D hidden, M = (2 + n) * n mixing rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pocketmoe.layers.linear import QuantLinear


@dataclass(frozen=True)
class HyperConfig:
    n: int                 # streams (hyper_connection.count)
    sinkhorn_iters: int
    eps: float             # hyper_connection.epsilon
    rms_eps: float         # the unweighted RMSNorm over the flattened streams


class HyperConnection:
    """One mixing site (before attention or before the FFN): fn [M, n*D], scale [3], base [M]."""

    def __init__(self, cfg: HyperConfig, ops: Any, fn: QuantLinear, scale: torch.Tensor, base: torch.Tensor) -> None:
        self.cfg, self.ops, self.fn, self.scale, self.base = cfg, ops, fn, scale, base
        self.native: Any = None  # the backend's handle of the site, made at first use

    def pre(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, D] -> sublayer input [T, D], post [T, n], comb [T, n src, n dst]."""
        return self.ops.hc_pre(self, x)

    def post(self, out: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The new streams [T, n, D]: post_j * out + sum_i comb[i, j] * x_i."""
        return self.ops.hc_post(out, x, post, comb)


class HyperHead:
    """The head's mixing: fn [n, n*D], scale [1], base [n]; streams [T, n, D] -> [T, D]."""

    def __init__(self, cfg: HyperConfig, ops: Any, fn: QuantLinear, scale: torch.Tensor, base: torch.Tensor) -> None:
        self.cfg, self.ops, self.fn, self.scale, self.base = cfg, ops, fn, scale, base
        self.native: Any = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.hc_head(self, x)
