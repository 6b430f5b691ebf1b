"""Layers vs independent references: HF transformers modules, gguf.quants.dequantize, plain torch."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from kv_check import KV_DTYPES
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf3

from pocketmoe.engine import ContextLengthError, KVPoolFullError, PagedKVCache
from pocketmoe.errors import PocketMoEError
from pocketmoe.gguf import open_bundle
from pocketmoe.layers import (
    ExpertWeights,
    QuantEmbedding,
    QuantLinear,
    ReferenceExperts,
    RMSNorm,
    RopeConfig,
    Rotary,
    Router,
    RouterConfig,
    apply_rope,
)
from pocketmoe.layers.linear import tiled_linear
from pocketmoe.native import available as native_available
from pocketmoe.ops.reference import ReferenceOps
from pocketmoe.quant.quantize import random_blocks

QTYPES = [Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.IQ2_XXS, Q.F16]


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def hf_config(cls: type, **kw: object) -> object:
    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, kv_lora_rank=16,
                q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=8,
                moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3)
    return cls(**{**base, **kw})


@pytest.mark.parametrize("factor", [1.0, 4.0, 40.0])
def test_rope_matches_hf(factor: float) -> None:
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if factor > 1:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": factor,
                "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                "mscale": 0.707, "mscale_all_dim": 0.707}
    cfg = hf_config(DeepseekV2Config, rope_parameters=rope, max_position_embeddings=int(64 * max(factor, 2)))
    pos = torch.arange(0, 120)[None]
    freqs = hf2.DeepseekV2RotaryEmbedding(cfg)(torch.zeros(1), pos)
    q, k = torch.randn(1, 2, 120, 16), torch.randn(1, 1, 120, 16)
    ref_q, ref_k = hf2.apply_rotary_emb(q, k, freqs)
    kind = "yarn" if factor > 1 else "none"
    cos, sin = Rotary(RopeConfig(16, 10000.0, kind, factor, 64)).cos_sin(pos[0])
    torch.testing.assert_close(apply_rope(q, cos, sin), ref_q, atol=2e-5, rtol=0)
    torch.testing.assert_close(apply_rope(k, cos, sin), ref_k, atol=2e-5, rtol=0)


def test_rope_config_errors() -> None:
    with pytest.raises(PocketMoEError, match="even"):
        RopeConfig(15, 10000.0)
    with pytest.raises(PocketMoEError, match="original_context_length"):
        RopeConfig(16, 10000.0, "yarn", 4.0, 0)


def test_rmsnorm_matches_hf() -> None:
    ref = hf2.DeepseekV2RMSNorm(48, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(48))
    x = torch.randn(5, 48) * 3
    torch.testing.assert_close(RMSNorm(ref.weight.detach(), 1e-6)(x), ref(x), atol=1e-6, rtol=1e-6)


def write_tensors(path: Path, tensors: dict[str, tuple[np.ndarray, Q]]) -> Path:
    w = gguf.GGUFWriter(str(path), "test")
    for name, (arr, qtype) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=None if qtype == Q.F32 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("qtype", QTYPES, ids=[q.name for q in QTYPES])
def test_quant_linear_and_embedding(qtype: Q, tmp_path: Path) -> None:
    shape = (24, 512)  # [out, in]
    blocks = random_blocks(int(qtype), shape, rng(1))
    bundle = open_bundle(write_tensors(tmp_path / "w.gguf", {"w": (blocks, qtype)}))
    ref_w = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32)).reshape(shape)
    x = torch.randn(7, 512)
    for cache in (False, True):
        lin = QuantLinear.from_bundle(bundle, "w", cache_dense=cache)
        torch.testing.assert_close(lin(x), x @ ref_w.T, atol=1e-4, rtol=1e-5)
        assert (lin._dense is not None) == cache
    tokens = torch.tensor([3, 0, 23, 3])
    torch.testing.assert_close(QuantEmbedding.from_bundle(bundle, "w")(tokens), ref_w[tokens], atol=0, rtol=0)


def test_f32_weights_are_zero_copy_views(tmp_path: Path) -> None:
    w = np.random.default_rng(2).standard_normal((6, 32, 64)).astype(np.float32)
    bundle = open_bundle(write_tensors(tmp_path / "w.gguf", {"exps": (w, Q.F32), "lin": (w[0], Q.F32)}))
    lin = QuantLinear.from_bundle(bundle, "lin")
    assert lin.dense().data_ptr() == bundle.raw_torch("lin").data_ptr()
    ex = ExpertWeights.from_bundle(bundle, "exps")
    assert ex.expert(3).data_ptr() == bundle.raw_torch("exps")[3].data_ptr()
    assert torch.equal(ex.expert(3), torch.from_numpy(w[3]))
    assert torch.equal(ex.rows(8, 32).expert(5), torch.from_numpy(w[5, 8:]))


def test_tiled_linear_is_batch_invariant() -> None:
    w, x = torch.randn(96, 128), torch.randn(40, 128)
    full = tiled_linear(x, w, 16)
    torch.testing.assert_close(full, F.linear(x, w), atol=1e-5, rtol=1e-5)
    for rows in ([5], [0, 39, 7], list(range(17))):
        assert torch.equal(tiled_linear(x[rows], w, 16), full[rows])


def hf_router_case(v3: bool) -> tuple[torch.nn.Module, Router]:
    if v3:
        cfg = hf_config(DeepseekV3Config, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
        ref = hf3.DeepseekV3TopkRouter(cfg)
    else:
        cfg = hf_config(DeepseekV2Config, topk_method="greedy", routed_scaling_factor=1.7)
        ref = hf2.DeepseekV2TopkRouter(cfg)
    torch.manual_seed(4)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(8, 32) / 32 ** 0.5 * 3)
        if v3:
            ref.e_score_correction_bias.copy_(0.3 * torch.randn(8))
    rc = RouterConfig(8, 3, gating=2 if v3 else 1, n_groups=4 if v3 else 1, groups_used=2, norm=v3,
                      scale=2.5 if v3 else 1.7)
    bias = ref.e_score_correction_bias.detach() if v3 else None
    return ref, Router(QuantLinear(ref.weight.detach(), 0, (8, 32)), rc, bias, ReferenceOps())


@pytest.mark.parametrize("v3", [False, True], ids=["softmax", "sigmoid-bias-groups-norm"])
def test_router_matches_hf(v3: bool) -> None:
    ref, router = hf_router_case(v3)
    x = torch.randn(50, 32)
    _, ref_w, ref_ids = ref(x)
    w, ids = router(x)
    order = ref_ids.argsort(-1)
    assert torch.equal(ids.sort(-1).values, ref_ids.gather(1, order))
    torch.testing.assert_close(w.gather(1, ids.argsort(-1)), ref_w.gather(1, order), atol=1e-6, rtol=1e-6)


def test_router_config_errors() -> None:
    with pytest.raises(PocketMoEError, match="gating function 4"):
        RouterConfig(8, 2, gating=4)
    with pytest.raises(PocketMoEError, match="fewer than the 5 experts"):
        RouterConfig(8, 5, n_groups=4, groups_used=2)


def test_reference_experts_match_hf_and_are_batch_invariant() -> None:
    cfg = hf_config(DeepseekV2Config, moe_intermediate_size=24)
    ref = hf2.DeepseekV2Experts(cfg)
    torch.manual_seed(5)
    with torch.no_grad():
        ref.gate_up_proj.normal_(0, 0.2)
        ref.down_proj.normal_(0, 0.2)
    gu, down = ref.gate_up_proj.detach(), ref.down_proj.detach()
    bank = ReferenceExperts(ExpertWeights(gu[:, :24], 0, (8, 24, 32)), ExpertWeights(gu[:, 24:], 0, (8, 24, 32)),
                            ExpertWeights(down, 0, (8, 32, 24)), tile_rows=8)
    x, ids, w = torch.randn(30, 32), torch.stack([torch.randperm(8)[:3] for _ in range(30)]), torch.rand(30, 3)
    y = bank(x, ids, w)
    torch.testing.assert_close(y, ref(x, ids, w), atol=1e-5, rtol=1e-5)
    for rows in ([4], [29, 0, 11], list(range(0, 30, 2))):
        assert torch.equal(bank(x[rows], ids[rows], w[rows]), y[rows])


def test_paged_cache() -> None:
    cache = PagedKVCache(n_layer=2, width=5, n_pages=3, max_seq_len=40, page=4)
    cache.reserve("a", 6)                      # pages 0, 1
    cache.reserve("b", 3)                      # page 2
    assert cache.rows("a", 0, 6).tolist() == [0, 1, 2, 3, 4, 5]
    assert cache.rows("b", 1, 2).tolist() == [9, 10]
    assert cache.page_table(["b", "a"]).tolist() == [[2, -1], [0, 1]]
    with pytest.raises(KVPoolFullError, match="0 free pages of 4 positions but 1 more are needed"):
        cache.reserve("a", 9)
    cache.free("b")
    cache.reserve("a", 9)                      # takes b's page back
    assert cache.rows("a", 8, 1).tolist() == [8] and cache.free_pages == 0
    rows = cache.rows("a", 0, 3)
    cache.data[1, torch.from_numpy(rows).long()] = torch.arange(15.0).view(3, 5)
    assert torch.equal(cache.keys(1, rows), torch.arange(15.0).view(3, 5))
    with pytest.raises(ContextLengthError, match="6 tokens and 35 more were requested, 41 in all, but the "
                                                 "context holds 40"):
        cache.check_fits(6, 35)
    with pytest.raises(ContextLengthError, match="position 40 is past the context of 40"):
        cache.reserve("a", 41)


@pytest.mark.parametrize("t", [0, 1, 5, 130])
def test_sinkhorn_is_the_torch_formula_bitwise(t: int) -> None:
    """DeepSeek-V4's mHC Sinkhorn (numpy, for speed on 4 x 4 blocks) against the same steps in torch."""
    from pocketmoe.ops.reference_v4 import sinkhorn

    eps, iters = 1e-6, 20
    logits = torch.randn(t, 4, 4, generator=torch.Generator().manual_seed(t)) * 4
    want = logits.softmax(-1) + eps
    want = want / (want.sum(1, keepdim=True) + eps)
    for _ in range(iters - 1):
        want = want / (want.sum(2, keepdim=True) + eps)
        want = want / (want.sum(1, keepdim=True) + eps)
    got = torch.from_numpy(sinkhorn(logits.softmax(-1).numpy(), iters, eps))
    assert torch.equal(got, want)
    if t:
        assert torch.allclose(got.sum(1), torch.ones(t, 4), atol=1e-5)  # columns sum to one after the last step


