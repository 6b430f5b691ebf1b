"""DeepSeek-V4 attention: one shared K=V head, a sliding window of raw rows, and per-layer compressed entries
(ratio 4 with the lightning indexer's top-k, or ratio 128), attention sinks, inverse rope on the output and
the grouped output LoRA (SPECS.md 3.4; llama.cpp's deepseek4.cpp). The math is ops.dsv4_attention's.

Cache rows. Every layer keeps one row per position (engine/kv_cache.py); `RowLayout` says where each value
lives in it: the normed, roped kv of the token; for a compressed layer the compressor's per-token state
(its kv projection and its gate score with the position embedding added) and, in the row of a block's last
token, the block's compressed entry; for ratio 4 also the indexer's compressor state and entry. The state
rows of a block's tokens are read back when the block completes, possibly in a later step.

Legend: T tokens, D hidden, H heads, d head dims, R rope dims, r compress ratio, c compressor width.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pocketmoe.layers.linear import QuantLinear

if TYPE_CHECKING:
    from pocketmoe.engine.step import StepContext

RATIOS = (0, 4, 128)


@dataclass(frozen=True)
class RowLayout:
    """Offsets (start, stop) of a layer's values in its cache row; unused parts are (0, 0)."""

    kv: tuple[int, int]
    comp_kv: tuple[int, int] = (0, 0)
    comp_score: tuple[int, int] = (0, 0)
    comp_entry: tuple[int, int] = (0, 0)
    idx_kv: tuple[int, int] = (0, 0)
    idx_score: tuple[int, int] = (0, 0)
    idx_entry: tuple[int, int] = (0, 0)

    @property
    def width(self) -> int:
        return max(stop for _, stop in (self.kv, self.comp_entry, self.idx_entry))

    @staticmethod
    def of(ratio: int, head_dim: int, indexer_head_dim: int) -> RowLayout:
        d = head_dim
        if ratio == 0:
            return RowLayout(kv=(0, d))
        c = 2 * d if ratio == 4 else d  # ratio 4 pools overlapping windows: two halves of channels
        e = d + 2 * c
        lay = RowLayout(kv=(0, d), comp_kv=(d, d + c), comp_score=(d + c, e), comp_entry=(e, e + d))
        if ratio != 4:
            return lay
        b, i = e + d, indexer_head_dim
        return RowLayout(lay.kv, lay.comp_kv, lay.comp_score, lay.comp_entry, idx_kv=(b, b + 2 * i),
                         idx_score=(b + 2 * i, b + 4 * i), idx_entry=(b + 4 * i, b + 5 * i))


def cache_width(ratios: Sequence[int], head_dim: int, indexer_head_dim: int) -> int:
    """Values per position and layer of the cache: the widest layer's row."""
    return max(RowLayout.of(r, head_dim, indexer_head_dim).width for r in ratios)


@dataclass(frozen=True)
class DSV4AttentionConfig:
    n_head: int
    head_dim: int
    n_rot: int            # rope on the last n_rot dims of q, kv, entries and the output
    o_groups: int
    o_lora_rank: int
    window: int           # raw rows a query sees: positions p - window + 1 .. p
    ratio: int            # 0 window only, 4 (indexer top-k), 128
    eps: float
    layout: RowLayout

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5


class Compressor:
    """Pools each block of `ratio` tokens into one entry: softmax over the block's tokens (per channel) of the
    gate score (+ the position embedding `ape[pos % ratio]`) weighting the kv projection; with `overlap`, the
    first half of channels comes from the previous block's tokens and the second half from this block's."""

    def __init__(self, wkv: QuantLinear, wgate: QuantLinear, ape: torch.Tensor, norm: torch.Tensor, ratio: int,
                 eps: float, kv: tuple[int, int], score: tuple[int, int], entry: tuple[int, int]) -> None:
        self.wkv, self.wgate, self.ape, self.norm, self.ratio = wkv, wgate, ape, norm, ratio  # ape [r, c]
        self.eps = float(eps)
        self.overlap = ratio == 4
        self.kv, self.score, self.entry = kv, score, entry
        self.dim = norm.shape[0]  # entry dims


class Indexer:
    """The lightning indexer of a ratio-4 layer: per query, score_s = sum_h w_h relu(q_h . k_s) over its own
    compressed keys; the query attends to the top_k entries by that score."""

    def __init__(self, wq_b: QuantLinear, proj: QuantLinear, compressor: Compressor, n_head: int, head_dim: int,
                 top_k: int) -> None:
        self.wq_b, self.proj, self.compressor = wq_b, proj, compressor
        self.n_head, self.head_dim, self.top_k = n_head, head_dim, top_k


class DSV4Attention:
    """Weights of one DeepSeek-V4 attention layer; its forward pass is ops.dsv4_attention."""

    def __init__(self, cfg: DSV4AttentionConfig, ops: Any, *, wq_a: QuantLinear, q_a_norm: torch.Tensor,
                 wq_b: QuantLinear, wkv: QuantLinear, kv_norm: torch.Tensor, sinks: torch.Tensor, wo_a: QuantLinear,
                 wo_b: QuantLinear, compressor: Compressor | None = None, indexer: Indexer | None = None) -> None:
        if cfg.ratio not in RATIOS:
            raise ValueError(f"compress ratio {cfg.ratio} is not one of {RATIOS}")
        if (cfg.ratio == 0) != (compressor is None) or (cfg.ratio == 4) != (indexer is not None):
            raise ValueError(f"a ratio-{cfg.ratio} layer needs a compressor iff ratio > 0 and an indexer iff ratio 4")
        if cfg.n_head % cfg.o_groups:
            raise ValueError(f"{cfg.n_head} heads do not split into {cfg.o_groups} output groups")
        self.cfg, self.ops = cfg, ops
        self.wq_a, self.q_a_norm, self.wq_b, self.wkv, self.kv_norm = wq_a, q_a_norm, wq_b, wkv, kv_norm
        self.sinks, self.wo_a, self.wo_b = sinks, wo_a, wo_b  # wo_a: per-group weights [G, o_lora_rank, H*d/G]
        self.compressor, self.indexer = compressor, indexer
        self.native: Any = None  # the backend's handle of the whole sublayer, made at first use

    def __call__(self, x: torch.Tensor, ctx: StepContext, layer: int, rope: Any) -> torch.Tensor:
        """x [T, D] (normed) -> attention output [T, D]; writes the tokens' cache rows (ops.dsv4_attention)."""
        return self.ops.dsv4_attention(self, x, ctx, layer, rope)


class DSV4Rope:
    """The two rotaries of a DeepSeek-V4 model and one step's positions: `plain` for window-only layers,
    `compressed` (compress_rope_freq_base, YaRN) for compressed layers, their indexers and entries."""

    def __init__(self, plain: Any, compressed: Any) -> None:
        self.plain, self.compressed = plain, compressed
        self.positions = np.zeros(1, dtype=np.int32)
        self.step: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}

    def prepare(self, positions: np.ndarray) -> None:
        self.positions, self.step = positions, {}

    def tables(self, compressed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """cos2, sin2 [T, R] of the step's positions (made at the step's first call)."""
        t = self.step.get(compressed)
        if t is None:
            t = self.step[compressed] = (self.compressed if compressed else self.plain).at(self.positions)
        return t

    def full(self, compressed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """cos2, sin2 [P, R] by position, P past the step's last position (every entry's block start too)."""
        return (self.compressed if compressed else self.plain).table(int(self.positions.max()) + 1)
