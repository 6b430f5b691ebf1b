"""DeepSeek-V2 / V2-Lite / V3 (`deepseek2`): MLA attention, leading dense blocks, routed + shared experts.

Math only: which layers, bound to which GGUF tensors, and the forward pass over the ops. Where experts
live and how an op computes are the runner's business (engine/runner.py builds from the placement plan).

Legend: T tokens of the step, D hidden, V vocab, L tokens that need logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pocketmoe.layers.attention import MLAConfig, MLAttention
from pocketmoe.layers.experts import ExpertsFactory, ExpertWeights
from pocketmoe.layers.linear import QuantEmbedding, load_float
from pocketmoe.layers.mlp import GatedMLP
from pocketmoe.layers.moe import MoEBlock, Router, RouterConfig
from pocketmoe.layers.rotary import RopeConfig, Rotary
from pocketmoe.models.decoder import DecoderBlock, DecoderModel, LinearFactory
from pocketmoe.specs.base import Role

if TYPE_CHECKING:
    from pocketmoe.gguf import GGUFBundle
    from pocketmoe.specs.deepseek2 import DeepSeek2Config


def rope_config(cfg: DeepSeek2Config) -> RopeConfig:
    rs = cfg.rope_scaling
    scaling = rs.kind if rs.kind in ("linear", "yarn") else "none"
    # cos/sin amplitude is 1: GGUF carries one mscale (mscale_all_dim), so mscale / mscale_all_dim = 1
    return RopeConfig(dim=cfg.qk_rope_head_dim, base=cfg.rope_freq_base, scaling=scaling, factor=rs.factor,
                      original_context=rs.orig_ctx, beta_fast=rs.beta_fast, beta_slow=rs.beta_slow)


def _attention(bundle: GGUFBundle, cfg: DeepSeek2Config, ops: Any, i: int, lin: LinearFactory) -> MLAttention:
    b = f"blk.{i}."
    mla = MLAConfig(n_head=cfg.n_head, qk_nope=cfg.qk_nope_head_dim, qk_rope=cfg.qk_rope_head_dim,
                    v_head=cfg.v_head_dim, kv_lora=cfg.kv_lora_rank, scale=cfg.attn_scale)
    q: dict[str, object] = {"wq": lin(b + "attn_q.weight")} if not cfg.q_lora_rank else {
        "wq_a": lin(b + "attn_q_a.weight"), "q_a_norm": load_float(bundle, b + "attn_q_a_norm.weight"),
        "wq_b": lin(b + "attn_q_b.weight")}
    kv: dict[str, object] = {"wkv_b": lin(b + "attn_kv_b.weight")} if cfg.mla_layout == "legacy" else {
        "k_b": lin(b + "attn_k_b.weight"), "v_b": lin(b + "attn_v_b.weight")}
    return MLAttention(mla, ops, wkv_a=lin(b + "attn_kv_a_mqa.weight"),
                       kv_a_norm=load_float(bundle, b + "attn_kv_a_norm.weight"), eps=cfg.rms_eps,
                       wo=lin(b + "attn_output.weight"), **q, **kv)


def _mlp(b: str, suffix: str, ops: Any, lin: LinearFactory) -> GatedMLP:
    return GatedMLP(lin(f"{b}ffn_gate{suffix}.weight"), lin(f"{b}ffn_up{suffix}.weight"),
                    lin(f"{b}ffn_down{suffix}.weight"), ops)


def _moe(bundle: GGUFBundle, cfg: DeepSeek2Config, ops: Any, i: int, lin: LinearFactory,
         make_experts: ExpertsFactory) -> MoEBlock:
    b = f"blk.{i}."
    router_cfg = RouterConfig(n_experts=cfg.n_expert, top_k=cfg.n_expert_used, gating=cfg.gating_func,
                              n_groups=cfg.n_expert_groups, groups_used=cfg.n_expert_groups_used,
                              norm=cfg.expert_weights_norm, scale=cfg.expert_weights_scale)
    bias_name = b + "exp_probs_b.bias"
    bias = load_float(bundle, bias_name) if bias_name in bundle.tensors else None
    router = Router(lin(b + "ffn_gate_inp.weight"), router_cfg, bias, ops)
    if b + "ffn_gate_up_exps.weight" in bundle.tensors:
        gate_up = ExpertWeights.from_bundle(bundle, b + "ffn_gate_up_exps.weight")
        ff = gate_up.shape[1] // 2
        gate, up = gate_up.rows(0, ff), gate_up.rows(ff, 2 * ff)  # gate rows first
    else:
        gate = ExpertWeights.from_bundle(bundle, b + "ffn_gate_exps.weight")
        up = ExpertWeights.from_bundle(bundle, b + "ffn_up_exps.weight")
    experts = make_experts(i, gate, up, ExpertWeights.from_bundle(bundle, b + "ffn_down_exps.weight"))
    shared = _mlp(b, "_shexp", ops, lin) if cfg.n_expert_shared else None
    return MoEBlock(router, experts, shared)


def build(bundle: GGUFBundle, cfg: DeepSeek2Config, ops: Any, lin: LinearFactory,
          make_experts: ExpertsFactory) -> DecoderModel:
    """Bind every layer to its tensor views in the bundle (no copies of quantized data)."""
    blocks = []
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        ffn = _mlp(b, "", ops, lin) if i < cfg.n_dense_lead else _moe(bundle, cfg, ops, i, lin, make_experts)
        blocks.append(DecoderBlock(load_float(bundle, b + "attn_norm.weight"), _attention(bundle, cfg, ops, i, lin),
                                     load_float(bundle, b + "ffn_norm.weight"), ffn))
    # llama.cpp ties the head to token_embd when output.weight is absent
    head = lin("output.weight") if "output.weight" in bundle.tensors else lin("token_embd.weight", Role.HEAD)
    return DecoderModel(cfg, ops, QuantEmbedding.from_bundle(bundle, "token_embd.weight"), blocks,
                          load_float(bundle, "output_norm.weight"), head, Rotary(rope_config(cfg)))
