"""The op set in plain torch: the reference every fast backend is tested against.

With `tile_rows`, GEMMs run on fixed row tiles, so a row's result never depends on the other rows of
the call; attention runs per sequence; so a sequence's logits do not depend on its batch companions.

Legend: T tokens, D hidden, H heads, N qk_nope, R rope dims, V v_head, C kv_lora, S keys, K experts
per token, E experts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from pocketmoe.layers.linear import QuantEmbedding, QuantLinear, ReferenceBackend
from pocketmoe.layers.moe import GATING_SOFTMAX, WEIGHT_SUM_MIN
from pocketmoe.ops.reference_v4 import DeepSeek4Ops
from pocketmoe.specs.base import Role

if TYPE_CHECKING:
    from pocketmoe.engine.step import StepContext
    from pocketmoe.layers.attention import MLAttention
    from pocketmoe.layers.experts import ExpertBank
    from pocketmoe.layers.gqa import GQAttention
    from pocketmoe.layers.mlp import GatedMLP
    from pocketmoe.layers.moe import MoEBlock, Router
    from pocketmoe.layers.norm import Residual


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # one fused op; on CPU fp32 it matched weight * (x * rsqrt(mean(x^2) + eps)) bit for bit (D 48..2048)
    return F.rms_norm(x, weight.shape, weight, eps)


def rope_rows(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor, neox: bool = False) -> torch.Tensor:
    """Rotate x [..., R] with tables cos2, sin2 broadcast to [..., R] (see layers.rotary.Rotary.tables).

    Each value becomes x[i] * cos2[i] + x[partner] * sin2[i]; the partner of a dim is the other member of
    its pair: (2i, 2i+1) in the normal mode, (i, i + R/2) in NeoX mode.
    """
    if neox:
        a, b = x.chunk(2, dim=-1)
        swapped = torch.cat((b, a), dim=-1)
    else:
        swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return x * cos2 + swapped * sin2


def causal_mask(t: int, start: int) -> torch.Tensor | None:
    """[T, S] additive mask: query t (at position start+t) sees keys 0..start+t."""
    if t == 1:
        return None
    s = torch.arange(start + t)
    q = torch.arange(t)[:, None] + start
    return torch.zeros(t, start + t).masked_fill_(s[None, :] > q, float("-inf"))


def sequence_rows(ctx: StepContext, i: int, n_keys: int) -> np.ndarray:
    """Cache rows of positions 0..n_keys-1 of the step's sequence i."""
    pos = np.arange(n_keys)
    page = ctx.cache.page
    return (ctx.page_table[i][pos // page].astype(np.int64) * page + pos % page).astype(np.int32)


class ReferenceOps(DeepSeek4Ops, ReferenceBackend):
    name = "reference"
    absorbs_legacy_mla = False  # runs attn_kv_b files by expanding the cache (the layout's own math)
    # weights whose dequantized float32 copy is worth keeping (within the runner's budget)
    dense_cache_roles: tuple[Role, ...] = (Role.ATTENTION, Role.DENSE_FFN, Role.SHARED_EXPERT, Role.ROUTER)
    detail = "torch reference"
    # Whether a KV row (and every result) is bitwise the same however a prompt is cut into chunks: torch's matmul
    # may round differently with the number of rows, so a prefix-cached row can differ in its last bits.
    chunk_invariant = False

    def __init__(self, tile_rows: int | None = 8) -> None:
        super().__init__(tile_rows)

    def run(self, model: Any, ctx: StepContext) -> torch.Tensor:
        """The model's forward over this step (a backend may run a recorded step instead, bitwise the same)."""
        return model(ctx)

    # -- where each layer runs -------------------------------------------------------------------
    def place_layers(self, layers: Sequence[str], head: str) -> None:
        """The plan's device (by name: cuda:i, or cpu:i for the CPU as device) of each layer and of the head.
        On the host every name is the host: nothing moves."""

    def enter_layer(self, layer: int, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Before a layer runs: its device becomes the ops' device, and ts (the residual stream and the normed
        input) move there. The models call it at each layer; on the host it returns ts as they are."""
        return ts

    def enter_head(self, x: torch.Tensor) -> torch.Tensor:
        """As enter_layer, for the final norm and the head."""
        return x

    # -- linear -------------------------------------------------------------------------------
    def linear_multi(self, weights: Sequence[QuantLinear], x: torch.Tensor) -> list[torch.Tensor]:
        """[x @ W.T for W in weights]: weights sharing one input."""
        return [self.linear(w, x) for w in weights]

    def embed(self, table: QuantEmbedding, tokens: np.ndarray) -> torch.Tensor:  # [T] -> [T, D]
        return table(torch.from_numpy(tokens).long())

    # -- norms and the residual stream ---------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_rows(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, add: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x += add (the residual stream, in place), then rms_norm(x)."""
        x.add_(add)
        return rms_norm_rows(x, weight, eps)

    def finalize(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None = None,
                 weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor | None:
        """x += a + b (a sublayer's outputs: routed + shared, then the residual); with a norm weight,
        rms_norm(x) of the updated rows (the next sublayer's input)."""
        x.add_(a if b is None else a + b)
        return None if weight is None else rms_norm_rows(x, weight, eps)

    def rope(self, x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor, neox: bool = False) -> torch.Tensor:
        """x [T, H, Dh]: the first R dims of every head rotated (cos2, sin2 [T, R])."""
        r = cos2.shape[-1]
        rot = rope_rows(x[..., :r], cos2[:, None], sin2[:, None], neox)
        return rot if r == x.shape[-1] else torch.cat([rot, x[..., r:]], dim=-1)

    # -- attention -----------------------------------------------------------------------------
    def mla_attention(self, attn: MLAttention, q: torch.Tensor, kv: torch.Tensor, ctx: StepContext,
                      layer: int) -> torch.Tensor:
        """q [T, H*(N+R)], kv [T, C+R] (the kv_a projection) -> [T, H*V]; writes the tokens' cache rows."""
        c = attn.cfg
        t = q.shape[0]
        q_nope, q_pe = q.view(t, c.n_head, -1).split([c.qk_nope, c.qk_rope], dim=-1)
        q_pe = rope_rows(q_pe, ctx.cos2[:, None], ctx.sin2[:, None])
        c_kv, k_pe = kv.split([c.kv_lora, c.qk_rope], dim=-1)
        lat = torch.cat([rms_norm_rows(c_kv, attn.kv_a_norm, attn.eps), rope_rows(k_pe, ctx.cos2, ctx.sin2)], -1)
        cache = ctx.cache
        rows = cache.layer_rows(layer)
        rows[torch.from_numpy(ctx.write_rows).long().to(rows.device)] = lat.to(rows.dtype)
        out = []
        for i, (a, b) in enumerate(ctx.seq_spans):
            start = int(ctx.positions[a])
            keys = cache.keys(layer, sequence_rows(ctx, i, int(ctx.keys[b - 1])))  # [S, C+R]
            o = self._mla_one(attn, q_nope[a:b], q_pe[a:b], keys, start)  # [H, t, V]
            out.append(o.transpose(0, 1).reshape(b - a, c.n_head * c.v_head))
        return out[0] if len(out) == 1 else torch.cat(out)

    def _mla_one(self, attn: MLAttention, q_nope: torch.Tensor, q_pe: torch.Tensor, lat: torch.Tensor,
                 start: int) -> torch.Tensor:
        """One sequence's queries [T, H, *] at positions start.. over its keys lat [S, C+R] -> [H, T, V]."""
        c = attn.cfg
        t = q_nope.shape[0]
        q_nope, q_pe = q_nope.transpose(0, 1), q_pe.transpose(0, 1)  # [H, T, *]
        mask = causal_mask(t, start)
        if attn.absorbed:
            qa = attn.k_b.batched(q_nope.contiguous())  # [H, T, C]
            # one GEMM against whole cache rows: [c_kv, k_pe] . [qa, q_pe] = qa.c_kv + q_pe.k_pe
            scores = torch.cat([qa, q_pe], dim=-1).view(c.n_head * t, -1) @ lat.t()  # [H*T, S]
            probs = _softmax(scores.view(c.n_head, t, -1), c.scale, mask)
            o_lat = probs.view(c.n_head * t, -1) @ lat[:, :c.kv_lora]  # [H*T, C]
            return attn.v_b.batched(o_lat.view(c.n_head, t, -1))  # [H, T, V]
        c_all, kpe_all = lat.split([c.kv_lora, c.qk_rope], dim=-1)  # [S, C], [S, R]
        kv = attn.wkv_b(c_all).view(-1, c.n_head, c.qk_nope + c.v_head)  # [S, H, N+V]
        k_nope, v = kv.permute(1, 0, 2).split([c.qk_nope, c.v_head], dim=-1)  # [H, S, *]
        scores = q_nope @ k_nope.transpose(1, 2) + q_pe @ kpe_all.t()  # [H, T, S]
        return _softmax(scores, c.scale, mask) @ v  # [H, T, V]

    def mla_sublayer(self, attn: MLAttention, x: torch.Tensor, ctx: StepContext, layer: int,
                     residual: Residual) -> torch.Tensor | None:
        """The attention sublayer: projections, mla_attention, the output projection, then finalize."""
        q, kv = attn.project_q_kv(x)
        return self.close(residual, self.linear(attn.wo, self.mla_attention(attn, q, kv, ctx, layer)))

    def gqa_attention(self, attn: GQAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext,
                      layer: int) -> torch.Tensor:
        """q [T, H*Dh], k [T, G*Dh], v [T, G*Dv] -> [T, H*Dv]; ropes q and k, writes the tokens' cache rows
        ([K of every KV head, then V]) and attends per sequence over that sequence's rows."""
        c = attn.cfg
        t, r = q.shape[0], c.n_rot
        cos2, sin2 = ctx.cos2[:, None], ctx.sin2[:, None]
        q, k = q.view(t, c.n_head, c.head_dim), k.view(t, c.n_head_kv, c.head_dim)
        q = torch.cat([rope_rows(q[..., :r], cos2, sin2, c.neox), q[..., r:]], dim=-1)
        k = torch.cat([rope_rows(k[..., :r], cos2, sin2, c.neox), k[..., r:]], dim=-1)
        cache = ctx.cache
        rows = cache.layer_rows(layer)
        rows[torch.from_numpy(ctx.write_rows).long().to(rows.device)] = torch.cat(
            [k.reshape(t, -1), v.reshape(t, -1)], dim=-1).to(rows.dtype)
        nk = c.n_head_kv * c.head_dim
        group = c.n_head // c.n_head_kv
        out = []
        for i, (a, b) in enumerate(ctx.seq_spans):
            rows = cache.keys(layer, sequence_rows(ctx, i, int(ctx.keys[b - 1])))  # [S, G*(Dh+Dv)]
            keys = rows[:, :nk].view(-1, c.n_head_kv, c.head_dim).transpose(0, 1)  # [G, S, Dh]
            vals = rows[:, nk:].view(-1, c.n_head_kv, c.v_dim).transpose(0, 1)     # [G, S, Dv]
            qs = q[a:b].transpose(0, 1).reshape(c.n_head_kv, group * (b - a), c.head_dim)  # [G, group*t, Dh]
            scores = (qs @ keys.transpose(1, 2)).view(c.n_head, b - a, -1)  # [H, t, S]
            probs = _softmax(scores, c.scale, causal_mask(b - a, int(ctx.positions[a])))
            o = probs.view(c.n_head_kv, group * (b - a), -1) @ vals  # [G, group*t, Dv]
            out.append(o.view(c.n_head, b - a, c.v_dim).transpose(0, 1).reshape(b - a, c.n_head * c.v_dim))
        return out[0] if len(out) == 1 else torch.cat(out)

    def gqa_sublayer(self, attn: GQAttention, x: torch.Tensor, ctx: StepContext, layer: int,
                     residual: Residual) -> torch.Tensor | None:
        """The attention sublayer: projections (and q / k norms), gqa_attention, the output projection, finalize."""
        q, k, v = attn.project(x)
        return self.close(residual, self.linear(attn.wo, self.gqa_attention(attn, q, k, v, ctx, layer)))

    def close(self, residual: Residual, a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor | None:
        """finalize into the residual stream: x += a (+ b); the next sublayer's input."""
        return self.finalize(residual.x, a, b, residual.norm, residual.eps)

    # -- experts -------------------------------------------------------------------------------
    def route(self, router: Router, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> weights [T, K] float32, ids [T, K] (see layers.moe.Router for the rules)."""
        c = router.cfg
        logits = router.gate(x.float())  # [T, E]
        probs = logits.softmax(-1) if c.gating == GATING_SOFTMAX else logits.sigmoid()
        select = probs if router.bias is None else probs + router.bias
        if c.n_groups > 1:
            grouped = select.view(-1, c.n_groups, c.n_experts // c.n_groups)  # [T, G, E/G]
            top2 = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [T, G]
            keep = top2.topk(c.groups_used, dim=-1).indices
            mask = torch.zeros_like(top2, dtype=torch.bool).scatter_(1, keep, True)
            select = grouped.masked_fill(~mask[..., None], float("-inf")).view(-1, c.n_experts)
        if select is probs:  # no bias, no group mask: the top-k values are the weights
            weights, ids = probs.topk(c.top_k, dim=-1)  # [T, K], [T, K]
        else:
            ids = select.topk(c.top_k, dim=-1).indices
            weights = probs.gather(1, ids)
        if c.norm:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(WEIGHT_SUM_MIN)
        if c.scale not in (0.0, 1.0):
            weights = weights * c.scale
        return weights, ids

    def moe(self, bank: ExpertBank, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) by the bank the placement plan chose."""
        return bank(x, ids, weights)

    def ffn(self, mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate x) * up x): dense FFN and shared experts."""
        g, u = self.linear_multi((mlp.gate, mlp.up), x)
        return self.linear(mlp.down, F.silu(g) * u)

    def ffn_sublayer(self, mlp: GatedMLP, x: torch.Tensor, residual: Residual) -> torch.Tensor | None:
        """A dense FFN sublayer: ffn, then finalize."""
        return self.close(residual, self.ffn(mlp, x))

    def moe_sublayer(self, block: MoEBlock, x: torch.Tensor, residual: Residual) -> torch.Tensor | None:
        """An MoE sublayer: route, the ExpertBank, the shared experts, then finalize (routed + shared + residual)."""
        weights, ids = self.route(block.router, x)
        routed = self.moe(block.experts, x, ids, weights)
        return self.close(residual, routed, None if block.shared is None else self.ffn(block.shared, x))


def _softmax(scores: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    scores = scores * scale
    if mask is not None:
        scores = scores + mask
    return scores.softmax(-1)
