"""Tensor parallelism of the shared decoder stack (models/decoder.py): shard at load, one all-reduce per sublayer.

`shard_decoder(model, tp)` turns a built DecoderModel (whose weights are still views of the file) into this
rank's ParallelDecoder: MLA query and per-head k_b / v_b by head with the latent kv_a path replicated, GQA
query and KV heads, the dense FFN and shared experts column- then row-parallel, the attention output
row-parallel, embedding and head vocab-parallel. Routed experts are partitioned by expert id in contiguous
ranges when the banks are made (`local_experts_factory`): each rank runs only the (token, slot) pairs routed
to its own experts. Each sublayer leaves its partial output in a zero buffer (a sublayer closing into a
`Residual` of that buffer with no norm: the native fused calls take it as they are), the buffer is summed
over the ranks by one async all-reduce, and the fused finalize (residual add + next norm) runs after it.
For MoE layers the shared expert and the local routed experts add into the same buffer: one reduce per layer.

Legend: T tokens, D hidden, V vocab, L tokens that need logits, H heads, G KV heads, E experts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pocketmoe.errors import PocketMoEError
from pocketmoe.layers.attention import MLAConfig, MLAttention
from pocketmoe.layers.experts import ExpertsFactory, ExpertWeights
from pocketmoe.layers.gqa import GQAConfig, GQAttention
from pocketmoe.layers.mlp import GatedMLP
from pocketmoe.layers.moe import MoEBlock
from pocketmoe.layers.norm import Residual
from pocketmoe.models.decoder import DecoderModel, finish_step
from pocketmoe.parallel.group import Parallel
from pocketmoe.parallel.linear import (
    ColumnParallelLinear,
    HeadParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    block_geometry,
    local_experts,
    split_range,
)

if TYPE_CHECKING:
    from pocketmoe.engine.step import StepContext
    from pocketmoe.layers.linear import QuantLinear


# -- what a tensor-parallel size must divide -------------------------------------------------------------
@dataclass(frozen=True)
class Constraint:
    what: str                    # "attention heads (4)"
    ok: Callable[[int], bool]    # this size splits it


def _divides(n: int) -> Callable[[int], bool]:
    return lambda w: n % w == 0


def _row_blocks(n_parts: int, part: int, w: QuantLinear) -> Callable[[int], bool]:
    """Input dim of w = n_parts * part values split over the ranks on whole parts, each share whole blocks."""
    block = block_geometry(w.ggml_type, w.raw)[0]
    return lambda size: n_parts % size == 0 and (n_parts // size * part) % block == 0


def check_size(constraints: list[Constraint], world: int) -> None:
    """One sentence naming the first dimension `world` cannot split, the numbers and the largest valid size."""
    bad = [c for c in constraints if not c.ok(world)]
    if not bad:
        return
    largest = max(n for n in range(1, world + 1) if all(c.ok(n) for c in constraints))
    raise PocketMoEError(f"{bad[0].what} cannot be split over {world} tensor-parallel ranks; the largest valid "
                         f"--nproc-per-node (tensor-parallel size) for this model is {largest}.")


def constraints_of(model: DecoderModel) -> list[Constraint]:
    out: list[Constraint] = []
    for i, b in enumerate(model.blocks):
        a = b.attn
        if isinstance(a, MLAttention):
            c = a.cfg
            out.append(Constraint(f"layer {i}: the {c.n_head} MLA attention heads", _divides(c.n_head)))
            block = block_geometry(a.wo.ggml_type, a.wo.raw)[0]
            out.append(Constraint(
                f"layer {i}: the attention output's input of {c.n_head} heads x {c.v_head} values in quant blocks of "
                f"{block} ({a.wo.name}, row-parallel needs whole blocks per rank)", _row_blocks(c.n_head, c.v_head, a.wo)))
        elif isinstance(a, GQAttention):
            c = a.cfg
            out.append(Constraint(f"layer {i}: the {c.n_head_kv} KV heads ({c.n_head} query heads)",
                                  _divides(c.n_head_kv)))
            block = block_geometry(a.wo.ggml_type, a.wo.raw)[0]
            out.append(Constraint(
                f"layer {i}: the attention output's input of {c.n_head} heads x {c.v_dim} values in quant blocks of "
                f"{block} ({a.wo.name}, row-parallel needs whole blocks per rank)", _row_blocks(c.n_head, c.v_dim, a.wo)))
        else:
            raise PocketMoEError(f"layer {i}: tensor parallelism does not know the attention {type(a).__name__}.")
        mlps = [b.ffn] if isinstance(b.ffn, GatedMLP) else [b.ffn.shared] if b.ffn.shared is not None else []
        for m in mlps:
            ff = m.gate.out_features
            block = block_geometry(m.down.ggml_type, m.down.raw)[0]
            out.append(Constraint(f"layer {i}: the FFN width {ff} in quant blocks of {block} ({m.down.name}, "
                                  "row-parallel needs whole blocks per rank)", _row_blocks(ff, 1, m.down)))
        if isinstance(b.ffn, MoEBlock):
            e = b.ffn.router.cfg.n_experts
            out.append(Constraint(f"layer {i}: the {e} routed experts", lambda w, e=e: w <= e))
    return out


# -- sharded sublayers ------------------------------------------------------------------------------------
def _mla(a: MLAttention, tp: Parallel) -> MLAttention:
    c = a.cfg
    h0, h1 = split_range(c.n_head, tp.world, tp.rank)
    qd = c.qk_nope + c.qk_rope
    q: dict[str, Any] = ({"wq": ColumnParallelLinear(a.wq, h0 * qd, h1 * qd)} if a.wq is not None else
                         {"wq_a": a.wq_a, "q_a_norm": a.q_a_norm, "wq_b": ColumnParallelLinear(a.wq_b, h0 * qd, h1 * qd)})
    if a.absorbed:
        kv: dict[str, Any] = {"k_b": HeadParallelLinear(a.k_b, h0, h1), "v_b": HeadParallelLinear(a.v_b, h0, h1)}
    else:
        kvd = c.qk_nope + c.v_head
        kv = {"wkv_b": ColumnParallelLinear(a.wkv_b, h0 * kvd, h1 * kvd)}
    local = MLAConfig(n_head=h1 - h0, qk_nope=c.qk_nope, qk_rope=c.qk_rope, v_head=c.v_head, kv_lora=c.kv_lora,
                      scale=c.scale)
    return MLAttention(local, a.ops, wkv_a=a.wkv_a, kv_a_norm=a.kv_a_norm, eps=a.eps,
                       wo=RowParallelLinear(a.wo, h0 * c.v_head, h1 * c.v_head), **q, **kv)


def _mlp(m: GatedMLP, tp: Parallel) -> GatedMLP:
    f0, f1 = split_range(m.gate.out_features, tp.world, tp.rank)
    return GatedMLP(ColumnParallelLinear(m.gate, f0, f1), ColumnParallelLinear(m.up, f0, f1),
                    RowParallelLinear(m.down, f0, f1), m.ops)


class ParallelGQA:
    """This rank's query and KV heads. The q / k RMSNorms run over the whole projections (MiniMax-M2), so
    their sums of squares are summed over the ranks first (one [T, 2] all-reduce)."""

    def __init__(self, a: GQAttention, tp: Parallel) -> None:
        c = a.cfg
        q0, q1 = split_range(c.n_head, tp.world, tp.rank)
        g0, g1 = split_range(c.n_head_kv, tp.world, tp.rank)
        dh, dv = c.head_dim, c.v_dim
        self.tp, self.ops, self.eps = tp, a.ops, a.eps
        self.q_width, self.k_width = c.n_head * dh, c.n_head_kv * dh
        self.q_norm = None if a.q_norm is None else a.q_norm[q0 * dh:q1 * dh]
        self.k_norm = None if a.k_norm is None else a.k_norm[g0 * dh:g1 * dh]
        local = GQAConfig(n_head=q1 - q0, n_head_kv=g1 - g0, head_dim=dh, v_dim=dv, n_rot=c.n_rot, neox=c.neox,
                          scale=c.scale)
        self.attn = GQAttention(local, a.ops, wq=ColumnParallelLinear(a.wq, q0 * dh, q1 * dh),
                                wk=ColumnParallelLinear(a.wk, g0 * dh, g1 * dh),
                                wv=ColumnParallelLinear(a.wv, g0 * dv, g1 * dv),
                                wo=RowParallelLinear(a.wo, q0 * dv, q1 * dv), eps=a.eps)

    @property
    def kv_width(self) -> int:
        return self.attn.cfg.kv_width

    def partial(self, x: torch.Tensor, ctx: StepContext, layer: int, part: torch.Tensor) -> None:
        ops, a = self.ops, self.attn
        q, k, v = ops.linear_multi((a.wq, a.wk, a.wv), x)
        if self.q_norm is not None or self.k_norm is not None:
            ss = torch.stack([q.square().sum(-1), k.square().sum(-1)], dim=-1)  # [T, 2]
            ss = self.tp.all_reduce(ss)
            if self.q_norm is not None:
                q = q * torch.rsqrt(ss[:, :1] / self.q_width + self.eps) * self.q_norm
            if self.k_norm is not None:
                k = k * torch.rsqrt(ss[:, 1:] / self.k_width + self.eps) * self.k_norm
        part.add_(ops.linear(a.wo, ops.gqa_attention(a, q.contiguous(), k.contiguous(), v, ctx, layer)))


class LocalExperts:
    """An ExpertBank over global expert ids whose bank holds only experts [start, stop): it runs the (token,
    slot) pairs routed to them, each as one row of a weight-1 slot, and leaves zeros for the other ranks' pairs."""

    def __init__(self, bank: Any, start: int, stop: int) -> None:
        self.bank, self.start, self.stop = bank, start, stop

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        tok, slot = ((ids >= self.start) & (ids < self.stop)).nonzero(as_tuple=True)
        if len(tok):
            y = self.bank(x[tok].contiguous(), (ids[tok, slot] - self.start).view(-1, 1).long(),
                          weights[tok, slot].view(-1, 1).float())
            out.index_add_(0, tok, y)
        return out


