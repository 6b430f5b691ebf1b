"""DeepSeek-V2 / V2-Lite / V3 (`deepseek2`): MLA attention, leading dense blocks, routed + shared experts.

Math only: which layers, bound to which GGUF tensors, and the forward pass. Where experts live and how
a linear computes are the factories' business (see engine/runner.py).

Legend: T tokens, D hidden, V vocab, L layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pocketmoe.layers.attention import LatentCache, MLAConfig, MLAttention
from pocketmoe.layers.experts import ExpertBank, ExpertWeights
from pocketmoe.layers.linear import QuantEmbedding, QuantLinear, load_float
from pocketmoe.layers.mlp import GatedMLP
from pocketmoe.layers.moe import MoEBlock, Router, RouterConfig
from pocketmoe.layers.norm import RMSNorm
from pocketmoe.layers.rotary import RopeConfig, Rotary

if TYPE_CHECKING:
    from pocketmoe.gguf import GGUFBundle
    from pocketmoe.specs.deepseek2 import DeepSeek2Config

# make_linear(name, kind) with kind in {"attn", "dense", "shared", "router", "head"}
LinearFactory = Callable[[str, str], QuantLinear]
# make_experts(layer, gate, up, down) -> the bank the placement plan chose
ExpertsFactory = Callable[[int, ExpertWeights, ExpertWeights, ExpertWeights], ExpertBank]


class DeepSeek2Block:
    def __init__(self, attn_norm: RMSNorm, attn: MLAttention, ffn_norm: RMSNorm,
                 ffn: GatedMLP | MoEBlock) -> None:
        self.attn_norm, self.attn, self.ffn_norm, self.ffn = attn_norm, attn, ffn_norm, ffn

    def __call__(self, x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor,
                 cache: LatentCache | None, layer: int, start: int) -> torch.Tensor:  # x: [T, D]
        x = x + self.attn(self.attn_norm(x), cos2, sin2, cache, layer, start)
        return x + self.ffn(self.ffn_norm(x))


class DeepSeek2Model:
    def __init__(self, cfg: DeepSeek2Config, embed: QuantEmbedding, blocks: list[DeepSeek2Block],
                 norm: RMSNorm, head: QuantLinear, rotary: Rotary) -> None:
        self.cfg = cfg
        self.embed, self.blocks, self.norm, self.head, self.rotary = embed, blocks, norm, head, rotary

    @property
    def n_layer(self) -> int:
        return len(self.blocks)

    @property
    def cache_width(self) -> int:
        """Latent values cached per token per layer: kv_lora_rank + rope dims."""
        return self.cfg.kv_lora_rank + self.cfg.qk_rope_head_dim

    @property
    def vocab_size(self) -> int:
        return self.head.out_features

    def __call__(self, tokens: torch.Tensor, start: int, cache: LatentCache | None,
                 last_only: bool = False) -> torch.Tensor:
        """tokens [T] at positions start.. -> logits [T, V] (or [1, V] with last_only)."""
        cos2, sin2 = self.rotary.span(start, tokens.numel())
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            x = block(x, cos2, sin2, cache, i, start)
        if last_only:
            x = x[-1:]
        return self.head(self.norm(x))


def rope_config(cfg: DeepSeek2Config) -> RopeConfig:
    rs = cfg.rope_scaling
    scaling = rs.kind if rs.kind in ("linear", "yarn") else "none"
    # cos/sin amplitude is 1: GGUF carries one mscale (mscale_all_dim), so mscale / mscale_all_dim = 1
    return RopeConfig(dim=cfg.qk_rope_head_dim, base=cfg.rope_freq_base, scaling=scaling, factor=rs.factor,
                      original_context=rs.orig_ctx, beta_fast=rs.beta_fast, beta_slow=rs.beta_slow)


def _attention(bundle: GGUFBundle, cfg: DeepSeek2Config, i: int, lin: LinearFactory) -> MLAttention:
    b = f"blk.{i}."
    mla = MLAConfig(n_head=cfg.n_head, qk_nope=cfg.qk_nope_head_dim, qk_rope=cfg.qk_rope_head_dim,
                    v_head=cfg.v_head_dim, kv_lora=cfg.kv_lora_rank, scale=cfg.attn_scale)
    q: dict[str, object] = {"wq": lin(b + "attn_q.weight", "attn")} if not cfg.q_lora_rank else {
        "wq_a": lin(b + "attn_q_a.weight", "attn"),
        "q_a_norm": RMSNorm(load_float(bundle, b + "attn_q_a_norm.weight"), cfg.rms_eps),
        "wq_b": lin(b + "attn_q_b.weight", "attn")}
    kv: dict[str, object] = {"wkv_b": lin(b + "attn_kv_b.weight", "attn")} if cfg.mla_layout == "legacy" else {
        "k_b": lin(b + "attn_k_b.weight", "attn"), "v_b": lin(b + "attn_v_b.weight", "attn")}
    return MLAttention(mla, wkv_a=lin(b + "attn_kv_a_mqa.weight", "attn"),
                       kv_a_norm=RMSNorm(load_float(bundle, b + "attn_kv_a_norm.weight"), cfg.rms_eps),
                       wo=lin(b + "attn_output.weight", "attn"), **q, **kv)


def _mlp(b: str, suffix: str, kind: str, lin: LinearFactory) -> GatedMLP:
    return GatedMLP(lin(f"{b}ffn_gate{suffix}.weight", kind), lin(f"{b}ffn_up{suffix}.weight", kind),
                    lin(f"{b}ffn_down{suffix}.weight", kind))


def _moe(bundle: GGUFBundle, cfg: DeepSeek2Config, i: int, lin: LinearFactory,
         make_experts: ExpertsFactory) -> MoEBlock:
    b = f"blk.{i}."
    router_cfg = RouterConfig(n_experts=cfg.n_expert, top_k=cfg.n_expert_used, gating=cfg.gating_func,
                              n_groups=cfg.n_expert_groups, groups_used=cfg.n_expert_groups_used,
                              norm=cfg.expert_weights_norm, scale=cfg.expert_weights_scale)
    bias_name = b + "exp_probs_b.bias"
    bias = load_float(bundle, bias_name) if bias_name in bundle.tensors else None
    router = Router(lin(b + "ffn_gate_inp.weight", "router"), router_cfg, bias)
    if b + "ffn_gate_up_exps.weight" in bundle.tensors:
        gate_up = ExpertWeights.from_bundle(bundle, b + "ffn_gate_up_exps.weight")
        ff = gate_up.shape[1] // 2
        gate, up = gate_up.rows(0, ff), gate_up.rows(ff, 2 * ff)  # gate rows first
    else:
        gate = ExpertWeights.from_bundle(bundle, b + "ffn_gate_exps.weight")
        up = ExpertWeights.from_bundle(bundle, b + "ffn_up_exps.weight")
    experts = make_experts(i, gate, up, ExpertWeights.from_bundle(bundle, b + "ffn_down_exps.weight"))
    shared = _mlp(b, "_shexp", "shared", lin) if cfg.n_expert_shared else None
    return MoEBlock(router, experts, shared)


def build(bundle: GGUFBundle, cfg: DeepSeek2Config, lin: LinearFactory,
          make_experts: ExpertsFactory) -> DeepSeek2Model:
    """Bind every layer to its tensor views in the bundle (no copies of quantized data)."""
    blocks = []
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        ffn = _mlp(b, "", "dense", lin) if i < cfg.n_dense_lead else _moe(bundle, cfg, i, lin, make_experts)
        blocks.append(DeepSeek2Block(RMSNorm(load_float(bundle, b + "attn_norm.weight"), cfg.rms_eps),
                                     _attention(bundle, cfg, i, lin),
                                     RMSNorm(load_float(bundle, b + "ffn_norm.weight"), cfg.rms_eps), ffn))
    head_name = "output.weight" if "output.weight" in bundle.tensors else "token_embd.weight"
    return DeepSeek2Model(cfg, QuantEmbedding.from_bundle(bundle, "token_embd.weight"), blocks,
                          RMSNorm(load_float(bundle, "output_norm.weight"), cfg.rms_eps),
                          lin(head_name, "head"), Rotary(rope_config(cfg)))
