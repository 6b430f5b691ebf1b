"""Lookup tables of the IQ and FP4 formats, read once from the gguf package's format constants.

They are decoded to float32 torch tensors on the CPU once and copied to each device on first use.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class Tables:
    iq2xxs: torch.Tensor  # [256, 8] magnitudes
    iq2xs: torch.Tensor  # [512, 8]
    iq2s: torch.Tensor  # [1024, 8]
    iq3xxs: torch.Tensor  # [256, 4]
    iq3s: torch.Tensor  # [512, 4]
    iq1s: torch.Tensor  # [2048, 8] values in {-1, 0, 1}
    ksigns: torch.Tensor  # [128, 8] +-1: 7 sign bits plus the even-parity 8th
    iq4nl: torch.Tensor  # [16] non-linear 4-bit levels
    e2m1: torch.Tensor  # [16] FP4 E2M1 levels, doubled (ggml's kvalues_mxfp4)


def _grid(spec: type) -> torch.Tensor:
    """Unpack a gguf grid spec: hex bytes, each holding fields of ceil(log2(levels)) bits, LSB first."""
    levels = spec.grid_map
    width = math.ceil(math.log2(len(levels)))
    step = 8 // (8 // width)
    mask = (1 << width) - 1
    packed = bytes.fromhex(spec.grid_hex.decode())
    codes = [(byte >> s) & mask for byte in packed for s in range(0, 8, step)]
    return torch.tensor([levels[c] for c in codes], dtype=torch.float32).reshape(spec.grid_shape)


@functools.cache
def _cpu_tables() -> Tables:
    from gguf import quants

    signs = [[-1.0 if (byte >> j) & 1 else 1.0 for j in range(8)] for byte in quants.IQ2_XXS.ksigns]
    return Tables(
        iq2xxs=_grid(quants.IQ2_XXS),
        iq2xs=_grid(quants.IQ2_XS),
        iq2s=_grid(quants.IQ2_S),
        iq3xxs=_grid(quants.IQ3_XXS),
        iq3s=_grid(quants.IQ3_S),
        iq1s=_grid(quants.IQ1_S),
        ksigns=torch.tensor(signs, dtype=torch.float32),
        iq4nl=torch.tensor(quants.IQ4_NL.kvalues, dtype=torch.float32),
        e2m1=torch.tensor(quants.MXFP4.kvalues, dtype=torch.float32),
    )


@functools.cache
def tables(device: torch.device) -> Tables:
    cpu = _cpu_tables()
    return Tables(**{f.name: getattr(cpu, f.name).to(device) for f in fields(Tables)})


def lookup(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """table[idx] for an integer index tensor of any shape -> [*idx.shape, *table.shape[1:]]."""
    return table.index_select(0, idx.reshape(-1).long()).reshape(*idx.shape, *table.shape[1:])
