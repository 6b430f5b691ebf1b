"""Tensor parallelism of DeepSeek-V4 (models/deepseek4.py): the same rules as the decoder stack's.

Attention: query heads (attn_q_b rows, the sinks) and whole output groups (attn_output_a per group, then
attn_output_b row-parallel on those groups' LoRA columns) by rank; the one shared K=V head, the compressors
and the lightning indexer are replicated (every rank writes the same cache rows). MoE: router and hash table
replicated, routed experts by contiguous expert ranges, the shared expert column- then row-parallel (its
SwiGLU clamp is elementwise). The hyper-connection mixes are replicated; each sublayer's partial output is
summed by one async all-reduce before hc_post. Embedding and head vocab-parallel.

Legend: T tokens, n streams, D hidden, V vocab, H heads, G output groups, d head dims, R o_lora rank.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from pocketmoe.layers.dsv4_attention import DSV4Attention
from pocketmoe.layers.dsv4_moe import DSV4MoE
from pocketmoe.layers.linear import QuantLinear
from pocketmoe.models.decoder import finish_step
from pocketmoe.models.deepseek4 import DeepSeek4Model
from pocketmoe.parallel.group import Parallel
from pocketmoe.parallel.linear import (
    ColumnParallelLinear,
    HeadParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    block_geometry,
    split_range,
)
from pocketmoe.parallel.model import Constraint, LocalExperts, _mlp, _row_blocks, check_size, local_embedding

if TYPE_CHECKING:
    from pocketmoe.engine.step import StepContext


def constraints(model: DeepSeek4Model) -> list[Constraint]:
    out: list[Constraint] = []
    for i, b in enumerate(model.blocks):
        c = b.attn.cfg
        out.append(Constraint(f"layer {i}: the {c.n_head} attention heads in {c.o_groups} output groups",
                              lambda w, c=c: c.n_head % w == 0 and c.o_groups % w == 0))
        wo_b = b.attn.wo_b
        block = block_geometry(wo_b.ggml_type, wo_b.raw)[0]
        out.append(Constraint(f"layer {i}: the output LoRA input of {c.o_groups} groups x {c.o_lora_rank} values in "
                              f"quant blocks of {block} ({wo_b.name}, row-parallel needs whole blocks per rank)",
                              _row_blocks(c.o_groups, c.o_lora_rank, wo_b)))
        m = b.moe
        if m.shared is not None:
            ff = m.shared.gate.out_features
            block = block_geometry(m.shared.down.ggml_type, m.shared.down.raw)[0]
            out.append(Constraint(f"layer {i}: the shared expert width {ff} in quant blocks of {block} "
                                  f"({m.shared.down.name})", _row_blocks(ff, 1, m.shared.down)))
        e = m.gate.out_features
        out.append(Constraint(f"layer {i}: the {e} routed experts", lambda w, e=e: w <= e))
    return out


def _attention(a: DSV4Attention, tp: Parallel) -> DSV4Attention:
    c = a.cfg
    h0, h1 = split_range(c.n_head, tp.world, tp.rank)
    g0, g1 = split_range(c.o_groups, tp.world, tp.rank)
    d, r = c.head_dim, c.o_lora_rank
    local = replace(c, n_head=h1 - h0, o_groups=g1 - g0)
    return DSV4Attention(local, a.ops, wq_a=a.wq_a, q_a_norm=a.q_a_norm, wq_b=ColumnParallelLinear(a.wq_b, h0 * d, h1 * d),
                         wkv=a.wkv, kv_norm=a.kv_norm, sinks=a.sinks[h0:h1], wo_a=HeadParallelLinear(a.wo_a, g0, g1),
                         wo_b=RowParallelLinear(a.wo_b, g0 * r, g1 * r), compressor=a.compressor, indexer=a.indexer)


def _moe(m: DSV4MoE, tp: Parallel) -> DSV4MoE:
    e = m.gate.out_features
    start, stop = split_range(e, tp.world, tp.rank)
    bank: Any = m.experts  # made over this rank's experts only (runner: local_experts_factory), clamp included
    route: dict[str, Any] = {"tid2eid": m.tid2eid} if m.tid2eid is not None else {"bias": m.bias}
    return DSV4MoE(m.ops, m.gate, LocalExperts(bank, start, stop), None if m.shared is None else _mlp(m.shared, tp),
                   top_k=m.top_k, norm=m.norm, scale=m.scale, shared_limit=m.shared_limit, **route)


class ParallelDeepSeek4:
    """This rank's share of a DeepSeek4Model; logits [L, V] on every rank."""

    def __init__(self, base: DeepSeek4Model, tp: Parallel, kv_width: int) -> None:
        self.base, self.tp, self.cfg, self.ops, self.kv_width = base, tp, base.cfg, base.ops, kv_width
        self._vocab = base.head.out_features
        self.embed = VocabParallelEmbedding(base.embed, *split_range(base.embed.shape[0], tp.world, tp.rank))
        self.head: QuantLinear = ColumnParallelLinear(base.head, *split_range(self._vocab, tp.world, tp.rank))
        self.attn = [_attention(b.attn, tp) for b in base.blocks]
        self.moe = [_moe(b.moe, tp) for b in base.blocks]

    @property
    def n_layer(self) -> int:
        return len(self.base.blocks)

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def _reduced(self, part: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce_async(part.contiguous()).wait()

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        base, ops, eps, n = self.base, self.ops, self.cfg.rms_eps, self.cfg.hc_count
        pending = self.tp.all_reduce_async(local_embedding(ops, self.embed, ctx.tokens, base.norm.device))
        base.rope.prepare(ctx.positions)  # independent of the reduce in flight
        tokens = torch.from_numpy(ctx.tokens).long()
        x = pending.wait()[:, None, :].expand(-1, n, -1).contiguous()  # the residual streams [T, n, D]
        for i, blk in enumerate(base.blocks):
            y, post, comb = blk.hc_attn.pre(x)
            out = self._reduced(self.attn[i](ops.rms_norm(y, blk.attn_norm, eps), ctx, i, base.rope))
            x = blk.hc_attn.post(out, x, post, comb)
            y, post, comb = blk.hc_ffn.pre(x)
            out = self._reduced(self.moe[i](ops.rms_norm(y, blk.ffn_norm, eps), tokens))
            x = blk.hc_ffn.post(out, x, post, comb)
        return finish_step(ctx, x, lambda h: ops.rms_norm(base.head_hc(h), base.norm, eps),
                           lambda h: self.tp.all_gather_cols(self.head(h), self.vocab_size), self.vocab_size)


def shard_deepseek4(model: DeepSeek4Model, tp: Parallel, kv_width: int) -> ParallelDeepSeek4:
    check_size(constraints(model), tp.world)
    return ParallelDeepSeek4(model, tp, kv_width)


__all__ = ["ParallelDeepSeek4", "shard_deepseek4"]
