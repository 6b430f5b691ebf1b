"""The non-matmul CUDA ops (CudaOps over src/norm_rope.cu, finalize.cu, route.cu, attention.cu) against the torch
reference (ops/reference.py), over the dims the engine runs: DeepSeek-V2 tiny / bench / V2-Lite, MiniMax-M2 tiny.

"shim": the kernels run on the CPU under the CUDA execution shim (pocketmoe.testing.cuda_shim), launched by
the same CudaOps glue the GPU runs. "gpu": CudaOps with CuPy on torch's CUDA device (skipped without one).
The reference always runs on the CPU on copies of the same inputs.
"""

from __future__ import annotations

import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch
from kv_check import KV_DTYPES, close_caches, rounding_values

from pocketmoe.engine import PagedKVCache, SeqChunk, Step, StepContext
from pocketmoe.errors import PocketMoEError
from pocketmoe.layers import MLAConfig, MLAttention, QuantLinear
from pocketmoe.layers.gqa import GQAConfig, GQAttention
from pocketmoe.layers.moe import GATING_SIGMOID, GATING_SOFTMAX, Router, RouterConfig
from pocketmoe.layers.rotary import RopeConfig, Rotary
from pocketmoe.ops import cuda, make_ops
from pocketmoe.ops.cuda.backend import CudaOps, kernel_params
from pocketmoe.ops.cuda.compile import SRC
from pocketmoe.ops.reference import ReferenceOps, rms_norm_rows
from pocketmoe.testing.cuda_shim import ShimLauncher, ShimModule, parse_kernels, shim_unavailable_reason

REASON = shim_unavailable_reason()
REF = ReferenceOps(tile_rows=None)


@pytest.fixture(scope="module", params=["shim", "gpu"])
def sub(request) -> tuple[CudaOps, torch.device]:
    """The backend under test and the device its tensors live on."""
    if request.param == "gpu":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        return CudaOps(tile_rows=None), torch.device("cuda")
    if REASON is not None:
        pytest.skip(REASON)
    return CudaOps(tile_rows=None, launcher=ShimLauncher()), torch.device("cpu")


def g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-5) -> None:
    torch.testing.assert_close(a.cpu(), b.cpu(), atol=tol, rtol=tol)


def f32_linear(out: int, inp: int, seed: int, dev: torch.device, heads: int | None = None) -> QuantLinear:
    shape = (out, inp) if heads is None else (heads, out, inp)
    w = (torch.randn(*shape, generator=g(seed)) / inp ** 0.5).to(dev)
    return QuantLinear(w.contiguous().view(torch.uint8).view(*shape[:-1], -1), 0, shape)


def test_cuda_backend_only_when_asked_for_and_present() -> None:
    assert make_ops("auto").name in ("native", "reference")
    if cuda.available():
        assert make_ops("cuda").name == "cuda"
    else:
        with pytest.raises(PocketMoEError, match="--backend cuda was asked for but"):
            make_ops("cuda")
    code = "import sys, pocketmoe.ops.cuda.backend, pocketmoe.ops.cuda.compile; assert 'cupy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)  # import-safe without CuPy or a GPU


def test_kernel_signatures_match_the_shim_parser() -> None:
    """CupyLauncher's argument packing reads the same parameter kinds as the shim's independent parser."""
    for path in sorted(SRC.glob("*.cu")):
        ours = kernel_params(path.read_text())
        theirs = {k.name: [("ptr" if p.kind in ("ptr", "ptrs") else "float" if p.kind == "float" else
                            "long long" if "long long" in p.ctype or "int64" in p.ctype else "int") for p in k.params]
                  for k in parse_kernels(path.read_text(), path.name)}
        assert ours == theirs, path.name


