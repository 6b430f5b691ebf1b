"""The DeepSeek-V4 ops in plain torch, mixed into ReferenceOps (so every backend has them; the native backend
runs their linears and norms on its kernels): hc_pre / hc_post / hc_head (mHC), dsv4_attention (window rows,
compressors, indexer, sinks, inverse rope, grouped output) and dsv4_moe (sqrtsoftplus and hash routing,
clamped SwiGLU). The math follows llama.cpp's deepseek4.cpp and its DSV4 cache (SPECS.md 3.4).

Attention runs per sequence over that sequence's cache rows, and the GEMMs are the backend's fixed-tile
ones, so a sequence's values never depend on its batch companions.

Legend: T tokens, n streams, D hidden, H heads, d head dims, R rope dims, r ratio, S keys, E experts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from pocketmoe.layers.dsv4_moe import clamped_swiglu
from pocketmoe.layers.moe import WEIGHT_SUM_MIN

if TYPE_CHECKING:
    from pocketmoe.engine.step import StepContext
    from pocketmoe.layers.dsv4_attention import Compressor, DSV4Attention, DSV4Rope, Indexer
    from pocketmoe.layers.dsv4_moe import DSV4MoE
    from pocketmoe.layers.hyper import HyperConnection, HyperHead

NEG_INF = float("-inf")


def rope_tail(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last R dims of x [..., d] in interleaved pairs (ggml NORM mode) by tables broadcast to [..., R];
    `inverse` rotates back (ggml_rope_ext_back)."""
    r = cos2.shape[-1]
    tail = x[..., x.shape[-1] - r:]
    swapped = tail.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    rot = tail * cos2 - swapped * sin2 if inverse else tail * cos2 + swapped * sin2
    return rot if r == x.shape[-1] else torch.cat([x[..., :x.shape[-1] - r], rot], dim=-1)


