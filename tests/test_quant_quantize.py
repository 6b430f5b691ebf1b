"""Fixture quantizers: gguf parity for the wrapped types; round-trip quality of our K-quant quantizers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from pocketmoe.quant import FORMATS, GGMLType, QuantError, dequantize
from pocketmoe.quant.quantize import QUANTIZABLE, quantize

T = GGMLType
WRAPPED = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.TQ1_0, T.TQ2_0, T.MXFP4)
# (type, values per sub-block, top quant level, top sub-block scale, symmetric)
KQUANTS = (
    (T.Q2_K, 16, 3, 15, False),
    (T.Q4_K, 32, 15, 63, False),
    (T.Q5_K, 32, 31, 63, False),
    (T.Q6_K, 16, 63, 127, True),
)


def _gguf(raw: np.ndarray, t: int, shape) -> np.ndarray:
    return np.asarray(quants.dequantize(raw, GGMLQuantizationType(t)), dtype=np.float32).reshape(shape)


def _ours(raw: np.ndarray, t: int, shape) -> np.ndarray:
    return dequantize(torch.from_numpy(raw), t, shape).numpy()


def _data(kind: str, shape, rng: np.random.Generator) -> np.ndarray:
    if kind == "normal":
        return rng.normal(0.0, 1.0, shape).astype(np.float32)
    if kind == "t3":
        return rng.standard_t(3, shape).astype(np.float32)
    x = rng.normal(0.0, 0.02, shape)  # small weights with rare large outliers
    x[rng.random(shape) < 0.002] *= 50
    return x.astype(np.float32)


def test_quantizable_list():
    assert set(QUANTIZABLE) == {int(t) for t in WRAPPED} | {int(k[0]) for k in KQUANTS}


@pytest.mark.parametrize("t", WRAPPED, ids=lambda t: t.name)
def test_wrapped_types_equal_gguf_quantize(t):
    rng = np.random.default_rng(int(t))
    shape = (2, 3, 2 * max(FORMATS[t].block_size, 32))
    x = rng.normal(0.0, 0.1, shape).astype(np.float32)
    q = quantize(x, t)
    assert q.dtype == np.uint8 and q.shape == (2, 3, FORMATS[t].row_bytes(shape[-1]))
    ref = np.ascontiguousarray(quants.quantize(x, GGMLQuantizationType(t))).view(np.uint8)
    np.testing.assert_array_equal(q, ref.reshape(q.shape))
    np.testing.assert_array_equal(_ours(q, t, shape), _gguf(q, t, shape))


def _ideal(x: np.ndarray, sub: int, qmax: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    """Round-to-nearest with an exact float step per sub-block -> (errors [n, sub], step [n, 1])."""
    b = x.reshape(-1, sub).astype(np.float64)
    if symmetric:
        step = np.abs(b).max(-1, keepdims=True) / (qmax // 2)
        return np.rint(b / step) * step - b, step
    lo, hi = np.minimum(b.min(-1, keepdims=True), 0), b.max(-1, keepdims=True)
    step = (hi - lo) / qmax
    return np.rint((b - lo) / step) * step + lo - b, step


@pytest.mark.parametrize("spec", KQUANTS, ids=lambda s: s[0].name)
@pytest.mark.parametrize("kind", ("normal", "t3", "outliers"))
def test_kquant_round_trip(spec, kind):
    t, sub, qmax, smax, symmetric = spec
    shape = (2, 48, 512)  # [E, out, in]
    x = _data(kind, shape, np.random.default_rng(int(t)))
    q = quantize(x, t)
    assert q.shape == (2, 48, FORMATS[t].row_bytes(512))
    y = _ours(q, t, shape)
    np.testing.assert_array_equal(y.view(np.int32), _gguf(q, t, shape).view(np.int32))

    err = (y.astype(np.float64) - x).reshape(-1, sub)
    ideal_err, step = _ideal(x, sub, qmax, symmetric)
    # No clipping: every error is within half a step the format can express. A sub-block step is
    # its exact step plus at most one unit of the super-block scale (largest step / top scale), and
    # an asymmetric block's offset adds at most one unit of the super-block min scale.
    per_super = 256 // sub
    step_max = step.reshape(-1, per_super).max(-1, keepdims=True)
    unit = np.repeat(step_max, per_super, axis=0) / smax
    if not symmetric:
        lo = np.minimum(x.reshape(-1, sub).min(-1, keepdims=True), 0)
        min_unit = np.repeat((-lo).reshape(-1, per_super).max(-1, keepdims=True), per_super, axis=0) / smax
        unit = unit + min_unit / qmax * (1 + 1 / smax)
    bound = 0.5 * (step + unit) * (1 + 2.0**-9)
    assert (np.abs(err) <= bound + 1e-7).all()
    if kind == "normal":  # similar sub-block ranges: close to the unconstrained ideal
        ratio = np.sqrt((err**2).mean() / (ideal_err**2).mean())
        assert ratio < (1.15 if t == T.Q2_K else 1.06), ratio


@pytest.mark.parametrize("spec", KQUANTS, ids=lambda s: s[0].name)
def test_kquant_special_inputs(spec):
    t = spec[0]
    zeros = np.zeros((2, 256), dtype=np.float32)
    np.testing.assert_array_equal(_ours(quantize(zeros, t), t, zeros.shape), zeros)
    const = np.full((1, 256), 0.25, dtype=np.float32)
    np.testing.assert_allclose(_ours(quantize(const, t), t, const.shape), const, rtol=2e-2)
    with pytest.raises(QuantError, match="overflows fp16"):
        quantize(np.full((1, 256), 1e9, dtype=np.float32), t)


def test_quantize_errors():
    with pytest.raises(QuantError, match="cannot make IQ2_XXS blocks"):
        quantize(np.zeros((1, 256), dtype=np.float32), T.IQ2_XXS)
    with pytest.raises(QuantError, match="row of 100 values is not a multiple of its block size 256"):
        quantize(np.zeros((1, 100), dtype=np.float32), T.Q4_K)
    with pytest.raises(QuantError, match="GGML type id 77 is unknown"):
        quantize(np.zeros((1, 32), dtype=np.float32), 77)
