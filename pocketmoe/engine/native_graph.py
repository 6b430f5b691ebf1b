"""The whole DeepSeek-V2 forward pass in one native call per chunk (pocketmoe._native.Deepseek2Graph).

With the native backend, the per-op path spends about as long in Python and small torch ops between
the kernels as in the kernels themselves at decode (0.9 ms per layer on a 2-core machine). The graph
runs norms, rotary, attention, routing, experts and the head in C++ over the same raw blocks and the
same latent cache, with one pool and no Python in between.

It also makes a token's logits independent of chunking: every op is per token or batch-invariant,
and attention sums each (head, query) over the cache in one fixed order, so prefill and one-token
decode give bitwise the same logits.

`build_graph` raises GraphUnsupported, with the reason, when the model has something the graph does not
cover (weights without a native kernel, a non-float32 cache); the per-op path then runs. Files in the legacy attn_kv_b layout run on the graph too: attn_kv_b is split at load into the
absorbed per-head k_b / v_b, kept in float32 (V2-Lite: 216 MiB), so attention stays in latent space
instead of expanding every cached token's keys and values at each step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pocketmoe.engine.backends import NativeExperts, native_blocks, native_reads
from pocketmoe.layers.linear import float_weight
from pocketmoe.layers.mlp import GatedMLP
from pocketmoe.layers.moe import MoEBlock

if TYPE_CHECKING:
    from pocketmoe.engine.kv_cache import LatentKVCache
    from pocketmoe.layers.linear import QuantLinear
    from pocketmoe.models.deepseek2 import DeepSeek2Model


class GraphUnsupported(Exception):
    """Why this model runs on the per-op path."""


class NativeGraph:
    """forward(tokens, start, last_only) -> logits [T or 1, V] float32, writing the cache rows of those positions."""

    def __init__(self, model: DeepSeek2Model, cache: LatentKVCache, handle: object, note: str) -> None:
        from pocketmoe import native

        self.native = native
        self.model, self.cache, self.handle = model, cache, handle
        self.note = note  # what runs, as the start-up line says it
        self._one = np.zeros(1, dtype=np.int32)

    def forward(self, tokens: torch.Tensor, start: int, last_only: bool = False) -> torch.Tensor:
        cos2, sin2 = self.model.rotary.span(start, tokens.numel())
        logits = self.native.graph_forward(self.handle, tokens.to(torch.int32).numpy(), start, cos2.numpy(),
                                           sin2.numpy(), last_only)
        return torch.from_numpy(logits)

    def decode(self, token: int, pos: int) -> torch.Tensor:
        """logits [V] of one token at position pos (forward's work without its per-call tensors)."""
        cos2, sin2 = self.model.rotary.span(pos, 1)
        self._one[0] = token
        logits = self.native.graph_forward(self.handle, self._one, pos, cos2.numpy(), sin2.numpy(), True)
        return torch.from_numpy(logits[0])

    def profile(self) -> dict[str, object]:
        """Wall seconds per op since the last reset: {"seconds": {op: s}, "calls": n, "tokens": n}."""
        return self.handle.profile()

    def reset_profile(self) -> None:
        self.handle.reset_profile()


def _floats(t: torch.Tensor | None, what: str) -> np.ndarray | None:
    if t is None:
        return None
    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise GraphUnsupported(f"{what} is not a float32 host tensor")
    return t.contiguous().numpy()


def _linear(layer: QuantLinear, types: frozenset[int]) -> tuple[np.ndarray, int, int]:
    blocks = native_blocks(layer, types)
    if blocks is None:
        raise GraphUnsupported(f"{layer.name or 'a weight'} (type {layer.ggml_type}) has no native kernel")
    return blocks, layer.ggml_type, layer.in_features


def _ffn(prefix: str, mlp: GatedMLP, types: frozenset[int]) -> dict[str, object]:
    return {prefix + "gate": _linear(mlp.gate, types), prefix + "up": _linear(mlp.up, types),
            prefix + "down": _linear(mlp.down, types)}


def _layer(block: object, types: frozenset[int]) -> tuple[dict[str, object], MoEBlock | None]:
    attn = block.attn
    d: dict[str, object] = {
        "attn_norm": _floats(block.attn_norm.weight, "attn_norm"),
        "wkv_a": _linear(attn.wkv_a, types), "kv_a_norm": _floats(attn.kv_a_norm.weight, "kv_a_norm"),
        "wo": _linear(attn.wo, types), "ffn_norm": _floats(block.ffn_norm.weight, "ffn_norm"),
    }
    if attn.absorbed:
        d.update(k_b=_linear(attn.k_b, types), v_b=_linear(attn.v_b, types))
    else:
        d.update(absorbed_from_kv_b(attn))
    if attn.wq is not None:
        d["wq"] = _linear(attn.wq, types)
    else:
        d.update(wq_a=_linear(attn.wq_a, types), wq_b=_linear(attn.wq_b, types),
                 q_a_norm=_floats(attn.q_a_norm.weight, "q_a_norm"))
    ffn = block.ffn
    if isinstance(ffn, GatedMLP):
        d.update(_ffn("dense_", ffn, types))
        return d, None
    if not isinstance(ffn.experts, NativeExperts):
        raise GraphUnsupported("routed experts are not on the native CPU kernels")
    ex = ffn.experts
    gate, up, down = ex.raw
    d.update(router=_linear(ffn.router.gate, types), router_bias=_floats(ffn.router.bias, "exp_probs_b"),
             experts_gate=(gate, ex.gate.ggml_type), experts_up=(up, ex.up.ggml_type),
             experts_down=(down, ex.down.ggml_type), expert_ffn=ex.ffn)
    if ffn.shared is not None:
        d.update(_ffn("shared_", ffn.shared, types))
    return d, ffn


def absorbed_from_kv_b(attn: object) -> dict[str, tuple[np.ndarray, int, int]]:
    """Legacy attn_kv_b [H*(N+V), C] -> k_b [H, C, N] and v_b [H, V, C] as float32 weights (ggml type F32).

    Per head, kv_b's first N rows map c_kv to k_nope and the next V rows to v; the absorbed form needs
    k_b transposed, which quantized blocks cannot be without requantizing, hence float32.
    """
    c, w = attn.cfg, attn.wkv_b
    # float_weight, not w.dense(): that would also keep the per-op path's float copy, which never runs now
    kv = float_weight(w.raw, w.ggml_type, w.shape).reshape(c.n_head, c.qk_nope + c.v_head, c.kv_lora)
    k_b = kv[:, :c.qk_nope, :].transpose(1, 2).contiguous().numpy()  # [H, C, N]
    v_b = kv[:, c.qk_nope:, :].contiguous().numpy()                   # [H, V, C]
    f32 = 0
    return {"k_b": (k_b.view(np.uint8), f32, c.qk_nope), "v_b": (v_b.view(np.uint8), f32, c.kv_lora)}


def build_graph(model: object, cache: LatentKVCache) -> NativeGraph:
    """The native graph of a DeepSeek-V2 model built on the native backend; GraphUnsupported if it cannot run."""
    from pocketmoe import native
    from pocketmoe.models.deepseek2 import DeepSeek2Model

    if not native.available():
        raise GraphUnsupported(native.unavailable_reason())
    if not isinstance(model, DeepSeek2Model):
        raise GraphUnsupported(f"{type(model).__name__} has no native graph")
    if cache.data.dtype != torch.float32:
        raise GraphUnsupported(f"the KV cache is {cache.data.dtype}; the graph reads float32")
    types = native.supported_types()
    layers, moe = [], None
    for block in model.blocks:
        d, m = _layer(block, types)
        layers.append(d)
        moe = moe or m
    note = "whole-model native graph"
    if not model.blocks[0].attn.absorbed:
        split = sum(d["k_b"][0].nbytes + d["v_b"][0].nbytes for d in layers)
        note += f" (attn_kv_b split into float32 k_b / v_b at load: {split / 2**20:.0f} MiB)"
    cfg = model.cfg
    router = moe.router.cfg if moe is not None else None
    params = {
        "hidden": cfg.n_embd, "n_head": cfg.n_head, "qk_nope": cfg.qk_nope_head_dim,
        "qk_rope": cfg.qk_rope_head_dim, "v_head": cfg.v_head_dim, "kv_lora": cfg.kv_lora_rank,
        "q_lora": cfg.q_lora_rank or 0, "attn_scale": cfg.attn_scale, "rms_eps": cfg.rms_eps,
        "n_experts": router.n_experts if router else 0, "top_k": router.top_k if router else 0,
        "gating": router.gating if router else 1, "n_groups": router.n_groups if router else 1,
        "groups_used": router.groups_used if router else 1, "weight_norm": bool(router and router.norm),
        "weight_scale": router.scale if router else 1.0,
    }
    emb = model.embed
    if not native_reads(emb.raw, emb.ggml_type, types):
        raise GraphUnsupported(f"token_embd (type {emb.ggml_type}) has no native kernel")
    embed = (emb.raw.reshape(emb.shape[0], -1).numpy(), emb.ggml_type, emb.shape[1])
    try:
        handle = native.deepseek2_graph(params, layers, embed, _floats(model.norm.weight, "output_norm"),
                                        _linear(model.head, types), cache.data.numpy())
    except native.NativeKernelError as exc:
        raise GraphUnsupported(str(exc)) from exc
    return NativeGraph(model, cache, handle, note)
