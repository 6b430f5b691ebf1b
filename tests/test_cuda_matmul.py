"""The CUDA matmul kernels (pocketmoe/ops/cuda/src/matmul.cu) under the CPU execution shim.

References: weights through gguf.quants.dequantize and a float64 matmul; activations through a numpy model of
the CPU's quantization (cpp_engine/src/act_quant.cpp), itself checked bit for bit against the kernels and
against pocketmoe.native. Tolerances are float-rounding bounds derived in pocketmoe.testing.cuda_matmul.tolerance, never fitted.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

from pocketmoe.quant.quantize import random_blocks
from pocketmoe.testing.cuda_matmul import (
    TYPES,
    act_inputs,
    cpu_chain,
    exact,
    grouped,
    quantize_model,
    random_acts,
    reference_weight,
    routing,
    select_acts,
    tolerance,
)
from pocketmoe.testing.cuda_shim import ShimModule, shim_unavailable_reason

pytestmark = pytest.mark.skipif(shim_unavailable_reason() is not None, reason=str(shim_unavailable_reason()))

THREADS = 128    # 4 warps per block in every launch below
WARPS = THREADS // 32


@pytest.fixture(scope="module")
def mod() -> ShimModule:
    # built with AddressSanitizer under `python -m pocketmoe.testing.cuda_shim --asan` (test_cuda_shim runs it)
    return ShimModule(["matmul.cu"])


def quantize_kernel(mod: ShimModule, x: np.ndarray, bv: int) -> tuple[torch.Tensor, ...]:
    t, n = x.shape
    q = torch.empty((t, n), dtype=torch.int8)
    d = torch.empty((t, n // bv), dtype=torch.float32)
    s = torch.empty((t, n // 32), dtype=torch.float32) if bv == 32 else torch.empty((t, n // 16), dtype=torch.int16)
    grid = (math.ceil(n // bv / WARPS), t, 1)
    args = [torch.from_numpy(x), n, q, d, s, n]
    mod.launch("quantize_q8_0" if bv == 32 else "quantize_q8_k", grid=grid, block=THREADS, args=args)
    return q, d, s


def gemv(mod: ShimModule, name: str, raw: np.ndarray, acts: list, rows: int, cols: int, t: int) -> np.ndarray:
    y = torch.full((t, rows), float("nan"))
    grid = (math.ceil(rows / WARPS), math.ceil(t / 8), 1)
    mod.launch(f"gemv_{name}", grid=grid, block=THREADS, args=[torch.from_numpy(raw), *acts, y, rows, cols, t])
    return y.numpy()


# ---- activation quantization ----

def tie_rows(cols: int) -> np.ndarray:
    """Rows with exact .5 products (max 127, so 127 / max is 1), an all-zero block and a huge-range block."""
    x = np.zeros((3, cols), dtype=np.float32)
    x[0] = (np.arange(cols) % 255 - 127) * np.float32(0.5)
    x[0, ::32] = 127.0
    x[1, 256:] = np.linspace(-3, 3, cols - 256, dtype=np.float32)
    x[2] = np.float32(1e-3)
    x[2, 5] = np.float32(3e4)
    return x


@pytest.mark.parametrize("bv", [32, 256])
def test_activation_quantization_matches_the_cpu_model(mod: ShimModule, bv: int) -> None:
    rng = np.random.default_rng(bv)
    # Q8_0 s past fp16's range: d32 * 4064 just over 65504 (fp16 would round it to 65504), far over, negative.
    big = np.ones((1, 512), dtype=np.float32)
    big[0, :96] = np.repeat(np.float32([2047.1875, 3e4, -3e4]), 32)
    x = np.concatenate([random_acts(rng, 3, 512) * 3, tie_rows(512), big])
    q, d, s = quantize_kernel(mod, x, bv)
    mq, md, ms = quantize_model(x, bv)
    np.testing.assert_array_equal(q.numpy(), mq)
    np.testing.assert_array_equal(d.numpy(), md)
    np.testing.assert_array_equal(s.numpy(), ms)
    assert (np.abs(x[3] - np.round(x[3])) == 0.5).sum() > 100   # the tie row really has .5 products
    assert (md[4] == 0).any()                                     # and a zero block
    if bv == 32:
        assert 65504 < ms[6, 0] < 65520 and ms[6, 1] > 65520 and ms[6, 2] < -65520
        assert (ms[:3] != (md[:3] * mq[:3].reshape(3, -1, 32).sum(axis=-1))).any()  # s is not d * sum


@pytest.mark.parametrize("bv", [32, 256])
def test_activation_rows_are_read_in_place_at_their_stride(mod: ShimModule, bv: int) -> None:
    """Each row's leading values of a wider tensor (MLA's per-head q_nope) are quantized where they lie, no copy
    first: the kernel reads x's own memory, and gives the bits of the contiguous copy. A view whose last row
    would run past the storage at that stride is copied instead, with the same bits."""
    from pocketmoe.ops.cuda import matmul

    read: list[int] = []

    def launch(source, kernel, grid, block, args, shared_mem):  # noqa: ANN001, ANN202 - backend.Launcher
        read.append(args[0].data_ptr())
        mod.launch(kernel, grid=grid, block=block, args=args, shared_mem=shared_mem)

    x = torch.from_numpy(random_acts(np.random.default_rng(bv + 1), 12, 640))
    lead = x.view(6, 2, 640)[..., :512].reshape(12, 512)  # rows 640 floats apart
    tail = x[:, 64:576]  # its last row's 640 floats would end 64 past x
    assert lead.stride() == tail.stride() == (640, 1)
    for view, in_place in ((lead, True), (tail, False)):
        got = matmul.quantize_activations(launch, view, bv)
        assert (read.pop() == x.data_ptr()) == in_place
        for a, b in zip(got, act_inputs(view.contiguous().numpy(), bv)[0], strict=True):
            np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("limit", [0.0, 1.5])
@pytest.mark.parametrize("bv", [32, 256])
def test_swiglu_quantization_is_the_model_of_the_float64_product(mod: ShimModule, bv: int, limit: float) -> None:
    """quantize_swiglu_* make silu(g) * u (clamped with a limit: DeepSeek-V4) as they quantize it: against the
    CPU model of the float64 product rounded to float32. The kernel's float32 product is a few ulps from it, so a
    q may sit one step off where the product lies at a rounding boundary; nothing else differs beyond that."""
    rng = np.random.default_rng([bv, int(limit * 10)])
    t, n = 6, 512
    g, u = (random_acts(rng, t, n) * 3 for _ in range(2))
    g[0, :bv] = 0.0  # a zero block (silu(0) = 0)
    q, d, s = (torch.empty_like(a) for a in quantize_kernel(mod, g, bv))
    mod.launch(f"quantize_swiglu_q8_{'0' if bv == 32 else 'k'}", grid=(math.ceil(n // bv / WARPS), t, 1),
               block=THREADS, args=[torch.from_numpy(np.stack([g, u])), t * n, n, limit, q, d, s, n])
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    if limit:
        g64, u64 = np.minimum(g64, limit), np.clip(u64, -limit, limit)
        assert (g > limit).any() and (np.abs(u) > limit).any()
    h = (g64 / (1.0 + np.exp(-g64)) * u64).astype(np.float32)
    mq, md, ms = quantize_model(h, bv)
    q, d, s = q.numpy(), d.numpy(), s.numpy()
    assert np.abs(q.astype(np.int32) - mq).max() <= 1 and (q == mq).mean() > 0.99
    # a block's scale from its max |h|: within a few float32 ulps (Q8_0's is stored as fp16: within its rounding)
    np.testing.assert_allclose(d, md, rtol=2**-10 if bv == 32 else 1e-6, atol=0)
    assert (md[0, 0] == 0) and (d[0, 0] == 0) and (q[0, :bv] == 0).all()
    if bv == 256:  # the sums are the kernel's own q's
        np.testing.assert_array_equal(s, q.reshape(t, n // 16, 16).sum(axis=-1, dtype=np.int16))
    # the host wrapper: gate and up stacked [2, T, I] or side by side [T, 2I] (one matmul's rows), the same bits
    from pocketmoe.ops.cuda import matmul

    def launch(source, kernel, grid, block, args, shared_mem):  # noqa: ANN001, ANN202 - backend.Launcher
        mod.launch(kernel, grid=grid, block=block, args=args, shared_mem=shared_mem)

    for gu in (torch.from_numpy(np.stack([g, u])), torch.from_numpy(np.concatenate([g, u], axis=1))):
        for a, b in zip(matmul.quantize_swiglu(launch, gu, bv, limit), (q, d, s), strict=True):
            np.testing.assert_array_equal(a.numpy(), b)


@pytest.mark.parametrize("bv", [32, 256])
def test_activation_model_matches_native(bv: int) -> None:
    native = pytest.importorskip("pocketmoe.native")
    if not native.available():
        pytest.skip(native.unavailable_reason())
    rng = np.random.default_rng(7)
    x = np.concatenate([random_acts(rng, 3, 512), tie_rows(512)])
    q, d, _ = quantize_model(x, bv)
    values = q.astype(np.float32) * np.repeat(d, bv, axis=1)
    np.testing.assert_array_equal(native.activation_roundtrip(x, 8 if bv == 32 else 12), values)


# ---- GEMV ----

SHAPES = [(32, 256, 1), (96, 512, 3), (256, 1024, 8)]


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("rows,cols,t", SHAPES)
def test_gemv_matches_dequantize_reference(mod: ShimModule, name: str, rows: int, cols: int, t: int) -> None:
    ggml_type, bv = TYPES[name]
    rng = np.random.default_rng([ggml_type, rows, cols, t])
    raw = random_blocks(ggml_type, (rows, cols), rng)
    acts, xd = act_inputs(random_acts(rng, t, cols), bv)
    y = gemv(mod, name, raw, acts, rows, cols, t)
    w = reference_weight(raw, name)
    ref = exact(name, raw, w, xd, acts)
    err = np.abs(y - ref)
    tol = tolerance(name, raw, w, xd, acts)
    assert np.isfinite(y).all()
    assert (err <= tol).all(), f"{name}: max err {err.max():.3g}, worst err/tol {(err / tol).max():.3g}"


@pytest.mark.parametrize("name", ["q4_k", "q8_0", "bf16"])
def test_gemv_more_than_eight_tokens(mod: ShimModule, name: str) -> None:
    ggml_type, bv = TYPES[name]
    rng = np.random.default_rng(11)
    raw = random_blocks(ggml_type, (37, 512), rng)   # 37 rows: the last block of 4 warps has one row
    x = random_acts(rng, 11, 512)
    acts, xd = act_inputs(x, bv)
    y = gemv(mod, name, raw, acts, 37, 512, 11)
    w = reference_weight(raw, name)
    assert (np.abs(y - exact(name, raw, w, xd, acts)) <= tolerance(name, raw, w, xd, acts)).all()
    # Token 9 alone gives bitwise the value it got in the second group of eight.
    acts9, _ = act_inputs(x[9:10], bv)
    np.testing.assert_array_equal(gemv(mod, name, raw, acts9, 37, 512, 1)[0], y[9])


def test_gemv_float_cols_not_a_multiple_of_32(mod: ShimModule) -> None:
    rng = np.random.default_rng(3)
    for name in ("f32", "f16", "bf16"):
        raw = random_blocks(TYPES[name][0], (33, 300), rng)
        acts, xd = act_inputs(random_acts(rng, 2, 300), 1)
        w = reference_weight(raw, name)
        y = gemv(mod, name, raw, acts, 33, 300, 2)
        assert (np.abs(y - exact(name, raw, w, xd, acts)) <= tolerance(name, raw, w, xd, acts)).all(), name


def test_mxfp4_smallest_exponents(mod: ShimModule) -> None:
    """E8M0 exponents 0 and 1 give subnormal scales 2^-128 and 2^-127 (the decoder's other branch); large
    activations keep every product normal."""
    rng = np.random.default_rng(39)
    raw = random_blocks(39, (32, 256), rng)
    raw.reshape(32, 8, 17)[:, :, 0] = rng.integers(0, 4, (32, 8))
    acts, xd = act_inputs(random_acts(rng, 2, 256) * np.float32(1e6), 32)
    w = reference_weight(raw, "mxfp4")
    y = gemv(mod, "mxfp4", raw, acts, 32, 256, 2)
    assert (np.abs(y - exact("mxfp4", raw, w, xd, acts)) <= tolerance("mxfp4", raw, w, xd, acts)).all()
    assert 0 < np.abs(y).max() < 1e-25


def test_nvfp4_every_scale_byte(mod: ShimModule) -> None:
    """All 256 UE4M3 scale bytes, each twice: 0x00, 0x80 and 0x7F (NaN) read as 0, exponent field 0 as
    m * 2^-10 (the decoder's other branch), bit 7 ignored (as gguf reads it). Rows of 224 values (3.5 NVFP4
    blocks) are refused."""
    from pocketmoe.ops.cuda import matmul

    rng = np.random.default_rng(40)
    raw = random_blocks(40, (32, 256), rng)
    raw.reshape(32, 4, 36)[:, :, :4] = rng.permutation(np.tile(np.arange(256, dtype=np.uint8), 2)).reshape(32, 4, 4)
    acts, xd = act_inputs(random_acts(rng, 2, 256), 32)
    w = reference_weight(raw, "nvfp4")
    y = gemv(mod, "nvfp4", raw, acts, 32, 256, 2)
    assert (np.abs(y - exact("nvfp4", raw, w, xd, acts)) <= tolerance("nvfp4", raw, w, xd, acts)).all()
    assert (w == 0).any() and np.abs(w).max() == 12 * 240   # 0xFF: half of 1.875 * 2^8, times e2m1 6 doubled
    with pytest.raises(matmul.CudaMatmulError, match="multiple of 64"):
        matmul.gemv(lambda *_: pytest.fail("launched"), torch.from_numpy(raw[:, :126]), 40, 224, acts)


@pytest.mark.parametrize("name", list(TYPES))
def test_gemv_matches_native_cpu_kernels(mod: ShimModule, name: str) -> None:
    native = pytest.importorskip("pocketmoe.native")
    if not native.available():
        pytest.skip(native.unavailable_reason())
    ggml_type, bv = TYPES[name]
    if ggml_type not in native.supported_types():
        pytest.skip(f"no native kernel for {name}")
    rng = np.random.default_rng([ggml_type, 5])
    rows, cols, t = 96, 1024, 3
    raw = random_blocks(ggml_type, (rows, cols), rng)
    x = random_acts(rng, t, cols)
    acts, xd = act_inputs(x, bv)
    y = gemv(mod, name, raw, acts, rows, cols, t)
    cpu = native.gemm(raw, ggml_type, x)
    w = reference_weight(raw, name)
    # Both lie within their own rounding bound of the exact value (the CPU's sum is a longer chain).
    tol = tolerance(name, raw, w, xd, acts) + tolerance(name, raw, w, xd, acts, cpu_chain(name, cols))
    assert (np.abs(y - cpu) <= tol).all(), f"{name}: max |gpu - cpu| {np.abs(y - cpu).max():.3g}"


def test_print_q8_0_gemv_shim_time(mod: ShimModule) -> None:
    rng = np.random.default_rng(0)
    raw = random_blocks(8, (1024, 1024), rng)
    acts, xd = act_inputs(random_acts(rng, 1, 1024), 32)
    gemv(mod, "q8_0", raw, acts, 1024, 1024, 1)  # warm the module
    start = time.perf_counter()
    y = gemv(mod, "q8_0", raw, acts, 1024, 1024, 1)
    print(f"\nshim: 1024x1024 Q8_0 GEMV, 1 token: {time.perf_counter() - start:.3f} s")
    w = reference_weight(raw, "q8_0")
    assert (np.abs(y - exact("q8_0", raw, w, xd, acts)) <= tolerance("q8_0", raw, w, xd, acts)).all()


# ---- grouped expert GEMM ----

def moe_gemm(mod: ShimModule, name: str, experts: list[torch.Tensor], route: tuple, acts: list, rows: int, cols: int,
             out_rows: int, top_k: int, act_by_pair: int, grid_y: int = 2) -> np.ndarray:
    y = torch.full((out_rows, rows), float("nan"))
    grid = (math.ceil(rows / (4 * WARPS)), grid_y, len(experts))
    mod.launch(f"moe_gemm_{name}", grid=grid, block=THREADS,
               args=[experts, *route, *acts, y, rows, cols, top_k, act_by_pair, route[0], 0])
    return y.numpy()


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("act_by_pair", [0, 1])
def test_moe_gemm_matches_reference_and_gemv(mod: ShimModule, name: str, act_by_pair: int) -> None:
    ggml_type, bv = TYPES[name]
    rows, cols, t, k = 40, 1280 if bv > 1 else 300, 14, 2
    rng = np.random.default_rng([ggml_type, act_by_pair])
    # Experts 0, 2 from a resident bank, 1, 3, 4 staged into their own buffers: one pointer array.
    bank = torch.from_numpy(random_blocks(ggml_type, (3, rows, cols), rng))
    staged = [torch.from_numpy(random_blocks(ggml_type, (rows, cols), rng)) for _ in range(3)]
    experts = [bank[0], staged[0], bank[2], staged[1], staged[2]]
    ids = routing(rng, t)
    route = grouped(ids, len(experts))
    offsets, tokens, slots = (a.numpy() for a in route)
    assert offsets[2] == offsets[1] and max(np.diff(offsets)) > 8 and offsets[5] - offsets[4] == 1
    x = random_acts(rng, t * k if act_by_pair else t, cols)
    acts, xd = act_inputs(x, bv)
    y = moe_gemm(mod, name, experts, route, acts, rows, cols, t * k, k, act_by_pair)
    assert np.isfinite(y).all(), "every (token, slot) row is written"
    for g, e in enumerate(experts):
        p = np.arange(offsets[g], offsets[g + 1])
        if len(p) == 0:
            continue
        src = tokens[p] * k + slots[p] if act_by_pair else tokens[p]
        raw = e.numpy()
        w = reference_weight(raw, name)
        out = y[tokens[p] * k + slots[p]]
        acts_p = select_acts(acts, src)
        err = np.abs(out - exact(name, raw, w, xd[src], acts_p))
        assert (err <= tolerance(name, raw, w, xd[src], acts_p)).all(), f"{name} expert {g}: max err {err.max():.3g}"
        # The same lane sequence as the GEMV: bitwise the same values.
        np.testing.assert_array_equal(out, gemv(mod, name, raw, acts_p, rows, cols, len(p)))
    # The tiles a block takes do not change a value.
    np.testing.assert_array_equal(moe_gemm(mod, name, experts, route, acts, rows, cols, t * k, k, act_by_pair, 1), y)


def test_moe_gemm_with_no_pairs_writes_nothing(mod: ShimModule) -> None:
    rng = np.random.default_rng(1)
    experts = [torch.from_numpy(random_blocks(12, (40, 256), rng)) for _ in range(2)]
    route = (torch.zeros(3, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    acts, _ = act_inputs(random_acts(rng, 1, 256), 256)
    assert np.isnan(moe_gemm(mod, "q4_k", experts, route, acts, 40, 256, 2, 2, 0)).all()


# ---- host wrappers (pocketmoe.ops.cuda.matmul) ----

@pytest.mark.parametrize("name", ["q4_k", "q8_0", "f16"])
def test_host_wrappers_match_the_kernels(mod: ShimModule, name: str) -> None:
    from pocketmoe.ops.cuda import matmul

    def launch(source, kernel, grid, block, args, shared_mem):  # noqa: ANN001, ANN202 - backend.Launcher
        assert source == "matmul.cu"
        mod.launch(kernel, grid=grid, block=block, args=args, shared_mem=shared_mem)

    ggml_type, bv = TYPES[name]
    rng = np.random.default_rng(21)
    rows, cols, t, k = 40, 512, 5, 2
    x = random_acts(rng, t, cols)
    acts = matmul.quantize_activations(launch, torch.from_numpy(x), matmul.activation_block(ggml_type))
    raw = random_blocks(ggml_type, (rows, cols), rng)
    y = matmul.gemv(launch, torch.from_numpy(raw), ggml_type, cols, acts)
    direct, _ = act_inputs(x, bv)
    np.testing.assert_array_equal(y.numpy(), gemv(mod, name, raw, direct, rows, cols, t))
    experts = [torch.from_numpy(random_blocks(ggml_type, (rows, cols), rng)) for _ in range(5)]
    route = grouped(routing(rng, t), 5)
    out = torch.full((t * k, rows), float("nan"))
    matmul.moe_gemm(launch, experts, ggml_type, rows, cols, *route, acts, k, out)
    np.testing.assert_array_equal(out.numpy(), moe_gemm(mod, name, experts, route, direct, rows, cols, t * k, k, 0))
    with pytest.raises(matmul.CudaMatmulError, match="multiple of"):
        matmul.gemv(launch, torch.from_numpy(raw), ggml_type, cols + bv // 2 if bv > 1 else 0, acts)
