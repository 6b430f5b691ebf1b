"""PocketMoE's side of the benchmark: load, pick the prompt, time prefill and greedy decode, memory."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from pocketmoe.benchmark.timing import BenchSettings, engine_result, measure, prompt_ids
from pocketmoe.memstat import MemoryWatch
from pocketmoe.ops.profile import OPS, OpProfile


class _RunnerStepper:
    """Times the runner; with an OpProfile, keeps its per-op time of the latest prefill, and of the decodes since."""

    def __init__(self, runner: Any, profile: OpProfile | None) -> None:
        self.runner = runner
        self.profile = profile
        self.prefill_profile: dict[str, Any] | None = None
        self.prefill_tokens = self.decode_tokens = 0
        self.prefill_stats: Any = None
        self.comm = runner.parallel.stats  # all-reduce time of tensor parallelism (none at world size 1)
        self.prefill_comm: tuple[float, int, int, int] = (0.0, 0, 0, 0)  # seconds, calls, bytes, tokens
        self.decode_comm_tokens = 0

    def prefill(self, ids: Sequence[int]) -> int:
        self.comm.reset()
        if self.profile is not None:
            self.profile.reset()
        stats = self.runner.experts.stats if self.runner.experts is not None else None
        if stats is not None:
            stats.reset()
        tok = int(self.runner.forward(ids, 0, last_only=True)[0].argmax())
        if stats is not None:  # the experts' statistics of the latest prefill, then of the decodes since
            stats.settle()
            self.prefill_stats = replace(stats, _lock=threading.Lock(), _counters={})  # settled: a snapshot
            stats.reset()
        if self.profile is not None:
            self.prefill_profile, self.prefill_tokens = self.profile.snapshot(), len(ids)
            self.profile.reset()
            self.decode_tokens = 0
        c = self.comm
        self.prefill_comm = (c.seconds, c.calls, c.bytes, len(ids))
        c.reset()
        self.decode_comm_tokens = 0
        return tok

    def tensor_parallel(self) -> dict[str, Any]:
        """World size and the all-reduce time, calls and bytes per token of the last timed run."""
        tp = self.runner.parallel
        s, calls, nbytes, n = self.prefill_comm
        c, nd = self.comm, max(self.decode_comm_tokens, 1)
        n = max(n, 1)
        return {"world_size": tp.world, "backend": tp.backend,
                "allreduce_ms_per_token": {"prefill": round(1e3 * s / n, 4), "decode": round(1e3 * c.seconds / nd, 4)},
                "allreduce_calls_per_token": {"prefill": round(calls / n, 2), "decode": round(c.calls / nd, 2)},
                "allreduce_bytes_per_token": {"prefill": round(nbytes / n), "decode": round(c.bytes / nd)}}

    def profiles(self) -> dict[str, Any] | None:
        """{"prefill"|"decode": {"ms_per_token": {op: ms}, "tokens": n}} of the last timed run."""
        if self.profile is None or self.prefill_profile is None:
            return None
        phases = (("prefill", self.prefill_profile, self.prefill_tokens),
                  ("decode", self.profile.snapshot(), self.decode_tokens))
        names = [op for op in OPS if any(op in prof["seconds"] for _, prof, _ in phases)]
        return {phase: {"tokens": n, "ms_per_token": {op: round(1e3 * prof["seconds"].get(op, 0.0) / max(n, 1), 4)
                                                      for op in names}}
                for phase, prof, n in phases}

    def decode(self, token: int, pos: int) -> int:
        self.decode_tokens += 1
        self.decode_comm_tokens += 1
        return int(self.runner.decode(token, pos).argmax())


def device_sync() -> Callable[[], None] | None:
    """torch.cuda.synchronize once the run has put work on a GPU (its kernels return before they run), else None."""
    import torch

    return torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else None


def ordinary_token_ids(tokenizer: Any, vocab_size: int) -> list[int]:
    """Ids of plain text tokens (token type NORMAL), never control, byte or unused ones."""
    from pocketmoe.tokenizer.specials import TokenAttr

    return [i for i, a in enumerate(tokenizer.attrs[:vocab_size]) if a == TokenAttr.NORMAL]


def run_pocketmoe(model: str | Path, s: BenchSettings, backend: str = "auto", profile: bool = False,
                  placement: Any = None) -> tuple[dict[str, Any], list[int], list[int], Any]:
    """-> (result object, prompt ids, greedy tokens, the LLM, still open so the caller can read its bundle)."""
    from pocketmoe.engine.llm import LLM
    from pocketmoe.experts.report import expert_report

    mem = MemoryWatch()
    t0 = time.perf_counter()
    llm = LLM(model, n_ctx=s.n_ctx, threads=s.threads, chunk_size=s.chunk_size, backend=backend,
              kv_dtype=s.kv_dtype, placement=placement, max_num_seqs=1)
    load_s = time.perf_counter() - t0
    vocab = llm.runner.vocab_size
    ids = prompt_ids(s.prompt_tokens, vocab, ordinary_token_ids(llm.tokenizer, vocab))
    stepper = _RunnerStepper(llm.runner, OpProfile(llm.runner.ops, sync=device_sync()) if profile else None)
    m = measure(stepper, ids, s.gen_tokens, s.repeats, mem.sample)
    result = engine_result(llm.backend_name, m, mem, load_s)
    result["detail"] = llm.backend_detail  # which ops ran: kernels, instruction set, threads
    result["profile"] = stepper.profiles()  # per-op time with --profile, else None
    result["tensor_parallel"] = stepper.tensor_parallel()  # all-reduce time per token (torchrun)
    # placement, cache statistics of the last timed run's decode (and prefill), predicted beside measured
    experts = expert_report(llm.runner)
    if stepper.prefill_stats is not None:
        experts["prefill_stats"] = stepper.prefill_stats.to_json()
    experts["measured_decode_tok_s"] = result["decode_tok_s"]
    result["experts"] = experts
    result["peak_device_memory_gib"] = peak_device_memory_gib()
    return result, ids, m.tokens, llm


def peak_device_memory_gib() -> float | None:
    """The most device memory torch's allocator held in this process (GiB; the CUDA context not included), or
    None when CUDA was never used."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return round(max(torch.cuda.max_memory_reserved(i) for i in range(torch.cuda.device_count())) / 2**30, 3)

