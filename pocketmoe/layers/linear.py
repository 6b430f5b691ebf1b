"""Linear layers over raw GGUF blocks: the weight stays a view of the file until a backend reads it.

Legend: T tokens, I in features, O out features.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from pocketmoe.gguf import GGUFBundle

F32 = 0


def float_weight(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 `shape` from raw bytes: a zero-copy view for F32, a dequantized copy otherwise."""
    if raw.is_floating_point():
        return raw.float().reshape(shape)
    if ggml_type == F32:
        return raw.view(torch.float32).view(shape)
    from pocketmoe.quant import dequantize

    return dequantize(raw, ggml_type, shape)


def load_float(bundle: GGUFBundle, name: str) -> torch.Tensor:
    """A small float tensor (norm, router, bias) from the bundle; no copy when it is F32."""
    info = bundle.tensors[name]
    return float_weight(bundle.raw_torch(name), info.ggml_type, tuple(info.shape))


def tiled_linear(x: torch.Tensor, w: torch.Tensor, tile: int) -> torch.Tensor:
    """x [T, I] @ w[O, I].T in fixed [tile, I] GEMMs: a row's result never depends on the other rows."""
    t = x.shape[0]
    n = -(-t // tile)
    if n * tile != t:
        x = torch.cat([x, x.new_zeros(n * tile - t, x.shape[1])])
    y = torch.bmm(x.view(n, tile, -1), w.t().expand(n, -1, -1))  # [n, tile, O]
    return y.view(n * tile, -1)[:t]


class LinearBackend(Protocol):
    """How a `QuantLinear` computes x @ W.T; chosen when the model is built."""

    def linear(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor: ...

    def batched(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        """Per-head weights [H, O, I]: x [H, T, I] -> [H, T, O], out[h] = x[h] @ W[h].T."""
        ...

    def torch_threads(self, requested: int | None) -> int | None:
        """torch intra-op threads to run with, given the user's request (None: torch's choice)."""
        ...


class ReferenceBackend:
    """Plain torch: dequantize (or reuse the cached float weight), then an fp32 GEMM.

    With `tile_rows` set, GEMMs run in fixed row tiles so results do not depend on batch composition.
    """

    def __init__(self, tile_rows: int | None = None) -> None:
        self.tile_rows = tile_rows

    def torch_threads(self, requested: int | None) -> int | None:
        return requested  # every GEMM is torch's: give it the cores

    def batched(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x, layer.dense_t())

    def linear(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        w = layer.dense()
        if self.tile_rows is None:
            return F.linear(x, w)
        return tiled_linear(x, w, self.tile_rows)


REFERENCE = ReferenceBackend()


class QuantLinear:
    """y = x @ W.T with W held as raw GGUF blocks (uint8 [*lead, O, row_bytes]) or an F32 view.

    `cache_dense` keeps the dequantized float32 weight after first use (for small dense weights where
    that is faster and fits); routed experts never use it.
    """

    def __init__(self, raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...], *,
                 cache_dense: bool = False, backend: LinearBackend = REFERENCE, name: str = "") -> None:
        self.raw = raw
        self.ggml_type = int(ggml_type)
        self.shape = tuple(int(s) for s in shape)
        self.cache_dense = cache_dense
        self.backend = backend
        self.name = name
        self.backend_data: object = None  # what the backend precomputed for this layer, set on first use
        self._dense: torch.Tensor | None = None
        self._dense_t: torch.Tensor | None = None
        if ggml_type == F32 or raw.is_floating_point():
            self._dense = float_weight(raw, ggml_type, self.shape)

    @classmethod
    def from_bundle(cls, bundle: GGUFBundle, name: str, **kw: object) -> QuantLinear:
        info = bundle.tensors[name]
        return cls(bundle.raw_torch(name), info.ggml_type, tuple(info.shape), name=name, **kw)

    @property
    def out_features(self) -> int:
        return self.shape[-2]

    @property
    def in_features(self) -> int:
        return self.shape[-1]

    def dense(self) -> torch.Tensor:
        """float32 weight [*lead, O, I]."""
        if self._dense is not None:
            return self._dense
        w = float_weight(self.raw, self.ggml_type, self.shape)
        if self.cache_dense:
            self._dense = w
        return w

    def dense_t(self) -> torch.Tensor:
        """float32 weight with the last two dims swapped: [*lead, I, O].

        With cache_dense it is kept as a contiguous copy (instead of dense()'s), which batched GEMMs read
        faster than the transposed view; otherwise it is that view.
        """
        if self._dense_t is not None:
            return self._dense_t
        if not self.cache_dense:
            return self.dense().transpose(-1, -2)
        self._dense_t = self.dense().transpose(-1, -2).contiguous()
        self._dense = None
        return self._dense_t

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, I] -> [T, O]
        return self.backend.linear(self, x)

    def batched(self, x: torch.Tensor) -> torch.Tensor:  # per-head weight [H, O, I]: x [H, T, I] -> [H, T, O]
        return self.backend.batched(self, x)

    def __repr__(self) -> str:
        return f"QuantLinear({self.name!r}, type={self.ggml_type}, shape={list(self.shape)})"


class QuantEmbedding:
    """Token embedding over raw blocks: only the looked-up rows are dequantized."""

    def __init__(self, raw: torch.Tensor, ggml_type: int, shape: tuple[int, int]) -> None:
        self.raw = raw
        self.ggml_type = int(ggml_type)
        self.shape = (int(shape[0]), int(shape[1]))
        self._dense = None
        if ggml_type == F32 or raw.is_floating_point():
            self._dense = float_weight(raw, ggml_type, self.shape)

    @classmethod
    def from_bundle(cls, bundle: GGUFBundle, name: str) -> QuantEmbedding:
        info = bundle.tensors[name]
        return cls(bundle.raw_torch(name), info.ggml_type, tuple(info.shape))

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens: [T] -> [T, D]
        if self._dense is not None:
            return self._dense[tokens]
        return float_weight(self.raw[tokens], self.ggml_type, (tokens.numel(), self.shape[1]))
