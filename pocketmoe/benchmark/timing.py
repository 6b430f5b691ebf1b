"""One timing loop for every engine: warm-up, then prefill + greedy decode, median over repeats.

prefill tok/s = prompt tokens / wall time of one forward over the prompt from position 0;
decode tok/s = generated tokens / summed wall time of the single-token steps that made them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from pocketmoe.defaults import DEFAULT_CHUNK_SIZE
from pocketmoe.kv_dtypes import DEFAULT_KV_DTYPE
from pocketmoe.memstat import MemoryWatch

PROMPT_SEED = 20240607
WARMUP_DECODES = 4


class Stepper(Protocol):
    """An engine seen as greedy steps; each returns the argmax token of the last position."""

    def prefill(self, ids: Sequence[int]) -> int: ...

    def decode(self, token: int, pos: int) -> int: ...


@dataclass(frozen=True)
class BenchSettings:
    prompt_tokens: int
    gen_tokens: int
    threads: int
    repeats: int
    n_ctx: int
    chunk_size: int = DEFAULT_CHUNK_SIZE  # our prefill tokens per forward (llama.cpp: n_ubatch)
    kv_dtype: str = DEFAULT_KV_DTYPE  # our KV cache's dtype (llama.cpp's stays f16)


@dataclass(frozen=True)
class Run:
    prefill_s: float
    decode_s: float
    tokens: list[int]          # argmax after the prompt, then one per decode step


@dataclass(frozen=True)
class Measured:
    prefill_tok_s: float
    decode_tok_s: float
    runs: list[Run] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.runs[-1].tokens if self.runs else []


def engine_result(backend: str, m: Measured, mem: MemoryWatch, load_s: float) -> dict[str, Any]:
    """The per-engine JSON object; memory is read now, so call it before anything else allocates."""
    mem.sample()
    return {
        "backend": backend,
        "prefill_tok_s": round(m.prefill_tok_s, 3),
        "decode_tok_s": round(m.decode_tok_s, 3),
        "peak_rss_mib": round(mem.peak_rss_mib, 1),
        "peak_anon_mib": round(mem.peak_anon_mib, 1),
        "load_s": round(load_s, 3),
    }


def prompt_ids(n: int, vocab_size: int, allowed: Sequence[int] | None = None, seed: int = PROMPT_SEED) -> list[int]:
    """`n` fixed pseudo-random ids drawn from `allowed` (ordinary tokens), else from the whole vocab."""
    pool = np.asarray(allowed if allowed else range(vocab_size), dtype=np.int64)
    return [int(t) for t in np.random.default_rng(seed).choice(pool, size=n)]


def run_once(stepper: Stepper, ids: Sequence[int], gen: int, sample: Callable[[], None]) -> Run:
    t0 = time.perf_counter()
    tok = stepper.prefill(ids)
    prefill_s = time.perf_counter() - t0
    sample()
    tokens, decode_s, pos = [tok], 0.0, len(ids)
    for _ in range(gen):
        t0 = time.perf_counter()
        tok = stepper.decode(tok, pos)
        decode_s += time.perf_counter() - t0
        sample()
        tokens.append(tok)
        pos += 1
    return Run(prefill_s, decode_s, tokens)


def measure(stepper: Stepper, ids: Sequence[int], gen: int, repeats: int,
            sample: Callable[[], None] = lambda: None) -> Measured:
    """One warm-up (full prompt, a few decodes), then `repeats` timed runs; medians of the rates."""
    run_once(stepper, ids, min(gen, WARMUP_DECODES), sample)
    runs = [run_once(stepper, ids, gen, sample) for _ in range(repeats)]
    prefill = statistics.median(len(ids) / max(r.prefill_s, 1e-9) for r in runs)
    decode = statistics.median(gen / max(r.decode_s, 1e-9) for r in runs)
    return Measured(prefill, decode, runs)


def matching_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two greedy continuations share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
