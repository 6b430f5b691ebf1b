"""The Python API: `LLM(path).generate(prompts, SamplingParams(...))` and a streaming iterator.

One prompt (and `stream`) runs as the single sequence that owns the runner's KV cache from position 0;
where the ops are chunk-invariant it continues from the rows its previous run left that hold the start
of the new prompt (llama.cpp's reuse of the previous prompt: a chat's next turn prefills the new turn only).
Several prompts run as one continuous batch, the server's engine in the caller's thread: up to
`max_num_seqs` sequences a step over a shared KV pool, later prompts admitted as earlier ones finish,
and (where the ops are chunk-invariant) a prompt start that an earlier one computed is not computed
again. Each prompt gets the tokens it gets alone: the same prompt and seed give the same tokens,
whatever else is in the batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from pocketmoe.defaults import DEFAULT_CHUNK_SIZE, DEFAULT_PREFIX_CACHE_DISK_GIB
from pocketmoe.engine.kv_cache import PAGE, ContextLengthError
from pocketmoe.engine.pooling import check_normalize, check_pooling, embd_normalize, model_pooling
from pocketmoe.engine.runner import SOLO, ModelRunner, RunnerConfig, default_kv_pool_bytes, load_spec
from pocketmoe.engine.sampler import (
    Logprob,
    LogprobEntry,
    Sampler,
    SamplingParams,
    StopChecker,
    TokenLogprob,
    logprob_entry,
    token_logprob,
)
from pocketmoe.errors import PocketMoEError
from pocketmoe.gguf import open_bundle
from pocketmoe.kv_dtypes import KV_DTYPE_BYTES
from pocketmoe.specs.base import ModelSpec
from pocketmoe.tokenizer import Tokenizer

Prompt = str | Sequence[int]
__all__ = ["LLM", "CompletionOutput", "EmbeddingOutput", "Logprob", "LogprobEntry", "SamplingParams", "StreamChunk"]


@dataclass
class StreamChunk:
    """One generated token and the text it completed (may be empty while UTF-8 or a stop is pending)."""

    token_id: int | None
    text: str
    finish_reason: str | None = None   # "stop" | "length" on the last chunk
    logprobs: LogprobEntry | None = None  # with SamplingParams.logprobs


@dataclass
class EmbeddingOutput:
    prompt_token_ids: list[int]
    embedding: torch.Tensor  # [D] float32 ([T, D] with pooling "none"), normalized as asked


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    prefill_s: float = 0.0            # prompt forward pass, wall time (in a batch: the time to first token)
    decode_s: float = 0.0             # tokens after the first, wall time
    ttft_s: float = 0.0               # time to first token (prefill + first sample; in a batch, from its start)
    cached_tokens: int = 0            # prompt tokens whose KV rows an earlier run left (not computed again)
    logprobs: list[LogprobEntry] | None = None  # one per generated token, with SamplingParams.logprobs
    # with SamplingParams.prompt_logprobs: one per prompt token, the first None (nothing comes before it)
    prompt_logprobs: list[LogprobEntry | None] | None = None
    index: int = 0                    # which of the prompt's SamplingParams.n completions this is
    # with SamplingParams.n > 1, on the first completion: all n of them (`outputs`)
    choices: list[CompletionOutput] | None = field(default=None, repr=False)

    @property
    def outputs(self) -> list[CompletionOutput]:
        """The prompt's completions, n of them with SamplingParams.n (vLLM's RequestOutput.outputs); else [self]."""
        return self.choices or [self]

    @property
    def prefill_tok_s(self) -> float:
        """Prompt tokens computed per second (those the cache gave are not counted)."""
        n = len(self.prompt_token_ids) - self.cached_tokens
        return n / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


class LLM:
    """A loaded model: tokenizer + runner. `model` may be any shard of a bundle or its directory; without
    one, the built-in demo model (pocketmoe/data/demo-model.gguf)."""

    def __init__(self, model: str | Path | None = None, *, n_ctx: int = 4096, threads: int | None = None,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, backend: str = "auto", kv_dtype: str = "f32", placement: Any = None,
                 max_num_seqs: int | None = None, kv_cache_bytes: int | None = None,
                 enable_prefix_caching: bool | None = None, prefix_cache_dir: str | Path | None = None,
                 prefix_cache_disk_bytes: int = DEFAULT_PREFIX_CACHE_DISK_GIB << 30) -> None:
        """placement: a placement.run.RunPlacement (the --device/--mode/... flags); None: CPU only.
        max_num_seqs: sequences a batch of prompts decodes at once (1: one prompt after another; default 8 on
        the CPU, 1 with a placement, whose plan reserves device memory for every sequence's KV cache).
        kv_cache_bytes: the KV pool (default: one sequence's until the first batch, then the server's rule for
        max_num_seqs sequences of n_ctx; with a placement, that up front).
        enable_prefix_caching: prompt starts computed before are not computed again, in a batch and by the single
        sequence (None: where the ops are chunk-invariant, so that the tokens are the same either way).
        prefix_cache_dir: computed pages are also kept in files there (engine/prefix_store.py, within
        prefix_cache_disk_bytes), so a later run, in this process or another, reads a prompt's start back."""
        if max_num_seqs is None:
            max_num_seqs = 8 if placement is None else 1
        if max_num_seqs <= 0:
            raise PocketMoEError(f"max_num_seqs must be > 0, got {max_num_seqs}.")
        if model is None:
            from pocketmoe.demo_model import demo_model_path

            model = demo_model_path()
        self.bundle = open_bundle(model)
        self.tokenizer = Tokenizer.from_metadata(self.bundle.metadata)
        # On the CPU a batch's KV pool is allocated when the first batch runs (one prompt at a time needs one
        # sequence's); a device plan reserves it up front, as it reserves everything it places.
        self._pool_later = placement is None and kv_cache_bytes is None and max_num_seqs > 1
        cfg = RunnerConfig(n_ctx=n_ctx, chunk_size=chunk_size, threads=threads, kv_dtype=kv_dtype, backend=backend,
                           placement=placement, max_seqs=1 if self._pool_later else max_num_seqs,
                           kv_cache_bytes=kv_cache_bytes,
                           prefix_cache_dir=None if prefix_cache_dir is None else str(prefix_cache_dir),
                           prefix_cache_disk_bytes=prefix_cache_disk_bytes)
        if kv_cache_bytes is None and max_num_seqs > 1 and not self._pool_later:
            cfg = replace(cfg, kv_cache_bytes=self._batch_pool_bytes(load_spec(self.bundle), n_ctx, max_num_seqs,
                                                                     kv_dtype))
        self.runner = ModelRunner(self.bundle, cfg)
        self.backend_name, self.backend_detail = self.runner.ops.name, self.runner.ops.detail
        self.n_ctx = n_ctx
        self.max_num_seqs, self.enable_prefix_caching = max_num_seqs, enable_prefix_caching
        # the single sequence continues from the rows its last run left where they hold the prompt's start
        self._reuse_prefix = self.runner.reuses_rows(enable_prefix_caching)
        self._engine: Any = None  # serve.engine.Engine, built at the first batch

    # -- prompts -------------------------------------------------------------------------------
    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Text gets the file's BOS policy; a list of ids is taken as it is (no BOS added)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.runner.vocab_size]
        if bad:
            raise PocketMoEError(f"token id {bad[0]} is outside the vocabulary of {self.runner.vocab_size} tokens.")
        return ids

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        return self.tokenizer.encode_chat(messages, add_generation_prompt)

    # -- generation ----------------------------------------------------------------------------
    def prompt_logits(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        """float32 [T, V] logits at every prompt position (fills the cache from position 0)."""
        self._check_prompt(len(prompt_ids))
        return self.runner.forward(prompt_ids, 0)

    def _check_prompt(self, n: int) -> None:
        if n == 0:
            raise PocketMoEError("the prompt is empty; give at least one token.")
        if n >= self.n_ctx:
            raise ContextLengthError(f"the prompt has {n} tokens but the context holds {self.n_ctx}; "
                                     "raise --n-ctx or shorten the prompt.")

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               output: CompletionOutput | None = None) -> Iterator[StreamChunk]:
        """Yield chunks as tokens are generated; `output` (if given) is filled with ids, text, timings."""
        params = params or SamplingParams()
        if params.n != 1:
            raise PocketMoEError(f"stream gives one completion but SamplingParams.n is {params.n}; use generate for "
                                 "several, or n=1.")
        ids = self.encode_prompt(prompt)
        self._check_prompt(len(ids))
        out = output if output is not None else CompletionOutput(prompt_token_ids=ids)
        out.prompt_token_ids = ids
        sampler = Sampler(params, self.tokenizer)
        stop = StopChecker(params.stop, params.include_stop_str_in_output, params.n_indent)
        decoder = self.tokenizer.stream_decoder(params.skip_special_tokens)
        history = list(ids)
        out.logprobs = [] if params.logprobs is not None else None

        t0 = time.perf_counter()
        if params.prompt_logprobs is None:
            start = self.runner.solo_restore(ids) if self._reuse_prefix else 0
            logits = self.runner.forward(ids[start:], start, last_only=True)[0]
            self.runner.solo_persist()
        else:
            start, logits, out.prompt_logprobs = 0, *self._prompt_logprobs(ids, params.prompt_logprobs)
        out.prefill_s, out.cached_tokens = time.perf_counter() - t0, start
        pos, t_first = len(ids), 0.0
        finish = "length"
        while True:
            token = sampler(logits, history)
            if not out.token_ids:
                t_first = time.perf_counter()
                out.ttft_s = t_first - t0
            if token in sampler.end_ids:
                finish = "stop"
                break
            out.token_ids.append(token)
            history.append(token)
            text, stopped = stop.push(decoder.push(token))
            out.text += text
            entry = self._logprob_entry(sampler.logprob(logits, token))
            if out.logprobs is not None:
                out.logprobs.append(entry)
            out.decode_s = time.perf_counter() - t_first
            yield StreamChunk(token, text, logprobs=entry)
            if stopped or sampler.complete:
                finish = "stop"
                break
            if len(out.token_ids) >= params.max_tokens or pos >= self.n_ctx or \
                    params.out_of_time(text, time.perf_counter() - t_first):
                break
            logits = self.runner.decode(token, pos)
            pos += 1
        self.runner.solo_persist()  # the reply's pages too: a conversation's next turn continues from them
        tail = stop.end(decoder.flush())
        out.text += tail
        out.finish_reason = "length" if stop.limited else finish  # a line under n_indent is a limit
        yield StreamChunk(None, tail, finish)

    def _prompt_logprobs(self, ids: list[int], k: int) -> tuple[torch.Tensor, list[LogprobEntry | None]]:
        """Prefill the whole prompt a chunk at a time, keeping every row's logits only as long as its chunk: (the last
        row's logits, one entry per prompt token: token p's logprob given the ones before it, the first None)."""
        entries: list[LogprobEntry | None] = [None]
        n = self.runner.cfg.chunk_size
        for i in range(0, len(ids), n):
            rows = self.runner.forward(ids[i:i + n], i)
            entries += [self._logprob_entry(token_logprob(rows[p - 1 - i], ids[p], k))
                        for p in range(i + 1, min(i + n + 1, len(ids)))]
        return rows[-1], entries

    def _logprob_entry(self, x: TokenLogprob | None) -> LogprobEntry | None:
        return None if x is None else logprob_entry(x, self.tokenizer)

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True) -> list[CompletionOutput]:
        """Complete each prompt (a string, or a list of token ids); one output per prompt, in order, its
        SamplingParams.n completions in its `outputs`. `params` is one SamplingParams for all, or one per prompt.
        Several prompts, or several completions, run as one batch (module doc); `use_tqdm` shows its progress on a
        terminal."""
        batch = [prompts] if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)) else list(prompts)
        per = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(batch)
        if len(per) != len(batch):
            raise PocketMoEError(f"got {len(per)} SamplingParams for {len(batch)} prompts; give one, or one per "
                                 "prompt.")
        if len(batch) == 1 and per[0].n == 1:
            out = CompletionOutput(prompt_token_ids=[])
            for _ in self.stream(batch[0], per[0], out):
                pass
            return [out]
        return self._generate_batch(batch, per, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             params: SamplingParams | Sequence[SamplingParams] | None = None, *, use_tqdm: bool = True
             ) -> CompletionOutput | list[CompletionOutput]:
        """Answer one conversation (a list of messages), or each of a list of conversations as one batch."""
        if messages and isinstance(messages[0], dict):
            return self.generate([self.encode_chat(messages)], params)[0]  # type: ignore[arg-type]
        conversations = [self.encode_chat(m) for m in messages]  # type: ignore[arg-type]
        return self.generate(conversations, params, use_tqdm=use_tqdm)

    def embed(self, prompts: Prompt | list[Prompt], *, pooling: str | None = None, normalize: int = 2,
              use_tqdm: bool = True) -> list[EmbeddingOutput]:
        """Each prompt's embedding: its final hidden states pooled (engine/pooling.py: "last", "mean", "cls" or "none";
        default the GGUF's pooling_type, else "last"), normalized as llama.cpp's embd_normalize (2: unit length, -1:
        as pooled). The prompts run as one batch, as generate's do (the single sequence's cached rows go)."""
        from tqdm import tqdm

        pooling = check_pooling(pooling or model_pooling(self.bundle.architecture, self.bundle.metadata))
        check_normalize(normalize)  # a bad value fails before any work
        batch = [prompts] if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)) else list(prompts)
        ids = []
        for i, prompt in enumerate(batch):
            ids.append(self.encode_prompt(prompt))
            if not ids[-1] or len(ids[-1]) > self.n_ctx:
                raise ContextLengthError(f"prompt {i} has {len(ids[-1])} tokens; an embedding takes 1 to {self.n_ctx} "
                                         "(the context); raise n_ctx or shorten the prompt.")
        engine = self._batch_engine()
        self.runner.free(SOLO)
        outs: list[EmbeddingOutput | None] = [None] * len(ids)
        errors: dict[int, str] = {}
        bar = tqdm(total=len(ids), desc="embed", unit="prompt", disable=None if use_tqdm else True, leave=False)

        def put(d: Any) -> None:
            if d is None:
                return
            bar.update()
            if d.error:
                errors[d.index] = d.error
            elif d.embedding is not None:
                outs[d.index] = EmbeddingOutput(ids[d.index], embd_normalize(d.embedding, normalize))

        _run_batch(engine, lambda: engine.submit_embed(ids, pooling, sink=put), bar, errors)
        return [o for o in outs if o is not None]

    # -- batches ---------------------------------------------------------------------------------
    def _generate_batch(self, prompts: list[Prompt], params: list[SamplingParams], use_tqdm: bool
                        ) -> list[CompletionOutput]:
        from tqdm import tqdm

        ids, samplers = [], []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):  # all checked before any work
            try:
                ids.append(self.encode_prompt(prompt))
                self._check_prompt(len(ids[-1]))
                samplers.append([Sampler(c, self.tokenizer) for c in p.choices()])  # compiles its grammar
            except PocketMoEError as e:
                raise type(e)(f"prompt {i}: {e}") from None
        engine = self._batch_engine()
        self.runner.free(SOLO)  # the single sequence's rows: their pages go to the batch
        # outs[i][c]: prompt i's completion c
        outs = [[CompletionOutput(prompt_token_ids=list(p), logprobs=None if q.logprobs is None else [],
                                  prompt_logprobs=None if q.prompt_logprobs is None else [], index=c)
                 for c in range(q.n)] for p, q in zip(ids, params, strict=True)]
        errors: dict[int, str] = {}
        bar = tqdm(total=len(ids), desc="generate", unit="prompt", disable=None if use_tqdm else True, leave=False)
        t0 = time.perf_counter()
        first: dict[tuple[int, int], float] = {}

        def sink(i: int) -> Any:
            def put(d: Any) -> None:
                if d is None:
                    bar.update()
                    return
                out, key, now = outs[i][d.index], (i, d.index), time.perf_counter()
                if key not in first and (d.token_ids or d.finish_reason is not None):
                    first[key] = now
                    out.ttft_s = out.prefill_s = now - t0
                out.token_ids += d.token_ids
                out.text += d.text
                if out.logprobs is not None:
                    out.logprobs += [self._logprob_entry(x) for x in d.logprobs]
                if out.prompt_logprobs is not None:
                    out.prompt_logprobs += [self._logprob_entry(x) for x in d.prompt_logprobs or ()]
                if key in first:
                    out.decode_s = now - first[key]
                if d.finish_reason is not None:
                    out.finish_reason, out.cached_tokens = d.finish_reason, d.cached_tokens or 0
                    if d.error:
                        errors[i] = d.error
            return put

        def submit() -> None:
            for i, (p, choices) in enumerate(zip(ids, samplers, strict=True)):
                engine.submit(p, [c.params for c in choices], sink=sink(i), samplers=choices)

        _run_batch(engine, submit, bar, errors)
        for group in outs:
            if len(group) > 1:
                group[0].choices = group
        return [group[0] for group in outs]

    def _batch_pool_bytes(self, spec: ModelSpec, n_ctx: int, max_num_seqs: int, kv_dtype: str) -> int:
        """The server's rule for max_num_seqs sequences of n_ctx, and at least one sequence."""
        row = spec.config.n_layer * spec.kv_values_per_token() * KV_DTYPE_BYTES[kv_dtype]
        return max(default_kv_pool_bytes(self.bundle, spec, n_ctx, max_num_seqs, kv_dtype),
                   -(-n_ctx // PAGE) * PAGE * row)

    def _batch_engine(self) -> Any:
        """The continuous-batching engine over this runner, kept between batches (its prefix cache too); the
        first batch on the CPU sizes the KV pool for max_num_seqs sequences."""
        if self._engine is None:
            if self._pool_later:
                self.runner.resize_kv(self._batch_pool_bytes(self.runner.spec, self.n_ctx, self.max_num_seqs,
                                                             self.runner.cfg.kv_dtype))
                self._pool_later = False
            from pocketmoe.serve.engine import Engine, EngineConfig
            from pocketmoe.serve.metrics import Metrics

            # max_model_len: the last sampled token takes no KV position, as on the single-sequence path
            cfg = EngineConfig(max_num_seqs=self.max_num_seqs, max_queue=2**62, chunk_size=self.runner.cfg.chunk_size,
                               max_model_len=self.n_ctx + 1, prefix_caching=self.enable_prefix_caching)
            self._engine = Engine(self.runner, self.tokenizer, cfg, Metrics())
        return self._engine

    def close(self) -> None:
        self.bundle.close()


def _run_batch(engine: Any, submit: Callable[[], object], bar: Any, errors: dict[int, str]) -> None:
    """submit() the batch's requests and run the engine until they are done (the progress bar closed either way);
    the first failed prompt's error (errors: prompt index -> message, filled as they end) as a PocketMoEError."""
    try:
        submit()
        engine.run_until_done()
    finally:
        bar.close()
    if errors:
        i = min(errors)
        raise PocketMoEError(f"prompt {i} failed: {errors[i]}")