@pytest.mark.parametrize("d", [256, 1024, 2048], ids=["tiny", "bench", "v2lite"])
def test_norms_and_finalize(sub, d: int) -> None:
    ops, dev = sub
    x = torch.randn(7, d, generator=g(1)) * 3
    w = torch.rand(d, generator=g(2)) + 0.5
    a, b = torch.randn(7, d, generator=g(3)), torch.randn(7, d, generator=g(4))
    xd, wd, ad, bd = x.to(dev), w.to(dev), a.to(dev), b.to(dev)
    close(ops.rms_norm(xd, wd, 1e-6), REF.rms_norm(x, w, 1e-6), 1e-5)
    close(ops.rms_norm(xd.view(7, 1, d), wd, 1e-6), REF.rms_norm(x.view(7, 1, d), w, 1e-6), 1e-5)
    xr = x.clone()
    close(ops.add_rms_norm(xd, ad, wd, 1e-6), REF.add_rms_norm(xr, a, w, 1e-6), 1e-5)
    assert torch.equal(xd.cpu(), xr)  # the residual stream: one fp32 add, the same bits
    close(ops.finalize(xd, ad, bd, wd, 1e-5), REF.finalize(xr, a, b, w, 1e-5), 1e-5)
    assert torch.equal(xd.cpu(), xr)
    close(ops.finalize(xd, ad, None, wd, 1e-6), REF.finalize(xr, a, None, w, 1e-6), 1e-5)
    assert ops.finalize(xd, ad, bd) is None and REF.finalize(xr, a, b) is None
    assert ops.finalize(xd, bd) is None and REF.finalize(xr, b) is None
    assert torch.equal(xd.cpu(), xr)


@pytest.mark.parametrize("block", [32, 256])
def test_finalize_quantizes_the_next_input_once_its_block_is_known(sub, block: int) -> None:
    """Once the next sublayer's matmuls have quantized a finalize's y for `block`-value weights, the next finalize
    with that norm weight quantizes its y in the same launch (finalize_q8_0 / _q8_k): y and the residual stream
    keep finalize_f32's bits, the activations have quantize_activations' bits of y, and _acts hands them out
    without a quantize launch. A y some op reads that is not the finalize's own output is quantized as before."""
    from pocketmoe.ops.cuda import matmul

    ops, dev = sub
    d = 2048
    w = (torch.rand(d, generator=g(5)) + 0.5).to(dev)
    x0 = (torch.randn(3, d, generator=g(6)) * 3).to(dev)
    a, b = torch.randn(3, d, generator=g(7)).to(dev), torch.randn(3, d, generator=g(8)).to(dev)
    plain, fused = x0.clone(), x0.clone()
    y_plain = ops.finalize(plain, a, b, w, 1e-6)  # the block is not known yet: finalize_f32
    want = matmul.quantize_activations(ops.launch, y_plain, block)
    assert ops._acts(y_plain, block) is ops._acts(y_plain, block)  # the first call learns the norm's block
    launches: list[str] = []
    real = ops.launch

    def counted(source, kernel, *rest):  # noqa: ANN001, ANN202
        launches.append(kernel)
        return real(source, kernel, *rest)

    ops.launch = counted
    try:
        y = ops.finalize(fused, a, b, w, 1e-6)
        got = ops._acts(y, block)
    finally:
        ops.launch = real
    assert launches == [f"finalize_q8_{'0' if block == 32 else 'k'}"]
    assert torch.equal(fused.cpu(), plain.cpu()) and torch.equal(y.cpu(), y_plain.cpu())
    for have, expect in zip(got, want, strict=True):
        assert torch.equal(have.cpu(), expect.cpu())
    other = y.clone()  # not the finalize's output: quantized on its own
    assert ops._acts(other, block) is not got
    ops._input = None


@pytest.mark.parametrize("k", [1, 6])
def test_finalize_combines_the_routed_experts_outputs(sub, k: int) -> None:
    """The MoE sublayer's close with the experts' unweighted outputs [T, K, D] and their weights: the combine
    (layers.experts.combine, slot order, no fused multiply-add) and the finalize in one launch, the bits of the
    two apart, with and without the shared experts' output and the norm."""
    from pocketmoe.layers.experts import combine

    ops, dev = sub
    t, d = 3, 1024
    contrib = torch.randn(t, k, d, generator=g(9)).to(dev)
    kw = torch.rand(t, k, generator=g(10)).to(dev)
    shared = torch.randn(t, d, generator=g(11)).to(dev)
    w = (torch.rand(d, generator=g(12)) + 0.5).to(dev)
    x0 = (torch.randn(t, d, generator=g(13)) * 3).to(dev)
    for b, norm in ((shared, w), (None, w), (shared, None)):
        fused, apart = x0.clone(), x0.clone()
        y = ops._finalize(fused, contrib, kw, b, norm, 1e-6)
        want = ops.finalize(apart, combine(contrib, kw), b, norm, 1e-6)
        assert torch.equal(fused.cpu(), apart.cpu())
        assert (y is None) == (want is None) and (y is None or torch.equal(y.cpu(), want.cpu()))
    ops._input = None


