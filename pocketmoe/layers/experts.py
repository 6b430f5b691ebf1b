"""Routed experts: the ExpertBank interface and the plain-torch reference bank.

Legend: T tokens, D hidden, K experts per token, E experts, F expert FFN width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from pocketmoe.layers.linear import float_weight

if TYPE_CHECKING:
    from pocketmoe.gguf import GGUFBundle


class ExpertBank(Protocol):
    """Computes sum_k weights[t, k] * expert_{ids[t, k]}(x[t]); where the experts live is its own business."""

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, D] float32, ids [T, K] int64, weights [T, K] float32 -> [T, D] float32."""
        ...


@dataclass(frozen=True)
class ExpertWeights:
    """One stacked routed-expert weight kept as raw blocks: uint8 [E, O, row_bytes] (or an F32 view)."""

    raw: torch.Tensor
    ggml_type: int
    shape: tuple[int, int, int]  # [E, O, I]

    @classmethod
    def from_bundle(cls, bundle: GGUFBundle, name: str) -> ExpertWeights:
        info = bundle.tensors[name]
        return cls(bundle.raw_torch(name), info.ggml_type, tuple(info.shape))

    def rows(self, start: int, stop: int) -> ExpertWeights:
        """Output rows [start, stop) of every expert, zero-copy (splits a fused gate_up tensor)."""
        e, _, i = self.shape
        return ExpertWeights(self.raw[:, start:stop], self.ggml_type, (e, stop - start, i))

    def expert(self, e: int) -> torch.Tensor:
        """float32 [O, I] of expert e, dequantized from its own blocks only."""
        return float_weight(self.raw[e], self.ggml_type, self.shape[1:])


def combine(contrib: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """contrib [T, K, D], weights [T, K] -> [T, D], summed in slot order 0..K-1 in fp32."""
    y = contrib[:, 0] * weights[:, 0:1]
    for k in range(1, contrib.shape[1]):
        y = y + contrib[:, k] * weights[:, k:k + 1]
    return y


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    """silu(gate) * up; with limit > 0 the clamped form (DeepSeek-V4, as llama.cpp computes it):
    silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    if limit > 0.0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up


def per_expert(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               expert_forward: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [T, D], ids / weights [T, K] -> [T, D]: each active expert on the rows routed to it
    (expert_forward(e, rows [n, D]) -> [n, D]), then the slot-order combine."""
    t, k = ids.shape
    flat = ids.reshape(-1)  # [T*K], pair p = token p // K, slot p % K
    contrib = x.new_zeros(t * k, x.shape[1])
    for e in torch.unique(flat).tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        contrib[pairs] = expert_forward(e, x[pairs // k].contiguous())
    return combine(contrib.view(t, k, -1), weights)


class ReferenceExperts:
    """Per call, each active expert's blocks are dequantized and run on the tokens routed to it.

    With `tile_rows`, every GEMM and activation of an expert runs on fixed [tile_rows, *] tiles (the last
    one zero-padded), so a token's contribution is bit-identical whatever other tokens share the batch;
    the slot-order combine fixes the sum order too.
    """

    def __init__(self, gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights,
                 tile_rows: int | None = None, swiglu_limit: float = 0.0) -> None:
        self.gate, self.up, self.down = gate, up, down
        self.tile_rows = tile_rows
        self.swiglu_limit = float(swiglu_limit)

    def _ffn(self, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        return F.linear(swiglu(F.linear(x, gate), F.linear(x, up), self.swiglu_limit), down)

    @property
    def n_experts(self) -> int:
        return self.gate.shape[0]

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:  # x: [n, D] -> [n, D]
        gate, up, down = self.gate.expert(e), self.up.expert(e), self.down.expert(e)
        if self.tile_rows is None:
            return self._ffn(x, gate, up, down)
        n, tile = x.shape[0], self.tile_rows
        padded = torch.cat([x, x.new_zeros(-n % tile, x.shape[1])])
        return torch.cat([self._ffn(t, gate, up, down) for t in padded.split(tile)])[:n]

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return per_expert(x, ids, weights, self.expert_forward)


class NativeExperts:
    """Routed experts of one MoE layer in host memory, computed by the native fused MoE op
    (pocketmoe._native.moe_forward: raw blocks, slot-order fp32 combine, batch-invariant)."""

    def __init__(self, gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights, swiglu_limit: float = 0.0) -> None:
        from pocketmoe import native

        self.native = native
        self.gate, self.up, self.down = gate, up, down
        self.n_experts, self.ffn = gate.shape[0], gate.shape[1]
        self.raw = tuple(w.raw.numpy() for w in (gate, up, down))  # uint8 blocks, no copy
        self.swiglu_limit = float(swiglu_limit)  # > 0: silu(min(gate, L)) * clamp(up, -L, L) (DeepSeek-V4)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.raw
        y = self.native.moe_forward(
            x.float().contiguous().numpy(), ids.to(torch.int32).contiguous().numpy(),
            weights.float().contiguous().numpy(), gate, self.gate.ggml_type, up, self.up.ggml_type,
            down, self.down.ggml_type, self.n_experts, self.ffn, swiglu_limit=self.swiglu_limit)
        return torch.from_numpy(y)


def native_reads(raw: torch.Tensor, ggml_type: int, types: frozenset[int], strided_experts: bool = False) -> bool:
    """The native kernels take this weight as it is: raw host blocks, contiguous, of a type they know.

    With strided_experts, a stacked [E, rows, row_bytes] weight may also have its experts further apart
    than one expert's bytes, each expert's rows still packed (a half of a fused gate_up tensor).
    """
    packed = raw.is_contiguous() or (strided_experts and raw.dim() == 3 and raw.stride(2) == 1
                                     and raw.stride(1) == raw.shape[2])
    return ggml_type in types and raw.device.type == "cpu" and not raw.is_floating_point() and packed


# make_experts(layer, gate, up, down, swiglu_limit=0.0) -> the bank the placement plan chose for that MoE
# layer; swiglu_limit > 0 clamps the experts' SwiGLU (see swiglu)
ExpertsFactory = Callable[..., ExpertBank]


def host_experts_factory(native_types: frozenset[int] | None, tile_rows: int | None) -> ExpertsFactory:
    """Banks for experts kept in host memory and computed there: native where the kernels read every
    weight (`native_types` None: never), else the torch reference."""

    def make(layer: int, gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights,
             swiglu_limit: float = 0.0) -> ExpertBank:
        if native_types is not None and all(native_reads(w.raw, w.ggml_type, native_types, strided_experts=True)
                                            for w in (gate, up, down)):
            return NativeExperts(gate, up, down, swiglu_limit)
        return ReferenceExperts(gate, up, down, tile_rows=tile_rows, swiglu_limit=swiglu_limit)

    return make
