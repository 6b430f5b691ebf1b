"""PocketMoE's side of the benchmark: load, pick the prompt, time prefill and greedy decode, memory."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pocketmoe.benchmark.timing import Measured, measure, prompt_ids
from pocketmoe.memstat import MemoryWatch


@dataclass(frozen=True)
class BenchSettings:
    prompt_tokens: int
    gen_tokens: int
    threads: int
    repeats: int
    n_ctx: int
    chunk_size: int = 256       # our prefill tokens per forward (llama.cpp: n_ubatch)


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


class _RunnerStepper:
    """With the native graph, keeps its per-op profile of the latest prefill, and of the decodes since."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.graph = runner.graph
        self.prefill_profile: dict[str, Any] | None = None

    def prefill(self, ids: Sequence[int]) -> int:
        if self.graph is not None:
            self.graph.reset_profile()
        tok = int(self.runner.forward(ids, 0, last_only=True)[0].argmax())
        if self.graph is not None:
            self.prefill_profile = self.graph.profile()
            self.graph.reset_profile()
        return tok

    def profiles(self) -> dict[str, Any] | None:
        """{"prefill"|"decode": {"ms_per_token": {op: ms}, "tokens": n}} of the last timed run."""
        if self.graph is None or self.prefill_profile is None:
            return None
        out = {}
        for phase, prof in (("prefill", self.prefill_profile), ("decode", self.graph.profile())):
            n = max(int(prof["tokens"]), 1)
            out[phase] = {"tokens": int(prof["tokens"]),
                          "ms_per_token": {op: round(1e3 * s / n, 4) for op, s in prof["seconds"].items()}}
        return out

    def decode(self, token: int, pos: int) -> int:
        return int(self.runner.decode(token, pos).argmax())


def ordinary_token_ids(tokenizer: Any, vocab_size: int) -> list[int]:
    """Ids of plain text tokens (token type NORMAL), never control, byte or unused ones."""
    from pocketmoe.tokenizer.specials import TokenAttr

    return [i for i, a in enumerate(tokenizer.attrs[:vocab_size]) if a == TokenAttr.NORMAL]


def run_pocketmoe(model: str | Path, s: BenchSettings, backend: str = "auto", native_graph: bool = True
                  ) -> tuple[dict[str, Any], list[int], list[int], Any]:
    """-> (result object, prompt ids, greedy tokens, the LLM, still open so the caller can read its bundle)."""
    from pocketmoe.engine.llm import LLM

    mem = MemoryWatch()
    t0 = time.perf_counter()
    llm = LLM(model, n_ctx=s.n_ctx, threads=s.threads, chunk_size=s.chunk_size, backend=backend,
              native_graph=native_graph)
    load_s = time.perf_counter() - t0
    vocab = llm.runner.vocab_size
    ids = prompt_ids(s.prompt_tokens, vocab, ordinary_token_ids(llm.tokenizer, vocab))
    stepper = _RunnerStepper(llm.runner)
    m = measure(stepper, ids, s.gen_tokens, s.repeats, mem.sample)
    result = engine_result(llm.backend_name, m, mem, load_s)
    result["detail"] = llm.backend_detail  # kernels, threads and which path ran (native graph or per op)
    result["profile"] = stepper.profiles()  # per-op time of the native graph, None on the per-op path
    return result, ids, m.tokens, llm
