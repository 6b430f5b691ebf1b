"""Native CPU kernels (pocketmoe.native) against gguf.quants.dequantize (Q1_0: its block formula) + float64 numpy
matmuls."""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from pocketmoe import native
from pocketmoe.quant.quantize import quantize, random_blocks
from pocketmoe.testing.cuda_matmul import block_mins, quantize_model
from pocketmoe.testing.dequant import dequantize_reference

pytestmark = pytest.mark.skipif(not native.available(), reason=native.unavailable_reason())

TYPES = {
    "Q4_K": 12, "Q6_K": 14, "Q8_0": 8, "Q5_K": 13, "Q5_0": 6, "Q4_0": 2, "Q2_K": 10, "Q3_K": 11,
    "IQ2_XXS": 16, "IQ2_XS": 17, "IQ2_S": 22, "IQ3_XXS": 18, "IQ3_S": 21, "IQ1_S": 19, "IQ1_M": 29, "IQ4_XS": 23,
    "TQ1_0": 34, "TQ2_0": 35,
    "MXFP4": 39, "NVFP4": 40, "IQ4_NL": 20, "Q4_1": 3, "Q5_1": 7, "Q1_0": 41, "F16": 1, "BF16": 30, "F32": 0,
}
FLOAT_TYPES = {0, 1, 30}
ACT_BLOCK = {**dict.fromkeys((2, 3, 6, 7, 8, 20, 39, 40, 41), 32),
             **dict.fromkeys((10, 11, 12, 13, 14, 16, 17, 18, 19, 21, 22, 23, 29, 34, 35), 256)}
TOKENS = (1, 3, 17, 64)


@pytest.fixture
def restore_threads():
    before = native.get_num_threads()
    yield
    native.set_num_threads(before)


