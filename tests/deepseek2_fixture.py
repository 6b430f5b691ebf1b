"""Tiny HF DeepSeek-V2/V3 models and the same weights written as `deepseek2` GGUF, for parity tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from pocketmoe.specs.deepseek2 import DeepSeek2Config
from pocketmoe.specs.metadata import RopeScaling
from pocketmoe.testing import hf_deepseek2_to_gguf_state_dict, write_from_state_dict
from pocketmoe.testing.quant_mix import quant_mix
from pocketmoe.testing.synth import fixture_metadata, spec_for
from pocketmoe.testing.writer import TensorPlan
from pocketmoe.testing.writer import write_gguf as write_plans


@dataclass(frozen=True)
class Tiny:
    """Knobs of a tiny deepseek2 model (HF field names where they exist)."""

    v3: bool = False                 # DeepseekV3ForCausalLM: sigmoid + bias + groups + norm
    hidden: int = 64
    layers: int = 2
    dense_lead: int = 1
    heads: int = 4
    vocab: int = 384
    ff: int = 96
    moe_ff: int = 32
    experts: int = 8
    top_k: int = 3
    shared: int = 1
    q_lora: int | None = None
    kv_lora: int = 32
    nope: int = 16
    rope: int = 16
    v_head: int = 16
    yarn_factor: float = 1.0         # > 1: YaRN with mscale = mscale_all_dim = 0.707
    groups: int = 1
    groups_used: int = 1
    norm_topk: bool = False
    scale: float = 1.0
    legacy: bool = False             # attn_kv_b instead of attn_k_b / attn_v_b


def hf_model(t: Tiny, seed: int = 0) -> torch.nn.Module:
    rope: dict[str, object] = {"rope_type": "default", "rope_theta": 10000.0}
    if t.yarn_factor > 1:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": t.yarn_factor,
                "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                "mscale": 0.707, "mscale_all_dim": 0.707}
    kw = dict(vocab_size=t.vocab, hidden_size=t.hidden, intermediate_size=t.ff, moe_intermediate_size=t.moe_ff,
              num_hidden_layers=t.layers, num_attention_heads=t.heads, num_key_value_heads=t.heads,
              n_shared_experts=t.shared, n_routed_experts=t.experts, num_experts_per_tok=t.top_k,
              routed_scaling_factor=t.scale, kv_lora_rank=t.kv_lora, q_lora_rank=t.q_lora,
              qk_nope_head_dim=t.nope, qk_rope_head_dim=t.rope, v_head_dim=t.v_head,
              first_k_dense_replace=t.dense_lead, n_group=t.groups, topk_group=t.groups_used,
              norm_topk_prob=t.norm_topk, max_position_embeddings=int(64 * t.yarn_factor) if t.yarn_factor > 1 else 256,
              rms_norm_eps=1e-6,
              rope_parameters=rope, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    cfg = DeepseekV3Config(**kw) if t.v3 else DeepseekV2Config(topk_method="greedy", **kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = (DeepseekV3ForCausalLM if t.v3 else DeepseekV2ForCausalLM)(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # norms: around 1
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
    return model


def ds2_config(t: Tiny) -> DeepSeek2Config:
    rs = RopeScaling("yarn", t.yarn_factor, 64, 32.0, 1.0) if t.yarn_factor > 1 else RopeScaling()
    return DeepSeek2Config(
        n_vocab=t.vocab, n_ctx=256, n_embd=t.hidden, n_layer=t.layers, n_head=t.heads, n_ff=t.ff,
        n_expert=t.experts, n_expert_used=t.top_k, n_expert_shared=t.shared, n_ff_exp=t.moe_ff,
        n_dense_lead=t.dense_lead, q_lora_rank=t.q_lora or 0, kv_lora_rank=t.kv_lora,
        qk_nope_head_dim=t.nope, qk_rope_head_dim=t.rope, v_head_dim=t.v_head,
        mla_layout="legacy" if t.legacy else "absorbed", gating_func=2 if t.v3 else 1,
        expert_weights_norm=t.norm_topk, expert_weights_scale=t.scale, n_expert_groups=t.groups,
        n_expert_groups_used=t.groups_used, rms_eps=1e-6, rope_freq_base=10000.0, rope_scaling=rs,
        mscale_all_dim=0.707 if t.yarn_factor > 1 else 0.0, bos_token_id=1, eos_token_id=2)


def gguf_state_dict(model: torch.nn.Module, t: Tiny) -> dict[str, torch.Tensor]:
    """HF parameter names -> llama.cpp `deepseek2` tensor names (torch order, float32)."""
    return hf_deepseek2_to_gguf_state_dict(model, ds2_config(t))


def write_gguf(path: Path, cfg: DeepSeek2Config, tensors: dict[str, torch.Tensor],
               blocks: dict[str, np.ndarray] | None = None, types: dict[str, int] | None = None) -> Path:
    """F32 GGUF of `tensors` via write_from_state_dict; with `blocks` (may be empty: no name checks), a
    plain writer that stores those names as raw uint8 blocks of `types[name]`."""
    if blocks is None:
        return write_from_state_dict("deepseek2", cfg, tensors, path)[0]
    types = types or {}
    spec = spec_for("deepseek2", cfg)
    plans = [TensorPlan(s.name, s.shape, types.get(s.name, 0)) for s in spec.tensors(tensors.keys())
             if s.name in tensors]
    meta = fixture_metadata("deepseek2", cfg, quant_mix("F32"), "parity fixture")

    def chunks(p: TensorPlan) -> list[np.ndarray]:
        return [blocks[p.name] if p.name in blocks else tensors[p.name].numpy()]

    return write_plans(path, "deepseek2", meta, plans, chunks)[0]


def quantize_experts(model: torch.nn.Module, t: Tiny, ggml_type: int, seed: int = 0
                     ) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Random valid `ggml_type` blocks for every routed expert; the HF model gets gguf.quants.dequantize
    (testing.dequant: Q1_0 by its formula) of exactly those blocks. Returns the blocks by GGUF name and their
    types."""
    from pocketmoe.quant.quantize import random_blocks
    from pocketmoe.testing.dequant import dequantize_reference

    rng = np.random.default_rng(seed)
    blocks: dict[str, np.ndarray] = {}

    def make(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        blocks[name] = random_blocks(ggml_type, shape, rng)
        deq = dequantize_reference(blocks[name], ggml_type).reshape(shape)
        return torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32))

    with torch.no_grad():
        for i in range(t.dense_lead, t.layers):
            b, ex = f"blk.{i}.", model.model.layers[i].mlp.experts
            e, d, f = t.experts, t.hidden, t.moe_ff
            gate, up = make(b + "ffn_gate_exps.weight", (e, f, d)), make(b + "ffn_up_exps.weight", (e, f, d))
            ex.gate_up_proj.copy_(torch.cat([gate, up], dim=1))
            ex.down_proj.copy_(make(b + "ffn_down_exps.weight", (e, d, f)))
    return blocks, {name: ggml_type for name in blocks}


def fuse_gate_up(t: Tiny, sd: dict[str, torch.Tensor], blocks: dict[str, np.ndarray], types: dict[str, int]) -> None:
    """In place: each MoE layer's gate and up experts as one `ffn_gate_up_exps` tensor (gate rows first), in the
    state dict and the quantized blocks, as newer converters write them."""
    for i in range(t.dense_lead, t.layers):
        b = f"blk.{i}."
        gate, up = (blocks.pop(b + f"ffn_{p}_exps.weight").reshape(t.experts, t.moe_ff, -1) for p in ("gate", "up"))
        blocks[b + "ffn_gate_up_exps.weight"] = np.concatenate([gate, up], axis=1)
        types[b + "ffn_gate_up_exps.weight"] = types.pop(b + "ffn_gate_exps.weight")
        types.pop(b + "ffn_up_exps.weight")
        sd[b + "ffn_gate_up_exps.weight"] = torch.cat([sd.pop(b + "ffn_gate_exps.weight"),
                                                       sd.pop(b + "ffn_up_exps.weight")], dim=1)