class ParallelMoE:
    """Router replicated; this rank's routed experts and its share of the shared expert, into one buffer."""

    def __init__(self, block: MoEBlock, tp: Parallel) -> None:
        self.router, self.ops = block.router, block.router.ops
        self.experts = LocalExperts(block.experts, *split_range(block.router.cfg.n_experts, tp.world, tp.rank))
        self.shared = None if block.shared is None else _mlp(block.shared, tp)

    def partial(self, x: torch.Tensor, part: torch.Tensor) -> None:
        weights, ids = self.ops.route(self.router, x)  # [T, K] each, the same on every rank
        if self.shared is not None:
            part.add_(self.ops.ffn(self.shared, x))
        part.add_(self.ops.moe(self.experts, x, ids, weights))


def local_embedding(ops: Any, e: VocabParallelEmbedding, tokens: np.ndarray, device: torch.device) -> torch.Tensor:
    """[T, D]: the rows of the tokens in this rank's vocab range, zeros for the rest (the sum over the ranks
    is every row)."""
    mine = (tokens >= e.start) & (tokens < e.stop)
    if mine.all():
        return ops.embed(e, (tokens - e.start).astype(np.int32)).contiguous()
    x = torch.zeros(len(tokens), e.shape[1], dtype=torch.float32, device=device)
    if mine.any():
        x[torch.from_numpy(mine)] = ops.embed(e, (tokens[mine] - e.start).astype(np.int32))
    return x