def dequant(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    return dequantize_reference(raw, ggml_type).astype(np.float64)


def cols_for(ggml_type: int) -> int:
    return 300 if ggml_type in FLOAT_TYPES else 512


def quant_error_bound(x: np.ndarray, block: int) -> np.ndarray:
    """Per row, an upper bound of ||x - x_q||_2 when each block of `block` values is rounded to
    int8 with d = max|x| / 127 (every value moves by at most d / 2)."""
    amax = np.abs(x.reshape(x.shape[0], -1, block)).max(axis=-1)
    return np.sqrt(block * ((amax / 254.0) ** 2).sum(axis=-1))


MIN_TYPES = {3: "q4_1", 7: "q5_1"}  # w = d q + m


def min_term_correction(w: np.ndarray, t: int, x: np.ndarray) -> np.ndarray:
    """[T, O]: what a Q4_1 / Q5_1 output adds to (dequantized activations) @ w^T. The min m of a block
    multiplies the activation block's s = fp16(fp32 d * sum of q) (llama.cpp's Q8_1 s) rather than fp16(d) *
    sum of q: sum_b m_b (s_b - d_b sum_b q), with q, d, s from the model of the CPU's activation quantization
    (held to the native one bit for bit in test_cuda_matmul). 0 for other types."""
    if t not in MIN_TYPES:
        return np.zeros((len(x), len(w)))
    q, d, s = quantize_model(x, 32)
    isum = q.reshape(len(x), -1, 32).sum(-1, dtype=np.int32)
    return (s.astype(np.float64) - d.astype(np.float64) * isum) @ block_mins(w, MIN_TYPES[t]).T


@pytest.mark.parametrize("rows", [33, 257])
@pytest.mark.parametrize("name", list(TYPES))
def test_gemm_matches_gguf_reference(name: str, rows: int) -> None:
    t = TYPES[name]
    cols = cols_for(t)
    rng = np.random.default_rng(rows * 100 + t)
    w = random_blocks(t, (rows, cols), rng)
    wf = dequant(w, t)
    w_norm = np.linalg.norm(wf, axis=1)
    for n_tokens in TOKENS:
        x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
        y = native.gemm(w, t, x)
        assert y.shape == (n_tokens, rows) and y.dtype == np.float32
        exact = x.astype(np.float64) @ wf.T
        x_norm = np.linalg.norm(x.astype(np.float64), axis=1)
        if t in FLOAT_TYPES:
            # Float activations: only fp32 accumulation error, ~1e-5 of |x| |w|.
            tol = 1e-5 * x_norm[:, None] * w_norm[None, :]
        else:
            # Q8 activations: |dy| <= |w| * |dx| (Cauchy-Schwarz), plus fp32 accumulation.
            dx = quant_error_bound(x.astype(np.float64), ACT_BLOCK[t])
            tol = w_norm[None, :] * (dx[:, None] + 1e-5 * x_norm[:, None])
            assert dx.max() < 2e-2 * x_norm.min()
            # And against the activations the kernel really multiplies: float rounding only.
            seen = native.activation_roundtrip(x, t).astype(np.float64)
            tight = seen @ wf.T + min_term_correction(w, t, x)
            assert np.all(np.abs(y - tight) <= 1e-5 * (np.abs(seen) @ np.abs(wf).T) + 1e-30), f"T={n_tokens}"
        err = np.abs(y - exact)
        assert np.all(err <= tol), f"T={n_tokens}: worst error/tolerance {(err / tol).max():.3g}"


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q4_0", "MXFP4"])
def test_gemm_on_quantized_weights(name: str) -> None:
    """Weights quantized from smooth floats (not random bytes), as a real checkpoint has them."""
    t = TYPES[name]
    rng = np.random.default_rng(t)
    rows, cols = 65, 1024
    w = quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.02, t)
    wf = dequant(w, t)
    x = rng.standard_normal((5, cols)).astype(np.float32)
    y = native.gemm(w, t, x)
    dx = quant_error_bound(x.astype(np.float64), ACT_BLOCK[t])
    tol = np.linalg.norm(wf, axis=1)[None, :] * (dx[:, None] + 1e-5 * np.linalg.norm(x, axis=1)[:, None])
    assert np.all(np.abs(y - x.astype(np.float64) @ wf.T) <= tol)


def test_gemm_vector_and_out_argument() -> None:
    rng = np.random.default_rng(0)
    w = random_blocks(12, (40, 256), rng)
    x = rng.standard_normal(256).astype(np.float32)
    out = np.empty((1, 40), np.float32)
    y = native.gemm(w, 12, x[None, :], out=out)
    assert y is out or np.shares_memory(y, out)
    np.testing.assert_array_equal(native.gemm(w, 12, x), out[0])
    out1 = np.empty(40, np.float32)                      # a vector x may also write into (rows,)
    y1 = native.gemm(w, 12, x, out=out1)
    assert y1.shape == (40,) and np.shares_memory(y1, out1)
    np.testing.assert_array_equal(out1, out[0])
    y2 = native.gemm(w, 12, x, out=out)                  # or into (1, rows), returned as (rows,)
    assert y2.shape == (40,) and np.shares_memory(y2, out)
    # Other dtypes and strided inputs are converted.
    np.testing.assert_array_equal(native.gemm(w, 12, x.astype(np.float64)), out[0])
    np.testing.assert_array_equal(native.gemm(w, 12, np.repeat(x, 2)[::2]), out[0])
    with pytest.raises(native.NativeKernelError, match="out must"):
        native.gemm(w, 12, x, out=np.empty(39, np.float32))


