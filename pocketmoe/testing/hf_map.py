"""HF transformers DeepseekV2ForCausalLM <-> GGUF: the config and the weight-name mapping (SPECS.md 1.3).

Used by parity tests: a tiny random HF model -> `write_from_state_dict` -> a GGUF both engines load.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from pocketmoe.errors import PocketMoEError
from pocketmoe.specs.deepseek2 import DeepSeek2Config

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_PLAIN = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
}
_PER_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


class HFMappingError(PocketMoEError):
    """An HF checkpoint does not match the DeepSeek2Config it is converted with."""


def hf_deepseek2_config(config: DeepSeek2Config, **extra: Any) -> Any:
    """A transformers DeepseekV2Config with the same hyperparameters (mscale == mscale_all_dim, as
    llama.cpp assumes)."""
    from transformers import DeepseekV2Config

    rs = config.rope_scaling
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_freq_base}
    if rs.kind == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": config.rope_freq_base, "factor": rs.factor,
                "original_max_position_embeddings": rs.orig_ctx, "beta_fast": rs.beta_fast,
                "beta_slow": rs.beta_slow, "mscale": config.mscale_all_dim,
                "mscale_all_dim": config.mscale_all_dim}
    return DeepseekV2Config(
        vocab_size=config.n_vocab, hidden_size=config.n_embd, intermediate_size=max(config.n_ff, 1),
        moe_intermediate_size=config.n_ff_exp, num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head, num_key_value_heads=config.n_head,
        n_shared_experts=config.n_expert_shared, n_routed_experts=config.n_expert,
        num_experts_per_tok=config.n_expert_used, first_k_dense_replace=config.n_dense_lead,
        kv_lora_rank=config.kv_lora_rank, q_lora_rank=config.q_lora_rank or None,
        qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim, routed_scaling_factor=config.expert_weights_scale,
        norm_topk_prob=config.expert_weights_norm, topk_method="greedy", n_group=config.n_expert_groups,
        topk_group=config.n_expert_groups_used, rms_norm_eps=config.rms_eps,
        max_position_embeddings=config.n_ctx, rope_parameters=rope, tie_word_embeddings=False,
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, **extra)


def _split_kv_b(w: torch.Tensor, config: DeepSeek2Config) -> dict[str, torch.Tensor]:
    """kv_b_proj [H*(nope+v), kv_lora] -> attn_k_b [H, kv_lora, nope] and attn_v_b [H, v, kv_lora]."""
    c = config
    kv = w.reshape(c.n_head, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
    return {"attn_k_b.weight": kv[:, :c.qk_nope_head_dim].transpose(1, 2).contiguous(),
            "attn_v_b.weight": kv[:, c.qk_nope_head_dim:].contiguous()}


def _layer_tensors(params: dict[str, torch.Tensor], config: DeepSeek2Config) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {"gate": {}, "up": {}, "down": {}}
    for key, w in params.items():
        if key in _PLAIN:
            out[_PLAIN[key]] = w
        elif key == "self_attn.kv_b_proj.weight":
            out |= {"attn_kv_b.weight": w} if config.mla_layout == "legacy" else _split_kv_b(w, config)
        elif key == "mlp.experts.gate_up_proj":  # [E, 2*ff, D], gate rows first
            out["ffn_gate_exps.weight"], out["ffn_up_exps.weight"] = w.chunk(2, dim=1)
        elif m := _PER_EXPERT.match(key):
            experts[m.group(2)][int(m.group(1))] = w
        else:
            raise HFMappingError(f"HF parameter {key!r} has no GGUF name in the deepseek2 mapping.")
    for kind, ws in experts.items():
        if ws:
            out[f"ffn_{kind}_exps.weight"] = torch.stack([ws[e] for e in sorted(ws)])
    return out


def hf_deepseek2_to_gguf_state_dict(hf_model: Any, config: DeepSeek2Config) -> dict[str, torch.Tensor]:
    """HF DeepseekV2ForCausalLM parameters -> {GGUF name: float32 tensor in torch order}.

    kv_b_proj becomes attn_k_b / attn_v_b (absorbed layout) or stays attn_kv_b (legacy); experts are
    stacked [E, out, in]; the order follows the HF state dict.
    """
    sd = hf_model.state_dict() if hasattr(hf_model, "state_dict") else dict(hf_model)
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    out: dict[str, torch.Tensor] = {}
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for key, w in sd.items():
        if key in top:
            out[top[key]] = w
        elif m := _LAYER.match(key):
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = w
        elif not key.endswith("rotary_emb.inv_freq"):
            raise HFMappingError(f"HF parameter {key!r} has no GGUF name in the deepseek2 mapping.")
    for i in sorted(layers):
        out |= {f"blk.{i}.{k}": v for k, v in _layer_tensors(layers[i], config).items()}
    if "output.weight" not in out and "token_embd.weight" in out:
        out["output.weight"] = out["token_embd.weight"]
    return {k: v.detach().to(torch.float32).contiguous() for k, v in out.items()}
