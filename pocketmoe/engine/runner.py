"""Build a model from a GGUF bundle and run it: chunked prefill, one-token decode, latent KV cache.

Legend: T tokens, V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pocketmoe.engine.backends import NativeLinearBackend
from pocketmoe.engine.kv_cache import ContextLengthError, LatentKVCache
from pocketmoe.engine.native_graph import GraphUnsupported, NativeGraph, build_graph
from pocketmoe.errors import PocketMoEError
from pocketmoe.layers.experts import ExpertBank, ExpertWeights, ReferenceExperts
from pocketmoe.layers.linear import LinearBackend, QuantLinear, ReferenceBackend
from pocketmoe.models import model_builder
from pocketmoe.specs import spec_from_bundle

if TYPE_CHECKING:
    from pocketmoe.gguf import GGUFBundle
    from pocketmoe.models.deepseek2 import ExpertsFactory

WEIGHT_KINDS = ("attn", "dense", "shared", "router", "head")
KV_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class RunnerConfig:
    n_ctx: int = 4096                 # positions in the KV cache (prompt + generated)
    chunk_size: int = 256             # prefill tokens per forward
    threads: int | None = None        # threads for the kernels; the backend decides torch's share
    # weight kinds whose dequantized float32 copy is kept after first use ("attn", "dense", "shared",
    # "router", "head"); routed experts are never expanded
    cache_kinds: tuple[str, ...] = ("attn", "dense", "shared", "router")
    # at most this many bytes of dequantized float32 copies in all (the rest is dequantized per call),
    # so anonymous memory stays bounded on full-size models
    cache_budget_bytes: int = 1 << 30
    tile_rows: int | None = 8         # GEMMs in fixed row tiles: a row's result ignores the other rows
    kv_dtype: str = "f32"
    # with native kernels, run the whole forward in one native call per chunk where the model allows
    # (engine/native_graph.py); False keeps the per-op path
    native_graph: bool = True

    def __post_init__(self) -> None:
        if self.n_ctx <= 0 or self.chunk_size <= 0:
            raise PocketMoEError(f"n_ctx ({self.n_ctx}) and chunk_size ({self.chunk_size}) must be > 0.")
        if self.threads is not None and self.threads <= 0:
            raise PocketMoEError(f"threads must be > 0, got {self.threads}.")
        if self.cache_budget_bytes < 0:
            raise PocketMoEError(f"cache_budget_bytes must be >= 0, got {self.cache_budget_bytes}.")
        if self.tile_rows is not None and self.tile_rows <= 0:
            raise PocketMoEError(f"tile_rows must be > 0 or None, got {self.tile_rows}.")
        unknown = set(self.cache_kinds) - set(WEIGHT_KINDS)
        if unknown:
            raise PocketMoEError(f"cache_kinds {sorted(unknown)} are not weight kinds ({', '.join(WEIGHT_KINDS)}).")
        if self.kv_dtype not in KV_DTYPES:
            raise PocketMoEError(f"kv_dtype {self.kv_dtype!r} is not one of {', '.join(KV_DTYPES)}.")


def load_config(bundle: GGUFBundle) -> object:
    """The architecture's hyperparameters, after checking the bundle's tensors against its spec."""
    spec = spec_from_bundle(bundle)
    report = spec.validate(bundle)
    if not report.ok:
        errors = report.errors()
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        raise PocketMoEError(f"{bundle.paths[0]}: {errors[0]}{more}")
    return spec.config


class ModelRunner:
    """One sequence: `forward(tokens, start_pos)` writes the cache at start_pos.. and returns logits."""

    def __init__(self, bundle: GGUFBundle, cfg: RunnerConfig | None = None, *,
                 backend: LinearBackend | None = None, make_experts: ExpertsFactory | None = None,
                 model_config: object | None = None) -> None:
        self.cfg = cfg = cfg or RunnerConfig()
        self.bundle = bundle
        self.backend = backend or ReferenceBackend(cfg.tile_rows)
        threads = self.backend.torch_threads(cfg.threads)
        if threads is not None:
            torch.set_num_threads(threads)
        self.cached_bytes = 0  # float32 bytes promised to dequantized-weight caches so far
        self.model_config = model_config if model_config is not None else load_config(bundle)
        build = model_builder(bundle.architecture)
        self.model = build(bundle, self.model_config, self._make_linear, make_experts or self._make_experts)
        self.cache = LatentKVCache(self.model.n_layer, cfg.n_ctx, self.model.cache_width,
                                   dtype=KV_DTYPES[cfg.kv_dtype])
        self.graph, self.graph_note = self._make_graph()
        # Embedding rows are read one per token in no order: without this, each new token id of a large
        # model faults its page in from disk in decode (V2-Lite: ~2 ms a token).
        if "token_embd.weight" in bundle.tensors:
            bundle.prefetch("token_embd.weight")

    def _make_graph(self) -> tuple[NativeGraph | None, str]:
        """The native whole-model graph when it can run this model, else None and why not."""
        if not self.cfg.native_graph:
            return None, "per-op path (native_graph off)"
        if not isinstance(self.backend, NativeLinearBackend):
            return None, "per-op path (torch reference backend)"
        try:
            graph = build_graph(self.model, self.cache)
        except GraphUnsupported as exc:
            return None, f"per-op path ({exc})"
        return graph, graph.note

    def _make_linear(self, name: str, kind: str) -> QuantLinear:
        info = self.bundle.tensors[name]
        cache = False
        if kind in self.cfg.cache_kinds and info.ggml_type != 0:  # F32 is a zero-copy view already
            nbytes = 4 * info.n_elements
            cache = self.cached_bytes + nbytes <= self.cfg.cache_budget_bytes
            self.cached_bytes += nbytes if cache else 0
        return QuantLinear.from_bundle(self.bundle, name, cache_dense=cache, backend=self.backend)

    def _make_experts(self, layer: int, gate: ExpertWeights, up: ExpertWeights,
                      down: ExpertWeights) -> ExpertBank:
        return ReferenceExperts(gate, up, down, tile_rows=self.cfg.tile_rows)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def _tokens(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        t = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        if t.numel() == 0:
            raise PocketMoEError("forward needs at least one token, got none.")
        bad = (t < 0) | (t >= self.vocab_size)
        if bool(bad.any()):
            raise PocketMoEError(f"token id {int(t[bad][0])} is outside the vocabulary of "
                                 f"{self.vocab_size} tokens.")
        return t

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int] | torch.Tensor, start_pos: int,
                last_only: bool = False) -> torch.Tensor:
        """tokens [T] at positions start_pos.. -> logits [T, V] float32 ([1, V] with last_only)."""
        t = self._tokens(tokens)
        if start_pos < 0 or start_pos + t.numel() > self.cfg.n_ctx:
            raise ContextLengthError(
                f"positions {start_pos}..{start_pos + t.numel() - 1} do not fit in the context of "
                f"{self.cfg.n_ctx} tokens; raise n_ctx or shorten the input.")
        out = []
        step = self.cfg.chunk_size
        for i in range(0, t.numel(), step):
            chunk = t[i:i + step]
            is_last = i + step >= t.numel()
            logits = self._run(chunk, start_pos + i, last_only)
            if is_last or not last_only:  # earlier chunks of a last_only call only fill the cache
                out.append(logits)
        return out[0] if len(out) == 1 else torch.cat(out)

    def _run(self, chunk: torch.Tensor, start: int, last_only: bool) -> torch.Tensor:
        if self.graph is not None:
            return self.graph.forward(chunk, start, last_only)
        return self.model(chunk, start, self.cache, last_only=last_only)

    def decode(self, token: int, pos: int) -> torch.Tensor:
        """One token at position pos -> logits [V]."""
        if self.graph is None:
            return self.forward([token], pos)[0]
        # The same checks as forward, without building tensors for one token (decode runs per token).
        if not 0 <= token < self.vocab_size:
            raise PocketMoEError(f"token id {token} is outside the vocabulary of {self.vocab_size} tokens.")
        if not 0 <= pos < self.cfg.n_ctx:
            raise ContextLengthError(f"position {pos} does not fit in the context of {self.cfg.n_ctx} tokens; "
                                     "raise n_ctx or shorten the input.")
        return self.graph.decode(int(token), pos)

    def generate_greedy(self, prompt: Sequence[int], max_tokens: int) -> list[int]:
        """Argmax continuation of `prompt` (the cache is overwritten from position 0)."""
        self.cache.check_fits(len(prompt), max_tokens)
        logits = self.forward(prompt, 0, last_only=True)[0]
        out: list[int] = []
        pos = len(prompt)
        while len(out) < max_tokens:
            out.append(int(logits.argmax()))
            if len(out) < max_tokens:
                logits = self.decode(out[-1], pos)
                pos += 1
        return out
