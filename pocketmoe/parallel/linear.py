"""Parallel weights: a rank's share of a weight as whole rows or whole quant blocks of the file's bytes.

The classes slice the raw block tensor (uint8 [*lead, O, row_bytes]) and never look inside a block:
column-parallel takes output rows [start, stop) (a view of the memory-mapped file: this rank reads only
those bytes), head-parallel takes the lead dim of a per-head stack, row-parallel takes the input columns
[start, stop), which must fall on block boundaries (a copy of those bytes of each row, made at load).
The sum of the row-parallel partial outputs over the ranks is the whole product (the sublayer reduces it).
"""

from __future__ import annotations

import torch

from pocketmoe.errors import PocketMoEError
from pocketmoe.layers.experts import ExpertWeights
from pocketmoe.layers.linear import F32, QuantEmbedding, QuantLinear
from pocketmoe.quant.formats import format_of


def block_geometry(ggml_type: int, raw: torch.Tensor) -> tuple[int, int]:
    """(values per block, bytes per block) of a weight's raw tensor."""
    if raw.is_floating_point():
        return 1, 1  # raw indexes values
    if ggml_type == F32:
        return 1, 4
    fmt = format_of(ggml_type)
    return fmt.block_size, fmt.type_size


def split_range(n: int, world: int, rank: int) -> tuple[int, int]:
    """Contiguous range of rank `rank` when n items are shared by `world` ranks as evenly as they go."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class ColumnParallelLinear(QuantLinear):
    """Output rows [start, stop) of a weight [O, I] (or of each head of [H, O, I]): whole rows of blocks."""

    def __init__(self, w: QuantLinear, start: int, stop: int) -> None:
        super().__init__(w.raw[..., start:stop, :], w.ggml_type, (*w.shape[:-2], stop - start, w.shape[-1]),
                         cache_dense=w.cache_dense, backend=w.backend, name=f"{w.name}[rows {start}:{stop}]")


class HeadParallelLinear(QuantLinear):
    """Heads [start, stop) of a per-head weight stack [H, O, I] (MLA k_b / v_b): a contiguous view."""

    def __init__(self, w: QuantLinear, start: int, stop: int) -> None:
        super().__init__(w.raw[start:stop], w.ggml_type, (stop - start, *w.shape[1:]), cache_dense=w.cache_dense,
                         backend=w.backend, name=f"{w.name}[heads {start}:{stop}]")


class RowParallelLinear(QuantLinear):
    """Input columns [start, stop) of a weight [O, I] on whole quant blocks: x[:, start:stop] @ W[:, start:stop].T
    is this rank's partial output."""

    def __init__(self, w: QuantLinear, start: int, stop: int) -> None:
        block, nbytes = block_geometry(w.ggml_type, w.raw)
        if start % block or stop % block:
            raise PocketMoEError(
                f"{w.name}: input columns {start}..{stop} of {w.in_features} do not fall on whole quant blocks of "
                f"{block} values, so this weight cannot be split row-parallel at this tensor-parallel size.")
        raw = w.raw[..., start // block * nbytes:stop // block * nbytes].contiguous()
        super().__init__(raw, w.ggml_type, (*w.shape[:-1], stop - start), cache_dense=w.cache_dense,
                         backend=w.backend, name=f"{w.name}[cols {start}:{stop}]")


class VocabParallelEmbedding(QuantEmbedding):
    """Token rows [start, stop) of the embedding table; other tokens are this rank's zeros (summed over ranks)."""

    def __init__(self, table: QuantEmbedding, start: int, stop: int) -> None:
        super().__init__(table.raw[start:stop], table.ggml_type, (stop - start, table.shape[1]))
        self.start, self.stop, self.full_shape = start, stop, table.shape


def local_experts(w: ExpertWeights, start: int, stop: int) -> ExpertWeights:
    """Experts [start, stop) of a stacked expert weight [E, O, I]: a view of their bytes only."""
    return ExpertWeights(w.raw[start:stop], w.ggml_type, (stop - start, *w.shape[1:]))