@dataclass
class ParallelBlock:
    attn_norm: torch.Tensor
    attn: Any   # MLAttention (whole-sublayer call into a partial buffer) or ParallelGQA
    ffn_norm: torch.Tensor
    ffn: Any    # GatedMLP or ParallelMoE


class ParallelDecoder:
    """This rank's share of a DecoderModel; the same forward contract (logits [L, V] on every rank)."""

    def __init__(self, base: DecoderModel, tp: Parallel, kv_width: int | None) -> None:
        self.base, self.tp, self.cfg, self.ops = base, tp, base.cfg, base.ops
        v = base.head.out_features
        self.v0, self.v1 = split_range(v, tp.world, tp.rank)
        self._vocab = v
        self.embed = VocabParallelEmbedding(base.embed, *split_range(base.embed.shape[0], tp.world, tp.rank))
        self.head = ColumnParallelLinear(base.head, self.v0, self.v1)
        self.norm = base.norm
        self.blocks = []
        widths = set()
        for b in base.blocks:
            if isinstance(b.attn, GQAttention):
                attn: Any = ParallelGQA(b.attn, tp)
                widths.add(attn.kv_width)
            else:
                attn = _mla(b.attn, tp)
            ffn = _mlp(b.ffn, tp) if isinstance(b.ffn, GatedMLP) else ParallelMoE(b.ffn, tp)
            self.blocks.append(ParallelBlock(b.attn_norm, attn, b.ffn_norm, ffn))
        self.kv_width = widths.pop() if widths else kv_width  # cache values per token on this rank

    @property
    def n_layer(self) -> int:
        return len(self.blocks)

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def prepare(self, ctx: StepContext) -> None:
        self.base.prepare(ctx)

    def _embed(self, ctx: StepContext) -> torch.Tensor:
        """The embedding rows summed over the ranks; the rope tables are made while the reduce is in flight."""
        pending = self.tp.all_reduce_async(local_embedding(self.ops, self.embed, ctx.tokens, self.norm.device))
        self.prepare(ctx)
        return pending.wait()

    def _close(self, x: torch.Tensor, part: torch.Tensor, norm: torch.Tensor | None, eps: float) -> torch.Tensor | None:
        """Sum the sublayer's partial outputs over the ranks, then finalize into the residual stream."""
        self.tp.all_reduce_async(part).wait()
        return self.ops.finalize(x, part, None, norm, eps)

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        ops, eps = self.ops, self.cfg.rms_eps
        x = self._embed(ctx)  # [T, D], the residual stream (replicated, updated in place)
        xn = ops.rms_norm(x, self.blocks[0].attn_norm, eps)
        for i, b in enumerate(self.blocks):
            part = torch.zeros_like(x)
            if isinstance(b.attn, ParallelGQA):
                b.attn.partial(xn, ctx, i, part)
            else:
                b.attn(xn, ctx, i, Residual(part, None, eps))
            xn = self._close(x, part, b.ffn_norm, eps)
            nxt = None if i + 1 == len(self.blocks) else self.blocks[i + 1].attn_norm
            part = torch.zeros_like(x)
            if isinstance(b.ffn, ParallelMoE):
                b.ffn.partial(xn, part)
            else:
                b.ffn(xn, Residual(part, None, eps))
            xn = self._close(x, part, nxt, eps)
        return finish_step(ctx, x, lambda h: ops.rms_norm(h, self.norm, eps),
                           lambda h: self.tp.all_gather_cols(self.head(h), self.vocab_size), self.vocab_size)


