"""CUDA graphs for decode steps (CudaOps.enable_graphs; off unless asked for: POCKETMOE_CUDA_GRAPHS=1).

A decode step (every sequence one token, every token wanting logits, at most GEMV_TOKENS of them) of a model
whose whole step runs on the device is captured once per batch size and replayed after. What the host makes
per step (the embedding rows, the rope tables, seq / keys / page table / write rows) reaches the graph through
static pinned buffers: while capturing, each such input is registered with the function that makes it from a
StepContext, and its copy into a static device buffer is a node of the graph; a replay refills the pinned
buffers from the new step and replays. The page table is padded to the cache's widest, so its width (a kernel
argument) is the same every step.

Guards: the first step of a batch size runs eagerly (it loads the modules, uploads the weights and fills the
pointer arrays the capture must not make); a capture that fails (the heterogeneous dispatcher syncs with the
host, a fallback op copies from pageable memory) turns graphs off for that shape and the step runs eagerly; the
first replay of a shape is checked against an eager run of the same step (which rewrites the same KV rows with
the same values) and must match bit for bit, else the shape runs eagerly from then on. Replays run the hooks
registered while capturing (expert statistics that Python would have counted). The logits tensor a replay
returns is the graph's static output: CudaOps.run copies it to the host before the next step.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

GRAPHS_ENV = "POCKETMOE_CUDA_GRAPHS"
MAX_TOKENS = 8  # matmul.GEMV_TOKENS: beyond it a linear takes the GEMM path, whose route arrays come from the host

_hooks: list[Callable[[], None]] | None = None  # replay hooks of the capture in progress


def capturing() -> bool:
    """Whether the current CUDA stream is being captured (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def made_once(cache: dict[Any, Any], key: Any, make: Callable[[], Any]) -> Any:
    """cache[key], made by make() at first use: a constant device tensor of the hot path. One made while a CUDA
    graph is captured is not kept (the graph's kernels that would fill it have not run yet)."""
    got = cache.get(key)
    if got is None:
        got = make()
        if not capturing():
            cache[key] = got
    return got


def on_replay(hook: Callable[[], None]) -> None:
    """Called while capturing: `hook` runs after every replay of the graph (statistics the step counts)."""
    if _hooks is not None:
        _hooks.append(hook)


def requested() -> bool:
    return os.environ.get(GRAPHS_ENV, "") == "1"


@dataclass
class HostInput:
    """One host-made input of a captured step: a pinned buffer, its device twin, and how a step makes it."""

    make: Callable[[Any], np.ndarray | torch.Tensor]
    pinned: torch.Tensor
    device: torch.Tensor

    def fill(self, ctx: Any) -> None:
        v = self.make(ctx)
        self.pinned.copy_(torch.as_tensor(v).reshape(self.pinned.shape))


@dataclass
class Captured:
    graph: Any
    out: torch.Tensor
    inputs: list[HostInput]
    hooks: list[Callable[[], None]]
    checked: bool = False


@dataclass
class DecodeGraphs:
    device: torch.device
    reset: Callable[[], None] = lambda: None  # drops the backend's per-step device arrays (made for the capture)
    graphs: dict[tuple[int, int], Captured | bool] = field(default_factory=dict)  # False: this shape runs eagerly
    seen: set[tuple[int, int]] = field(default_factory=set)
    failures: dict[tuple[int, int], str] = field(default_factory=dict)
    inputs: list[HostInput] | None = None  # while capturing: the inputs registered so far
    # the CUDA calls (tests hand in CPU stand-ins)
    pinned: Callable[[torch.Size, torch.dtype], torch.Tensor] = lambda shape, dtype: torch.empty(
        shape, dtype=dtype, pin_memory=True)
    new_graph: Callable[[], Any] = lambda: torch.cuda.CUDAGraph()
    capture: Callable[[Any], Any] = lambda graph: torch.cuda.graph(graph)
    sync: Callable[[torch.device], None] = lambda device: torch.cuda.synchronize(device)

    @staticmethod
    def decode_shaped(model: Any, ctx: Any) -> bool:
        t = ctx.n_tokens
        return (0 < t <= MAX_TOKENS and len(ctx.logit_rows) == t and len(np.unique(ctx.seq)) == t
                and not len(ctx.hidden_rows) and hasattr(model, "prepare"))

    def host_input(self, make: Callable[[Any], np.ndarray | torch.Tensor], ctx: Any) -> torch.Tensor | None:
        """While capturing: a static device tensor holding make(ctx), copied from a pinned buffer by a graph node
        (None when no capture is in progress: the caller uploads as usual)."""
        if self.inputs is None:
            return None
        v = torch.as_tensor(make(ctx))
        pinned = self.pinned(v.shape, v.dtype)
        dev = torch.empty(v.shape, dtype=v.dtype, device=self.device)
        inp = HostInput(make, pinned, dev)
        inp.fill(ctx)
        dev.copy_(pinned, non_blocking=True)
        self.inputs.append(inp)
        return dev

    def run(self, model: Any, ctx: Any) -> torch.Tensor | None:
        """The step's logits from a graph (None: run it eagerly)."""
        if not self.decode_shaped(model, ctx):
            return None
        key = (id(model), ctx.n_tokens)
        entry = self.graphs.get(key)
        if entry is False:
            return None
        if entry is None:
            if key not in self.seen:  # the first step of this shape warms up eagerly
                self.seen.add(key)
                return None
            entry = self._capture(model, ctx, key)
            if entry is None:
                return None
        else:
            model.prepare(ctx)
            for inp in entry.inputs:
                inp.fill(ctx)
        entry.graph.replay()
        for hook in entry.hooks:
            hook()
        if not entry.checked:  # the first replay of a shape against an eager run of the same step
            entry.checked = True
            self.reset()
            eager = model(ctx)
            if not torch.equal(eager, entry.out):
                self.graphs[key] = False
                self.failures[key] = "the replayed logits differ from the eager step's"
                warnings.warn(f"CUDA graph of a {ctx.n_tokens}-token decode step disagreed with the eager step; "
                              "that shape runs eagerly", RuntimeWarning, stacklevel=2)
                return eager
        return entry.out

    def _capture(self, model: Any, ctx: Any, key: tuple[int, int]) -> Captured | None:
        global _hooks
        graph = self.new_graph()
        self.inputs, _hooks = [], []
        try:
            self.sync(self.device)
            with self.capture(graph):
                out = model(ctx)
            entry = Captured(graph, out, self.inputs, _hooks)
        except Exception as exc:  # noqa: BLE001 - any capture failure: this shape runs eagerly
            self.graphs[key] = False
            self.failures[key] = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"a {ctx.n_tokens}-token decode step could not be captured as a CUDA graph ({exc}); "
                          "that shape runs eagerly", RuntimeWarning, stacklevel=3)
            return None
        finally:
            self.inputs, _hooks = None, None
            self.reset()
        self.graphs[key] = entry
        return entry
