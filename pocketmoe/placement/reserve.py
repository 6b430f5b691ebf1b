"""Memory to set aside besides the weights: the KV cache per layer and the activation/logits workspace."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from pocketmoe.kv_dtypes import KV_DTYPE_BYTES

ACT_BUFFERS = 16  # fp32 [tokens, hidden] buffers live at once in a step (residual, norms, attention, FFN)


@dataclass(frozen=True)
class KVReserve:
    """KV cache bytes per layer at `context_length` x `batch`, and the rule that produced them."""

    per_layer: Mapping[int, int]
    rule: str

    def __post_init__(self) -> None:
        if any(b < 0 for b in self.per_layer.values()):
            raise ValueError(f"negative KV bytes in {dict(self.per_layer)}")
        object.__setattr__(self, "per_layer", MappingProxyType(dict(self.per_layer)))

    @property
    def total(self) -> int:
        return sum(self.per_layer.values())


def _get(meta: Mapping[str, Any], arch: str, key: str, default: Any = None) -> Any:
    v = meta.get(f"{arch}.{key}", default)
    return getattr(v, "value", v)


def _int(meta: Mapping[str, Any], arch: str, key: str, default: int | None = None) -> int:
    v = _get(meta, arch, key, default)
    if isinstance(v, (list, tuple)):  # per-layer arrays: take the largest (a safe reserve)
        v = max(v)
    if v is None:
        raise KeyError(f"{arch}.{key}")
    return int(v)


def kv_reserve(arch: str, meta: Mapping[str, Any], context_length: int, batch: int,
               dtype: str = "f16", values_per_token: int | None = None) -> KVReserve:
    """KV bytes per layer for `batch` sequences of `context_length` tokens, keyed on the architecture.

    `values_per_token`: the spec's own count where its cache is uniform (ModelSpec.kv_values_per_token).
    """
    if dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"KV dtype {dtype!r} is not one of {', '.join(KV_DTYPE_BYTES)}")
    size = KV_DTYPE_BYTES[dtype]
    n_layers = _int(meta, arch, "block_count")
    ctx, b = context_length, batch
    if values_per_token is not None:
        what = "MLA latent cache: (kv_lora_rank + rope dims)" if arch == "deepseek2" else "KV cache:"
        rule = f"{what} = {values_per_token} values/token/layer in {dtype}"
        per_layer = {layer: values_per_token * ctx * b * size for layer in range(n_layers)}
    elif arch == "deepseek4":
        per_layer, rule = _deepseek4(meta, arch, n_layers, ctx, b, size, dtype)
    else:
        n_head = _int(meta, arch, "attention.head_count")
        kv_heads = _int(meta, arch, "attention.head_count_kv", n_head)
        head_k = _int(meta, arch, "attention.key_length", _int(meta, arch, "embedding_length") // n_head)
        head_v = _int(meta, arch, "attention.value_length", head_k)
        dims = kv_heads * (head_k + head_v)
        rule = (f"K and V of {kv_heads} KV heads x ({head_k}+{head_v}) dims = {dims} values/token/layer "
                f"in {dtype}")
        per_layer = {layer: dims * ctx * b * size for layer in range(n_layers)}
    return KVReserve(per_layer, f"{rule}, x {ctx} tokens x batch {b}")


def _deepseek4(meta: Mapping[str, Any], arch: str, n_layers: int, ctx: int, b: int, size: int,
               dtype: str) -> tuple[dict[int, int], str]:
    dims = _int(meta, arch, "attention.key_length", 512)
    window = _int(meta, arch, "attention.sliding_window", 128)
    idx_dims = _int(meta, arch, "attention.indexer.key_length", 128)
    ratios = list(_get(meta, arch, "attention.compress_ratios", [0] * n_layers))
    per_layer: dict[int, int] = {}
    for layer in range(n_layers):
        r = int(ratios[layer]) if layer < len(ratios) else 0
        entries = min(window, ctx) + (ctx // r if r else 0)
        values = entries * dims + (ctx // r * idx_dims if r == 4 else 0)
        per_layer[layer] = values * b * size
    rule = (f"sliding window {window} + ctx/ratio compressed entries of {dims} values per layer "
            f"(+ ctx/4 indexer keys of {idx_dims} on ratio-4 layers) in {dtype}")
    return per_layer, rule


@dataclass(frozen=True)
class Workspace:
    """Activation buffers of one prefill chunk on every device, logits on the head's device."""

    activations: int
    logits: int
    context_overhead: int  # CUDA context and allocator slack per GPU (0 for the CPU)
    rule: str

    def on_device(self, holds_head: bool) -> int:
        return self.activations + self.context_overhead + (self.logits if holds_head else 0)


def workspace(hidden: int, vocab: int, batch: int, chunk: int, context_overhead: int) -> Workspace:
    activations = ACT_BUFFERS * batch * chunk * hidden * 4
    logits = vocab * batch * 4
    rule = (f"activations {ACT_BUFFERS} x batch {batch} x chunk {chunk} x hidden {hidden} x 4 B; "
            f"logits vocab {vocab} x batch {batch} x 4 B; {context_overhead / 2**30:.2f} GiB context per GPU")
    return Workspace(activations, logits, context_overhead, rule)
