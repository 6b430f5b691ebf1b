"""Registry of GGML tensor types: block geometry and the vectorized torch dequantizer of each."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import torch

from pocketmoe.errors import PocketMoEError


class QuantError(PocketMoEError):
    """A tensor's bytes, shape or type id do not fit its GGML quant format."""


class GGMLType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41


BlockDequant = Callable[[torch.Tensor], torch.Tensor]
"""uint8 [n_blocks, type_size] -> float32 [n_blocks, block_size], on the input's device."""


@dataclass(frozen=True)
class QuantFormat:
    ggml_type: int
    name: str
    block_size: int  # values per block
    type_size: int  # bytes per block
    dequant_blocks: BlockDequant | None = field(default=None, repr=False, compare=False)

    @property
    def can_dequantize(self) -> bool:
        return self.dequant_blocks is not None

    def row_bytes(self, n: int) -> int:
        if n < 0 or n % self.block_size:
            raise QuantError(
                f"a {self.name} row of {n} values is not a multiple of its block size {self.block_size}."
            )
        return n // self.block_size * self.type_size

    def nbytes(self, shape: Sequence[int]) -> int:
        dims = tuple(int(s) for s in shape) or (1,)
        return math.prod(dims[:-1]) * self.row_bytes(dims[-1])


FORMATS: dict[int, QuantFormat] = {}


def declare(t: GGMLType, block: int, nbytes: int, dequant: BlockDequant | None = None) -> QuantFormat:
    """Add one type to FORMATS (each family module declares its own types at import)."""
    if int(t) in FORMATS:
        raise ValueError(f"GGML type {t.name} is declared twice")
    fmt = QuantFormat(int(t), t.name, block, nbytes, dequant)
    FORMATS[int(t)] = fmt
    return fmt


def register(t: GGMLType, block: int, nbytes: int) -> Callable[[BlockDequant], BlockDequant]:
    """Decorator form of `declare` for a block dequantizer."""

    def wrap(fn: BlockDequant) -> BlockDequant:
        declare(t, block, nbytes, fn)
        return fn

    return wrap


def format_of(ggml_type: int) -> QuantFormat:
    fmt = FORMATS.get(int(ggml_type))
    if fmt is None:
        known = ", ".join(str(k) for k in sorted(FORMATS))
        raise QuantError(f"GGML type id {int(ggml_type)} is unknown (known ids: {known}).")
    return fmt


def type_name(ggml_type: int) -> str:
    return format_of(ggml_type).name


def dequantize(raw: torch.Tensor, ggml_type: int, shape: Sequence[int]) -> torch.Tensor:
    """Raw GGML bytes (uint8, any shape) -> float32 tensor of `shape` (torch order) on raw.device."""
    fmt = format_of(ggml_type)
    dims = tuple(int(s) for s in shape)
    if raw.dtype != torch.uint8:
        raise QuantError(f"{fmt.name} dequantize expects uint8 bytes but got a {raw.dtype} tensor.")
    expected = fmt.nbytes(dims)
    if raw.numel() != expected:
        raise QuantError(
            f"a {fmt.name} tensor of shape {list(dims)} needs {expected} bytes but {raw.numel()} were given."
        )
    if fmt.dequant_blocks is None:
        raise QuantError(f"dequantizing {fmt.name} (GGML type {fmt.ggml_type}) is not supported.")
    blocks = raw.reshape(-1, fmt.type_size)
    return fmt.dequant_blocks(blocks).reshape(dims)