def test_rms_norm_kernel_row_strides() -> None:
    """rms_norm_f32 on the first C values of [T, C+R] rows (the latent's c_kv), into rows of another width."""
    if REASON is not None:
        pytest.skip(REASON)
    mod = ShimModule(["norm_rope.cu"])
    x = torch.randn(5, 288, generator=g(5))
    w = torch.rand(256, generator=g(6)) + 0.5
    y = torch.full((5, 300), 7.0)
    mod.launch("rms_norm_f32", grid=(5, 1, 1), block=(64, 1, 1), args=[x, 288, w, y, 300, 256, 1e-6])
    close(y[:, :256], rms_norm_rows(x[:, :256], w, 1e-6), 1e-5)
    assert torch.equal(y[:, 256:], torch.full((5, 44), 7.0))


@pytest.mark.parametrize("shape", [(4, 96, 32, False), (16, 192, 64, False), (4, 64, 32, True), (2, 64, 64, True)],
                         ids=["mla-tiny", "mla-v2lite", "gqa-partial-neox", "full-neox"])
def test_rope(sub, shape: tuple[int, int, int, bool]) -> None:
    ops, dev = sub
    heads, head_dim, rot, neox = shape
    rotary = Rotary(RopeConfig(dim=rot, base=10000.0, scaling="yarn", factor=4.0, original_context=32, neox=neox))
    pos = np.array([0, 5, 6, 7, 40, 3, 1000], dtype=np.int32)
    cos2, sin2 = rotary.at(pos)
    x = torch.randn(7, heads, head_dim, generator=g(7))
    got = ops.rope(x.to(dev), cos2.to(dev), sin2.to(dev), neox)
    close(got, REF.rope(x, cos2, sin2, neox), 1e-5)
    assert torch.equal(got[..., rot:].cpu(), x[..., rot:])


ROUTES = {  # RouterConfig, bias scale: the engine's routing kinds at their real widths
    "v2-tiny-softmax": (RouterConfig(8, 2, GATING_SOFTMAX), 0.0),
    "v2lite-softmax": (RouterConfig(64, 6, GATING_SOFTMAX), 0.0),
    "v2-groups-scale": (RouterConfig(160, 6, GATING_SOFTMAX, n_groups=8, groups_used=3, scale=16.0), 0.0),
    "v3-sigmoid-bias-groups-norm": (RouterConfig(256, 8, GATING_SIGMOID, n_groups=8, groups_used=4, norm=True,
                                                 scale=2.5), 0.3),
    "mm2-sigmoid-bias-norm": (RouterConfig(32, 4, GATING_SIGMOID, norm=True), 0.3),
}


@pytest.mark.parametrize("case", list(ROUTES))
def test_route(sub, case: str) -> None:
    ops, dev = sub
    cfg, bias_scale = ROUTES[case]
    bias = bias_scale * torch.randn(cfg.n_experts, generator=g(8)) if bias_scale else None
    x = torch.randn(9, 64, generator=g(9))
    gate = f32_linear(cfg.n_experts, 64, 10, torch.device("cpu"))
    w_r, ids_r = REF.route(Router(gate, cfg, bias, REF), x)
    gate_d = f32_linear(cfg.n_experts, 64, 10, dev)
    w_c, ids_c = ops.route(Router(gate_d, cfg, None if bias is None else bias.to(dev), ops), x.to(dev))
    assert ids_c.dtype == ids_r.dtype and torch.equal(ids_c.cpu(), ids_r)
    close(w_c, w_r, 1e-5)


MLA_DIMS = {  # n_head, qk_nope, qk_rope, v_head, kv_lora
    "tiny": (4, 64, 32, 64, 256),
    "v2lite": (16, 128, 64, 128, 512),
}


def mla_layer(dims: tuple[int, ...], dev: torch.device, ops: object) -> MLAttention:
    h, n, r, v, c = dims
    cfg = MLAConfig(n_head=h, qk_nope=n, qk_rope=r, v_head=v, kv_lora=c, scale=(n + r) ** -0.5)
    return MLAttention(cfg, ops, wkv_a=f32_linear(c + r, 8, 1, dev), kv_a_norm=(torch.rand(c, generator=g(9)) + 0.5).to(dev),
                       eps=1e-6, wo=f32_linear(8, h * v, 2, dev), wq=f32_linear(h * (n + r), 8, 3, dev),
                       k_b=f32_linear(c, n, 4, dev, heads=h), v_b=f32_linear(v, c, 5, dev, heads=h))


