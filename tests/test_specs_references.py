"""Specs checked against independent references: gguf 0.19's constants, gguf's writer/reader, and
HF transformers' DeepseekV2 / MiniMaxM2 models (built on the meta device, so full size is cheap)."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest
import torch
from gguf import MODEL_ARCH, MODEL_TENSOR, MODEL_TENSORS, TENSOR_NAMES, GGUFReader, GGUFWriter, Keys

from pocketmoe.specs import (
    DeepSeek2Config,
    DeepSeek4Config,
    MiniMaxM2Config,
    metadata_from_config,
    spec_from_metadata,
)
from pocketmoe.specs.base import ModelSpec

transformers = pytest.importorskip("transformers")

PRESETS = {"deepseek2": DeepSeek2Config.v2_lite(), "minimax-m2": MiniMaxM2Config.full(),
           "deepseek4": DeepSeek4Config.flash()}


def spec_for(arch: str, cfg) -> ModelSpec:
    return spec_from_metadata(metadata_from_config(arch, cfg))


def templates(spec: ModelSpec) -> set[str]:
    """Our tensor names in gguf's template form: blk.{bid}.attn_q (suffix dropped)."""
    return {re.sub(r"^blk\.\d+\.", "blk.{bid}.", t.name.rsplit(".", 1)[0]) for t in spec.tensors()}


def gguf_templates(arch: MODEL_ARCH, skip: set[MODEL_TENSOR] = frozenset()) -> set[str]:
    return {TENSOR_NAMES[t] for t in MODEL_TENSORS[arch] if t not in skip}


def gguf_key_names(arch: str) -> set[str]:
    out: set[str] = set()
    stack = [Keys]
    while stack:
        ns = stack.pop()
        for v in vars(ns).values():
            if isinstance(v, type):
                stack.append(v)
            elif isinstance(v, str) and "." in v:
                out.add(v.replace("{arch}", arch))
    return out


# --- gguf 0.19 constants ------------------------------------------------------------------------

def test_deepseek2_tensor_names_match_gguf_constants():
    base = DeepSeek2Config.v2_lite()
    ours = set()
    for cfg in (base, replace(base, mla_layout="legacy", q_lora_rank=1536)):
        ours |= templates(spec_for("deepseek2", cfg))
    # ffn_gate_up_exps (--fuse-gate-up-exps) reached the deepseek2 list after gguf 0.19 (SPECS.md 1.3)
    assert ours - gguf_templates(MODEL_ARCH.DEEPSEEK2) == {"blk.{bid}.ffn_gate_up_exps"}
    assert TENSOR_NAMES[MODEL_TENSOR.FFN_GATE_UP_EXP] == "blk.{bid}.ffn_gate_up_exps"
    # rope_freqs / attn_rot_embd are never written for deepseek2; attn_k / attn_v are not loaded by it
    skip = {MODEL_TENSOR.ROPE_FREQS, MODEL_TENSOR.ATTN_ROT_EMBD, MODEL_TENSOR.ATTN_K, MODEL_TENSOR.ATTN_V}
    assert gguf_templates(MODEL_ARCH.DEEPSEEK2, skip) <= ours


def test_minimax_m2_tensor_names_match_gguf_constants():
    assert templates(spec_for("minimax-m2", MiniMaxM2Config.full())) == gguf_templates(MODEL_ARCH.MINIMAXM2)


def test_deepseek4_tensor_names_reuse_gguf_strings_where_they_exist():
    ours = templates(spec_for("deepseek4", DeepSeek4Config.flash()))
    known = {TENSOR_NAMES[t] for t in (MODEL_TENSOR.ATTN_SINKS, MODEL_TENSOR.ATTN_Q_A, MODEL_TENSOR.ATTN_Q_B,
                                       MODEL_TENSOR.ATTN_Q_A_NORM, MODEL_TENSOR.ATTN_KV_A_NORM,
                                       MODEL_TENSOR.INDEXER_PROJ, MODEL_TENSOR.INDEXER_ATTN_Q_B,
                                       MODEL_TENSOR.FFN_EXP_PROBS_B, MODEL_TENSOR.FFN_GATE_INP,
                                       MODEL_TENSOR.FFN_GATE_SHEXP, MODEL_TENSOR.FFN_DOWN_EXP)}
    assert known <= ours


@pytest.mark.parametrize("arch", sorted(PRESETS))
def test_metadata_keys_are_gguf_keys(arch):
    keys = set(metadata_from_config(arch, PRESETS[arch]))
    known = gguf_key_names(arch)
    # deepseek4 keys that arrived in llama.cpp after gguf 0.19 (SPECS.md 3.2 and 4)
    newer = {f"{arch}.{k}" for k in ("attention.output_group_count", "attention.output_lora_rank",
                                      "attention.compress_ratios", "attention.compress_rope_freq_base",
                                      "hyper_connection.count", "hyper_connection.sinkhorn_iterations",
                                      "hyper_connection.epsilon", "hash_layer_count")}
    assert keys - known == (newer if arch == "deepseek4" else set())


# --- a real GGUF file through gguf's own writer and reader ------------------------------------------