@pytest.mark.parametrize("name", ["Q4_K", "Q5_0", "IQ2_XXS", "F16"])
def test_gemm_bitwise_stable(name: str, restore_threads) -> None:
    """A token's output is bitwise the same alone or in a batch, with 1 or 2 threads."""
    t = TYPES[name]
    rng = np.random.default_rng(1)
    w = random_blocks(t, (45, cols_for(t)), rng)
    x = rng.standard_normal((19, cols_for(t))).astype(np.float32)
    native.set_num_threads(2)
    batch = native.gemm(w, t, x)
    np.testing.assert_array_equal(native.gemm(w, t, x), batch)
    native.set_num_threads(1)
    np.testing.assert_array_equal(native.gemm(w, t, x), batch)
    for i in range(x.shape[0]):
        np.testing.assert_array_equal(native.gemm(w, t, x[i]), batch[i])


BATCHED_TYPES = ["Q8_0", "Q5_0", "Q4_0", "IQ4_NL", "Q4_1", "Q5_1", "NVFP4", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS", "IQ1_S", "IQ3_S",
                 "F16", "BF16", "F32"]


def batched_case(t: int, heads: int, rows: int, cols: int, n_tokens: int, seed: int):
    rng = np.random.default_rng(seed)
    w = random_blocks(t, (heads, rows, cols), rng)
    x = rng.standard_normal((heads, n_tokens, cols)).astype(np.float32)
    return w, x


def batched_shapes(t: int) -> list[tuple[int, int]]:
    """(rows, cols) like MLA's attn_k_b [H, 512, 128] and attn_v_b [H, 128, 512]; k-quant rows need
    256-value multiples, so their attn_k_b-like case has 512 columns."""
    return [(512, 512), (128, 512)] if ACT_BLOCK.get(t) == 256 else [(512, 128), (128, 512)]


@pytest.mark.parametrize("heads", [1, 4, 16])
@pytest.mark.parametrize("name", BATCHED_TYPES)
def test_gemm_batched_equals_gemm_per_head(name: str, heads: int) -> None:
    t = TYPES[name]
    for rows, cols in batched_shapes(t):
        for n_tokens in (1, 3, 17):
            w, x = batched_case(t, heads, rows, cols, n_tokens, seed=heads * 1000 + n_tokens + t)
            y = native.gemm_batched(w, t, x)
            assert y.shape == (heads, n_tokens, rows) and y.dtype == np.float32
            for h in range(heads):
                np.testing.assert_array_equal(y[h], native.gemm(w[h], t, x[h]), err_msg=f"{rows}x{cols} T={n_tokens}")


@pytest.mark.parametrize("name", BATCHED_TYPES)
def test_gemm_batched_matches_gguf_reference(name: str) -> None:
    t = TYPES[name]
    heads = 4
    for rows, cols in batched_shapes(t):
        for n_tokens in (1, 3, 17):
            w, x = batched_case(t, heads, rows, cols, n_tokens, seed=7 * n_tokens + rows + t)
            y = native.gemm_batched(w, t, x)
            for h in range(heads):
                wf = dequant(w[h], t)
                xh = x[h].astype(np.float64)
                x_norm = np.linalg.norm(xh, axis=1)
                w_norm = np.linalg.norm(wf, axis=1)
                if t in FLOAT_TYPES:
                    tol = 1e-5 * x_norm[:, None] * w_norm[None, :]
                else:
                    dx = quant_error_bound(xh, ACT_BLOCK[t])
                    tol = w_norm[None, :] * (dx[:, None] + 1e-5 * x_norm[:, None])
                err = np.abs(y[h] - xh @ wf.T)
                assert np.all(err <= tol), f"h={h} T={n_tokens}: worst error/tolerance {(err / tol).max():.3g}"


@pytest.mark.parametrize("name", ["Q8_0", "Q5_0", "Q4_K", "F16"])
def test_gemm_batched_bitwise_stable(name: str, restore_threads) -> None:
    """Bitwise the same with 1 or 2 threads, and a token alone or in a batch."""
    t = TYPES[name]
    rows, cols = batched_shapes(t)[0]
    w, x = batched_case(t, 16, rows, cols, 17, seed=3)
    native.set_num_threads(2)
    batch = native.gemm_batched(w, t, x)
    np.testing.assert_array_equal(native.gemm_batched(w, t, x), batch)
    native.set_num_threads(1)
    np.testing.assert_array_equal(native.gemm_batched(w, t, x), batch)
    for i in (0, 5, 16):
        np.testing.assert_array_equal(native.gemm_batched(w, t, x[:, i:i + 1]), batch[:, i:i + 1])


