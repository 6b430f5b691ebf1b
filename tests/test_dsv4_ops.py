"""DeepSeek-V4's coarse native ops (ops/cpu_v4.py: an mHC site, an attention sublayer, an MoE sublayer in one call
each) against their torch reference (ops/reference_v4.py: the same math as fine ops, here on the native linears so
only the coarse op differs), on the tiny preset's layers: a window-only, two ratio-4 (indexer) and a ratio-128 layer,
a hash-routed and biased top-k MoE layers. Each op's rows are also bitwise the same alone as in a batch.

Legend: T tokens, n streams, D hidden.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from kv_check import KV_DTYPES, close_caches

from pocketmoe import native
from pocketmoe.engine import ModelRunner, RunnerConfig, SeqChunk, Step
from pocketmoe.engine.step import StepContext
from pocketmoe.gguf import open_bundle
from pocketmoe.ops.reference import ReferenceOps
from pocketmoe.testing.synth import write_fixture

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels")

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("ds4ops")
    return {q: write_fixture("deepseek4", "tiny", q, d / f"{q}.gguf", seed=5)[0] for q in ("F32", "MXFP4_MOE")}


def native_runner(path: Path, kv_dtype: str = "f32") -> ModelRunner:
    return ModelRunner(open_bundle(path), RunnerConfig(n_ctx=256, backend="native", chunk_size=64, max_seqs=3,
                                                       kv_dtype=kv_dtype))


def tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(2, 512, n)]


@pytest.mark.parametrize("quant", ["F32", "MXFP4_MOE"])
def test_hc_pre_and_head(fixtures: dict[str, Path], quant: str) -> None:
    r = native_runner(fixtures[quant])
    ops, m = r.ops, r.model
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, m.cfg.hc_count, m.cfg.n_embd, generator=g) * 3
    for site in (m.blocks[0].hc_attn, m.blocks[2].hc_ffn):
        got = ops.hc_pre(site, x)
        assert site.native not in (None, False)
        want = ReferenceOps.hc_pre(ops, site, x)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for i in (0, 5):
            alone = ops.hc_pre(site, x[i:i + 1].contiguous())
            assert all(torch.equal(a[0], b[i]) for a, b in zip(alone, got, strict=True))
    got = ops.hc_head(m.head_hc, x)
    torch.testing.assert_close(got, ReferenceOps.hc_head(ops, m.head_hc, x), rtol=1e-5, atol=1e-6)
    assert torch.equal(ops.hc_head(m.head_hc, x[3:4].contiguous())[0], got[3])
    assert ops.hc_pre(m.blocks[1].hc_attn, x[:0])[0].shape == (0, m.cfg.n_embd)


def _context(r: ModelRunner, chunks: list[SeqChunk]) -> StepContext:
    return StepContext.build(Step(chunks), r.cache, r.vocab_size)


def _close_but_rounding_flips(got: torch.Tensor, want: torch.Tensor) -> None:
    """Rows within TOL, but for a few rows whose quantized output projections round one activation the other way.

    The two Q8_0 projections after the attention quantize their inputs, so float noise there (the reference's
    compressor, norms and rope sum in another order: cache rows differ by up to 1.3e-6) can move one int8 value
    by a step: measured on this fixture, multiplying the reference's attention output by 1 + 1e-7 * noise changes
    about one row in 31 by more than 1e-5 (5 trials: 0-1 rows), 1e-6 * noise 0-3 rows. Such a row moves by about
    one step's worth (1e-3 here); a wrong weight, layout or formula moves every row by far more."""
    err = (got - want).abs().amax(1)
    off = err > TOL["atol"] + TOL["rtol"] * want.abs().amax(1)
    assert off.sum().item() <= 3, err
    assert err.max().item() <= 5e-3, err


@pytest.mark.parametrize("kv", list(KV_DTYPES))
@pytest.mark.parametrize("quant", ["F32", "MXFP4_MOE"])
def test_attention_sublayer(fixtures: dict[str, Path], quant: str, kv: str) -> None:
    """A step of two sequences: one continuing past a ratio-128 block and the indexer's top-k (positions 125..134
    after a 125-token prefill), one starting afresh; every layer's output and cache rows against the reference
    composition, then the fresh sequence alone. Over a cache of each KV dtype, which the native op reads and
    writes itself (kv rows, compressor states, entries rounded as the reference's .to(dtype) rounds them)."""
    r = native_runner(fixtures[quant], kv)
    assert r.cache.data.dtype == KV_DTYPES[kv][0]
    ops, m = r.ops, r.model
    r.forward(Step([SeqChunk("a", tokens(125, 1), 0, "last")]))
    a, b = SeqChunk("a", tokens(10, 2), 125, "none"), SeqChunk("b", tokens(21, 3), 0, "none")
    both, alone = _context(r, [a, b]), _context(r, [b])
    cache = r.cache.data
    saved = cache.clone()
    x = torch.randn(both.n_tokens, m.cfg.n_embd, generator=torch.Generator().manual_seed(4))
    for i, blk in enumerate(m.blocks):
        attn = blk.attn
        m.rope.prepare(both.positions)
        got = ops.dsv4_attention(attn, x, both, i, m.rope)
        assert attn.native not in (None, False)
        got_cache = cache.clone()
        cache.copy_(saved)
        want = ReferenceOps.dsv4_attention(ops, attn, x, both, i, m.rope)
        if quant == "F32":
            torch.testing.assert_close(got, want, **TOL)
        else:
            _close_but_rounding_flips(got, want)
        if kv == "f32":
            torch.testing.assert_close(got_cache, cache, **TOL)
        else:
            # Within a rounding step of the type; and the same half for all but values whose float32 sums (in
            # another order here) straddle a tie: a rounding of its own (truncating, say) changes far more.
            close_caches(got_cache, cache)
            assert (got_cache != cache).float().mean().item() < 1e-3
        cache.copy_(saved)
        m.rope.prepare(alone.positions)
        solo = ops.dsv4_attention(attn, x[10:].contiguous(), alone, i, m.rope)
        assert torch.equal(solo, got[10:]), i
        rows = torch.from_numpy(alone.write_rows).long()
        assert torch.equal(cache[i, rows], got_cache[i, rows]), i
        cache.copy_(saved)


@pytest.mark.parametrize("quant", ["F32", "MXFP4_MOE"])
def test_moe_sublayer(fixtures: dict[str, Path], quant: str) -> None:
    r = native_runner(fixtures[quant])
    ops, m = r.ops, r.model
    g = torch.Generator().manual_seed(6)
    x = torch.randn(11, m.cfg.n_embd, generator=g)
    ids = torch.randint(0, m.cfg.n_vocab, (11,), generator=g)
    for i in (0, 2):  # hash-routed, biased top-k
        moe = m.blocks[i].moe
        got = ops.dsv4_moe(moe, x, ids)
        assert moe.native not in (None, False)
        torch.testing.assert_close(got, ReferenceOps.dsv4_moe(ops, moe, x, ids), **TOL)
        for t in (0, 7):
            assert torch.equal(ops.dsv4_moe(moe, x[t:t + 1].contiguous(), ids[t:t + 1])[0], got[t])