def seq_rows(ctx: StepContext, i: int, positions: np.ndarray) -> torch.Tensor:
    """Cache rows (int64) of the given positions of the step's sequence i."""
    page = ctx.cache.page
    pos = np.asarray(positions, dtype=np.int64)
    return torch.from_numpy(ctx.page_table[i][pos // page].astype(np.int64) * page + pos % page)


def mix_streams(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_i w[:, i] * x[:, i] in stream order: x [T, n, D], w [T, n] -> [T, D]."""
    y = x[:, 0] * w[:, 0:1]
    for i in range(1, x.shape[1]):
        y = y + x[:, i] * w[:, i:i + 1]
    return y


def sinkhorn(p: np.ndarray, iters: int, eps: float) -> np.ndarray:
    """comb [T, n src, n dst] from the row softmax p: + eps, columns (over src) normalised, then iters - 1 times
    rows and columns. numpy float32 (a few us an op where torch takes ten on these 4 x 4 blocks); the sums run in
    index order, bitwise torch's."""
    e = np.float32(eps)
    comb = p + e
    comb /= comb.sum(1, keepdims=True) + e
    for _ in range(iters - 1):
        comb /= comb.sum(2, keepdims=True) + e
        comb /= comb.sum(1, keepdims=True) + e
    return comb


def rowwise(fn: Any, x: torch.Tensor) -> torch.Tensor:
    """fn(x) elementwise in float64, rounded to float32: torch's vector and scalar paths (which one an element
    takes depends on the tensor's size) then agree, so a row's values do not depend on the other rows."""
    return fn(x.double()).float()


def heap_top_k(values: list[float], k: int) -> list[int]:
    """The indices ggml's CPU top_k keeps: std::partial_sort (libstdc++: a heap of the first k, then each later
    index that is strictly greater than the heap's least replaces it), which decides exact ties."""
    heap = list(range(k))

    def sift(hole: int, n: int, value: int) -> None:  # std::__adjust_heap with comp(a, b) = v[a] > v[b]
        top, child = hole, hole
        while child < (n - 1) // 2:
            child = 2 * (child + 1)
            if values[heap[child]] > values[heap[child - 1]]:
                child -= 1
            heap[hole], hole = heap[child], child
        if n % 2 == 0 and child == (n - 2) // 2:
            child = 2 * (child + 1)
            heap[hole], hole = heap[child - 1], child - 1
        parent = (hole - 1) // 2
        while hole > top and values[heap[parent]] > values[value]:
            heap[hole], hole = heap[parent], parent
            parent = (hole - 1) // 2
        heap[hole] = value

    for parent in range((k - 2) // 2, -1, -1):
        sift(parent, k, heap[parent])
    for i in range(k, len(values)):
        if values[i] > values[heap[0]]:
            sift(0, k, i)
    return heap


def _slice(cache: torch.Tensor, rows: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    return cache[rows, span[0]:span[1]].float()


class DeepSeek4Ops:
    """Mixed into ReferenceOps; uses its linear, linear_multi, rms_norm and moe."""

    linear: Any
    linear_multi: Any
    rms_norm: Any
    moe: Any

    # -- hyper-connections -----------------------------------------------------------------------
    def _hc_mixes(self, site: HyperConnection | HyperHead, x: torch.Tensor) -> torch.Tensor:
        """x [T, n, D] -> fn . rmsnorm(flat x) [T, M] (the norm has no weight)."""
        flat = x.reshape(x.shape[0], -1)
        return self.linear(site.fn, F.rms_norm(flat, (flat.shape[1],), eps=site.cfg.rms_eps))

    def hc_pre(self, hc: HyperConnection, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, n, D] -> (sum_i pre_i x_i [T, D], post [T, n], comb [T, n src, n dst]).

        comb: softmax over dst, + eps, columns (over src) normalised, then iters - 1 times rows and columns.
        """
        c, s, b = hc.cfg, hc.scale, hc.base
        t, n = x.shape[0], c.n
        m = self._hc_mixes(hc, x)
        pre = rowwise(torch.sigmoid, m[:, :n] * s[0] + b[:n]) + c.eps
        post = 2.0 * rowwise(torch.sigmoid, m[:, n:2 * n] * s[1] + b[n:2 * n])
        comb = self.hc_sinkhorn((m[:, 2 * n:] * s[2] + b[2 * n:]).view(t, n, n).softmax(-1), c.sinkhorn_iters, c.eps)
        return self.hc_mix(x, pre), post, comb

    def hc_sinkhorn(self, p: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        """comb [T, n, n] from the row softmax p (module function sinkhorn)."""
        return torch.from_numpy(sinkhorn(p.cpu().numpy(), iters, eps)).to(p.device)

    def hc_mix(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """sum_i w[:, i] * x[:, i] in stream order: x [T, n, D], w [T, n] -> [T, D]."""
        return mix_streams(x, w)

    def hc_post(self, out: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """New streams [T, n, D]: stream j = post_j * out + sum_i comb[i, j] * x_i."""
        streams = []
        for j in range(x.shape[1]):
            y = out * post[:, j:j + 1]
            for i in range(x.shape[1]):
                y = y + x[:, i] * comb[:, i, j:j + 1]
            streams.append(y)
        return torch.stack(streams, dim=1)

    def hc_head(self, head: HyperHead, x: torch.Tensor) -> torch.Tensor:
        """x [T, n, D] -> sum_i pre_i x_i [T, D], pre = sigmoid(fn . rmsnorm(x) * scale + base) + eps."""
        pre = rowwise(torch.sigmoid, self._hc_mixes(head, x) * head.scale[0] + head.base) + head.cfg.eps
        return self.hc_mix(x, pre)

    # -- attention -------------------------------------------------------------------------------
    def dsv4_attention(self, attn: DSV4Attention, x: torch.Tensor, ctx: StepContext, layer: int,
                       rope: DSV4Rope) -> torch.Tensor:
        """x [T, D] (normed) -> [T, D]. Writes each token's cache row (kv, compressor states), the entries of
        the blocks its tokens complete, then attends per sequence over window rows and visible entries."""
        c = attn.cfg
        t, d, eps = x.shape[0], c.head_dim, c.eps
        cos2, sin2 = rope.tables(c.ratio != 0)
        qa, kv = self.linear_multi((attn.wq_a, attn.wkv), x)
        qr = self.rms_norm(qa, attn.q_a_norm, eps)
        q = F.rms_norm(self.linear(attn.wq_b, qr).view(t, c.n_head, d), (d,), eps=eps)  # unweighted, per head
        q = rope_tail(q, cos2[:, None], sin2[:, None])
        kv = rope_tail(self.rms_norm(kv, attn.kv_norm, eps), cos2, sin2)
        cache = ctx.cache.layer_rows(layer)  # [P, W]
        rows = torch.from_numpy(ctx.write_rows).long().to(cache.device)
        cache[rows, c.layout.kv[0]:c.layout.kv[1]] = kv.to(cache.dtype)
        idx = attn.indexer
        comps = [k for k in (attn.compressor, idx.compressor if idx else None) if k is not None]
        for k in comps:
            self._compressor_state(k, x, ctx, cache, rows)
        if idx is not None:
            iq = rope_tail(self.linear(idx.wq_b, qr).view(t, idx.n_head, idx.head_dim), cos2[:, None], sin2[:, None])
            iw = self.linear(idx.proj, x) * (idx.head_dim * idx.n_head) ** -0.5  # [T, h]
        out = []
        for i, (a, b) in enumerate(ctx.seq_spans):
            start, end = int(ctx.positions[a]), int(ctx.positions[b - 1]) + 1
            for k in comps:
                self._compress_blocks(k, ctx, i, cache, start, end, rope.compressed)
            keep = None if idx is None else self._indexer_select(idx, iq[a:b], iw[a:b], ctx, i, cache, start, end)
            out.append(self._attend(attn, q[a:b], ctx, i, cache, start, end, keep))
        o = rope_tail(out[0] if len(out) == 1 else torch.cat(out), cos2[:, None], sin2[:, None], inverse=True)
        return self.linear(attn.wo_b, self._grouped_output(attn, o.reshape(t, c.o_groups, -1)))

    def _grouped_output(self, attn: DSV4Attention, o: torch.Tensor) -> torch.Tensor:
        """o [T, G, H*d/G] -> concat_g wo_a[g] o_g [T, G*o_lora], in fixed row tiles (batch-invariant)."""
        t = o.shape[0]
        tile = self.batched_tile(attn.wo_a) or t
        pad = -t % tile
        x = torch.cat([o, o.new_zeros(pad, *o.shape[1:])]) if pad else o
        parts = [attn.wo_a.batched(x[k:k + tile].transpose(0, 1).contiguous()) for k in range(0, t + pad, tile)]
        return torch.cat(parts, dim=1)[:, :t].transpose(0, 1).reshape(t, -1)  # from [G, T, o_lora]

    def batched_tile(self, layer: Any) -> int | None:
        """Rows per call that keep `batched` on this weight batch-invariant (None: any count; torch's bmm
        needs the fixed tiles)."""
        return getattr(self, "tile_rows", None)

    def _compressor_state(self, k: Compressor, x: torch.Tensor, ctx: StepContext, cache: torch.Tensor,
                          rows: torch.Tensor) -> None:
        """Each token's compressor state into its row: kv = wkv x, score = wgate x + ape[pos % r]."""
        kv, score = self.linear_multi((k.wkv, k.wgate), x)
        ape = k.ape[torch.from_numpy(ctx.positions % k.ratio).long()]
        cache[rows, k.kv[0]:k.kv[1]] = kv.to(cache.dtype)
        cache[rows, k.score[0]:k.score[1]] = (score + ape).to(cache.dtype)

    def _compress_blocks(self, k: Compressor, ctx: StepContext, i: int, cache: torch.Tensor, start: int, end: int,
                         rotary: Any) -> None:
        """The entries of the blocks that positions start..end-1 of sequence i complete, each in the row of its
        last token: pooled, RMSNorm, rope (at the block's first position) on the last R dims."""
        r, d = k.ratio, k.dim
        blocks = np.arange(start // r, end // r)
        if len(blocks) == 0:
            return
        nb = len(blocks)
        cur = blocks[:, None] * r + np.arange(r)  # [nb, r] positions of each block
        kv = _slice(cache, seq_rows(ctx, i, cur.ravel()), k.kv).view(nb, r, -1)
        score = _slice(cache, seq_rows(ctx, i, cur.ravel()), k.score).view(nb, r, -1)
        if k.overlap:  # first half of channels from the previous block (none before block 0: weight 0)
            prev = cur - r
            gone = torch.from_numpy(prev < 0)[..., None]
            prows = seq_rows(ctx, i, np.maximum(prev, 0).ravel())
            pkv = _slice(cache, prows, (k.kv[0], k.kv[0] + d)).view(nb, r, d).masked_fill(gone, 0.0)
            psc = _slice(cache, prows, (k.score[0], k.score[0] + d)).view(nb, r, d).masked_fill(gone, NEG_INF)
            kv = torch.cat([pkv, kv[..., d:]], dim=1)  # [nb, 2r, d]
            score = torch.cat([psc, score[..., d:]], dim=1)
        pooled = (kv * score.softmax(dim=1)).sum(dim=1)  # [nb, d]
        entry = F.rms_norm(pooled, (d,), k.norm, k.eps)
        cos2, sin2 = rotary.at((blocks * r).astype(np.int32))
        entry = rope_tail(entry, cos2, sin2)
        cache[seq_rows(ctx, i, (blocks + 1) * r - 1), k.entry[0]:k.entry[1]] = entry.to(cache.dtype)

    def _indexer_select(self, idx: Indexer, q: torch.Tensor, w: torch.Tensor, ctx: StepContext, i: int,
                        cache: torch.Tensor, start: int, end: int) -> torch.Tensor | None:
        """[t, S] bool: the entries each query keeps, its top_k by sum_h w_h relu(q_h . k_s) among the visible."""
        r = idx.compressor.ratio
        n_ent = end // r
        if n_ent == 0:
            return None
        keys = _slice(cache, seq_rows(ctx, i, np.arange(n_ent) * r + r - 1), idx.compressor.entry)  # [S, i]
        score = (torch.relu(torch.einsum("thd,sd->ths", q, keys)) * w[..., None]).sum(dim=1)  # [t, S]
        visible = torch.arange(n_ent)[None, :] < (torch.arange(start, end)[:, None] + 1) // r
        score = score.masked_fill(~visible, NEG_INF)
        k = min(idx.top_k, n_ent)
        keep = torch.zeros_like(visible).scatter_(1, score.topk(k, dim=-1).indices, True)
        if k < n_ent:  # exact ties at the boundary (scores of 0: every head's relu 0) go as llama.cpp's do
            ranked = score.sort(dim=-1, descending=True).values
            for row in (ranked[:, k - 1] == ranked[:, k]).nonzero().flatten().tolist():
                keep[row] = False
                keep[row, heap_top_k(score[row].tolist(), k)] = True
        return keep & visible

    def _attend(self, attn: DSV4Attention, q: torch.Tensor, ctx: StepContext, i: int, cache: torch.Tensor,
                start: int, end: int, keep: torch.Tensor | None) -> torch.Tensor:
        """One sequence's queries q [t, H, d] at positions start..end-1 -> [t, H, d]: softmax over the window
        rows, the visible (and kept) entries and the head's sink logit (its mass dropped), K = V."""
        c = attn.cfg
        lay, width = c.layout, cache.shape[1]
        raw = np.arange(max(0, start - c.window + 1), end)
        offsets = seq_rows(ctx, i, raw).numpy() * width + lay.kv[0]  # [S] value offsets of the keys in the cache
        pos = np.arange(start, end)[:, None]
        allowed = (raw[None, :] <= pos) & (pos - raw[None, :] < c.window)
        n_ent = end // c.ratio if c.ratio else 0
        if n_ent:
            ent = seq_rows(ctx, i, np.arange(n_ent) * c.ratio + c.ratio - 1).numpy() * width + lay.comp_entry[0]
            offsets = np.concatenate([offsets, ent])
            visible = np.arange(n_ent)[None, :] < (pos + 1) // c.ratio
            allowed = np.concatenate([allowed, visible if keep is None else visible & keep.numpy()], axis=1)
        return self.dsv4_attend(q, cache, offsets, allowed, attn.sinks, c.scale)

    def dsv4_attend(self, q: torch.Tensor, cache: torch.Tensor, offsets: np.ndarray, allowed: np.ndarray,
                    sinks: torch.Tensor, scale: float) -> torch.Tensor:
        """q [t, H, d] over the keys at value offsets `offsets` [S] of the cache (K = V: d values each), query t
        seeing those `allowed` [t, S] marks; softmax with each head's sink logit, its mass dropped -> [t, H, d]."""
        d = q.shape[-1]
        keys = cache.view(-1)[torch.from_numpy(offsets)[:, None] + torch.arange(d)].float()  # [S, d]
        scores = torch.einsum("thd,sd->hts", q, keys) * scale
        scores = scores.masked_fill(~torch.from_numpy(allowed)[None], NEG_INF)
        sink = sinks[:, None, None].expand(-1, q.shape[0], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        return torch.einsum("hts,sd->thd", probs, keys)

    # -- MoE -------------------------------------------------------------------------------------
    def dsv4_moe(self, moe: DSV4MoE, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """x [T, D], tokens [T] -> routed + shared [T, D]. probs = sqrt(softplus(gate x)); ids from tid2eid or
        top-k of probs + bias; weights = probs[ids] (renormalised, scaled)."""
        probs = rowwise(F.softplus, self.linear(moe.gate, x.float())).sqrt()  # [T, E]
        if moe.tid2eid is not None:
            ids = moe.tid2eid[tokens.long()].long()
        else:
            ids = (probs + moe.bias).topk(moe.top_k, dim=-1).indices
        weights = probs.gather(1, ids)
        if moe.norm:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(WEIGHT_SUM_MIN)
        if moe.scale not in (0.0, 1.0):
            weights = weights * moe.scale
        y = self.moe(moe.experts, x, ids, weights)
        if moe.shared is not None:
            gate, up = self.linear_multi((moe.shared.gate, moe.shared.up), x)
            y = y + self.linear(moe.shared.down, clamped_swiglu(gate, up, moe.shared_limit))
        return y
