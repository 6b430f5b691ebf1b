"""Plain element types (one value per block): float and integer tensors, converted to float32."""

from __future__ import annotations

import torch

from pocketmoe.quant.bits import view_as
from pocketmoe.quant.formats import GGMLType, declare

_PLAIN: dict[GGMLType, torch.dtype] = {
    GGMLType.F32: torch.float32,
    GGMLType.F16: torch.float16,
    GGMLType.BF16: torch.bfloat16,
    GGMLType.F64: torch.float64,
    GGMLType.I8: torch.int8,
    GGMLType.I16: torch.int16,
    GGMLType.I32: torch.int32,
    GGMLType.I64: torch.int64,
}


def _plain(dtype: torch.dtype):
    def dequant(b: torch.Tensor) -> torch.Tensor:
        return view_as(b, dtype).to(torch.float32)

    return dequant


for _t, _dtype in _PLAIN.items():
    declare(_t, 1, _dtype.itemsize, _plain(_dtype))
