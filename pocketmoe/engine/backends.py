"""Which kernels run the model: the native C++ CPU kernels when built, else the torch reference.

The native backend computes QuantLinear and routed experts straight from the file's blocks (no
dequantized copies); whatever it has no kernel for (a type, a 3-D per-head weight, a CUDA tensor)
falls back to the reference path for that one op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pocketmoe.errors import PocketMoEError
from pocketmoe.layers.experts import ExpertBank, ExpertWeights, ReferenceExperts
from pocketmoe.layers.linear import QuantLinear, ReferenceBackend

if TYPE_CHECKING:
    from pocketmoe.engine.runner import RunnerConfig

BACKENDS = ("auto", "native", "reference")


class NativeLinearBackend:
    """y = x @ W.T by pocketmoe._native.gemm on raw blocks; other cases go to `fallback`.

    torch runs at one intra-op thread beside it (see `torch_threads`).
    """

    def __init__(self, fallback: ReferenceBackend) -> None:
        from pocketmoe import native

        self.native = native
        self.types = native.supported_types()
        self.fallback = fallback

    def torch_threads(self, requested: int | None) -> int:
        """1, whatever was asked (`requested` sizes the native pool instead, see make_backends).

        The heavy GEMMs run in the native pool; torch's OpenMP workers spin after each of the many small
        ops left to torch (attention, norms, router) and steal the pool's cores. On the 452M bench model
        (2 cores, 2 native threads), torch at 1 thread vs 2: decode 47 vs 28 tok/s, prefill of 128
        tokens 270 vs 60 tok/s. torch.set_num_threads is process-wide: this holds for every model in
        the process.
        """
        return 1

    def _weight(self, layer: QuantLinear) -> object:
        """The weight as the kernel takes it, or False: the fallback's."""
        w = native_blocks(layer, self.types)
        return False if w is None else w

    def _run(self, kernel, fallback, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        w = layer.backend_data
        if w is None:
            w = layer.backend_data = self._weight(layer)
        if w is False or not x.is_cpu:
            return fallback(layer, x)
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        return torch.from_numpy(kernel(w, layer.ggml_type, x.numpy()))

    def batched(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:  # [H, T, I] -> [H, T, O]
        return self._run(self.native.gemm_batched, self.fallback.batched, layer, x)

    def linear(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:  # [T, I] -> [T, O]
        return self._run(self.native.gemm, self.fallback.linear, layer, x)


class NativeExperts:
    """Routed experts of one MoE layer by pocketmoe._native.moe_forward (fused, slot-order combine)."""

    def __init__(self, gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights) -> None:
        from pocketmoe import native

        self.native = native
        self.gate, self.up, self.down = gate, up, down
        self.n_experts, self.ffn = gate.shape[0], gate.shape[1]
        self.raw = tuple(w.raw.numpy() for w in (gate, up, down))  # uint8 blocks, no copy (the graph reads them too)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.raw
        y = self.native.moe_forward(
            x.float().contiguous().numpy(), ids.to(torch.int32).contiguous().numpy(),
            weights.float().contiguous().numpy(), gate, self.gate.ggml_type, up, self.up.ggml_type,
            down, self.down.ggml_type, self.n_experts, self.ffn)
        return torch.from_numpy(y)


def native_blocks(layer: QuantLinear, types: frozenset[int]) -> np.ndarray | None:
    """A 2-D or per-head 3-D weight as the kernels take it (uint8 [*lead, O, row_bytes] numpy, no copy), or None."""
    ok = len(layer.shape) in (2, 3) and native_reads(layer.raw, layer.ggml_type, types)
    return layer.raw.reshape(*layer.shape[:-1], -1).numpy() if ok else None


def native_reads(raw: torch.Tensor, ggml_type: int, types: frozenset[int], strided_experts: bool = False) -> bool:
    """The native kernels take this weight as it is: raw host blocks, contiguous, of a type they know.

    With strided_experts, a stacked [E, rows, row_bytes] weight may also have its experts further apart
    than one expert's bytes, each expert's rows still packed (a half of a fused gate_up tensor).
    """
    packed = raw.is_contiguous() or (strided_experts and raw.dim() == 3 and raw.stride(2) == 1
                                     and raw.stride(1) == raw.shape[2])
    return ggml_type in types and raw.device.type == "cpu" and not raw.is_floating_point() and packed


def native_can_run(gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights, types: frozenset[int]) -> bool:
    return all(native_reads(w.raw, w.ggml_type, types, strided_experts=True) for w in (gate, up, down))


@dataclass(frozen=True)
class Backends:
    name: str                     # "native" | "reference", as printed at start
    linear: object                # LinearBackend
    make_experts: object          # (layer, gate, up, down) -> ExpertBank
    cache_kinds: tuple[str, ...]  # weight kinds worth a dequantized copy with this backend
    detail: str                   # e.g. the instruction set and threads, or why native is off


def make_backends(name: str, cfg: RunnerConfig) -> Backends:
    """Pick kernels: "auto" takes native when it is built and this CPU can run it."""
    if name not in BACKENDS:
        raise PocketMoEError(f"backend {name!r} is not one of {', '.join(BACKENDS)}.")
    from pocketmoe import native

    reference = ReferenceBackend(cfg.tile_rows)

    def reference_experts(layer: int, gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights) -> ExpertBank:
        return ReferenceExperts(gate, up, down, tile_rows=cfg.tile_rows)

    if name == "reference" or (name == "auto" and not native.available()):
        why = "" if name == "reference" else f" ({native.unavailable_reason()})"
        return Backends("reference", reference, reference_experts, cfg.cache_kinds, "torch reference" + why)
    if not native.available():
        raise PocketMoEError(f"--backend native was asked for but {native.unavailable_reason()}.")
    if cfg.threads is not None:
        native.set_num_threads(cfg.threads)
    linear = NativeLinearBackend(reference)
    types = linear.types

    def native_experts(layer: int, gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights) -> ExpertBank:
        if native_can_run(gate, up, down, types):
            return NativeExperts(gate, up, down)
        return reference_experts(layer, gate, up, down)

    # Only fallbacks (types without a kernel) dequantize here: let attention weights keep that copy.
    return Backends("native", linear, native_experts, ("attn",), native.describe())