@pytest.mark.skipif(not native_available(), reason="native kernels")
@pytest.mark.parametrize("t", [0, 1, 9])
def test_native_hyper_connection_ops_are_the_reference_bitwise(t: int) -> None:
    """hc_sinkhorn / hc_mix / hc_post on the native kernels against the torch / numpy reference, bit for bit."""
    from pocketmoe.ops.cpu import NativeOps

    g = torch.Generator().manual_seed(100 + t)
    ref, nat = ReferenceOps(), NativeOps()
    p = (torch.randn(t, 4, 4, generator=g) * 3).softmax(-1)
    x, out = torch.randn(t, 4, 96, generator=g), torch.randn(t, 96, generator=g)
    w, post = torch.rand(t, 4, generator=g), 2 * torch.rand(t, 4, generator=g)
    comb = ref.hc_sinkhorn(p, 20, 1e-6)
    assert torch.equal(nat.hc_sinkhorn(p, 20, 1e-6), comb)
    assert torch.equal(nat.hc_mix(x, w), ref.hc_mix(x, w))
    assert torch.equal(nat.hc_post(out, x, post, comb), ref.hc_post(out, x, post, comb))


@pytest.mark.skipif(not native_available(), reason="native kernels")
@pytest.mark.parametrize("kv", list(KV_DTYPES))
def test_native_dsv4_attend_is_the_torch_softmax_with_sinks(kv: str) -> None:
    """DeepSeek-V4's attention core on the native kernels: each query over its allowed keys (window rows and
    entries at any value offsets of the cache, of each KV dtype), the head's sink logit in the softmax, against
    the torch path; a query's output is bitwise the same alone or with others."""
    from pocketmoe.ops.cpu import NativeOps

    g = torch.Generator().manual_seed(5)
    t, h, d, width, rows = 7, 6, 64, 200, 40
    cache = torch.randn(rows, width, generator=g).to(KV_DTYPES[kv][0])
    offsets = np.concatenate([np.arange(20) * width + 3, np.arange(20, 30) * width + 130]).astype(np.int64)
    allowed = torch.rand(t, len(offsets), generator=g).numpy() < 0.6
    allowed[np.arange(t), np.arange(t)] = True  # every query sees at least one key
    q, sinks = torch.randn(t, h, d, generator=g), torch.randn(h, generator=g) * 3
    ref, nat = ReferenceOps(), NativeOps()
    want = ref.dsv4_attend(q, cache, offsets, allowed, sinks, 0.125)
    got = nat.dsv4_attend(q, cache, offsets, allowed, sinks, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    no_sink = nat.dsv4_attend(q, cache, offsets, allowed, torch.full((h,), -1e30), 0.125)
    assert (got - no_sink).abs().max() > 1e-3  # the sinks take mass
    for i in (0, 4):
        alone = nat.dsv4_attend(q[i:i + 1].contiguous(), cache, offsets, allowed[i:i + 1], sinks, 0.125)
        assert torch.equal(alone[0], got[i])
