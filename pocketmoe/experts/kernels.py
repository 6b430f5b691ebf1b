"""Expert kernels over a store of raw expert blocks (the host's stacked tensors, or a device slot pool):
each pair's unweighted expert output, and the slot-order fp32 combine.

The native kernels run a pair set through moe_forward with top_k 1 and weight 1 (fma(1, c, 0) = c),
and combine with moe_combine, moe_forward's own fma order; the reference runs ReferenceExperts'
per-expert tiles and its combine. So whichever path computed which expert, the sum has the bits of
the CPU-only bank of the same kernels.

A call's pairs read their input rows by index (pair p reads row rows[p] of x), so a token's row is not copied
once per expert; the device kernels quantize each row of x once per layer call (Activations), however many
pairs and calls (a dispatcher's hits, then each staged expert) read it. The host kernels gather the pairs'
rows and run them as moe_forward's own rows.

Legend: P pairs, R input rows (a layer call's tokens, or a subset), D hidden, T tokens, K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from pocketmoe.layers.experts import ExpertWeights, ReferenceExperts, combine, native_reads


@dataclass(frozen=True)
class ExpertStore:
    """gate, up, down of E experts (host tensors) or of S slots (a device pool), same layout per expert."""

    gate: ExpertWeights
    up: ExpertWeights
    down: ExpertWeights
    swiglu_limit: float = 0.0  # > 0: the clamped SwiGLU of DeepSeek-V4 (layers.experts.swiglu)

    @property
    def count(self) -> int:
        return self.gate.shape[0]

    @property
    def ffn(self) -> int:
        return self.gate.shape[1]

    def expert_bytes(self, e: int = 0) -> int:
        return sum(w.raw[e].numel() * w.raw.element_size() for w in (self.gate, self.up, self.down))


@dataclass
class Activations:
    """The input rows of one layer call, and what kernels derive from them once (their quantized forms, keyed
    by the kernels), shared by every outputs call of that layer over a subset of its pairs."""

    x: torch.Tensor  # [R, D] float32
    derived: dict[Any, Any] = field(default_factory=dict)


def input_rows(x: torch.Tensor | Activations, rows: torch.Tensor | None) -> torch.Tensor:
    """The pairs' own rows: x[rows] (rows None: x itself, one row per pair)."""
    x = x.x if isinstance(x, Activations) else x
    return x if rows is None else x[rows.to(x.device)]


def count_used(which: torch.Tensor, n: int, used: torch.Tensor | None) -> None:
    """used (an int64 counter on which's device) += the distinct values of which (in [0, n)), on the device."""
    if used is not None and len(which):
        used += torch.zeros(n, dtype=torch.bool, device=which.device).index_fill_(0, which, True).sum()


class ExpertKernels(Protocol):
    name: str

    def outputs(self, store: ExpertStore, x: torch.Tensor | Activations, which: torch.Tensor,
                rows: torch.Tensor | None = None, used: torch.Tensor | None = None) -> torch.Tensor:
        """x [R, D] float32, which [P] int64 (expert or slot of `store`), rows [P] (pair p reads x[rows[p]];
        None: R == P, row p) -> [P, D] float32, unweighted. used: an int64 counter on which's device that gains
        the number of distinct experts of the call (count_used), read back only when the statistics are."""
        ...

    def combine(self, contrib: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """contrib [T, K, D], weights [T, K] -> [T, D] float32 in slot order."""
        ...


class NativeKernels:
    name = "native"

    def __init__(self) -> None:
        from pocketmoe import native

        self.native = native
        self.lib = native._lib()
        self._arrays: dict[int, tuple[ExpertStore, tuple[np.ndarray, ...]]] = {}

    def _raw(self, store: ExpertStore) -> tuple[np.ndarray, ...]:
        got = self._arrays.get(id(store))
        if got is None or got[0] is not store:
            got = self._arrays[id(store)] = (store, tuple(w.raw.numpy() for w in (store.gate, store.up, store.down)))
        return got[1]

    def outputs(self, store: ExpertStore, x: torch.Tensor | Activations, which: torch.Tensor,
                rows: torch.Tensor | None = None, used: torch.Tensor | None = None) -> torch.Tensor:
        count_used(which, store.count, used)
        g, u, d = self._raw(store)
        x = input_rows(x, rows)
        ids = which.to(torch.int32).reshape(-1, 1).numpy()
        ones = np.ones(ids.shape, dtype=np.float32)
        y = self.lib.moe_forward(x.float().contiguous().numpy(), ids, ones, g, store.gate.ggml_type, u,
                                 store.up.ggml_type, d, store.down.ggml_type, store.count, store.ffn,
                                 swiglu_limit=store.swiglu_limit)
        return torch.from_numpy(y)

    def combine(self, contrib: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.lib.moe_combine(contrib.contiguous().numpy(), weights.float().contiguous().numpy()))


class ReferenceKernels:
    name = "reference"

    def __init__(self, tile_rows: int | None) -> None:
        self.tile_rows = tile_rows

    def outputs(self, store: ExpertStore, x: torch.Tensor | Activations, which: torch.Tensor,
                rows: torch.Tensor | None = None, used: torch.Tensor | None = None) -> torch.Tensor:
        count_used(which, store.count, used)
        x = input_rows(x, rows)
        bank = ReferenceExperts(store.gate, store.up, store.down, tile_rows=self.tile_rows,
                                swiglu_limit=store.swiglu_limit)
        out = x.new_zeros(x.shape)
        for e in torch.unique(which).tolist():
            rows = (which == e).nonzero().squeeze(1)
            out[rows] = bank.expert_forward(e, x[rows])
        return out

    def combine(self, contrib: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return combine(contrib, weights)


def host_kernels(store: ExpertStore, native_types: frozenset[int] | None, tile_rows: int | None) -> ExpertKernels:
    """The kernels the CPU-only bank of these weights would run: native where it reads every weight."""
    if native_types is not None and all(native_reads(w.raw, w.ggml_type, native_types, strided_experts=True)
                                        for w in (store.gate, store.up, store.down)):
        return NativeKernels()
    return ReferenceKernels(tile_rows)
