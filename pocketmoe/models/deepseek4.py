"""DeepSeek-V4 (`deepseek4`): mHC residual streams, attention over a sliding window plus compressed entries
(ratio 4 with the lightning indexer, or 128) with sinks, hash-routed and sqrtsoftplus-routed MoE with a
SwiGLU clamp (SPECS.md 3.4). llama.cpp (deepseek4.cpp) is the reference where it and DeepSeek's differ:
the shared expert is clamped too, and the reference's FP8 / FP4 activation round-trips are not simulated.

Math only: which layers, bound to which GGUF tensors, and the forward pass over the ops. The MTP layers
(nextn) are not run. Legend: T tokens, n streams, D hidden, V vocab, L tokens that need logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pocketmoe.layers.dsv4_attention import (
    Compressor,
    DSV4Attention,
    DSV4AttentionConfig,
    DSV4Rope,
    Indexer,
    RowLayout,
)
from pocketmoe.layers.dsv4_moe import CLAMP_MIN, DSV4MoE
from pocketmoe.layers.experts import ExpertsFactory, ExpertWeights
from pocketmoe.layers.hyper import HyperConfig, HyperConnection, HyperHead
from pocketmoe.layers.linear import QuantEmbedding, QuantLinear, load_float
from pocketmoe.layers.mlp import GatedMLP
from pocketmoe.layers.rotary import RopeConfig, Rotary
from pocketmoe.models.decoder import LayeredModel, LinearFactory, finish_step

if TYPE_CHECKING:
    from pocketmoe.engine.step import StepContext
    from pocketmoe.gguf import GGUFBundle
    from pocketmoe.specs.deepseek4 import DeepSeek4Config


def rope_configs(cfg: DeepSeek4Config) -> tuple[RopeConfig, RopeConfig]:
    """(window-only layers: rope_freq_base, no scaling; compressed layers: compress base with the file's
    scaling). llama.cpp sets the cos/sin amplitude to 1 in both (dsv4_rope_attn_factor undoes YaRN's mscale)."""
    rs = cfg.rope_scaling
    scaling = rs.kind if rs.kind in ("linear", "yarn") else "none"
    return (RopeConfig(dim=cfg.n_rot, base=cfg.rope_freq_base),
            RopeConfig(dim=cfg.n_rot, base=cfg.compress_rope_freq_base, scaling=scaling, factor=rs.factor,
                       original_context=rs.orig_ctx, beta_fast=rs.beta_fast, beta_slow=rs.beta_slow))


class DSV4Block:
    def __init__(self, hc_attn: HyperConnection, attn_norm: torch.Tensor, attn: DSV4Attention,
                 hc_ffn: HyperConnection, ffn_norm: torch.Tensor, moe: DSV4MoE) -> None:
        self.hc_attn, self.attn_norm, self.attn = hc_attn, attn_norm, attn
        self.hc_ffn, self.ffn_norm, self.moe = hc_ffn, ffn_norm, moe


class DeepSeek4Model(LayeredModel):
    def __init__(self, cfg: DeepSeek4Config, ops: Any, embed: QuantEmbedding, blocks: list[DSV4Block],
                 head_hc: HyperHead, norm: torch.Tensor, head: QuantLinear, rope: DSV4Rope) -> None:
        self.cfg, self.ops, self.embed, self.blocks = cfg, ops, embed, blocks
        self.head_hc, self.norm, self.head, self.rope = head_hc, norm, head, rope

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        """logits [L, V] float32 of the step's tokens that need them; writes every token's cache rows."""
        ops, eps, n = self.ops, self.cfg.rms_eps, self.cfg.hc_count
        self.rope.prepare(ctx.positions)
        tokens = torch.from_numpy(ctx.tokens).long()
        e = ops.embed(self.embed, ctx.tokens)  # [T, D]
        x = e[:, None, :].expand(-1, n, -1).contiguous()  # the residual streams [T, n, D]
        for i, blk in enumerate(self.blocks):
            x, = ops.enter_layer(i, x)  # a model split over GPUs: the streams move to the layer's device
            y, post, comb = blk.hc_attn.pre(x)
            x = blk.hc_attn.post(blk.attn(ops.rms_norm(y, blk.attn_norm, eps), ctx, i, self.rope), x, post, comb)
            y, post, comb = blk.hc_ffn.pre(x)
            x = blk.hc_ffn.post(blk.moe(ops.rms_norm(y, blk.ffn_norm, eps), tokens), x, post, comb)
        return finish_step(ctx, ops.enter_head(x), lambda h: ops.rms_norm(self.head_hc(h), self.norm, eps),
                           self.head, self.vocab_size)


def _grouped(w: QuantLinear, groups: int) -> QuantLinear:
    """attn_output_a [G*R, I] as per-group weights [G, R, I] (a view of the same blocks)."""
    r = w.out_features // groups
    return QuantLinear(w.raw.reshape(groups, r, -1), w.ggml_type, (groups, r, w.in_features),
                       cache_dense=w.cache_dense, backend=w.backend, name=w.name)


def _compressor(bundle: GGUFBundle, lin: LinearFactory, prefix: str, ratio: int, eps: float,
                spans: tuple[tuple[int, int], ...]) -> Compressor:
    return Compressor(lin(prefix + "kv.weight"), lin(prefix + "gate.weight"), load_float(bundle, prefix + "ape.weight"),
                      load_float(bundle, prefix + "norm.weight"), ratio, eps, *spans)


def _attention(bundle: GGUFBundle, cfg: DeepSeek4Config, ops: Any, i: int, lin: LinearFactory) -> DSV4Attention:
    b, ratio = f"blk.{i}.", cfg.compress_ratio(i)
    lay = RowLayout.of(ratio, cfg.head_dim, cfg.indexer_head_dim)
    acfg = DSV4AttentionConfig(n_head=cfg.n_head, head_dim=cfg.head_dim, n_rot=cfg.n_rot, o_groups=cfg.o_groups,
                               o_lora_rank=cfg.o_lora_rank, window=cfg.sliding_window, ratio=ratio, eps=cfg.rms_eps,
                               layout=lay)
    comp = idx = None
    if ratio:
        comp = _compressor(bundle, lin, b + "attn_compressor_", ratio, cfg.rms_eps,
                           (lay.comp_kv, lay.comp_score, lay.comp_entry))
    if ratio == 4:
        ic = _compressor(bundle, lin, b + "indexer_compressor_", ratio, cfg.rms_eps,
                         (lay.idx_kv, lay.idx_score, lay.idx_entry))
        idx = Indexer(lin(b + "indexer.attn_q_b.weight"), lin(b + "indexer.proj.weight"), ic, cfg.n_indexer_head,
                      cfg.indexer_head_dim, cfg.indexer_top_k)
    return DSV4Attention(acfg, ops, wq_a=lin(b + "attn_q_a.weight"), q_a_norm=load_float(bundle, b + "attn_q_a_norm.weight"),
                         wq_b=lin(b + "attn_q_b.weight"), wkv=lin(b + "attn_kv.weight"),
                         kv_norm=load_float(bundle, b + "attn_kv_a_norm.weight"),
                         sinks=load_float(bundle, b + "attn_sinks.weight"),
                         wo_a=_grouped(lin(b + "attn_output_a.weight"), cfg.o_groups), wo_b=lin(b + "attn_output_b.weight"),
                         compressor=comp, indexer=idx)


def _limit(values: tuple[float, ...], i: int) -> float:
    return float(values[min(i, len(values) - 1)]) if values else 0.0


def _moe(bundle: GGUFBundle, cfg: DeepSeek4Config, ops: Any, i: int, lin: LinearFactory,
         make_experts: ExpertsFactory) -> DSV4MoE:
    b = f"blk.{i}."
    gate, up, down = (ExpertWeights.from_bundle(bundle, f"{b}ffn_{w}_exps.weight") for w in ("gate", "up", "down"))
    limit = _limit(cfg.swiglu_clamp_exp, i)
    # llama.cpp: the shared experts' limits default to the routed ones when the file has none
    shared_limit = _limit(cfg.swiglu_clamp_shexp, i) if cfg.swiglu_clamp_shexp else limit
    # the routed experts' SwiGLU clamp travels with the bank, whichever the placement chose (every kernel clamps)
    bank = make_experts(i, gate, up, down, swiglu_limit=limit if limit > CLAMP_MIN else 0.0)
    shared = GatedMLP(lin(b + "ffn_gate_shexp.weight"), lin(b + "ffn_up_shexp.weight"),
                      lin(b + "ffn_down_shexp.weight"), ops) if cfg.n_expert_shared else None
    route: dict[str, torch.Tensor] = {}
    if i < cfg.n_hash_layers:  # token id -> expert ids (I32 [V, K])
        route["tid2eid"] = bundle.raw_torch(b + "ffn_gate_tid2eid.weight").view(torch.int32).reshape(-1, cfg.n_expert_used)
    else:
        route["bias"] = load_float(bundle, b + "exp_probs_b.bias")
    return DSV4MoE(ops, lin(b + "ffn_gate_inp.weight"), bank, shared, top_k=cfg.n_expert_used,
                   norm=cfg.expert_weights_norm, scale=cfg.expert_weights_scale, shared_limit=shared_limit, **route)


def _hyper(bundle: GGUFBundle, ops: Any, hc: HyperConfig, lin: LinearFactory, prefix: str) -> HyperConnection:
    return HyperConnection(hc, ops, lin(prefix + "_fn.weight"), load_float(bundle, prefix + "_scale.weight"),
                           load_float(bundle, prefix + "_base.weight"))


def build(bundle: GGUFBundle, cfg: DeepSeek4Config, ops: Any, lin: LinearFactory,
          make_experts: ExpertsFactory) -> DeepSeek4Model:
    """Bind every layer to its tensor views in the bundle (no copies of quantized data)."""
    hc = HyperConfig(n=cfg.hc_count, sinkhorn_iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps, rms_eps=cfg.rms_eps)
    blocks = []
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        blocks.append(DSV4Block(_hyper(bundle, ops, hc, lin, b + "hc_attn"), load_float(bundle, b + "attn_norm.weight"),
                                _attention(bundle, cfg, ops, i, lin), _hyper(bundle, ops, hc, lin, b + "hc_ffn"),
                                load_float(bundle, b + "ffn_norm.weight"), _moe(bundle, cfg, ops, i, lin, make_experts)))
    head_hc = HyperHead(hc, ops, lin("output_hc_fn.weight"), load_float(bundle, "output_hc_scale.weight"),
                        load_float(bundle, "output_hc_base.weight"))
    plain, compressed = rope_configs(cfg)
    return DeepSeek4Model(cfg, ops, QuantEmbedding.from_bundle(bundle, "token_embd.weight"), blocks, head_hc,
                          load_float(bundle, "output_norm.weight"), lin("output.weight"),
                          DSV4Rope(Rotary(plain), Rotary(compressed)))
