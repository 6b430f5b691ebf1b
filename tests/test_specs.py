"""Spec registry, metadata parsing with llama.cpp's defaults, full-size presets, validation reports."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest

from pocketmoe.errors import PocketMoEError
from pocketmoe.specs import (
    SUPPORTED_ARCHITECTURES,
    DeepSeek2Config,
    DeepSeek4Config,
    MiniMaxM2Config,
    Role,
    SpecError,
    UnknownArchitectureError,
    metadata_from_config,
    register,
    spec_from_bundle,
    spec_from_metadata,
)
from pocketmoe.specs.base import KV, ModelSpec
from pocketmoe.specs.deepseek2 import decode_log_mul, encode_log_mul
from pocketmoe.specs.metadata import RopeScaling, plain

F32, Q8_0, Q4_K, I32 = 0, 8, 12, 26
PRESETS = {"deepseek2": DeepSeek2Config.v2_lite(), "minimax-m2": MiniMaxM2Config.full(),
           "deepseek4": DeepSeek4Config.flash()}


def tiny_ds2(**kw) -> DeepSeek2Config:
    base = dict(n_vocab=96, n_ctx=256, n_embd=64, n_layer=3, n_head=4, n_ff=96, n_expert=8, n_expert_used=2,
                n_expert_shared=1, n_ff_exp=32, n_dense_lead=1, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16)
    return DeepSeek2Config(**(base | kw))


def bundle_for(spec: ModelSpec, **types) -> SimpleNamespace:
    """A stand-in bundle with the spec's required tensors and output.weight: floats F32, tid2eid I32,
    the rest Q8_0 (`types` overrides per name)."""
    tensors = {}
    for t in spec.tensors():
        if t.optional and t.name != "output.weight":
            continue
        ty = I32 if t.allowed_types else F32 if t.float_only else Q8_0
        tensors[t.name] = SimpleNamespace(shape=t.shape, ggml_type=types.get(t.name, ty))
    return SimpleNamespace(metadata=plain(spec.metadata()), tensors=tensors)


def ds2_minimal_metadata() -> dict:
    p = "deepseek2."
    return {"general.architecture": "deepseek2", p + "block_count": 2, p + "context_length": 512,
            p + "embedding_length": 64, p + "attention.head_count": 4, p + "rope.dimension_count": 8,
            p + "attention.kv_lora_rank": 32, p + "attention.key_length_mla": 24,
            p + "attention.value_length_mla": 16, p + "attention.layer_norm_rms_epsilon": 1e-5,
            p + "expert_count": 8, p + "expert_used_count": 2, p + "expert_shared_count": 0,
            p + "expert_feed_forward_length": 32, "tokenizer.ggml.tokens": ["t"] * 77}


# --- registry ------------------------------------------------------------------------------------

def test_registry_lists_the_three_architectures():
    assert set(SUPPORTED_ARCHITECTURES) == {"deepseek2", "minimax-m2", "deepseek4"}


def test_unknown_architecture_names_supported_ones():
    with pytest.raises(UnknownArchitectureError) as e:
        spec_from_metadata({"general.architecture": "llama"})
    msg = str(e.value)
    assert "'llama'" in msg and all(a in msg for a in SUPPORTED_ARCHITECTURES)
    assert isinstance(e.value, PocketMoEError) and isinstance(e.value, SpecError)
    with pytest.raises(UnknownArchitectureError, match="general.architecture"):
        spec_from_metadata({})


def test_register_rejects_a_second_spec_for_an_architecture():
    with pytest.raises(SpecError, match="already registered"):
        register("deepseek2")(type("Other", (ModelSpec,), {}))


@pytest.mark.parametrize("arch", sorted(PRESETS))
def test_config_metadata_round_trip(arch):
    cfg = PRESETS[arch]
    meta = metadata_from_config(arch, cfg)
    assert meta["general.architecture"].value == arch
    assert all(isinstance(v, KV) for v in meta.values())
    spec = spec_from_metadata(meta)
    assert spec.architecture == arch and spec.config == cfg
    assert spec_from_metadata(plain(meta)).config == cfg


def test_metadata_from_config_rejects_the_wrong_config_type():
    with pytest.raises(SpecError, match="DeepSeek2Config"):
        metadata_from_config("deepseek2", MiniMaxM2Config.full())


# --- deepseek2 metadata ---------------------------------------------------------------------------

def test_deepseek2_llama_cpp_defaults():
    c = spec_from_metadata(ds2_minimal_metadata()).config
    assert (c.gating, c.expert_weights_norm, c.expert_weights_scale) == ("softmax", False, 1.0)
    assert (c.n_expert_groups, c.n_expert_groups_used, c.n_dense_lead, c.q_lora_rank) == (1, 1, 0, 0)
    assert c.rope_freq_base == 10000.0 and c.rope_scaling == RopeScaling("none", 1.0, 512, 32.0, 1.0)
    assert c.mscale_all_dim == 0.0 and c.yarn_mscale == 1.0
    assert c.n_vocab == 77 and (c.bos_token_id, c.eos_token_id) == (None, None)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.mla_layout) == (16, 8, 16, "absorbed")
    assert c.attn_scale == pytest.approx(1 / math.sqrt(24))


def test_deepseek2_zero_means_one_and_token_ids():
    p = "deepseek2."
    meta = ds2_minimal_metadata() | {p + "expert_weights_scale": 0.0, p + "expert_group_count": 0,
                                     p + "expert_group_used_count": 0, p + "expert_gating_func": 0,
                                     p + "vocab_size": 100, "tokenizer.ggml.bos_token_id": 5,
                                     "tokenizer.ggml.eos_token_id": 6}
    c = spec_from_metadata(meta).config
    assert (c.expert_weights_scale, c.n_expert_groups, c.n_expert_groups_used, c.gating_func) == (1.0, 1, 1, 1)
    assert c.n_vocab == 100 and (c.bos_token_id, c.eos_token_id) == (5, 6)


def test_deepseek2_yarn_log_multiplier_is_a_tenth_of_mscale_all_dim():
    c = DeepSeek2Config.v2_lite()
    meta = plain(metadata_from_config("deepseek2", c))
    assert meta["deepseek2.rope.scaling.yarn_log_multiplier"] == pytest.approx(0.0707, rel=1e-6)
    assert c.mscale_all_dim == pytest.approx(0.707, rel=1e-6)
    # SPECS.md 1.4: mscale = 0.1*0.707*ln 40 + 1, kq_scale = mscale^2/sqrt(192) ~ 0.11472
    assert c.yarn_mscale == pytest.approx(0.1 * 0.707 * math.log(40) + 1, rel=1e-6)
    assert c.attn_scale == pytest.approx(0.11472, abs=1e-5)
    for m in (0.707, 1.0, 0.1234567, 2.5, 1e-3, 0.0, 0.3333):
        canon = replace(c, mscale_all_dim=m).mscale_all_dim
        assert canon == pytest.approx(m, rel=1e-6)
        assert decode_log_mul(encode_log_mul(canon)) == canon


def test_deepseek2_missing_required_key_is_named():
    meta = ds2_minimal_metadata()
    del meta["deepseek2.attention.kv_lora_rank"]
    with pytest.raises(SpecError, match=r"deepseek2\.attention\.kv_lora_rank"):
        spec_from_metadata(meta)


def test_deepseek2_wrong_value_type_is_named():
    meta = ds2_minimal_metadata() | {"deepseek2.block_count": "27"}
    with pytest.raises(SpecError, match=r"deepseek2\.block_count.*integer"):
        spec_from_metadata(meta)
    meta = ds2_minimal_metadata() | {"deepseek2.rope.scaling.type": "longrope"}
    with pytest.raises(SpecError, match="longrope"):
        spec_from_metadata(meta)


def test_deepseek2_mla_requires_single_kv_head():
    meta = ds2_minimal_metadata() | {"deepseek2.attention.head_count_kv": 4}
    with pytest.raises(SpecError, match="head_count_kv"):
        spec_from_metadata(meta)


def test_deepseek2_vocab_falls_back_to_token_embd_rows():
    meta = ds2_minimal_metadata()
    del meta["tokenizer.ggml.tokens"]
    with pytest.raises(SpecError, match="vocabulary size"):
        spec_from_metadata(meta)
    tensors = {"token_embd.weight": SimpleNamespace(shape=(123, 64)), "blk.1.attn_norm.weight": SimpleNamespace(shape=(64,))}
    bundle = SimpleNamespace(metadata=meta, tensors=tensors)
    assert spec_from_bundle(bundle).config.n_vocab == 123


def test_block_count_beyond_the_files_blocks_is_refused_before_listing_tensors():
    """A damaged block_count (here 2^31 - 1) must not make the spec list tensors for every block it names."""
    meta = ds2_minimal_metadata()
    meta["deepseek2.block_count"] = 2**31 - 1
    tensors = {"token_embd.weight": SimpleNamespace(shape=(123, 64)), "blk.1.attn_norm.weight": SimpleNamespace(shape=(64,))}
    with pytest.raises(SpecError, match=r"block_count is 2147483647 but the file holds tensors for 2 blocks"):
        spec_from_bundle(SimpleNamespace(metadata=meta, tensors=tensors))


def test_deepseek2_legacy_layout_from_metadata():
    legacy = tiny_ds2(mla_layout="legacy")
    meta = plain(metadata_from_config("deepseek2", legacy))
    assert "deepseek2.attention.key_length_mla" not in meta
    assert meta["deepseek2.attention.head_count_kv"] == 4 and meta["deepseek2.attention.key_length"] == 24
    spec = spec_from_metadata(meta)
    assert spec.config == legacy
    names = {t.name for t in spec.tensors()}
    assert "blk.1.attn_kv_b.weight" in names and "blk.1.attn_k_b.weight" not in names


def test_deepseek2_metadata_writes_what_llama_cpp_needs():
    meta = plain(metadata_from_config("deepseek2", tiny_ds2()))
    p = "deepseek2."
    assert meta[p + "attention.q_lora_rank"] == 0 and meta[p + "attention.head_count_kv"] == 1
    assert (meta[p + "attention.key_length"], meta[p + "attention.value_length"]) == (40, 32)
    assert (meta[p + "attention.key_length_mla"], meta[p + "attention.value_length_mla"]) == (24, 16)
    for k in ("rope.dimension_count", "leading_dense_block_count", "expert_gating_func"):
        assert p + k in meta


@pytest.mark.parametrize("bad", [dict(n_expert_used=9), dict(gating_func=4), dict(n_dense_lead=4),
                                 dict(mla_layout="mha"), dict(n_expert_groups=3), dict(n_embd=0),
                                 dict(n_ff=0)])
def test_deepseek2_config_rejects_inconsistent_values(bad):
    with pytest.raises(SpecError):
        tiny_ds2(**bad)


# --- full-size presets ----------------------------------------------------------------------------

def test_v2_lite_tensor_counts_and_parameter_count():
    spec = spec_from_metadata(metadata_from_config("deepseek2", DeepSeek2Config.v2_lite()))
    required = [t for t in spec.tensors() if not t.optional]
    # + output.weight: optional in the spec (llama.cpp falls back to token_embd) but V2-Lite ships it
    names = [t.name for t in required] + ["output.weight"]
    assert len(names) == 404
    assert spec.n_params(names) == 15_706_484_224  # SPECS.md 1.1
    legacy = spec_from_metadata(metadata_from_config(
        "deepseek2", replace(DeepSeek2Config.v2_lite(), mla_layout="legacy")))
    legacy_names = [t.name for t in legacy.tensors() if not t.optional] + ["output.weight"]
    # one attn_kv_b instead of attn_k_b + attn_v_b in each of the 27 layers: 404 - 27 = 377
    assert len(legacy_names) == 377 and legacy.n_params(legacy_names) == 15_706_484_224
    shapes = {t.name: t.shape for t in spec.tensors()}
    assert shapes["blk.1.attn_k_b.weight"] == (16, 512, 128)
    assert shapes["blk.1.attn_v_b.weight"] == (16, 128, 512)
    assert shapes["blk.1.ffn_gate_exps.weight"] == (64, 1408, 2048)
    assert shapes["blk.1.ffn_down_exps.weight"] == (64, 2048, 1408)
    assert shapes["blk.1.ffn_gate_shexp.weight"] == (2816, 2048)
    assert shapes["blk.0.ffn_up.weight"] == (10944, 2048) and "blk.0.ffn_gate_inp.weight" not in shapes
    assert {t.name: t.shape for t in legacy.tensors()}["blk.3.attn_kv_b.weight"] == (4096, 512)


def test_minimax_m2_has_809_tensors():
    spec = spec_from_metadata(metadata_from_config("minimax-m2", MiniMaxM2Config.full()))
    tensors = spec.tensors()
    assert len(tensors) == 809 and not any(t.optional for t in tensors)
    shapes = {t.name: t.shape for t in tensors}
    assert shapes["blk.0.attn_q_norm.weight"] == (6144,) and shapes["blk.0.attn_k_norm.weight"] == (1024,)
    assert shapes["blk.61.ffn_down_exps.weight"] == (256, 3072, 1536)
    assert spec.moe_layers() == list(range(62))


def test_deepseek4_flash_layer_dependent_tensors():
    spec = spec_from_metadata(metadata_from_config("deepseek4", DeepSeek4Config.flash()))
    shapes = {t.name: t for t in spec.tensors()}
    assert "blk.0.attn_compressor_kv.weight" not in shapes  # ratio 0: sliding window only
    assert shapes["blk.2.attn_compressor_kv.weight"].shape == (1024, 4096)  # ratio 4: 2 x 512
    assert shapes["blk.2.attn_compressor_ape.weight"].shape == (4, 1024)
    assert shapes["blk.2.indexer.attn_q_b.weight"].shape == (8192, 1024)
    assert shapes["blk.2.indexer_compressor_ape.weight"].shape == (4, 256)
    assert shapes["blk.3.attn_compressor_kv.weight"].shape == (512, 4096)  # ratio 128
    assert shapes["blk.3.attn_compressor_ape.weight"].shape == (128, 512)
    assert "blk.3.indexer.proj.weight" not in shapes and "blk.42.indexer.proj.weight" in shapes
    assert shapes["blk.1.attn_output_a.weight"].shape == (8192, 4096)  # file ne {4096, 8192}
    assert shapes["blk.1.hc_attn_fn.weight"].shape == (24, 16384) and shapes["output_hc_fn.weight"].shape == (4, 16384)
    tid = shapes["blk.2.ffn_gate_tid2eid.weight"]
    assert tid.shape == (129280, 6) and tid.allowed_types == (I32,)
    assert "blk.3.ffn_gate_tid2eid.weight" not in shapes and "blk.3.exp_probs_b.bias" in shapes
    assert "blk.2.exp_probs_b.bias" not in shapes
    assert spec.capability()["layer_kinds"][:4] == ["sliding", "sliding", "csa", "hca"]


@pytest.mark.parametrize("bad,fragment", [
    (dict(hc_count=3), "hyper_connection.count"), (dict(gating_func=2), "sqrtsoftplus"),
    (dict(compress_ratios=(0, 8) * 22), "0, 4 or 128"), (dict(compress_ratios=(0,) * 42), "entries"),
    (dict(indexer_head_dim=96), "multiple of 64"), (dict(swiglu_clamp_exp=(10.0,) * 3), "swiglu_clamp_exp")])
def test_deepseek4_llama_cpp_constraints(bad, fragment):
    with pytest.raises(SpecError, match=fragment):
        replace(DeepSeek4Config.flash(), **bad)


def test_deepseek4_mtp_layers_are_ignored():
    cfg = replace(DeepSeek4Config.flash(), n_nextn=1)
    meta = plain(metadata_from_config("deepseek4", cfg))
    assert meta["deepseek4.block_count"] == 44 and meta["deepseek4.nextn_predict_layers"] == 1
    spec = spec_from_metadata(meta)
    assert spec.config == cfg and spec.config.n_layer == 43
    bundle = bundle_for(spec)
    bundle.tensors["blk.43.nextn.eh_proj.weight"] = SimpleNamespace(shape=(4096, 8192), ggml_type=Q8_0)
    bundle.tensors["blk.43.attn_norm.weight"] = SimpleNamespace(shape=(4096,), ggml_type=F32)
    report = spec.validate(bundle)
    assert report.ok and sorted(report.ignored) == ["blk.43.attn_norm.weight", "blk.43.nextn.eh_proj.weight"]


# --- validation -----------------------------------------------------------------------------------

def test_validate_clean_bundle_is_ok_and_json():
    for arch in ("deepseek2", "minimax-m2"):
        spec = spec_from_metadata(metadata_from_config(arch, PRESETS[arch]))
        report = spec.validate(bundle_for(spec))
        assert report.ok and report.errors() == [], report.errors()
        assert json.loads(json.dumps(report.to_json()))["ok"] is True


def test_validate_reports_each_kind_of_problem():
    spec = spec_from_metadata(metadata_from_config("deepseek2", tiny_ds2()))
    b = bundle_for(spec, **{"blk.1.attn_norm.weight": Q4_K, "blk.2.ffn_down_exps.weight": 99})
    del b.tensors["blk.2.attn_kv_a_mqa.weight"]
    b.tensors["blk.1.attn_q.weight"] = SimpleNamespace(shape=(96, 60), ggml_type=Q8_0)
    b.tensors["blk.1.mystery.weight"] = SimpleNamespace(shape=(4,), ggml_type=F32)
    b.tensors["blk.3.nextn.enorm.weight"] = SimpleNamespace(shape=(64,), ggml_type=F32)
    r = spec.validate(b)
    assert not r.ok
    assert r.missing == ["blk.2.attn_kv_a_mqa.weight"]
    assert r.wrong_shape == [("blk.1.attn_q.weight", (96, 64), (96, 60))]
    assert {n for n, _ in r.unsupported_type} == {"blk.1.attn_norm.weight", "blk.2.ffn_down_exps.weight"}
    assert r.unexpected == ["blk.1.mystery.weight"] and r.ignored == ["blk.3.nextn.enorm.weight"]
    errs = r.errors()
    assert len(errs) == 5 and all(e.endswith(".") and e.count(". ") == 0 for e in errs)
    assert any("blk.2.attn_kv_a_mqa.weight" in e and "missing" in e for e in errs)
    assert any("Q4_K" in e for e in errs)


def test_validate_error_list_is_capped():
    spec = spec_from_metadata(metadata_from_config("deepseek2", DeepSeek2Config.v2_lite()))
    b = bundle_for(spec)
    for n in [n for n in b.tensors if "_exps" in n]:
        del b.tensors[n]
    r = spec.validate(b)
    assert len(r.missing) == 78
    errs = r.errors()
    assert len(errs) == 9 and errs[-1] == "... and 70 more missing tensors."


def test_validate_accepts_fused_gate_up_and_missing_output():
    spec = spec_from_metadata(metadata_from_config("deepseek2", tiny_ds2()))
    b = bundle_for(spec)
    del b.tensors["output.weight"]
    for i in (1, 2):
        gate = b.tensors.pop(f"blk.{i}.ffn_gate_exps.weight")
        del b.tensors[f"blk.{i}.ffn_up_exps.weight"]
        b.tensors[f"blk.{i}.ffn_gate_up_exps.weight"] = SimpleNamespace(
            shape=(8, 64, 64), ggml_type=gate.ggml_type)
    assert spec.validate(b).ok
    assert spec.expert_tensor_names(1, b.tensors) == ["blk.1.ffn_gate_up_exps.weight",
                                                       "blk.1.ffn_down_exps.weight"]


def test_validate_type_rules():
    spec = spec_from_metadata(metadata_from_config("deepseek4", DeepSeek4Config.flash()))
    ok = spec.validate(bundle_for(spec, **{"blk.0.ffn_gate_inp.weight": 30}))  # BF16 router is fine
    assert ok.ok, ok.errors()
    bad = spec.validate(bundle_for(spec, **{"blk.0.ffn_gate_tid2eid.weight": F32,
                                            "blk.5.ffn_gate_inp.weight": Q8_0}))
    assert {n for n, _ in bad.unsupported_type} == {"blk.0.ffn_gate_tid2eid.weight", "blk.5.ffn_gate_inp.weight"}


# --- structure helpers ------------------------------------------------------------------------------

def test_structure_helpers():
    spec = spec_from_metadata(metadata_from_config("deepseek2", DeepSeek2Config.v2_lite()))
    assert spec.moe_layers() == list(range(1, 27))
    assert (spec.n_experts, spec.n_experts_used) == (64, 6)
    assert spec.expert_tensor_names(5) == [f"blk.5.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
    assert spec.expert_tensor_names(0) == []
    with pytest.raises(SpecError, match="out of range"):
        spec.expert_tensor_names(27)
    roles = {t.role for t in spec.tensors()}
    assert roles >= {Role.EMBEDDING, Role.ATTENTION, Role.NORM, Role.ROUTER, Role.SHARED_EXPERT,
                     Role.ROUTED_EXPERT, Role.DENSE_FFN, Role.HEAD}
    assert all(t.float_only for t in spec.tensors() if len(t.shape) == 1 or t.role is Role.ROUTER)
    d = json.loads(json.dumps(spec.describe()))
    assert d["config"]["n_expert"] == 64 and d["config"]["rms_eps"] == 1e-6
    assert d["n_params_routed_experts"] == 26 * 3 * 64 * 1408 * 2048
    cap = spec.capability()
    assert cap["generate"] is True and cap["mla_layout"] == "absorbed" and cap["gating"] == "softmax"
    cap = spec_from_metadata(metadata_from_config("minimax-m2", PRESETS["minimax-m2"])).capability()
    assert cap["generate"] is True and cap["attention"] == "gqa"
    cap = spec_from_metadata(metadata_from_config("deepseek4", PRESETS["deepseek4"])).capability()
    assert cap["generate"] is True and cap["inspect"] is True