def test_gemm_batched_arguments() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    w = random_blocks(8, (4, 64, 128), rng)
    x = rng.standard_normal((4, 2, 128)).astype(np.float32)
    ref = native.gemm_batched(w, 8, x)
    out = np.empty((4, 2, 64), np.float32)
    assert native.gemm_batched(w, 8, x, out=out) is not None
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(native.gemm_batched(torch.from_numpy(w), 8, torch.from_numpy(x)), ref)
    np.testing.assert_array_equal(native.gemm_batched(w, 8, x.astype(np.float64)), ref)
    with pytest.raises(native.NativeKernelError, match="heads"):
        native.gemm_batched(w, 8, x[:3])
    with pytest.raises(native.NativeKernelError, match="bytes"):
        native.gemm_batched(w, 8, np.zeros((4, 2, 96), np.float32))
    with pytest.raises(native.NativeKernelError, match="dimensions"):
        native.gemm_batched(w, 8, x[0])
    with pytest.raises(native.NativeKernelError, match="out must"):
        native.gemm_batched(w, 8, x, out=np.empty((4, 2, 63), np.float32))


def round_activations(x: np.ndarray, block: int | None) -> np.ndarray:
    """numpy model of the kernels' activation rounding: per block d = max|x| / 127, q = rint(x / d)."""
    if block is None:
        return x.astype(np.float64)
    xb = x.astype(np.float32).reshape(x.shape[0], -1, block)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(xb * inv)
    return (q * (amax / np.float32(127))).reshape(x.shape).astype(np.float64)


def silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def moe_case(rng: np.random.Generator, gate_type: int, down_type: int, n_experts: int, hidden: int, ffn: int):
    gate = random_blocks(gate_type, (n_experts, ffn, hidden), rng)
    up = random_blocks(gate_type, (n_experts, ffn, hidden), rng)
    down = random_blocks(down_type, (n_experts, hidden, ffn), rng)
    return gate, up, down


def moe_reference(x, ids, weights, gate, up, down, gate_type, down_type, n_experts, limit=0.0):
    """float64 numpy MoE on gguf-dequantized experts, with the kernels' activation rounding; limit > 0:
    DeepSeek-V4's clamped SwiGLU silu(min(g, L)) * clip(u, -L, L)."""
    wg = [dequant(gate[e], gate_type) for e in range(n_experts)]
    wu = [dequant(up[e], gate_type) for e in range(n_experts)]
    wd = [dequant(down[e], down_type) for e in range(n_experts)]
    xq = round_activations(x, ACT_BLOCK.get(gate_type))
    y = np.zeros(x.shape, np.float64)
    scale = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[t, k]
            g, u = wg[e] @ xq[t], wu[e] @ xq[t]
            if limit > 0:
                g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
            h = (silu(g) * u).astype(np.float32)
            hq = round_activations(h[None, :], ACT_BLOCK.get(down_type))[0]
            y[t] += weights[t, k] * (wd[e] @ hq)
            scale[t] += abs(weights[t, k]) * np.linalg.norm(wd[e], axis=1) * np.linalg.norm(hq)
    return y, scale