@pytest.mark.parametrize("arch", sorted(PRESETS))
def test_metadata_survives_a_gguf_file(arch, tmp_path):
    meta = metadata_from_config(arch, PRESETS[arch])
    path = tmp_path / "m.gguf"
    w = GGUFWriter(str(path), arch)
    for key, kv in meta.items():
        if key != "general.architecture":
            w.add_key_value(key, kv.value, kv.type, sub_type=kv.item_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    fields = GGUFReader(str(path)).fields
    read = {k: f.contents() for k, f in fields.items() if not k.startswith("GGUF.")}
    for key, kv in meta.items():
        assert fields[key].types[0] == kv.type, key
    assert spec_from_metadata(read).config == PRESETS[arch]


# --- HF transformers: parameter shapes mapped to GGUF names -----------------------------------------

def hf_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    out = {n: tuple(p.shape) for n, p in model.named_parameters() if p.numel()}  # HF keeps 0-wide shexp
    out |= {n: tuple(b.shape) for n, b in model.named_buffers() if "e_score_correction_bias" in n}
    return out


COMMON = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
          "model.norm.weight": "output_norm.weight", "input_layernorm.weight": "attn_norm.weight",
          "post_attention_layernorm.weight": "ffn_norm.weight", "self_attn.o_proj.weight": "attn_output.weight",
          "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.experts.down_proj": "ffn_down_exps.weight",
          "mlp.e_score_correction_bias": "exp_probs_b.bias"}
DS2 = {"self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_a_proj.weight": "attn_q_a.weight",
       "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight", "self_attn.q_b_proj.weight": "attn_q_b.weight",
       "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
       "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
       "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
       "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
       "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
       "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight"}
MM2 = {f"self_attn.{a}_proj.weight": f"attn_{a}.weight" for a in "qkv"} | {
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"}


def to_gguf(hf: dict[str, tuple[int, ...]], table: dict[str, str], n_head: int = 0, nope: int = 0,
            legacy: bool = False) -> dict[str, tuple[int, ...]]:
    """Rename and reshape like llama.cpp's converter, using torch ops on meta tensors."""
    out = {}
    for name, shape in hf.items():
        m = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
        b, rest = (f"blk.{m.group(1)}.", m.group(2)) if m else ("", name)
        t = torch.empty(shape, device="meta")
        if rest == "self_attn.kv_b_proj.weight":
            if legacy:
                out[b + "attn_kv_b.weight"] = shape
                continue
            kv = t.view(n_head, -1, shape[-1])  # per head: nope k rows, then v rows
            out[b + "attn_k_b.weight"] = tuple(kv[:, :nope].transpose(1, 2).shape)
            out[b + "attn_v_b.weight"] = tuple(kv[:, nope:].shape)
        elif rest == "mlp.experts.gate_up_proj":
            gate, up = t.chunk(2, dim=1)
            out[b + "ffn_gate_exps.weight"], out[b + "ffn_up_exps.weight"] = tuple(gate.shape), tuple(up.shape)
        else:
            out[b + (table | COMMON)[rest]] = shape
    return out


def ds2_hf_config(c: DeepSeek2Config):
    return transformers.DeepseekV2Config(
        vocab_size=c.n_vocab, hidden_size=c.n_embd, intermediate_size=c.n_ff, moe_intermediate_size=c.n_ff_exp,
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_head,
        n_routed_experts=c.n_expert, num_experts_per_tok=c.n_expert_used, n_shared_experts=c.n_expert_shared,
        first_k_dense_replace=c.n_dense_lead, kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank or None,
        qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
        bos_token_id=None, eos_token_id=None)


def expected(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    return {t.name: t.shape for t in spec.tensors() if not t.optional or t.name == "output.weight"}


TINY_DS2 = DeepSeek2Config(n_vocab=96, n_ctx=256, n_embd=64, n_layer=3, n_head=4, n_ff=96, n_expert=8,
                           n_expert_used=2, n_expert_shared=2, n_ff_exp=32, n_dense_lead=1, kv_lora_rank=32,
                           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24)


@pytest.mark.parametrize("cfg", [
    DeepSeek2Config.v2_lite(), TINY_DS2, replace(TINY_DS2, mla_layout="legacy"),
    replace(TINY_DS2, q_lora_rank=48, n_dense_lead=0), replace(TINY_DS2, n_expert_shared=0)],
    ids=["v2-lite", "tiny", "tiny-legacy", "tiny-qlora", "tiny-no-shared"])
def test_deepseek2_shapes_match_hf_model(cfg):
    with torch.device("meta"):
        model = transformers.DeepseekV2ForCausalLM(ds2_hf_config(cfg))
    hf = hf_shapes(model)
    spec = spec_for("deepseek2", cfg)
    assert to_gguf(hf, DS2, cfg.n_head, cfg.qk_nope_head_dim, cfg.mla_layout == "legacy") == expected(spec)
    assert spec.n_params(expected(spec)) == sum(math.prod(s) for s in hf.values())


@pytest.mark.parametrize("cfg", [MiniMaxM2Config.full(), MiniMaxM2Config(
    n_vocab=96, n_ctx=256, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, head_dim=32, v_head_dim=32, n_rot=16,
    n_expert=8, n_expert_used=2, n_ff_exp=48)], ids=["full", "tiny"])
def test_minimax_m2_shapes_match_hf_model(cfg):
    hf_cfg = transformers.MiniMaxM2Config(
        vocab_size=cfg.n_vocab, hidden_size=cfg.n_embd, intermediate_size=cfg.n_ff_exp,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head_kv,
        head_dim=cfg.head_dim, num_local_experts=cfg.n_expert, num_experts_per_tok=cfg.n_expert_used,
        bos_token_id=None, eos_token_id=None)
    with torch.device("meta"):
        model = transformers.MiniMaxM2ForCausalLM(hf_cfg)
    spec = spec_for("minimax-m2", cfg)
    hf = hf_shapes(model)
    assert to_gguf(hf, MM2) == expected(spec)
    assert spec.n_params() == sum(math.prod(s) for s in hf.values())

