"""The op set on the native CPU kernels (pocketmoe._native): raw GGUF blocks, activations quantized once
per row, bitwise batch-invariant. Whatever an op cannot take natively (a type without a kernel, a weight
on another device, a cache of another dtype) runs that one op on the reference.

Each native weight is wrapped once (a `_native.Weight` handle kept on the layer), so a call passes
handles and arrays, nothing to convert.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pocketmoe.layers.experts import NativeExperts, native_reads
from pocketmoe.layers.linear import QuantEmbedding, QuantLinear
from pocketmoe.layers.moe import GATING_SIGMOID, GATING_SOFTMAX, WEIGHT_SUM_MIN
from pocketmoe.ops.cpu_v4 import NativeDeepSeek4Ops, native_cache
from pocketmoe.ops.reference import ReferenceOps
from pocketmoe.specs.base import Role

if TYPE_CHECKING:
    from pocketmoe.engine.step import StepContext
    from pocketmoe.layers.attention import MLAttention
    from pocketmoe.layers.gqa import GQAttention
    from pocketmoe.layers.mlp import GatedMLP
    from pocketmoe.layers.moe import MoEBlock, Router
    from pocketmoe.layers.norm import Residual


def _np(x: torch.Tensor) -> np.ndarray:
    return (x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()).numpy()


def _not_replayed(op: Callable[..., Any]) -> Callable[..., Any]:
    """An op a StepProgram does not hold: called while a step is recorded, it makes the step not replayable."""

    @functools.wraps(op)
    def wrapped(self: NativeOps, *args: Any, **kw: Any) -> Any:
        if self._recording is not None:
            self._recording.append(("other",))
        return op(self, *args, **kw)

    return wrapped


class NativeOps(NativeDeepSeek4Ops):
    name = "native"
    absorbs_legacy_mla = True  # attn_kv_b is split into float32 k_b / v_b at load (attention in latent space)
    dense_cache_roles = (Role.ATTENTION,)  # only fallbacks (types without a kernel) dequantize
    replay = True  # run recorded steps in one call (see run); False: always op by op
    chunk_invariant = True  # the kernels' result for a row never depends on the rows computed beside it

    def __init__(self, tile_rows: int | None = 8) -> None:
        super().__init__(tile_rows)
        from pocketmoe import native

        self.native = native
        self.lib = native._lib()
        self.types = native.supported_types()
        # Per-call conversions made once: numpy views of weights' float vectors and of the residual stream,
        # and the attention's per-step arrays (a decode token makes 20 calls; each view costs ~1 us).
        self._views: dict[int, tuple[torch.Tensor, np.ndarray]] = {}
        self._stream: tuple[torch.Tensor | None, np.ndarray | None] = (None, None)
        self._step: tuple[object, tuple[object, ...]] = (None, ())
        self._cache_layers: tuple[torch.Tensor | None, list[np.ndarray] | None, np.ndarray | None] = (None, None, None)
        # Recorded steps (see run): per model, a StepProgram, or False where its step cannot be replayed.
        self._programs: dict[int, tuple[object, object]] = {}
        self._recording: list[tuple[Any, ...]] | None = None

    def torch_threads(self, requested: int | None) -> int:
        """1, whatever was asked (`requested` sizes the native pool instead).

        The heavy work runs in the native pool; torch's OpenMP workers spin after each small op left to
        torch and steal the pool's cores (452M bench model, 2 cores: decode 47 vs 28 tok/s per-op with
        torch at 1 vs 2 threads). torch.set_num_threads is process-wide.
        """
        return 1

    # -- recorded steps --------------------------------------------------------------------------
    def run(self, model: Any, ctx: StepContext) -> torch.Tensor:
        """A step whose every token wants logits and none its hidden state (a decode step of any batch) runs as one
        native call.

        The first such step runs the model op by op and records the calls; if they are the pipeline a
        StepProgram replays (embed, norm, native sublayers, norm, head, each feeding the next), later
        steps replay them in one call with the step's own arrays, bitwise the same. Anything else the
        model called (a fallback, another op) makes the model run op by op every time. The model must
        change tensors only through ops, as it does for every backend.
        """
        whole = (self.replay and len(ctx.logit_rows) == ctx.n_tokens and not len(ctx.hidden_rows)
                 and hasattr(model, "prepare"))
        entry = self._programs.get(id(model))
        program = entry[1] if entry is not None and entry[0] is model else None
        if whole and program:
            model.prepare(ctx)
            step = self._step_args(ctx)
            if step is not None:
                cos2, sin2, _, seq, keys, write_rows, table, page = step
                return torch.from_numpy(program(ctx.tokens, cos2, sin2, self._cache_layers[2], seq, keys,
                                                write_rows, table, page))
        if not whole or program is not None:
            return model(ctx)
        self._recording = []
        try:
            out = model(ctx)
            program = self._program_from(self._recording, out)
        finally:
            self._recording = None
        self._programs[id(model)] = (model, program)
        return out

    def _record(self, *entry: Any) -> None:
        if self._recording is not None:
            self._recording.append(entry)

    def _program_from(self, rec: list[tuple[Any, ...]], out: torch.Tensor) -> object:
        """A StepProgram of the recorded calls, or False when they are not embed, norm, sublayers, norm, head
        with each one's output the next one's input."""
        if len(rec) < 5 or rec[0][0] != "embed" or rec[1][0] != "norm" or rec[-2][0] != "norm" or rec[-1][0] != "linear":
            return False
        (_, table, x), (_, x_in, first_norm, first_eps, xn) = rec[0], rec[1]
        if x_in is not x:
            return False
        middle = rec[2:-2]
        if any(len(e) != 8 or e[0] not in _SUBLAYER_KINDS for e in middle):
            return False
        subs = []
        for i, (kind, op, sub_in, stream, norm, eps, layer, sub_out) in enumerate(middle):
            if sub_in is not xn or stream is not x or (norm is None) != (i == len(middle) - 1):
                return False
            subs.append((_SUBLAYER_KINDS[kind], op, None if norm is None else norm.numpy(), float(eps), layer))
            xn = sub_out
        (_, y_in, out_norm, out_eps, y), (_, head, head_in, logits) = rec[-2], rec[-1]
        if y_in is not x or head_in is not y or logits is not out:
            return False
        return self.lib.StepProgram(table, first_norm.numpy(), float(first_eps), subs, out_norm.numpy(),
                                    float(out_eps), head)

    # -- weights ---------------------------------------------------------------------------------
    def handle(self, w: QuantLinear) -> object:
        """The layer's `_native.Weight`, made on first use; False when the kernels cannot read it."""
        h = w.backend_data
        if h is None:
            ok = len(w.shape) in (2, 3) and native_reads(w.raw, w.ggml_type, self.types)
            h = self.lib.Weight(w.raw.reshape(*w.shape[:-1], -1).numpy(), w.ggml_type, w.in_features) if ok else False
            w.backend_data = h
        return h

    def _embed_handle(self, table: QuantEmbedding) -> object:
        h = getattr(table, "native", None)
        if h is None:
            ok = native_reads(table.raw, table.ggml_type, self.types)
            h = self.lib.Weight(table.raw.reshape(table.shape[0], -1).numpy(), table.ggml_type,
                                table.shape[1]) if ok else False
            table.native = h
        return h

    # -- linear ----------------------------------------------------------------------------------
    def linear(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:  # [T, I] -> [T, O]
        h = self.handle(layer)
        if h is False or not x.is_cpu:
            self._record("other")
            return super().linear(layer, x)
        y = torch.from_numpy(self.lib.linear_multi(_np(x), [h])[0])
        self._record("linear", h, x, y)
        return y

    @_not_replayed
    def batched(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:  # [H, T, I] -> [H, T, O]
        h = self.handle(layer)
        if h is False or not x.is_cpu:
            return super().batched(layer, x)
        return torch.from_numpy(self.native.gemm_batched(layer.raw.reshape(*layer.shape[:-1], -1).numpy(),
                                                         layer.ggml_type, _np(x)))

    def batched_tile(self, layer: QuantLinear) -> int | None:
        """None where gemm_batched runs the weight: its rows are batch-invariant at any count."""
        return None if self.handle(layer) is not False else super().batched_tile(layer)

    @_not_replayed
    def linear_multi(self, weights: Sequence[QuantLinear], x: torch.Tensor) -> list[torch.Tensor]:
        handles = [self.handle(w) for w in weights]
        if not x.is_cpu or any(h is False for h in handles) or len(handles) > 4:
            return super().linear_multi(weights, x)
        return [torch.from_numpy(y) for y in self.lib.linear_multi(_np(x), handles)]

    def embed(self, table: QuantEmbedding, tokens: np.ndarray) -> torch.Tensor:
        h = self._embed_handle(table)
        if h is False:
            self._record("other")
            return super().embed(table, tokens)
        y = torch.from_numpy(self.lib.embed(h, tokens))
        self._record("embed", h, y)
        return y

    # -- norms and the residual stream -----------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y = torch.from_numpy(self.lib.rms_norm(_np(x), weight.numpy(), eps))
        self._record("norm", x, weight, eps, y)
        return y

    @_not_replayed
    def add_rms_norm(self, x: torch.Tensor, add: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.from_numpy(self.lib.add_rms_norm(x.numpy(), _np(add), weight.numpy(), eps))

    @_not_replayed
    def finalize(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None = None,
                 weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor | None:
        y = self.lib.finalize(x.numpy(), _np(a), None if b is None else _np(b),
                              None if weight is None else weight.numpy(), eps)
        return None if y is None else torch.from_numpy(y)

    @_not_replayed
    def rope(self, x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor, neox: bool = False) -> torch.Tensor:
        t, h, d = x.shape
        y = x.float().contiguous().clone().view(t, h * d)
        self.lib.rope(y.numpy(), h, d, cos2.shape[-1], neox, _np(cos2), _np(sin2))
        return y.view(t, h, d)

    # -- attention ---------------------------------------------------------------------------------
    @_not_replayed
    def mla_attention(self, attn: MLAttention, q: torch.Tensor, kv: torch.Tensor, ctx: StepContext,
                      layer: int) -> torch.Tensor:
        k_b, v_b = (self.handle(attn.k_b), self.handle(attn.v_b)) if attn.absorbed else (False, False)
        step = self._step_args(ctx)
        if k_b is False or v_b is False or step is None:
            return super().mla_attention(attn, q, kv, ctx, layer)
        cos2, sin2, layers, *kv_layout = step
        out = self.lib.mla_attention(self._mla_shape(attn), _np(q), _np(kv), attn.kv_a_norm.numpy(), k_b, v_b, cos2,
                                     sin2, layers[layer], *kv_layout)
        return torch.from_numpy(out)

    @_not_replayed
    def gqa_attention(self, attn: GQAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext,
                      layer: int) -> torch.Tensor:
        step = self._step_args(ctx)
        if step is None:
            return super().gqa_attention(attn, q, k, v, ctx, layer)
        cos2, sin2, layers, *kv_layout = step
        if attn.native is None:
            c = attn.cfg
            attn.native = self.lib.GQAShape(c.n_head, c.n_head_kv, c.head_dim, c.v_dim, c.n_rot, c.neox, c.scale)
        return torch.from_numpy(self.lib.gqa_attention(attn.native, _np(q), _np(k), _np(v), cos2, sin2, layers[layer],
                                                       *kv_layout))

    def gqa_sublayer(self, attn: GQAttention, x: torch.Tensor, ctx: StepContext, layer: int,
                     residual: Residual) -> torch.Tensor | None:
        """One native call: projections, q / k norms, attention, output projection and the residual update."""
        op = attn.native_sublayer
        if op is None:
            ws = [self.handle(w) for w in (attn.wq, attn.wk, attn.wv, attn.wo)]
            c = attn.cfg
            shape = attn.native or self.lib.GQAShape(c.n_head, c.n_head_kv, c.head_dim, c.v_dim, c.n_rot, c.neox,
                                                     c.scale)
            attn.native = shape
            op = attn.native_sublayer = self.lib.GQASublayer(
                shape, *ws, None if attn.q_norm is None else attn.q_norm.numpy(),
                None if attn.k_norm is None else attn.k_norm.numpy(), attn.eps) if all(
                h is not False for h in ws) else False
        step = self._step_args(ctx)
        if op is False or step is None or not x.is_cpu:
            self._record("other")
            return super().gqa_sublayer(attn, x, ctx, layer, residual)
        cos2, sin2, layers, *kv = step
        y = _tensor(op(_np(x), *self._residual(residual), cos2, sin2, layers[layer], *kv))
        self._record("gqa", op, x, residual.x, residual.norm, residual.eps, layer, y)
        return y

    def _mla_shape(self, attn: MLAttention) -> object:
        if attn.native is None:
            c = attn.cfg
            attn.native = self.lib.MLAShape(c.n_head, c.qk_nope, c.qk_rope, c.v_head, c.kv_lora, c.scale, attn.eps)
        return attn.native

    def mla_sublayer(self, attn: MLAttention, x: torch.Tensor, ctx: StepContext, layer: int,
                     residual: Residual) -> torch.Tensor | None:
        """One native call: projections, attention, output projection and the residual update."""
        op = attn.native_sublayer
        if op is None:
            ws = [None if w is None else self.handle(w) for w in (attn.wq, attn.wq_a, attn.wq_b, attn.wkv_a, attn.k_b,
                                                                  attn.v_b, attn.wo)]
            ok = attn.absorbed and all(h is not False for h in ws)
            wq, wq_a, wq_b, wkv_a, k_b, v_b, wo = ws
            op = attn.native_sublayer = self.lib.MLASublayer(
                self._mla_shape(attn), wq, wq_a, None if attn.q_a_norm is None else attn.q_a_norm.numpy(), wq_b, wkv_a,
                attn.kv_a_norm.numpy(), k_b, v_b, wo) if ok else False
        step = self._step_args(ctx)
        if op is False or step is None or not x.is_cpu:
            self._record("other")
            return super().mla_sublayer(attn, x, ctx, layer, residual)
        cos2, sin2, layers, *kv = step
        y = _tensor(op(_np(x), *self._residual(residual), cos2, sin2, layers[layer], *kv))
        self._record("mla", op, x, residual.x, residual.norm, residual.eps, layer, y)
        return y

    def _step_args(self, ctx: StepContext) -> tuple[object, ...] | None:
        """The attention's arrays of this step, made at its first call (None: the cache is not native)."""
        if self._step[0] is not ctx:
            data = ctx.cache.data
            if data is not None and self._cache_layers[0] is not data:
                whole = native_cache(data)
                layers = None if whole is None else [whole[i] for i in range(data.shape[0])]
                self._cache_layers = (data, layers, whole)
            if data is None or self._cache_layers[1] is None:
                args = None
            else:
                args = (ctx.cos2.numpy(), ctx.sin2.numpy(), self._cache_layers[1], ctx.seq, ctx.keys, ctx.write_rows,
                        ctx.page_table, ctx.cache.page)
            self._step = (ctx, args)
        return self._step[1]

    def _residual(self, residual: Residual) -> tuple[np.ndarray, np.ndarray | None, float]:
        """(x, norm, eps) of a sublayer's residual update as the native sublayers take them."""
        if self._stream[0] is not residual.x:
            self._stream = (residual.x, residual.x.numpy())
        norm = residual.norm
        if norm is None:
            return self._stream[1], None, residual.eps
        view = self._views.get(id(norm))
        if view is None or view[0] is not norm:
            view = self._views[id(norm)] = (norm, norm.numpy())
        return self._stream[1], view[1], residual.eps

    # -- experts -----------------------------------------------------------------------------------
    @_not_replayed
    def route(self, router: Router, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.handle(router.gate)
        if h is False or not x.is_cpu:
            return super().route(router, x)
        bias = None if router.bias is None else router.bias.numpy()
        ids, weights = self.lib.route(self._route_params(router), _np(x), h, bias)
        return torch.from_numpy(weights), torch.from_numpy(ids)

    moe = _not_replayed(ReferenceOps.moe)

    def _route_params(self, router: Router) -> object:
        if router.native is None:
            c = router.cfg
            router.native = self.lib.RouteParams(c.n_experts, c.top_k, c.gating, c.n_groups, c.groups_used, c.norm,
                                                 c.scale, WEIGHT_SUM_MIN, GATING_SOFTMAX, GATING_SIGMOID)
        return router.native

    @_not_replayed
    def ffn(self, mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
        hs = [self.handle(w) for w in (mlp.gate, mlp.up, mlp.down)]
        if any(h is False for h in hs) or not x.is_cpu:
            return super().ffn(mlp, x)
        return torch.from_numpy(self.lib.gated_ffn(_np(x), *hs))


    def ffn_sublayer(self, mlp: GatedMLP, x: torch.Tensor, residual: Residual) -> torch.Tensor | None:
        """One native call: the gated FFN and the residual update."""
        op = mlp.native
        if op is None:
            hs = [self.handle(w) for w in (mlp.gate, mlp.up, mlp.down)]
            op = mlp.native = False if any(h is False for h in hs) else self.lib.FFNSublayer(*hs)
        if op is False or not x.is_cpu:
            self._record("other")
            return super().ffn_sublayer(mlp, x, residual)
        return self._host_sublayer("ffn", op, x, residual)

    def moe_sublayer(self, block: MoEBlock, x: torch.Tensor, residual: Residual) -> torch.Tensor | None:
        """One native call when the bank is the native host bank (route, experts, shared, residual update);
        any other ExpertBank runs the sublayer op by op."""
        op = block.native
        if op is None:
            op = block.native = self._moe_sublayer(block)
        if op is False or not x.is_cpu:
            self._record("other")
            return super().moe_sublayer(block, x, residual)
        return self._host_sublayer("moe", op, x, residual)

    def _host_sublayer(self, kind: str, op: object, x: torch.Tensor, residual: Residual) -> torch.Tensor | None:
        """Run an FFN or MoE sublayer handle on x and record the call."""
        y = _tensor(op(_np(x), *self._residual(residual)))
        self._record(kind, op, x, residual.x, residual.norm, residual.eps, -1, y)
        return y

    def _moe_sublayer(self, block: MoEBlock) -> object:
        bank, router = block.experts, block.router
        gate_inp = self.handle(router.gate)
        shared = [None] * 3 if block.shared is None else [self.handle(w) for w in (block.shared.gate, block.shared.up,
                                                                                   block.shared.down)]
        if not isinstance(bank, NativeExperts) or gate_inp is False or any(h is False for h in shared):
            return False
        (g, u, d), types = bank.raw, (bank.gate.ggml_type, bank.up.ggml_type, bank.down.ggml_type)
        return self.lib.MoESublayer(self._route_params(router), gate_inp,
                                    None if router.bias is None else router.bias.numpy(), g, types[0], u, types[1], d,
                                    types[2], bank.ffn, *shared)


# Sublayer kinds as StepProgram numbers them.
_SUBLAYER_KINDS = {"mla": 0, "ffn": 1, "moe": 2, "gqa": 3}


def _tensor(y: np.ndarray | None) -> torch.Tensor | None:
    return None if y is None else torch.from_numpy(y)