@pytest.mark.parametrize(
    "gate_name,down_name,hidden,ffn",
    [("Q4_K", "Q5_0", 512, 352), ("Q4_K", "Q6_K", 256, 512), ("Q4_K", "Q8_0", 256, 352),
     ("IQ2_XXS", "IQ2_XXS", 256, 256), ("Q8_0", "Q4_K", 96, 256), ("F16", "BF16", 40, 24)],
)
def test_moe_forward_matches_reference(gate_name: str, down_name: str, hidden: int, ffn: int) -> None:
    gate_type, down_type = TYPES[gate_name], TYPES[down_name]
    rng = np.random.default_rng(hidden + ffn)
    n_experts, top_k = 8, 3
    gate, up, down = moe_case(rng, gate_type, down_type, n_experts, hidden, ffn)
    for n_tokens in (1, 3, 17):
        x = rng.standard_normal((n_tokens, hidden)).astype(np.float32)
        ids = np.stack([rng.permutation(n_experts)[:top_k] for _ in range(n_tokens)]).astype(np.int32)
        weights = rng.uniform(0.1, 1.0, (n_tokens, top_k)).astype(np.float32)
        y = native.moe_forward(x, ids, weights, gate, gate_type, up, gate_type, down, down_type, n_experts, ffn)
        ref, scale = moe_reference(x, ids, weights, gate, up, down, gate_type, down_type, n_experts)
        # Left over: fp32 vs float64 sums, and the odd hidden value rounded to the other int8 step.
        assert np.all(np.abs(y - ref) <= 2e-3 * scale), f"T={n_tokens}"


