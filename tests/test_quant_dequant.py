"""pocketmoe.quant.dequantize against gguf.quants.dequantize (and numpy formulas where gguf has none)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from pocketmoe.errors import PocketMoEError
from pocketmoe.quant import FORMATS, GGMLType, QuantError, dequantize, format_of, type_name
from pocketmoe.quant.quantize import random_blocks
from pocketmoe.testing.dequant import dequantize_reference

T = GGMLType
GGUF_DEQUANT = (
    T.F32,
    T.F16,
    T.BF16,
    T.Q4_0,
    T.Q4_1,
    T.Q5_0,
    T.Q5_1,
    T.Q8_0,
    T.Q2_K,
    T.Q3_K,
    T.Q4_K,
    T.Q5_K,
    T.Q6_K,
    T.IQ2_XXS,
    T.IQ2_XS,
    T.IQ2_S,
    T.IQ3_XXS,
    T.IQ3_S,
    T.IQ1_S,
    T.IQ1_M,
    T.IQ4_NL,
    T.IQ4_XS,
    T.TQ1_0,
    T.TQ2_0,
    T.MXFP4,
    T.NVFP4,
)
NO_GGUF_DEQUANT = (T.Q8_1, T.Q8_K, T.Q1_0, T.I8, T.I16, T.I32, T.I64, T.F64)


def _shapes(t: int) -> list[tuple[int, ...]]:
    b = max(FORMATS[t].block_size, 64)
    return [(b,), (3, 2 * b), (2, 3, 2 * b)]  # 1-D, [out, in], stacked [E, out, in]


def _ours(raw: np.ndarray, t: int, shape) -> np.ndarray:
    out = dequantize(torch.from_numpy(raw), t, shape)
    assert out.dtype == torch.float32 and out.device.type == "cpu" and tuple(out.shape) == tuple(shape)
    return out.numpy()


def _gguf(raw: np.ndarray, t: int, shape) -> np.ndarray:
    return np.asarray(quants.dequantize(raw, GGMLQuantizationType(t)), dtype=np.float32).reshape(shape)


def test_registry_covers_every_gguf_type_with_its_sizes():
    assert {t.name: t.value for t in GGMLQuantizationType} == {t.name: t.value for t in GGMLType}
    assert set(FORMATS) == {int(t) for t in GGMLQuantizationType}
    for t, (block, size) in GGML_QUANT_SIZES.items():
        fmt = format_of(int(t))
        assert (fmt.ggml_type, fmt.name, fmt.block_size, fmt.type_size) == (int(t), t.name, block, size)
        assert type_name(int(t)) == t.name
    assert set(GGUF_DEQUANT) | set(NO_GGUF_DEQUANT) == set(GGMLType)
    assert all(FORMATS[t].can_dequantize for t in GGUF_DEQUANT)


@pytest.mark.parametrize("t", NO_GGUF_DEQUANT, ids=lambda t: t.name)
def test_gguf_has_no_dequantizer_for(t):
    raw = np.zeros(FORMATS[t].type_size * 2, dtype=np.uint8)
    with pytest.raises(NotImplementedError):
        quants.dequantize(raw, GGMLQuantizationType(t))


@pytest.mark.parametrize("t", GGUF_DEQUANT, ids=lambda t: t.name)
def test_random_valid_blocks_match_gguf_bit_exactly(t):
    rng = np.random.default_rng(int(t))
    for shape in _shapes(t):
        raw = random_blocks(t, shape, rng)
        ours, ref = _ours(raw, t, shape), _gguf(raw, t, shape)
        assert np.isfinite(ref).all()
        np.testing.assert_array_equal(ours.view(np.int32), ref.view(np.int32))


@pytest.mark.parametrize("t", GGUF_DEQUANT, ids=lambda t: t.name)
def test_arbitrary_bytes_match_gguf_including_inf_and_nan(t):
    rng = np.random.default_rng(1000 + int(t))
    shape = (5, 4 * FORMATS[t].block_size if FORMATS[t].block_size > 1 else 128)
    raw = rng.integers(0, 256, (shape[0], FORMATS[t].row_bytes(shape[1])), dtype=np.uint8)
    with np.errstate(all="ignore"):
        ref = _gguf(raw, t, shape)
    np.testing.assert_array_equal(_ours(raw, t, shape), ref)  # NaN == NaN here; values bit-exact


def test_q8_k_and_q1_0_follow_their_block_formulas():
    rng = np.random.default_rng(7)
    raw = random_blocks(T.Q8_K, (2, 512), rng)
    blocks = raw.reshape(-1, 292)
    d = blocks[:, 0:4].copy().view(np.float32)
    expected = (d * blocks[:, 4:260].view(np.int8).astype(np.float32)).reshape(2, 512)
    np.testing.assert_array_equal(_ours(raw, T.Q8_K, (2, 512)), expected)

    raw = random_blocks(T.Q1_0, (3, 256), rng)
    np.testing.assert_array_equal(_ours(raw, T.Q1_0, (3, 256)), dequantize_reference(raw, T.Q1_0))


@pytest.mark.parametrize("t", (T.I8, T.I16, T.I32, T.I64, T.F64, T.F32, T.F16, T.BF16), ids=lambda t: t.name)
def test_plain_types_convert_to_float32(t):
    rng = np.random.default_rng(int(t))
    raw = random_blocks(t, (4, 6), rng)
    dtype = {
        T.I8: np.int8,
        T.I16: np.int16,
        T.I32: np.int32,
        T.I64: np.int64,
        T.F64: np.float64,
        T.F32: np.float32,
        T.F16: np.float16,
    }.get(t)
    if dtype is None:  # bf16: the high half of a float32
        expected = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        expected = raw.view(dtype).astype(np.float32)
    np.testing.assert_array_equal(_ours(raw, t, (4, 6)), expected.reshape(4, 6))


@pytest.mark.parametrize(
    "t", (T.Q4_K, T.Q6_K, T.IQ2_XXS, T.IQ1_M, T.Q5_0, T.MXFP4, T.NVFP4), ids=lambda t: t.name
)
def test_views_with_offsets_and_strides(t):
    rng = np.random.default_rng(11)
    shape = (4, 2 * FORMATS[t].block_size)
    raw = random_blocks(t, shape, rng)
    ref = _gguf(raw, t, shape)
    row = raw.shape[1]
    buf = torch.zeros(1 + raw.size + 3, dtype=torch.uint8)
    buf[1 : 1 + raw.size] = torch.from_numpy(raw.reshape(-1))
    offset_view = buf[1 : 1 + raw.size]  # storage offset 1: no field is aligned
    assert offset_view.storage_offset() == 1
    np.testing.assert_array_equal(dequantize(offset_view, t, shape).numpy(), ref)
    wide = torch.zeros(4, row + 5, dtype=torch.uint8)
    wide[:, 3 : 3 + row] = torch.from_numpy(raw)
    strided = wide[:, 3 : 3 + row]  # rows with a gap between them
    assert not strided.is_contiguous()
    np.testing.assert_array_equal(dequantize(strided, t, shape).numpy(), ref)


def test_tables_shared_by_mxfp4_and_nvfp4_agree():
    assert quants.NVFP4.kvalues == quants.MXFP4.kvalues


def test_errors_are_quant_errors_with_the_numbers():
    raw = torch.zeros(144 * 2, dtype=torch.uint8)
    with pytest.raises(QuantError, match=r"Q4_K tensor of shape \[2, 256\] needs 288 bytes but 287"):
        dequantize(raw[:-1], T.Q4_K, (2, 256))
    with pytest.raises(QuantError, match="row of 300 values is not a multiple of its block size 256"):
        dequantize(raw, T.Q4_K, (2, 300))
    for bad in (4, 5, 31, 99, -1):
        with pytest.raises(QuantError, match=f"GGML type id {bad} is unknown"):
            dequantize(raw, bad, (2, 256))
    with pytest.raises(QuantError, match="expects uint8 bytes"):
        dequantize(raw.view(torch.int8), T.Q4_K, (2, 256))
    with pytest.raises(QuantError, match="dequantizing Q8_1"):
        dequantize(torch.zeros(40, dtype=torch.uint8), T.Q8_1, (32,))
    assert issubclass(QuantError, PocketMoEError)
    assert FORMATS[T.Q4_K].nbytes((3, 5, 512)) == 3 * 5 * 2 * 144
    with pytest.raises(QuantError):
        FORMATS[T.Q8_0].row_bytes(33)


@pytest.mark.parametrize("t", sorted(FORMATS), ids=lambda t: FORMATS[t].name)
def test_random_blocks_are_valid_and_of_sane_magnitude(t):
    fmt = FORMATS[t]
    shape = (2, 3, 4 * max(fmt.block_size, 32))
    a = random_blocks(t, shape, np.random.default_rng(5))
    b = random_blocks(t, shape, np.random.default_rng(5))
    assert a.dtype == np.uint8 and a.shape == (2, 3, fmt.row_bytes(shape[-1]))
    np.testing.assert_array_equal(a, b)
    if not fmt.can_dequantize:
        return
    w = _ours(a, t, shape)
    assert np.isfinite(w).all()
    if not fmt.name.startswith("I"):  # integer tensors hold small integers, not weights
        assert 0.01 < w.std() < 0.2, w.std()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("t", GGUF_DEQUANT + NO_GGUF_DEQUANT[1:], ids=lambda t: t.name)
def test_cuda_matches_cpu(t):
    shape = (3, 4, 2 * max(FORMATS[t].block_size, 32))
    raw = torch.from_numpy(random_blocks(t, shape, np.random.default_rng(3)))
    out = dequantize(raw.cuda(), t, shape)
    assert out.device.type == "cuda" and out.dtype == torch.float32
    np.testing.assert_array_equal(out.cpu().numpy(), dequantize(raw, t, shape).numpy())


def test_empty_tensors():
    for t, fmt in FORMATS.items():
        if fmt.can_dequantize:
            out = dequantize(torch.zeros(0, dtype=torch.uint8), t, (0, fmt.block_size))
            assert out.shape == (0, fmt.block_size) and out.dtype == torch.float32
