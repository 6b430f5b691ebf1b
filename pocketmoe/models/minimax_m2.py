"""MiniMax-M2 (`minimax-m2`): GQA with RMSNorm over the whole q and k projections, NeoX rope on the first
n_rot dims of each head, sigmoid-routed experts with a selection bias and renormalised top-k, no shared
expert (SPECS.md 2.4; llama.cpp's minimax-m2.cpp).

Math only: which layers, bound to which GGUF tensors; the stack is models/decoder.py's.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from pocketmoe.layers.experts import ExpertsFactory, ExpertWeights
from pocketmoe.layers.gqa import GQAConfig, GQAttention
from pocketmoe.layers.linear import QuantEmbedding, load_float
from pocketmoe.layers.moe import MoEBlock, Router, RouterConfig
from pocketmoe.layers.rotary import RopeConfig, Rotary
from pocketmoe.models.decoder import DecoderBlock, DecoderModel, LinearFactory
from pocketmoe.specs.base import Role

if TYPE_CHECKING:
    from pocketmoe.gguf import GGUFBundle
    from pocketmoe.specs.minimax_m2 import MiniMaxM2Config


def gqa_config(cfg: MiniMaxM2Config) -> GQAConfig:
    return GQAConfig(n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim, v_dim=cfg.v_head_dim,
                     n_rot=cfg.n_rot, neox=True, scale=1.0 / math.sqrt(cfg.head_dim))


def _block(bundle: GGUFBundle, cfg: MiniMaxM2Config, ops: Any, i: int, lin: LinearFactory,
           make_experts: ExpertsFactory) -> DecoderBlock:
    b = f"blk.{i}."
    attn = GQAttention(gqa_config(cfg), ops, wq=lin(b + "attn_q.weight"), wk=lin(b + "attn_k.weight"),
                       wv=lin(b + "attn_v.weight"), wo=lin(b + "attn_output.weight"),
                       q_norm=load_float(bundle, b + "attn_q_norm.weight"),
                       k_norm=load_float(bundle, b + "attn_k_norm.weight"), eps=cfg.rms_eps)
    # llama.cpp hard-codes the renormalisation of the top-k weights and no scale
    router_cfg = RouterConfig(n_experts=cfg.n_expert, top_k=cfg.n_expert_used, gating=cfg.gating_func, norm=True,
                              scale=1.0)
    router = Router(lin(b + "ffn_gate_inp.weight"), router_cfg, load_float(bundle, b + "exp_probs_b.bias"), ops)
    experts = make_experts(i, *(ExpertWeights.from_bundle(bundle, f"{b}ffn_{w}_exps.weight")
                                for w in ("gate", "up", "down")))
    return DecoderBlock(load_float(bundle, b + "attn_norm.weight"), attn, load_float(bundle, b + "ffn_norm.weight"),
                        MoEBlock(router, experts, None))


def build(bundle: GGUFBundle, cfg: MiniMaxM2Config, ops: Any, lin: LinearFactory,
          make_experts: ExpertsFactory) -> DecoderModel:
    """Bind every layer to its tensor views in the bundle (no copies of quantized data)."""
    blocks = [_block(bundle, cfg, ops, i, lin, make_experts) for i in range(cfg.n_layer)]
    head = lin("output.weight") if "output.weight" in bundle.tensors else lin("token_embd.weight", Role.HEAD)
    return DecoderModel(cfg, ops, QuantEmbedding.from_bundle(bundle, "token_embd.weight"), blocks,
                        load_float(bundle, "output_norm.weight"), head,
                        Rotary(RopeConfig(dim=cfg.n_rot, base=cfg.rope_freq_base, neox=True)))
