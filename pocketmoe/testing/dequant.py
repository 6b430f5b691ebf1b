"""The independent dequantization the kernel and model tests compare against."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, quants


def dequantize_reference(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """Raw blocks [..., row_bytes] -> float32 weights [..., I] through gguf.quants.dequantize; Q1_0, which gguf
    does not dequantize, by its block formula (ggml's dequantize_row_q1_0: d, then bit v % 8 of qs[v / 8] set
    gives d, clear -d)."""
    if ggml_type != GGMLQuantizationType.Q1_0:
        return quants.dequantize(raw, GGMLQuantizationType(ggml_type))
    blocks = raw.reshape(*raw.shape[:-1], -1, 18)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    bits = np.unpackbits(blocks[..., 2:], axis=-1, bitorder="little")
    return np.where(bits == 1, d, -d).reshape(*raw.shape[:-1], -1)