def shard_decoder(model: DecoderModel, tp: Parallel, kv_width: int | None = None) -> ParallelDecoder:
    """This rank's ParallelDecoder (PocketMoEError when a dimension cannot be split over tp.world ranks)."""
    check_size(constraints_of(model), tp.world)
    return ParallelDecoder(model, tp, kv_width)


def local_experts_factory(make: ExpertsFactory, tp: Parallel) -> ExpertsFactory:
    """Banks over this rank's contiguous range of experts only (their bytes, never the others')."""

    def local(layer: int, gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights, **kw: Any) -> Any:
        e = gate.shape[0]
        if tp.world > e:
            raise PocketMoEError(f"layer {layer}: the {e} routed experts cannot be split over {tp.world} "
                                 f"tensor-parallel ranks; the largest valid --nproc-per-node is {e}.")
        a, b = split_range(e, tp.world, tp.rank)
        return make(layer, local_experts(gate, a, b), local_experts(up, a, b), local_experts(down, a, b), **kw)

    return local


def shard_model(model: Any, tp: Parallel, kv_width: int) -> Any:
    """This rank's share of a built model of any architecture with a tensor-parallel form."""
    if isinstance(model, DecoderModel):
        return shard_decoder(model, tp, kv_width)
    from pocketmoe.models.deepseek4 import DeepSeek4Model

    if isinstance(model, DeepSeek4Model):
        from pocketmoe.parallel.deepseek4 import shard_deepseek4

        return shard_deepseek4(model, tp, kv_width)
    raise PocketMoEError(f"{type(model).__name__} has no tensor-parallel form yet; run it with one process "
                         "(without torchrun, or --nproc-per-node 1).")
