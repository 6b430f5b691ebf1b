"""Round-to-nearest K-quant quantizers (Q2_K, Q4_K, Q5_K, Q6_K) for test fixtures; vectorized numpy.

Each sub-block gets the smallest step (in units of the fp16 super-block scale) that covers its
range, so no value is clipped; values are then rounded to the nearest level.
"""

from __future__ import annotations

import numpy as np

from pocketmoe.quant.formats import QuantError


def _half(x: np.ndarray, what: str) -> np.ndarray:
    """x -> the nearest fp16 at or above it (so a top scale of `smax` units still covers x)."""
    with np.errstate(over="ignore"):
        h = x.astype(np.float16)
    h = np.where(h.astype(np.float32) < x, np.nextafter(h, np.float16(np.inf)), h)
    if not np.all(np.isfinite(h)):
        raise QuantError(f"a K-quant {what} of up to {float(np.max(x)):.3g} overflows fp16 (max 65504).")
    return h


def _steps(need: np.ndarray, unit: np.ndarray, top: int) -> np.ndarray:
    """Smallest integer multiples (0..top) of `unit` [nb] covering `need` [nb, nsub]."""
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.ceil(need / unit[:, None])
    return np.where(unit[:, None] > 0, np.clip(k, 0, top), 0).astype(np.uint8)


def _rint_div(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(step > 0, np.rint(x / step), 0.0)


def _asymmetric(x: np.ndarray, qmax: int, smax: int):
    """x [nb, nsub, sub] -> fp16 d, fp16 dmin [nb]; scales, mins [nb, nsub]; q [nb, nsub, sub] in 0..qmax.

    Dequantized value: d * scale * q - dmin * min.
    """
    lo = np.minimum(x.min(axis=-1), 0.0)
    hi = x.max(axis=-1)
    dmin = _half((-lo).max(axis=-1) / smax, "min")
    mins = _steps(-lo, dmin.astype(np.float32), smax)
    offset = dmin.astype(np.float32)[:, None] * mins  # >= -lo: the lowest level sits at or below lo
    need = (hi + offset) / qmax
    d = _half(need.max(axis=-1) / smax, "scale")
    scales = _steps(need, d.astype(np.float32), smax)
    step = (d.astype(np.float32)[:, None] * scales)[..., None]
    q = np.clip(_rint_div(x + offset[..., None], step), 0, qmax).astype(np.uint8)
    return d, dmin, scales, mins, q


def _fp16_bytes(h: np.ndarray) -> np.ndarray:
    return h.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _pack_k4_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """6-bit scales and mins [nb, 8] -> the 12-byte Q4_K/Q5_K scales field."""
    return np.concatenate(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4),
        ],
        axis=-1,
    )


def _low_nibbles_k(q: np.ndarray) -> np.ndarray:
    """q [nb, 8, 32] -> qs[128]: byte 32c + j holds sub-block 2c (low nibble) and 2c + 1 (high)."""
    q = (q & 0x0F).reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    """x float32 [nb, 256] -> Q2_K blocks uint8 [nb, 84]."""
    d, dmin, sc, mn, q = _asymmetric(x.reshape(-1, 16, 16), 3, 15)
    q = q.reshape(-1, 2, 4, 32)  # value 128c + 32s + j -> bits 2s of qs[32c + j]
    qs = (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([sc | (mn << 4), qs, _fp16_bytes(d), _fp16_bytes(dmin)], axis=-1)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """x float32 [nb, 256] -> Q4_K blocks uint8 [nb, 144]."""
    d, dmin, sc, mn, q = _asymmetric(x.reshape(-1, 8, 32), 15, 63)
    return np.concatenate(
        [_fp16_bytes(d), _fp16_bytes(dmin), _pack_k4_scales(sc, mn), _low_nibbles_k(q)], axis=-1
    )


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """x float32 [nb, 256] -> Q5_K blocks uint8 [nb, 176]."""
    d, dmin, sc, mn, q = _asymmetric(x.reshape(-1, 8, 32), 31, 63)
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for i in range(8):  # bit i of qh[j]: the fifth bit of value 32i + j
        qh |= ((q[:, i] >> 4) & 1) << i
    return np.concatenate(
        [_fp16_bytes(d), _fp16_bytes(dmin), _pack_k4_scales(sc, mn), qh, _low_nibbles_k(q)], axis=-1
    )


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """x float32 [nb, 256] -> Q6_K blocks uint8 [nb, 210]: value = d * scale * (q - 32), scale int8."""
    x = x.reshape(-1, 16, 16)
    need = np.abs(x).max(axis=-1) / 31
    d = _half(need.max(axis=-1) / 127, "scale")
    sc = _steps(need, d.astype(np.float32), 127)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    q = (np.clip(_rint_div(x, step), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 2, 64)
    ql = ((q[:, :, 0] & 0x0F) | ((q[:, :, 1] & 0x0F) << 4)).reshape(-1, 128)
    hi = (q.reshape(-1, 2, 4, 32) >> 4) & 3  # value 128h + 32s + j -> bits 2s of qh[32h + j]
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _fp16_bytes(d)], axis=-1)