@pytest.mark.parametrize("gate_name,down_name", [("MXFP4", "MXFP4"), ("Q8_0", "Q4_K")])
def test_moe_forward_swiglu_clamp(gate_name: str, down_name: str) -> None:
    """swiglu_limit (DeepSeek-V4): the clamp bites on a good share of the values and matches the float64
    reference; with the limit 0 the op is the plain SwiGLU, bitwise."""
    gate_type, down_type = TYPES[gate_name], TYPES[down_name]
    rng = np.random.default_rng(11)
    n_experts, hidden, ffn, top_k, limit = 6, 256, 256, 2, 0.5
    gate, up, down = moe_case(rng, gate_type, down_type, n_experts, hidden, ffn)
    x = 4 * rng.standard_normal((5, hidden)).astype(np.float32)
    ids = np.stack([rng.permutation(n_experts)[:top_k] for _ in range(5)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (5, top_k)).astype(np.float32)
    args = (x, ids, weights, gate, gate_type, up, gate_type, down, down_type, n_experts, ffn)
    y = native.moe_forward(*args, swiglu_limit=limit)
    ref, scale = moe_reference(x, ids, weights, gate, up, down, gate_type, down_type, n_experts, limit)
    plain, _ = moe_reference(x, ids, weights, gate, up, down, gate_type, down_type, n_experts)
    assert np.all(np.abs(y - ref) <= 2e-3 * scale)
    assert np.abs(plain - ref).max() > 100 * np.abs(y - ref).max()  # the clamp changed the result
    assert np.array_equal(native.moe_forward(*args, swiglu_limit=0.0), native.moe_forward(*args))


def test_moe_forward_float_weights_exact(restore_threads) -> None:
    """F32 experts: no rounding anywhere but fp32 arithmetic, so ~1e-5 of the norms."""
    rng = np.random.default_rng(2)
    n_experts, hidden, ffn, top_k = 5, 48, 40, 2
    gate, up, down = moe_case(rng, 0, 0, n_experts, hidden, ffn)
    x = rng.standard_normal((6, hidden)).astype(np.float32)
    ids = rng.integers(0, n_experts, (6, top_k)).astype(np.int32)
    weights = rng.uniform(0, 1, (6, top_k)).astype(np.float32)
    y = native.moe_forward(x, ids, weights, gate, 0, up, 0, down, 0, n_experts, ffn)
    ref, scale = moe_reference(x, ids, weights, gate, up, down, 0, 0, n_experts)
    assert np.all(np.abs(y - ref) <= 1e-5 * scale)


def test_moe_forward_bitwise_repeatable(restore_threads) -> None:
    """Same bits across runs, thread counts 1 and 2, and batch composition."""
    rng = np.random.default_rng(3)
    n_experts, hidden, ffn, top_k = 16, 512, 352, 6
    gate, up, down = moe_case(rng, 12, 6, n_experts, hidden, ffn)
    x = rng.standard_normal((33, hidden)).astype(np.float32)
    ids = np.stack([rng.permutation(n_experts)[:top_k] for _ in range(33)]).astype(np.int32)
    weights = rng.uniform(0, 1, (33, top_k)).astype(np.float32)

    def run(rows: slice) -> np.ndarray:
        return native.moe_forward(x[rows], ids[rows], weights[rows], gate, 12, up, 12, down, 6, n_experts, ffn)

    native.set_num_threads(2)
    first = run(slice(None))
    np.testing.assert_array_equal(run(slice(None)), first)
    native.set_num_threads(1)
    np.testing.assert_array_equal(run(slice(None)), first)
    native.set_num_threads(2)
    for t in (0, 7, 32):
        np.testing.assert_array_equal(run(slice(t, t + 1))[0], first[t])


def test_torch_tensors_are_accepted() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    w = random_blocks(14, (16, 256), rng)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    np.testing.assert_array_equal(native.gemm(torch.from_numpy(w), 14, torch.from_numpy(x)), native.gemm(w, 14, x))
    grad = torch.from_numpy(x).requires_grad_()          # .numpy() refuses it: read through detach()
    np.testing.assert_array_equal(native.gemm(w, 14, grad), native.gemm(w, 14, x))
    np.testing.assert_array_equal(native.gemm(w, 14, torch.from_numpy(x).double()), native.gemm(w, 14, x))


def test_errors_are_clear() -> None:
    rng = np.random.default_rng(5)
    w = random_blocks(12, (4, 256), rng)
    x = np.zeros((1, 256), np.float32)
    with pytest.raises(native.NativeKernelError, match="no native kernel"):
        native.gemm(random_blocks(15, (4, 256), rng), 15, x)   # Q8_K: activations only
    with pytest.raises(native.NativeKernelError, match="bytes"):
        native.gemm(w, 12, np.zeros((1, 512), np.float32))
    with pytest.raises(native.NativeKernelError, match="contiguous"):
        native.gemm(np.asfortranarray(w), 12, x)
    gate = random_blocks(12, (2, 32, 256), rng)
    down = random_blocks(8, (2, 256, 32), rng)
    with pytest.raises(native.NativeKernelError, match="expert id 2"):
        native.moe_forward(x, np.array([[2]]), np.ones((1, 1)), gate, 12, gate, 12, down, 8, 2, 32)
    with pytest.raises(native.NativeKernelError, match="down holds"):
        native.moe_forward(x, np.array([[1]]), np.ones((1, 1)), gate, 12, gate, 12, down[:1], 8, 2, 32)


def test_describe_and_threads(restore_threads) -> None:
    assert "threads" in native.describe()
    assert {12, 14, 8, 13, 6} <= native.supported_types()
    native.set_num_threads(3)
    assert native.get_num_threads() == 3
    with pytest.raises(native.NativeKernelError):
        native.set_num_threads(0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_forked_child_gets_a_fresh_pool(restore_threads) -> None:
    """fork() keeps only the calling thread; the child must not wait on the parent's workers."""
    rng = np.random.default_rng(6)
    w = random_blocks(12, (64, 256), rng)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    native.set_num_threads(2)
    expected = native.gemm(w, 12, x)
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if np.array_equal(native.gemm(w, 12, x), expected) and native.get_num_threads() == 2 else 1)
        except BaseException:
            os._exit(2)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung in the native thread pool")
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_cpu_without_avx2_is_refused_before_import(monkeypatch) -> None:
    monkeypatch.setattr(native, "_cpu_flags", lambda: frozenset({"sse2", "avx"}))
    module, reason = native._load()
    assert module is None and "avx2" in reason and "fma" in reason


def _isa_in_subprocess(env_value: str | None) -> dict:
    """native.kernel_isa() (or the error it raises) in a fresh process with POCKETMOE_ISA set."""
    env = {k: v for k, v in os.environ.items() if k != "POCKETMOE_ISA"}
    if env_value is not None:
        env["POCKETMOE_ISA"] = env_value
    code = ("import json; from pocketmoe import native\n"
            "try:\n    print(json.dumps(native.kernel_isa()))\n"
            "except native.NativeKernelError as e:\n    print(json.dumps({'error': str(e)}))\n")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout)


