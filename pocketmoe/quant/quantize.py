"""Fixture helpers: quantize float arrays to GGML blocks, and make valid random blocks of any type."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from pocketmoe.quant.formats import GGMLType, QuantError, format_of
from pocketmoe.quant.kquantize import quantize_q2_k, quantize_q4_k, quantize_q5_k, quantize_q6_k

_OURS: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    GGMLType.Q2_K: quantize_q2_k,
    GGMLType.Q4_K: quantize_q4_k,
    GGMLType.Q5_K: quantize_q5_k,
    GGMLType.Q6_K: quantize_q6_k,
}
_BY_GGUF = (
    GGMLType.F32,
    GGMLType.F16,
    GGMLType.BF16,
    GGMLType.Q4_0,
    GGMLType.Q4_1,
    GGMLType.Q5_0,
    GGMLType.Q5_1,
    GGMLType.Q8_0,
    GGMLType.TQ1_0,
    GGMLType.TQ2_0,
    GGMLType.MXFP4,
)
QUANTIZABLE: tuple[int, ...] = tuple(sorted(int(t) for t in (*_BY_GGUF, *_OURS)))


def quantize(values: np.ndarray, ggml_type: int) -> np.ndarray:
    """float32 [..., n] (n % block == 0) -> uint8 [..., row_bytes] GGML blocks."""
    fmt = format_of(ggml_type)
    x = np.ascontiguousarray(values, dtype=np.float32)
    if x.ndim == 0:
        raise QuantError(f"quantize to {fmt.name} needs at least one dimension but got a scalar.")
    out_shape = (*x.shape[:-1], fmt.row_bytes(x.shape[-1]))
    if fmt.ggml_type in _OURS:
        blocks = _OURS[fmt.ggml_type](x.reshape(-1, fmt.block_size))
    elif fmt.ggml_type in _BY_GGUF:
        from gguf import GGMLQuantizationType, quants

        blocks = np.ascontiguousarray(quants.quantize(x, GGMLQuantizationType(fmt.ggml_type))).view(np.uint8)
    else:
        names = ", ".join(format_of(t).name for t in QUANTIZABLE)
        raise QuantError(f"the fixture quantizer cannot make {fmt.name} blocks (it makes {names}).")
    return blocks.reshape(out_shape)


# fp16 scale fields per type: (byte offset, typical value). The magnitudes keep dequantized random
# payloads at a std of roughly 0.02-0.1; a negative value is a block minimum (added, not scaled).
_F16_FIELDS: dict[int, tuple[tuple[int, float], ...]] = {
    GGMLType.Q4_0: ((0, 1e-2),),
    GGMLType.Q4_1: ((0, 1e-2), (2, -7.5e-2)),
    GGMLType.Q5_0: ((0, 5e-3),),
    GGMLType.Q5_1: ((0, 5e-3), (2, -7.5e-2)),
    GGMLType.Q8_0: ((0, 5e-4),),
    GGMLType.Q1_0: ((0, 3e-2),),
    GGMLType.Q2_K: ((80, 3e-3), (82, 4.5e-3)),
    GGMLType.Q3_K: ((108, 1e-3),),
    GGMLType.Q4_K: ((0, 2e-4), (2, 1.5e-3)),
    GGMLType.Q5_K: ((0, 1e-4), (2, 1.5e-3)),
    GGMLType.Q6_K: ((208, 3e-5),),
    GGMLType.IQ2_XXS: ((0, 1e-3),),
    GGMLType.IQ2_XS: ((0, 1e-3),),
    GGMLType.IQ2_S: ((0, 1e-3),),
    GGMLType.IQ3_XXS: ((0, 3e-4),),
    GGMLType.IQ3_S: ((0, 3e-4),),
    GGMLType.IQ1_S: ((0, 5e-3),),
    GGMLType.IQ4_NL: ((0, 5e-4),),
    GGMLType.IQ4_XS: ((0, 3e-5),),
    GGMLType.TQ1_0: ((52, 5e-2),),
    GGMLType.TQ2_0: ((64, 3e-2),),
}
_PLAIN: dict[int, type] = {
    GGMLType.F32: np.float32,
    GGMLType.F16: np.float16,
    GGMLType.F64: np.float64,
    GGMLType.I8: np.int8,
    GGMLType.I16: np.int16,
    GGMLType.I32: np.int32,
    GGMLType.I64: np.int64,
}


def _magnitude(rng: np.random.Generator, n: int, typical: float) -> np.ndarray:
    return (rng.uniform(0.5, 1.5, n) * typical).astype(np.float32)


def _plain_values(t: int, count: int, rng: np.random.Generator) -> np.ndarray:
    if t == GGMLType.BF16:
        x = rng.normal(0.0, 0.05, count).astype(np.float32)
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    dtype = _PLAIN[t]
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-100, 100, count).astype(dtype).view(np.uint8)
    return rng.normal(0.0, 0.05, count).astype(dtype).view(np.uint8)


def _fix_scales(t: int, b: np.ndarray, rng: np.random.Generator) -> None:
    """Overwrite the scale fields of random blocks b [nb, type_size] in place."""
    nb = b.shape[0]
    for off, typical in _F16_FIELDS.get(t, ()):
        b[:, off : off + 2] = _magnitude(rng, nb, typical).astype(np.float16).view(np.uint8).reshape(nb, 2)
    if t == GGMLType.IQ1_M:  # fp16 d spread over the top nibbles of the four 16-bit scale words
        h = _magnitude(rng, nb, 5e-3).astype(np.float16).view(np.uint16)
        for k in range(4):
            b[:, 49 + 2 * k] = (b[:, 49 + 2 * k] & 0x0F) | (((h >> (4 * k)) & 0x0F) << 4).astype(np.uint8)
    elif t == GGMLType.Q8_K:  # f32 d, int8 qs[256], int16 bsums[16] (sums of 16 values)
        b[:, 0:4] = _magnitude(rng, nb, 5e-4).view(np.uint8).reshape(nb, 4)
        sums = b[:, 4:260].view(np.int8).reshape(nb, 16, 16).sum(axis=-1, dtype=np.int16)
        b[:, 260:292] = sums.view(np.uint8)
    elif t == GGMLType.Q8_1:  # gguf 0.19 layout: f32 d, f32 s = d * sum(qs), int8 qs[32]
        d = _magnitude(rng, nb, 5e-4)
        s = d * b[:, 8:40].view(np.int8).sum(axis=-1, dtype=np.int32).astype(np.float32)
        b[:, 0:8] = np.stack([d, s], axis=-1).view(np.uint8).reshape(nb, 8)
    elif t == GGMLType.MXFP4:  # E8M0 exponent: scale 2**-8 .. 2**-4
        b[:, 0] = 127 + rng.integers(-8, -3, nb)
    elif t == GGMLType.NVFP4:  # four UE4M3 scales with exponent field 1..2 (about 0.016 .. 0.06)
        b[:, 0:4] = (rng.integers(1, 3, (nb, 4)) << 3) | rng.integers(0, 8, (nb, 4))


def random_blocks(ggml_type: int, shape: Sequence[int], rng: np.random.Generator) -> np.ndarray:
    """Valid random GGML data for a tensor of torch-order `shape` -> uint8 [..., row_bytes].

    The payload bytes are uniform; scale fields hold finite values of a sensible magnitude.
    """
    fmt = format_of(ggml_type)
    dims = tuple(int(s) for s in shape) or (1,)
    out_shape = (*dims[:-1], fmt.row_bytes(dims[-1]))
    n_blocks = fmt.nbytes(dims) // fmt.type_size
    if fmt.block_size == 1:
        return _plain_values(fmt.ggml_type, n_blocks, rng).reshape(out_shape)
    b = rng.integers(0, 256, (n_blocks, fmt.type_size), dtype=np.uint8)
    _fix_scales(fmt.ggml_type, b, rng)
    return b.reshape(out_shape)
