"""Each native op (ops/cpu.py over cpp_engine/src/ops) against its plain-torch reference (ops/reference.py),
on float weights (the native kernels then take float activations: only summation order differs) and,
for the linear ops, on quantized blocks against the reference fed the activations the kernels multiply.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from kv_check import KV_DTYPES, close_caches, rounding_values

from pocketmoe import native
from pocketmoe.engine import PagedKVCache, SeqChunk, Step, StepContext
from pocketmoe.layers import ExpertWeights, GatedMLP, MLAConfig, MLAttention, QuantEmbedding, QuantLinear
from pocketmoe.layers.experts import NativeExperts, ReferenceExperts
from pocketmoe.layers.moe import GATING_SIGMOID, GATING_SOFTMAX, MoEBlock, Router, RouterConfig
from pocketmoe.layers.norm import Residual
from pocketmoe.layers.rotary import RopeConfig, Rotary
from pocketmoe.ops.reference import ReferenceOps
from pocketmoe.quant.quantize import random_blocks

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.unavailable_reason()}")


@pytest.fixture(scope="module")
def ops():
    from pocketmoe.ops.cpu import NativeOps

    return NativeOps(), ReferenceOps(tile_rows=None)


def g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def f32_linear(out: int, inp: int, seed: int, ops: object, heads: int | None = None) -> QuantLinear:
    shape = (out, inp) if heads is None else (heads, out, inp)
    w = torch.randn(*shape, generator=g(seed)) / inp ** 0.5
    return QuantLinear(w.contiguous().view(torch.uint8).view(*shape[:-1], -1), 0, shape, backend=ops)


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-5) -> None:
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_norms_and_finalize(ops) -> None:
    nat, ref = ops
    x = torch.randn(7, 96, generator=g(1))
    w = torch.rand(96, generator=g(2)) + 0.5
    a, b = torch.randn(7, 96, generator=g(3)), torch.randn(7, 96, generator=g(4))
    close(nat.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), 1e-6)
    xn, xr = x.clone(), x.clone()
    close(nat.add_rms_norm(xn, a, w, 1e-6), ref.add_rms_norm(xr, a, w, 1e-6), 1e-6)
    assert torch.equal(xn, xr) and torch.equal(xn, x + a)
    close(nat.finalize(xn, a, b, w, 1e-6), ref.finalize(xr, a, b, w, 1e-6), 1e-6)
    assert torch.equal(xn, xr)
    assert nat.finalize(xn, a) is None and ref.finalize(xr, a) is None
    assert torch.equal(xn, xr)


@pytest.mark.parametrize("neox", [False, True], ids=["normal", "neox"])
@pytest.mark.parametrize("rot", [16, 8], ids=["full", "partial"])
def test_rope(ops, neox: bool, rot: int) -> None:
    nat, ref = ops
    rotary = Rotary(RopeConfig(dim=rot, base=10000.0, scaling="yarn", factor=4.0, original_context=32, neox=neox))
    pos = np.array([0, 5, 6, 7, 40, 3], dtype=np.int32)
    cos2, sin2 = rotary.at(pos)
    x = torch.randn(6, 3, 16, generator=g(5))
    got = nat.rope(x, cos2, sin2, neox)
    close(got, ref.rope(x, cos2, sin2, neox), 1e-6)
    # Independent check: rotate pair (i, partner) by the angle of pair i.
    cos, sin = rotary.cos_sin(torch.from_numpy(pos).long())  # [T, rot/2]
    xr = x[..., :rot]
    a, b = (xr[..., :rot // 2], xr[..., rot // 2:]) if neox else (xr[..., 0::2], xr[..., 1::2])
    c, s = cos[:, None], sin[:, None]
    ra, rb = a * c - b * s, a * s + b * c
    want = torch.cat([ra, rb], -1) if neox else torch.stack([ra, rb], -1).flatten(-2)
    close(got[..., :rot], want, 1e-5)
    assert torch.equal(got[..., rot:], x[..., rot:])


def mla_layer(ops: object) -> MLAttention:
    cfg = MLAConfig(n_head=5, qk_nope=16, qk_rope=8, v_head=12, kv_lora=32, scale=0.17)
    return MLAttention(cfg, ops, wkv_a=f32_linear(40, 64, 1, ops), kv_a_norm=torch.rand(32, generator=g(9)) + 0.5,
                       eps=1e-6, wo=f32_linear(64, 60, 2, ops), wq=f32_linear(5 * 24, 64, 3, ops),
                       k_b=f32_linear(32, 16, 4, ops, heads=5), v_b=f32_linear(12, 32, 5, ops, heads=5))


def test_mla_attention_over_several_sequences(ops) -> None:
    """Three sequences in one call (a prefill chunk after cached positions, a decode token, a fresh
    prompt) over a paged cache: native vs reference, outputs and cache rows."""
    rotary = Rotary(RopeConfig(dim=8, base=10000.0))
    outs, caches = [], []
    for o in ops:
        attn = mla_layer(o)
        cache = PagedKVCache(n_layer=1, width=40, n_pages=12, max_seq_len=64, page=4)
        ctx_steps = [Step([SeqChunk("a", list(range(9)), 0), SeqChunk("b", list(range(5)), 0)]),
                     Step([SeqChunk("a", list(range(6)), 9), SeqChunk("b", [1], 5), SeqChunk("c", list(range(7)), 0)])]
        res = []
        for i, step in enumerate(ctx_steps):
            ctx = StepContext.build(step, cache, 100)
            ctx.cos2, ctx.sin2 = rotary.at(ctx.positions)
            t = ctx.n_tokens
            q = torch.randn(t, 5 * 24, generator=g(10 + i))
            kv = torch.randn(t, 40, generator=g(20 + i))
            res.append(o.mla_attention(attn, q, kv, ctx, 0))
        outs.append(torch.cat(res))
        caches.append(cache.data.clone())
    close(outs[0], outs[1])
    close(caches[0], caches[1], 1e-6)


def _mla_steps(o: object, attn: MLAttention, cache: PagedKVCache, steps: list[Step], seed: int) -> list[torch.Tensor]:
    """mla_attention on each step in turn, with seeded random q and kv rows."""
    rotary = Rotary(RopeConfig(dim=8, base=10000.0))
    outs = []
    for i, step in enumerate(steps):
        ctx = StepContext.build(step, cache, 1000)
        ctx.cos2, ctx.sin2 = rotary.at(ctx.positions)
        q = torch.randn(ctx.n_tokens, 5 * 24, generator=g(seed + i))
        kv = torch.randn(ctx.n_tokens, 40, generator=g(seed + 50 + i))
        outs.append(o.mla_attention(attn, q, kv, ctx, 0))
    return outs


@pytest.mark.parametrize("kv", list(KV_DTYPES))
def test_mla_attention_over_many_keys(ops, kv: str) -> None:
    """Past several chunks of 64 keys (partial softmaxes, merged per head): a 150-token and a 70-token prefill,
    then the first sequence's next 3 tokens beside a decode and a fresh prompt; native vs reference, over a
    cache of each dtype. On the native side each row is bitwise the same alone as in the batch, and a decode row
    is bitwise the last row of a prefill of the same tokens."""
    dtype = KV_DTYPES[kv][0]
    prefill = Step([SeqChunk("a", list(range(150)), 0), SeqChunk("b", list(range(70)), 0)])
    step = Step([SeqChunk("a", [1, 2, 3], 150), SeqChunk("b", [4], 70), SeqChunk("c", list(range(5)), 0)])
    results = []
    for o in ops:
        cache = PagedKVCache(n_layer=1, width=40, n_pages=24, max_seq_len=256, page=16, dtype=dtype)
        results.append((_mla_steps(o, mla_layer(o), cache, [prefill, step], 30), cache))
    (nat, nat_cache), (ref, ref_cache) = results
    for a, b in zip(nat, ref, strict=True):
        close(a, b)
    close_caches(nat_cache.data, ref_cache.data)

    nat_ops = ops[0]
    attn = mla_layer(nat_ops)
    cache = PagedKVCache(n_layer=1, width=40, n_pages=24, max_seq_len=256, page=16, dtype=dtype)
    _mla_steps(nat_ops, attn, cache, [prefill], 30)
    rotary = Rotary(RopeConfig(dim=8, base=10000.0))
    q = torch.randn(9, 5 * 24, generator=g(31))
    kv = torch.randn(9, 40, generator=g(81))
    saved = cache.data.clone()
    both = StepContext.build(step, cache, 1000)
    both.cos2, both.sin2 = rotary.at(both.positions)
    batched = nat_ops.mla_attention(attn, q, kv, both, 0)
    assert torch.equal(batched, nat[1])
    for chunk, rows in ((step.chunks[1], slice(3, 4)), (step.chunks[0], slice(0, 3))):
        cache.data.copy_(saved)
        alone = StepContext.build(Step([chunk]), cache, 1000)
        alone.cos2, alone.sin2 = rotary.at(alone.positions)
        assert torch.equal(nat_ops.mla_attention(attn, q[rows], kv[rows], alone, 0), batched[rows])

    # Row 149 of a 150-token prefill vs the same row decoded after a 149-token prefill.
    q = torch.randn(150, 5 * 24, generator=g(40))
    kv = torch.randn(150, 40, generator=g(41))
    outs = []
    for cut in (150, 149):
        cache = PagedKVCache(n_layer=1, width=40, n_pages=24, max_seq_len=256, page=16, dtype=dtype)
        for start, end in ((0, cut), (cut, 150)):
            if start == end:
                continue
            ctx = StepContext.build(Step([SeqChunk("a", list(range(start, end)), start)]), cache, 1000)
            ctx.cos2, ctx.sin2 = rotary.at(ctx.positions)
            out = nat_ops.mla_attention(attn, q[start:end], kv[start:end], ctx, 0)
        outs.append(out[-1])
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("kv", ["f16", "bf16"])
def test_kv_cache_rounds_as_torch(ops, kv: str) -> None:
    """The native attention stores a cache entry rounded to nearest even as torch's .to(dtype) rounds it: the V
    values of a GQA cache row are the op's v input as given, here kv_check's delicate values and random ones."""
    from pocketmoe.layers.gqa import GQAConfig, GQAttention

    dtype = KV_DTYPES[kv][0]
    cfg = GQAConfig(n_head=2, n_head_kv=1, head_dim=8, v_dim=64, n_rot=8, neox=False, scale=0.3)
    attn = GQAttention(cfg, ops[0], wq=None, wk=None, wv=None, wo=None)  # type: ignore[arg-type]
    special = rounding_values()
    v = torch.randn(3, 64, generator=g(60)) * 100
    v.view(-1)[:len(special)] = special
    rotary = Rotary(RopeConfig(dim=8, base=10000.0))
    cache = PagedKVCache(n_layer=1, width=72, n_pages=2, max_seq_len=32, page=16, dtype=dtype)
    ctx = StepContext.build(Step([SeqChunk("a", [1, 2, 3], 0)]), cache, 100)
    ctx.cos2, ctx.sin2 = rotary.at(ctx.positions)
    assert ops[0]._step_args(ctx) is not None, "the cache did not go to the native op"
    ops[0].gqa_attention(attn, torch.randn(3, 16, generator=g(61)), torch.randn(3, 8, generator=g(62)), v, ctx, 0)
    rows = torch.from_numpy(ctx.write_rows).long()
    got, want = cache.data[0, rows, 8:], v.to(dtype)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_attention_refuses_a_cache_it_cannot_read() -> None:
    """A cache of another dtype, shape or layout is a ValueError naming what is wrong, before anything is written."""
    lib = native._lib()
    shape = lib.GQAShape(2, 1, 8, 8, 8, False, 0.3)
    q, k, v = np.ones((1, 16), np.float32), np.ones((1, 8), np.float32), np.ones((1, 8), np.float32)
    cos2, sin2 = np.ones((1, 8), np.float32), np.zeros((1, 8), np.float32)
    step = (np.zeros(1, np.int32), np.ones(1, np.int32), np.zeros(1, np.int32), np.zeros((1, 1), np.int32), 16)
    for cache, message in ((np.zeros((16, 16), np.float64), "float32, float16 or uint16"),
                           (np.zeros((16, 12), np.float16), "rows have 12 values, expected 16"),
                           (np.zeros((2, 16, 16), np.uint16), "2 dimensions, got 3"),
                           (np.zeros((16, 32), np.float32)[:, ::2], "C-contiguous")):
        before = cache.copy()
        with pytest.raises(ValueError, match=message):
            lib.gqa_attention(shape, q, k, v, cos2, sin2, cache, *step)
        assert np.array_equal(cache, before)


@pytest.mark.parametrize("h", [16, 288])
def test_attention_over_tens_of_thousands_of_keys(h: int) -> None:
    """One query over 33,000 keys (516 chunks of 64, folded into 31 spans of 17 chunks and a last of 6, one partial
    per head and span); with 288 heads those partials (288 x 31 x 514 floats) pass the cap a call holds, so the heads
    go in blocks. Against float64 softmax attention with each head's sink, and the second query of the call the
    first one's keys in reverse. The keys repeat 97 cache rows (K = V, 512 values), read-only (the op only reads
    them)."""
    rng = np.random.default_rng(0)
    d, n_keys, scale = 512, 33_000, 0.05
    cache = rng.standard_normal((97, d)).astype(np.float32)
    cache.setflags(write=False)
    rows = rng.integers(0, 97, n_keys)
    offsets = np.concatenate([rows, rows[::-1]]).astype(np.int64) * d
    starts = np.array([0, n_keys, 2 * n_keys], dtype=np.int32)
    q = rng.standard_normal((2, h, d)).astype(np.float32)
    sinks = rng.standard_normal(h).astype(np.float32)
    got = native._lib().dsv4_attend(q, cache, offsets, starts, sinks, scale)
    for t, keys in enumerate((rows, rows[::-1])):
        kv = cache[keys].astype(np.float64)                              # [S, d]
        logits = np.concatenate([q[t].astype(np.float64) @ kv.T * scale, sinks[:, None]], axis=1)
        p = np.exp(logits - logits.max(1, keepdims=True))
        want = (p[:, :-1] / p.sum(1, keepdims=True)) @ kv                # [h, d], the sink's mass dropped
        np.testing.assert_allclose(got[t], want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("case", ["softmax", "sigmoid-bias-groups-norm-scale"])
def test_route(ops, case: str) -> None:
    nat, ref = ops
    if case == "softmax":
        cfg, bias = RouterConfig(16, 4, GATING_SOFTMAX), None
    else:
        cfg = RouterConfig(16, 4, GATING_SIGMOID, n_groups=4, groups_used=2, norm=True, scale=2.5)
        bias = 0.3 * torch.randn(16, generator=g(7))
    x = torch.randn(33, 64, generator=g(8))
    w_n, ids_n = nat.route(Router(f32_linear(16, 64, 6, nat), cfg, bias, nat), x)
    w_r, ids_r = ref.route(Router(f32_linear(16, 64, 6, ref), cfg, bias, ref), x)
    assert torch.equal(ids_n.long(), ids_r)
    close(w_n, w_r, 1e-5)


def test_ffn_and_moe(ops) -> None:
    nat, ref = ops
    x = torch.randn(9, 64, generator=g(11))
    y = [o.ffn(GatedMLP(f32_linear(48, 64, 1, o), f32_linear(48, 64, 2, o), f32_linear(64, 48, 3, o), o), x)
         for o in ops]
    close(y[0], y[1])
    # F32 experts (float activations); the quantized kernels of the MoE op are tested in test_native_kernels.
    ew = [ExpertWeights((torch.randn(8, o, i, generator=g(30 + k)) / i ** 0.5).view(torch.uint8).view(8, o, -1), 0,
                        (8, o, i)) for k, (o, i) in enumerate(((32, 64), (32, 64), (64, 32)))]
    ids = torch.stack([torch.randperm(8, generator=g(s))[:3] for s in range(9)])
    w = torch.rand(9, 3, generator=g(12))
    close(nat.moe(NativeExperts(*ew), x, ids, w), ref.moe(ReferenceExperts(*ew), x, ids, w))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0, Q.IQ4_XS])
def test_linear_multi_and_embed(ops, qtype: Q) -> None:
    nat, ref = ops
    rng = np.random.default_rng(int(qtype))
    ws = [(QuantLinear(torch.from_numpy(random_blocks(int(qtype), (r, 256), rng)), int(qtype), (r, 256),
                       backend=nat)) for r in (24, 40)]
    x = torch.randn(5, 256, generator=g(13))
    multi = nat.linear_multi(ws, x)
    for w, y in zip(ws, multi, strict=True):
        assert torch.equal(y, nat.linear(w, x))  # one quantized activation, bitwise each weight alone
        xq = torch.from_numpy(native.activation_roundtrip(x.numpy(), int(qtype)))
        close(y, ref.linear(w, xq), 1e-4)
    table = QuantEmbedding(torch.from_numpy(random_blocks(int(qtype), (30, 256), rng)), int(qtype), (30, 256))
    tokens = np.array([3, 0, 29, 3], dtype=np.int32)
    close(nat.embed(table, tokens), ref.embed(table, tokens), 1e-6)


def _op_by_op(nat):
    """The native backend with its one-call sublayers disabled: the same native ops, one call each."""
    from pocketmoe.ops.cpu import NativeOps

    class OpByOp(NativeOps):
        mla_sublayer = ReferenceOps.mla_sublayer
        ffn_sublayer = ReferenceOps.ffn_sublayer
        moe_sublayer = ReferenceOps.moe_sublayer

    return OpByOp()


@pytest.mark.parametrize("qlora", [False, True], ids=["q", "q-lora"])
def test_mla_sublayer(ops, qlora: bool) -> None:
    """One native call (projections, attention, output, residual + next norm) is bitwise the native ops one
    at a time, and matches the torch reference; over two steps of two sequences."""
    nat, ref = ops
    rotary = Rotary(RopeConfig(dim=8, base=10000.0))
    norm = torch.rand(64, generator=g(40)) + 0.5
    results = []
    for o in (nat, _op_by_op(nat), ref):
        attn = mla_layer(o)
        if qlora:
            attn.wq, attn.wq_a, attn.wq_b = None, f32_linear(48, 64, 41, o), f32_linear(5 * 24, 48, 42, o)
            attn.q_a_norm = torch.rand(48, generator=g(43)) + 0.5
        cache = PagedKVCache(n_layer=1, width=40, n_pages=8, max_seq_len=32, page=4)
        x = torch.randn(11, 64, generator=g(44))
        outs = []
        for step in (Step([SeqChunk("a", list(range(7)), 0), SeqChunk("b", list(range(4)), 0)]),
                     Step([SeqChunk("a", [1], 7), SeqChunk("b", [2, 3], 4)])):
            ctx = StepContext.build(step, cache, 100)
            ctx.cos2, ctx.sin2 = rotary.at(ctx.positions)
            xs = x[:ctx.n_tokens].clone()
            xn = torch.randn(ctx.n_tokens, 64, generator=g(45 + len(outs)))
            nxt = attn(xn, ctx, 0, Residual(xs, norm, 1e-6))
            outs += [xs, nxt]
            assert attn(xn, ctx, 0, Residual(xs.clone(), None, 1e-6)) is None
        results.append(outs)
    fused, one_by_one, torch_ref = results
    for a, b, c in zip(fused, one_by_one, torch_ref, strict=True):
        assert torch.equal(a, b)
        close(a, c, 1e-4)


def test_ffn_and_moe_sublayers(ops) -> None:
    nat, ref = ops
    norm = torch.rand(64, generator=g(50)) + 0.5
    xn = torch.randn(9, 64, generator=g(51))
    ew = [ExpertWeights((torch.randn(8, o, i, generator=g(52 + k)) / i ** 0.5).view(torch.uint8).view(8, o, -1), 0,
                        (8, o, i)) for k, (o, i) in enumerate(((32, 64), (32, 64), (64, 32)))]
    cfg = RouterConfig(8, 3, GATING_SIGMOID, norm=True, scale=1.5)
    bias = 0.2 * torch.randn(8, generator=g(55))
    results = []
    for o in (nat, _op_by_op(nat), ref):
        mlp = GatedMLP(f32_linear(48, 64, 56, o), f32_linear(48, 64, 57, o), f32_linear(64, 48, 58, o), o)
        bank = NativeExperts(*ew) if o is not ref else ReferenceExperts(*ew)
        block = MoEBlock(Router(f32_linear(8, 64, 59, o), cfg, bias, o), bank, mlp)
        x1, x2 = torch.randn(9, 64, generator=g(60)), torch.randn(9, 64, generator=g(61))
        n1 = mlp(xn, Residual(x1, norm, 1e-6))
        n2 = block(xn, Residual(x2, norm, 1e-6))
        results.append((x1, n1, x2, n2))
    for a, b, c in zip(*results, strict=True):
        assert torch.equal(a, b)
        close(a, c, 1e-4)


@pytest.mark.parametrize("n", [1, 9, 300])
def test_moe_sublayer_quantized_shared_expert(ops, n: int) -> None:
    """The one-call MoE sublayer runs the shared expert inside the routed experts' dispatches; on quantized
    weights whose activation formats differ (Q8_K, Q8_0, float), a shared width unlike the routed one and more
    tokens than one gemm work item takes, it is bitwise the same native ops one call each."""
    nat, _ = ops
    rng = np.random.default_rng(70 + n)
    hidden, ffn, sffn, ne = 256, 256, 512, 8

    def experts(qtype: Q, o: int, i: int) -> ExpertWeights:
        return ExpertWeights(torch.from_numpy(random_blocks(int(qtype), (ne, o, i), rng)), int(qtype), (ne, o, i))

    ew = [experts(Q.Q4_K, ffn, hidden), experts(Q.Q5_0, ffn, hidden), experts(Q.Q6_K, hidden, ffn)]
    shared = [(Q.Q8_0, sffn, hidden), (Q.IQ4_XS, sffn, hidden), (Q.F16, hidden, sffn)]
    blocks = [random_blocks(int(q), (o, i), rng) for q, o, i in shared]
    router = torch.randn(ne, hidden, generator=g(71)) / hidden ** 0.5
    cfg = RouterConfig(ne, 3, GATING_SOFTMAX, norm=False, scale=1.0)
    norm = torch.rand(hidden, generator=g(72)) + 0.5
    xn = torch.randn(n, hidden, generator=g(73))
    x = torch.randn(n, hidden, generator=g(74))
    results = []
    for o in (nat, _op_by_op(nat)):
        mlp = GatedMLP(*(QuantLinear(torch.from_numpy(b), int(q), (r, c), backend=o)
                         for b, (q, r, c) in zip(blocks, shared, strict=True)), o)
        gate = QuantLinear(router.contiguous().view(torch.uint8), 0, (ne, hidden), backend=o)
        block = MoEBlock(Router(gate, cfg, None, o), NativeExperts(*ew), mlp)
        xs = x.clone()
        results.append((xs, block(xn, Residual(xs, norm, 1e-6))))
        if o is nat:
            assert block.native not in (None, False)  # the one native call ran
    (xa, na), (xb, nb) = results
    assert torch.equal(xa, xb) and torch.equal(na, nb)
    assert torch.isfinite(na).all() and not torch.equal(xa, x)
