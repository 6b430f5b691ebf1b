"""The DeepSeek-V4 ops on the native kernels, mixed into NativeOps: one native call per mHC site (hc_pre,
hc_head), per attention sublayer (dsv4_attention) and per MoE sublayer (dsv4_moe), each layer's weights bound
once in a handle on the layer. What a handle cannot take (a weight type without a kernel, an expert bank other
than the native host one, a cache not on the host or of a dtype outside NATIVE_KV) runs the reference composition
(reference_v4.py) over the native fine ops.

Legend: T tokens, n streams, D hidden, M = (2 + n) * n mixing rows, P cache rows, R rope dims.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pocketmoe.layers.dsv4_moe import CLAMP_MIN
from pocketmoe.layers.experts import NativeExperts
from pocketmoe.layers.moe import WEIGHT_SUM_MIN
from pocketmoe.ops.reference import ReferenceOps

if TYPE_CHECKING:
    from pocketmoe.engine.step import StepContext
    from pocketmoe.layers.dsv4_attention import Compressor, DSV4Attention, DSV4Rope
    from pocketmoe.layers.dsv4_moe import DSV4MoE
    from pocketmoe.layers.hyper import HyperConnection, HyperHead


def _np(x: torch.Tensor) -> np.ndarray:
    return (x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()).numpy()


# The KV cache dtypes the native attention reads, and each one's numpy view (numpy has no bfloat16: its bits
# go as uint16, which the native ops take as bfloat16).
NATIVE_KV: dict[torch.dtype, Callable[[torch.Tensor], np.ndarray]] = {
    torch.float32: lambda t: t.numpy(),
    torch.float16: lambda t: t.numpy(),
    torch.bfloat16: lambda t: t.view(torch.uint16).numpy(),
}


def native_cache(t: torch.Tensor) -> np.ndarray | None:
    """Cache rows as the native ops take them, or None where they cannot (another dtype, device or layout)."""
    if t.dtype not in NATIVE_KV or not t.is_cpu or not t.is_contiguous():
        return None
    return NATIVE_KV[t.dtype](t)


def _floats(t: torch.Tensor) -> np.ndarray:
    """A float vector or matrix as the handles keep it: float32, C order (a copy only when it is not)."""
    return np.ascontiguousarray(t.detach().float().cpu().numpy())


class NativeDeepSeek4Ops(ReferenceOps):
    """Uses NativeOps' lib, handle and _record."""

    lib: Any
    handle: Any
    _record: Any

    def __init__(self, tile_rows: int | None = 8) -> None:
        super().__init__(tile_rows)
        # numpy views made once a step: (ctx, {compressed: (cos2, sin2) [P, R]}, {layer: cache rows [P, W]})
        self._v4_step: tuple[Any, dict[bool, tuple[np.ndarray, np.ndarray]], dict[int, np.ndarray]] = (None, {}, {})

    # -- hyper-connections: one call a site, the fine ones bitwise the reference's arithmetic -----------------
    def _hc_site(self, site: HyperConnection | HyperHead) -> Any:
        op = site.native
        if op is None:
            h = self.handle(site.fn)
            c = site.cfg
            op = site.native = False if h is False else self.lib.HCSite(
                h, _floats(site.scale.reshape(-1)), _floats(site.base), c.n, c.sinkhorn_iters, c.eps, c.rms_eps)
        return op

    def hc_pre(self, hc: HyperConnection, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self._record("other")
        op = self._hc_site(hc)
        if op is False or not x.is_cpu:
            return super().hc_pre(hc, x)
        y, post, comb = op.pre(_np(x))
        return torch.from_numpy(y), torch.from_numpy(post), torch.from_numpy(comb)

    def hc_head(self, head: HyperHead, x: torch.Tensor) -> torch.Tensor:
        self._record("other")
        op = self._hc_site(head)
        if op is False or not x.is_cpu:
            return super().hc_head(head, x)
        return torch.from_numpy(op.head(_np(x)))

    def hc_sinkhorn(self, p: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        self._record("other")
        if not p.is_cpu:
            return super().hc_sinkhorn(p, iters, eps)
        return torch.from_numpy(self.lib.hc_sinkhorn(_np(p), iters, eps))

    def hc_mix(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        self._record("other")
        if not x.is_cpu:
            return super().hc_mix(x, w)
        return torch.from_numpy(self.lib.hc_mix(_np(x), _np(w)))

    def hc_post(self, out: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        self._record("other")
        if not x.is_cpu:
            return super().hc_post(out, x, post, comb)
        return torch.from_numpy(self.lib.hc_post(_np(out), _np(x), _np(post), _np(comb)))

    # -- attention -----------------------------------------------------------------------------------------
    def dsv4_attention(self, attn: DSV4Attention, x: torch.Tensor, ctx: StepContext, layer: int,
                       rope: DSV4Rope) -> torch.Tensor:
        """One native call: projections, norms, rope, cache rows, compressed entries, indexer, attention, output."""
        self._record("other")
        op = attn.native
        if op is None:
            op = attn.native = self._attention_op(attn)
        step = self._v4_step
        if step[0] is not ctx:
            step = self._v4_step = (ctx, {}, {})
        cache = step[2].get(layer)
        if cache is None:
            view = native_cache(ctx.cache.layer_rows(layer))
            cache = step[2][layer] = False if view is None else view
        if op is False or cache is False or not x.is_cpu:
            return super().dsv4_attention(attn, x, ctx, layer, rope)
        compressed = attn.cfg.ratio != 0
        tables = step[1].get(compressed)
        if tables is None:
            cos2, sin2 = rope.full(compressed)
            tables = step[1][compressed] = (cos2.numpy(), sin2.numpy())
        return torch.from_numpy(op(_np(x), cache, ctx.positions, ctx.seq, ctx.write_rows, ctx.page_table,
                                   ctx.cache.page, *tables))

    def _compressor_op(self, k: Compressor) -> Any:
        h = [self.handle(w) for w in (k.wkv, k.wgate)]
        if any(x is False for x in h):
            return False
        return self.lib.DSV4Compressor(*h, _floats(k.ape), _floats(k.norm), k.ratio, k.dim, k.eps, k.kv[0],
                                       k.score[0], k.entry[0])

    def _attention_op(self, attn: DSV4Attention) -> Any:
        c = attn.cfg
        ws = [self.handle(w) for w in (attn.wq_a, attn.wq_b, attn.wkv, attn.wo_a, attn.wo_b)]
        comp = idx = None
        if attn.compressor is not None:
            comp = self._compressor_op(attn.compressor)
        if attn.indexer is not None:
            i = attn.indexer
            ic, hs = self._compressor_op(i.compressor), [self.handle(w) for w in (i.wq_b, i.proj)]
            idx = False if ic is False or any(h is False for h in hs) else self.lib.DSV4Indexer(
                *hs, ic, i.n_head, i.head_dim, i.top_k, (i.head_dim * i.n_head) ** -0.5)
        if any(h is False for h in (*ws, comp, idx)) or c.head_dim % 8:
            return False
        wq_a, wq_b, wkv, wo_a, wo_b = ws
        shape = (c.n_head, c.head_dim, c.n_rot, c.o_groups, c.window, c.ratio, c.eps, c.scale, c.layout.kv[0])
        return self.lib.DSV4AttentionSublayer(shape, wq_a, _floats(attn.q_a_norm), wq_b, wkv, _floats(attn.kv_norm),
                                              _floats(attn.sinks), wo_a, wo_b, comp, idx)

    def dsv4_attend(self, q: torch.Tensor, cache: torch.Tensor, offsets: np.ndarray, allowed: np.ndarray,
                    sinks: torch.Tensor, scale: float) -> torch.Tensor:
        """One native call: each query over its allowed keys only (the mask as per-query key lists)."""
        self._record("other")
        view = native_cache(cache)
        if view is None or q.shape[-1] % 8:
            return super().dsv4_attend(q, cache, offsets, allowed, sinks, scale)
        ti, si = np.nonzero(allowed)  # row-major: query by query, keys in order
        starts = np.zeros(len(allowed) + 1, dtype=np.int32)
        np.cumsum(np.bincount(ti, minlength=len(allowed)), out=starts[1:])
        keys = np.ascontiguousarray(offsets[si], dtype=np.int64)
        return torch.from_numpy(self.lib.dsv4_attend(_np(q), view, keys, starts, _np(sinks), scale))

    # -- MoE -----------------------------------------------------------------------------------------------
    def dsv4_moe(self, moe: DSV4MoE, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """One native call when the bank is the native host bank: routing, routed and shared experts."""
        self._record("other")
        op = moe.native
        if op is None:
            op = moe.native = self._moe_op(moe)
        if op is False or not x.is_cpu:
            return super().dsv4_moe(moe, x, tokens)
        ids = tokens.numpy() if tokens.dtype == torch.int64 and tokens.is_contiguous() else tokens.long().numpy()
        return torch.from_numpy(op(_np(x), ids, moe.experts.swiglu_limit))

    def _moe_op(self, moe: DSV4MoE) -> Any:
        bank = moe.experts
        gate = self.handle(moe.gate)
        shared = [None] * 3 if moe.shared is None else [self.handle(w) for w in (moe.shared.gate, moe.shared.up,
                                                                                 moe.shared.down)]
        if not isinstance(bank, NativeExperts) or gate is False or any(h is False for h in shared):
            return False
        (g, u, d), types = bank.raw, (bank.gate.ggml_type, bank.up.ggml_type, bank.down.ggml_type)
        tid2eid = None if moe.tid2eid is None else np.ascontiguousarray(moe.tid2eid.numpy(), dtype=np.int32)
        bias = None if moe.bias is None else _floats(moe.bias)
        limit = moe.shared_limit if moe.shared_limit > CLAMP_MIN else 0.0
        return self.lib.DSV4MoESublayer(gate, tid2eid, bias, moe.top_k, moe.norm, moe.scale, WEIGHT_SUM_MIN, g,
                                        types[0], u, types[1], d, types[2], bank.n_experts, bank.ffn, *shared,
                                        limit)