def _steps() -> list[Step]:
    """A fresh prompt beside a prefill chunk after 66 cached positions (two key tiles of 64), then decode
    tokens beside a second chunk: every sequence its own rows, lengths and causal mask."""
    return [Step([SeqChunk("a", list(range(5)), 0), SeqChunk("long", [3, 4], 66), SeqChunk("b", [1, 2, 3], 0)]),
            Step([SeqChunk("a", [7], 5), SeqChunk("b", list(range(4)), 3), SeqChunk("long", [9], 68)])]


def _token_rows(tokens: list[tuple[str, int]], cols: int, seed: int) -> torch.Tensor:
    """Random rows [T, cols], a token's following from its sequence's name and its position alone."""
    return torch.stack([torch.randn(cols, generator=g(zlib.crc32(f"{seed}/{name}/{pos}".encode())))
                        for name, pos in tokens])


def _run_attention(kind: str, ops: object, dev: torch.device, dims: tuple[int, ...],
                   kv: torch.dtype = torch.float32, steps: list[Step] | None = None,
                   prior: dict[str, int] | None = None) -> tuple[torch.Tensor, ...]:
    """The outputs of `steps` (default _steps()) through one attention layer, and the cache after; `prior`: the
    positions already cached (random rows) of each sequence, default 66 of "long"."""
    if kind == "mla":
        attn = mla_layer(dims, dev, ops)
        width, rot = dims[4] + dims[2], dims[2]
    else:
        attn = gqa_layer(dims, dev, ops)
        width, rot = attn.cfg.kv_width, attn.cfg.n_rot
    rotary = Rotary(RopeConfig(dim=rot, base=10000.0, neox=kind == "gqa"))
    prior = {"long": 66} if prior is None else prior
    longest = max([128, *(n + 8 for n in prior.values())])
    cache = PagedKVCache(n_layer=2, width=width, n_pages=-(-longest // 16) * (len(prior) + 2), max_seq_len=longest,
                         page=16, device=dev, dtype=kv)
    for i, (name, n) in enumerate(prior.items()):  # rows not at the start of the pool: "a" comes first
        cache.reserve(name, n)
        rows = torch.randn(n, width, generator=g(30 + i))
        cache.data[1, torch.from_numpy(cache.rows(name, 0, n)).long().to(dev)] = rows.to(dev, kv)
    outs = []
    for step in _steps() if steps is None else steps:
        ctx = StepContext.build(step, cache, 100)
        cos2, sin2 = rotary.at(ctx.positions)
        ctx.cos2, ctx.sin2 = cos2.to(dev), sin2.to(dev)
        names = [c.seq for c in step.chunks]
        tokens = [(names[s], int(p)) for s, p in zip(ctx.seq, ctx.positions, strict=True)]
        inputs = lambda cols, seed, tokens=tokens: _token_rows(tokens, cols, seed).to(dev)  # noqa: E731
        if kind == "mla":
            h, n, r = dims[:3]
            outs.append(ops.mla_attention(attn, inputs(h * (n + r), 10), inputs(width, 20), ctx, 1))
        else:
            c = attn.cfg
            outs.append(ops.gqa_attention(attn, inputs(c.n_head * c.head_dim, 10), inputs(c.n_head_kv * c.head_dim, 20),
                                          inputs(c.n_head_kv * c.v_dim, 40), ctx, 1))
    return torch.cat(outs).cpu(), cache.data.cpu()


@pytest.mark.parametrize("dims,kv", [("tiny", "f32"), ("v2lite", "f32"), ("tiny", "f16"), ("v2lite", "bf16")])
def test_mla_attention_over_several_sequences(sub, dims: str, kv: str) -> None:
    """The kernels against the reference over a cache of each --kv-dtype: outputs, and the latent rows (normed
    c_kv, roped k_pe) the kernel wrote, at most one rounding step of the half types apart."""
    ops, dev = sub
    dtype = KV_DTYPES[kv][0]
    out_c, cache_c = _run_attention("mla", ops, dev, MLA_DIMS[dims], dtype)
    out_r, cache_r = _run_attention("mla", REF, torch.device("cpu"), MLA_DIMS[dims], dtype)
    close(out_c, out_r, 5e-5)
    if kv == "f32":
        close(cache_c, cache_r, 1e-5)
    else:
        close_caches(cache_c, cache_r)


def test_attention_constants_match_the_kernel_source() -> None:
    """The backend's tile, heads-per-block and value-dims-per-thread limits are attention.cu's #defines (a block of
    more heads than the kernel's arrays hold would write past them)."""
    import re

    from pocketmoe.ops.cuda import backend

    text = (SRC / "attention.cu").read_text()
    defines = {k: int(v) for k, v in re.findall(r"#define (ATT_\w+) (\d+)", text)}
    assert defines == {"ATT_TILE": backend.ATT_TILE, "ATT_HEADS": backend.ATT_HEADS, "ATT_VACC": backend.ATT_VACC}
    assert CudaOps.att_heads <= backend.ATT_HEADS


def _long_steps() -> list[Step]:
    """Decode tokens after 5000, 1500 and 40 cached positions beside a 3-token prompt: 27, 12 and one span of
    attention.cu's keys at the backend's spans (2 tiles of 64 at least, 32 spans at most)."""
    return [Step([SeqChunk("far", [5], 5000), SeqChunk("a", [1, 2, 3], 0), SeqChunk("mid", [7], 1500),
                  SeqChunk("near", [2], 40)])]


LONG_PRIOR = {"far": 5000, "mid": 1500, "near": 40}


@pytest.mark.parametrize("kind,dims", [("mla", MLA_DIMS["tiny"]), ("gqa", (4, 2, 64, 64, 32))], ids=["mla", "gqa"])
def test_attention_over_long_contexts_splits_and_merges_spans(sub, kind: str, dims: tuple[int, ...]) -> None:
    """Tokens of one span and of many (a span per block, attention_merge_f32 folding them) in one step, against
    the reference; and the same at spans of one tile, at most two per token."""
    ops, dev = sub
    from pocketmoe.ops.cuda.backend import attention_spans

    assert [attention_spans(n + 1) for n in (5000, 1500, 40)] == [27, 12, 1]
    out_r, cache_r = _run_attention(kind, REF, torch.device("cpu"), dims, steps=_long_steps(), prior=LONG_PRIOR)
    narrow = CudaOps(tile_rows=None, launcher=ops.launch, device=dev)
    narrow.att_min_tiles, narrow.att_max_spans = 1, 2
    for backend in (ops, narrow):
        out_c, cache_c = _run_attention(kind, backend, dev, dims, steps=_long_steps(), prior=LONG_PRIOR)
        close(out_c, out_r, 5e-5)
        close(cache_c, cache_r, 1e-5)


@pytest.mark.parametrize("kind,dims", [("mla", MLA_DIMS["tiny"]), ("gqa", (12, 2, 64, 64, 32))], ids=["mla", "gqa"])
def test_a_heads_attention_is_the_same_in_any_block_of_heads(sub, kind: str, dims: tuple[int, ...]) -> None:
    """The heads that read the same rows (MLA's 4; GQA's 6 per KV head) in blocks of at most 1 or 3 heads give
    bitwise what one block of them all gives: a head's arithmetic does not depend on the heads beside it."""
    ops, dev = sub
    want = _run_attention(kind, ops, dev, dims, steps=_long_steps(), prior=LONG_PRIOR)[0]
    for per_block in (1, 3):
        narrow = CudaOps(tile_rows=None, launcher=ops.launch, device=dev)
        narrow.att_heads = per_block
        got = _run_attention(kind, narrow, dev, dims, steps=_long_steps(), prior=LONG_PRIOR)[0]
        assert torch.equal(got, want), per_block


def test_a_tokens_attention_is_the_same_in_any_batch(sub, monkeypatch) -> None:
    """A token's output is bitwise the same alone, beside a longer token (more spans in the launch's grid), and
    with the step's tokens in groups of one (a small ATT_PART_BYTES): its spans follow from its keys alone."""
    ops, dev = sub
    dims = MLA_DIMS["tiny"]
    alone = _run_attention("mla", ops, dev, dims, steps=[Step([SeqChunk("mid", [7], 1500)])], prior=LONG_PRIOR)[0]
    batched = _run_attention("mla", ops, dev, dims, steps=_long_steps(), prior=LONG_PRIOR)[0]
    from pocketmoe.ops.cuda import backend

    monkeypatch.setattr(backend, "ATT_PART_BYTES", 1)
    grouped = _run_attention("mla", ops, dev, dims, steps=_long_steps(), prior=LONG_PRIOR)[0]
    assert torch.equal(batched[4], alone[0]) and torch.equal(grouped, batched)


def test_kv_cache_values_round_as_torch() -> None:
    """common.cuh's kv_store rounds a float to half and bfloat16 as torch's .to(dtype) does (kv_check's delicate
    values, then random ones, bitwise), and kv_value reads the stored value back exactly."""
    if REASON is not None:
        pytest.skip(REASON)
    from pathlib import Path

    mod = ShimModule([Path(__file__).parent / "cuda_kernels" / "kv_round.cu"])
    x = torch.cat([rounding_values(), torch.randn(1000, generator=g(70)) * 300])
    n = x.numel()
    h, b = torch.empty(n, dtype=torch.float16), torch.empty(n, dtype=torch.bfloat16)
    back_h, back_b = torch.empty(n), torch.empty(n)
    mod.launch("kv_round", grid=(-(-n // 128), 1, 1), block=(128, 1, 1), args=[x, h, b, back_h, back_b, n])
    for got, back, dtype in ((h, back_h, torch.float16), (b, back_b, torch.bfloat16)):
        assert torch.equal(got.view(torch.int16), x.to(dtype).view(torch.int16)), dtype
        assert torch.equal(back, got.float()), dtype


def gqa_layer(dims: tuple[int, ...], dev: torch.device, ops: object) -> GQAttention:
    h, kvh, hd, vd, rot = dims
    cfg = GQAConfig(n_head=h, n_head_kv=kvh, head_dim=hd, v_dim=vd, n_rot=rot, neox=True, scale=hd ** -0.5)
    return GQAttention(cfg, ops, wq=f32_linear(h * hd, 8, 1, dev), wk=f32_linear(kvh * hd, 8, 2, dev),
                       wv=f32_linear(kvh * vd, 8, 3, dev), wo=f32_linear(8, h * vd, 4, dev))


@pytest.mark.parametrize("dims,kv", [((4, 2, 64, 64, 32), "f32"), ((12, 2, 128, 128, 64), "f32"),
                                     ((4, 2, 64, 64, 32), "bf16"), ((12, 2, 128, 128, 64), "f16")],
                         ids=["mm2-tiny", "mm2-bench", "mm2-tiny-bf16", "mm2-bench-f16"])
def test_gqa_attention_over_several_sequences(sub, dims: tuple[int, ...], kv: str) -> None:
    ops, dev = sub
    dtype = KV_DTYPES[kv][0]
    out_c, cache_c = _run_attention("gqa", ops, dev, dims, dtype)
    out_r, cache_r = _run_attention("gqa", REF, torch.device("cpu"), dims, dtype)
    close(out_c, out_r, 5e-5)
    if kv == "f32":
        close(cache_c, cache_r, 1e-5)
    else:
        close_caches(cache_c, cache_r)


def test_results_do_not_depend_on_thread_order() -> None:
    """Threads run lowest id first or highest id first: bitwise the same (no race, fixed reduction order)."""
    if REASON is not None:
        pytest.skip(REASON)
    cpu = torch.device("cpu")
    fwd = _run_attention("mla", CudaOps(None, ShimLauncher(order="forward")), cpu, MLA_DIMS["tiny"])
    rev = _run_attention("mla", CudaOps(None, ShimLauncher(order="reverse")), cpu, MLA_DIMS["tiny"])
    assert all(torch.equal(a, b) for a, b in zip(fwd, rev, strict=True))
    cfg, x = ROUTES["v3-sigmoid-bias-groups-norm"][0], torch.randn(5, 64, generator=g(11))
    bias = 0.3 * torch.randn(cfg.n_experts, generator=g(8))
    routed = [CudaOps(None, ShimLauncher(order=o)).route(Router(f32_linear(256, 64, 10, cpu), cfg, bias), x)
              for o in ("forward", "reverse")]
    assert torch.equal(routed[0][0], routed[1][0]) and torch.equal(routed[0][1], routed[1][1])
