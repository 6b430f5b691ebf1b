"""All-device routed experts: every expert's raw blocks on the device, computed by the device kernels.

On the CPU device the blocks already are in (mapped) host memory, so `to(device)` copies nothing and
the bank is the native host bank itself (the native backend then runs the MoE sublayer as one call).
"""

from __future__ import annotations

import torch

from pocketmoe.experts.kernels import ExpertKernels, ExpertStore, NativeKernels
from pocketmoe.experts.stats import ExpertStats
from pocketmoe.layers.experts import ExpertBank, ExpertWeights, NativeExperts, ReferenceExperts
from pocketmoe.ops.cuda.graphs import made_once


class ResidentExperts:
    """A store of every expert on the device and the kernels that read it in place."""

    def __init__(self, store: ExpertStore, kernels: ExpertKernels, stats: ExpertStats,
                 counts_tokens: bool = False) -> None:
        self.store, self.kernels, self.stats, self.counts_tokens = store, kernels, stats, counts_tokens
        self._rows: dict[tuple[int, int], torch.Tensor] = {}  # (T, K) -> each pair's input row, made once
        # the distinct experts of each call, counted by the kernels into a device counter (no read-back per layer,
        # and a decode CUDA graph's replays count too)
        self._used = stats.counter("resident", store.gate.raw.device)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        dev = self.store.gate.raw.device
        return self.kernels.combine(self.unweighted(x, ids), weights.to(dev)).to(x.device)

    def unweighted(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each (token, slot)'s expert output [T, K, D] on the store's device, before the combine (a backend that
        combines them as it closes the sublayer takes these: ops.cuda's moe_sublayer)."""
        t, k = ids.shape
        dev = self.store.gate.raw.device
        flat = ids.reshape(-1).to(dev)
        if len(self._rows) >= 256:  # prefill chunks of many lengths
            self._rows.clear()
        rows = made_once(self._rows, (t, k), lambda: torch.arange(t * k, dtype=torch.int32, device=dev) // k)
        contrib = self.kernels.outputs(self.store, x.to(dev), flat, rows, used=self._used)
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # a decode CUDA graph (ops.cuda.graphs): nothing is read back; each replay counts the tokens
            from pocketmoe.ops.cuda.graphs import on_replay

            on_replay(lambda: self.stats.add(tokens=t if self.counts_tokens else 0))
        else:
            self.stats.add(tokens=t if self.counts_tokens else 0)
        return contrib.view(t, k, -1)


def to_device(w: ExpertWeights, device: torch.device) -> ExpertWeights:
    return ExpertWeights(w.raw.to(device), w.ggml_type, w.shape)


def resident_bank(store: ExpertStore, kernels: ExpertKernels, device: torch.device, stats: ExpertStats,
                  tile_rows: int | None, counts_tokens: bool) -> ExpertBank:
    """The bank of one all-device MoE layer: on the CPU device, the same bank as the CPU plan's."""
    on_dev = ExpertStore(*(to_device(w, device) for w in (store.gate, store.up, store.down)), store.swiglu_limit)
    if device.type == "cpu":
        if isinstance(kernels, NativeKernels):
            return NativeExperts(on_dev.gate, on_dev.up, on_dev.down, store.swiglu_limit)
        return ReferenceExperts(on_dev.gate, on_dev.up, on_dev.down, tile_rows=tile_rows,
                                swiglu_limit=store.swiglu_limit)
    return ResidentExperts(on_dev, kernels, stats, counts_tokens)
