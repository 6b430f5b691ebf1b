"""Rotary position embedding on interleaved pairs (2i, 2i+1) (ggml NORM mode), with linear or YaRN scaling.

Legend: T tokens, R rotary dims.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from pocketmoe.errors import PocketMoEError


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN magnitude factor 0.1*mscale*ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeConfig:
    dim: int                        # R, rotated dims per head (even)
    base: float                     # theta
    scaling: str = "none"           # "none" | "linear" | "yarn"
    factor: float = 1.0             # context extension factor (1 / freq_scale)
    original_context: int = 0       # YaRN: training context before extension
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attn_factor: float = 1.0        # cos/sin amplitude
    neox: bool = False              # pairs (i, i + R/2) instead of (2i, 2i+1)

    def __post_init__(self) -> None:
        if self.dim <= 0 or self.dim % 2:
            raise PocketMoEError(f"rope dimension count must be a positive even number, got {self.dim}.")
        if self.scaling not in ("none", "linear", "yarn"):
            raise PocketMoEError(f"rope scaling type {self.scaling!r} is not supported (none, linear, yarn).")
        if self.scaling != "none" and self.factor <= 0:
            raise PocketMoEError(f"rope scaling factor must be > 0, got {self.factor}.")
        if self.scaling == "yarn" and self.factor != 1.0 and self.original_context <= 0:
            raise PocketMoEError(
                f"YaRN rope with factor {self.factor} needs original_context_length > 0, "
                f"got {self.original_context}.")

    def yarn_corr_dims(self) -> tuple[float, float]:
        """Pair-index range [low, high] over which YaRN ramps from extrapolation to interpolation."""
        def corr(n_rot: float) -> float:
            return self.dim * math.log(self.original_context / (n_rot * 2 * math.pi)) / (2 * math.log(self.base))

        low = max(0.0, math.floor(corr(self.beta_fast)))
        high = min(self.dim - 1.0, math.ceil(corr(self.beta_slow)))
        return low, high

    def inv_freq(self) -> torch.Tensor:
        """Angle per position of each pair, float64 [R/2]."""
        i = torch.arange(self.dim // 2, dtype=torch.float64)
        extrap = self.base ** (-2.0 * i / self.dim)
        if self.scaling == "linear":
            return extrap / self.factor
        if self.scaling != "yarn" or self.factor == 1.0:
            return extrap
        low, high = self.yarn_corr_dims()
        ramp = 1.0 - ((i - low) / max(0.001, high - low)).clamp(0.0, 1.0)  # 1: keep extrapolated
        return extrap / self.factor * (1.0 - ramp) + extrap * ramp


class Rotary:
    """cos/sin tables, shared by every layer; `span` serves positions from one table built once per context."""

    def __init__(self, cfg: RopeConfig) -> None:
        self.cfg = cfg
        self.inv_freq = cfg.inv_freq()
        self._cos2 = self._sin2 = torch.empty(0, cfg.dim)  # [P, R], see span()

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, R/2] float32."""
        angles = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]
        a = self.cfg.attn_factor
        return (angles.cos() * a).float(), (angles.sin() * a).float()

    def _grow(self, end: int) -> None:
        if end > self._cos2.shape[0]:
            cos, sin = self.cos_sin(torch.arange(max(end, 2 * self._cos2.shape[0], 256)))
            if self.cfg.neox:
                self._cos2 = torch.cat((cos, cos), dim=-1)
                self._sin2 = torch.cat((-sin, sin), dim=-1)
            else:
                self._cos2 = cos.repeat_interleave(2, dim=-1)
                self._sin2 = torch.stack((-sin, sin), dim=-1).flatten(-2)

    def span(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions start..start+n-1 -> cos2, sin2 [n, R] for the rope op (views of a cached table).

        Normal mode: cos2 repeats each pair's cos twice and sin2 holds (-sin, +sin) per pair; NeoX: the
        pair's cos in both halves, -sin in the first and +sin in the second.
        """
        self._grow(start + n)
        return self._cos2[start:start + n], self._sin2[start:start + n]

    def table(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos2, sin2 [P, R] of positions 0..P-1, P >= end: the whole cached table (row p is position p)."""
        self._grow(end)
        return self._cos2, self._sin2

    def at(self, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """cos2, sin2 [T, R] of any positions (int [T])."""
        self._grow(int(positions.max()) + 1)
        idx = torch.from_numpy(positions).long()
        return self._cos2[idx], self._sin2[idx]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) by the angle of pair i. x [..., R]; cos, sin broadcast to [..., R/2]."""
    pairs = x.unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)