def _amx_permitted() -> bool:
    """Whether Linux lets this process use the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, feature 18)."""
    libc = ctypes.CDLL(None, use_errno=True)
    sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    return libc.syscall(sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0


def test_kernel_isa_is_the_widest_the_cpu_has() -> None:
    """The dispatcher against /proc/cpuinfo: AMX-INT8 (with AVX-512 VNNI, where the kernel lets the process
    use the tiles), then AVX-512 VNNI (with F, BW, DQ, VL), then AVX-VNNI, then AVX2."""
    flags = native._cpu_flags() or frozenset()
    avx512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"} <= flags
    if avx512 and {"amx_tile", "amx_int8"} <= flags and _amx_permitted():
        expected = "amx"
    elif avx512:
        expected = "avx512vnni"
    elif "avx_vnni" in flags:
        expected = "avxvnni"
    else:
        expected = "avx2"
    isa = _isa_in_subprocess(None)
    # A wider set is only left out when its start-up check failed, and then the note says so.
    assert isa["name"] == expected or "start-up check" in isa["note"], isa
    assert isa["name"] in native.describe()


def test_pocketmoe_isa_caps_the_kernels() -> None:
    assert _isa_in_subprocess("avx2")["name"] == "avx2"
    flags = native._cpu_flags() or frozenset()
    if "avx512_vnni" not in flags:
        isa = _isa_in_subprocess("avx512vnni")
        assert isa["name"] in ("avxvnni", "avx2") and "lacks" in isa["note"], isa
    bad = _isa_in_subprocess("avx9")
    assert "POCKETMOE_ISA=avx9" in bad["error"] and "amx, avx512vnni, avxvnni or avx2" in bad["error"], bad


def test_wide_instructions_stay_in_the_dispatched_kernels() -> None:
    """The extension runs on any AVX2 CPU: every AVX-512, VNNI or AMX instruction in it lies in the kernels
    compiled for those sets (namespaces amx / avx512vnni / avxvnni), which run only after the CPU check, and
    every set is built (vpdpbusd / vpdpwssd present; tdpbssd in the AMX set)."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed")
    from pocketmoe import _native
    text = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", _native.__file__], capture_output=True,
                          text=True, check=True, timeout=600).stdout
    wide = re.compile(r"%zmm|%[xy]mm(1[6-9]|2\d|3[01])\b|%k[0-7]\b|\{1to\d+\}|\{evex\}|vpdpbusd|vpdpwssd|"
                      r"vpternlog|vmovdqu(8|16|32|64)\b|vmovdqa(32|64)\b|vperm[it]2|vpbroadcastm|%tmm\d|tilecfg|tilerelease")
    func, outside, vnni = "", set(), {"amx": 0, "avx512vnni": 0, "avxvnni": 0}
    for line in text.splitlines():
        if line.endswith(">:"):
            func = line
        elif "\t" in line and wide.search(line):
            owner = next((ns for ns in vnni if f"pocketmoe::{ns}::" in func), None)
            if owner is None:
                outside.add(func)
            elif "vpdp" in line or "tdpbssd" in line:
                vnni[owner] += 1
    assert not outside, sorted(outside)[:10]
    assert all(count > 0 for count in vnni.values()), vnni
    assert "tdpbssd" in text
