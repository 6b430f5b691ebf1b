"""The Python API: `LLM(path).generate(prompts, SamplingParams(...))` and a streaming iterator.

One sequence at a time owns the runner's KV cache (overwritten from position 0 per request), so a
request's tokens never depend on what else was asked: the same prompt and seed give the same tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pocketmoe.engine.kv_cache import ContextLengthError
from pocketmoe.engine.runner import ModelRunner, RunnerConfig
from pocketmoe.engine.sampler import Sampler, SamplingParams, StopChecker
from pocketmoe.errors import PocketMoEError
from pocketmoe.gguf import open_bundle
from pocketmoe.tokenizer import Tokenizer

Prompt = str | Sequence[int]


@dataclass
class StreamChunk:
    """One generated token and the text it completed (may be empty while UTF-8 or a stop is pending)."""

    token_id: int | None
    text: str
    finish_reason: str | None = None   # "stop" | "length" on the last chunk


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    prefill_s: float = 0.0            # prompt forward pass, wall time
    decode_s: float = 0.0             # tokens after the first, wall time
    ttft_s: float = 0.0               # time to first token (prefill + first sample)

    @property
    def prefill_tok_s(self) -> float:
        return len(self.prompt_token_ids) / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


class LLM:
    """A loaded model: tokenizer + runner. `model` may be any shard of a bundle or its directory; without
    one, the built-in demo model (pocketmoe/data/demo-model.gguf)."""

    def __init__(self, model: str | Path | None = None, *, n_ctx: int = 4096, threads: int | None = None,
                 chunk_size: int = 256, backend: str = "auto", kv_dtype: str = "f32", placement: Any = None) -> None:
        """placement: a placement.run.RunPlacement (the --device/--mode/... flags); None: CPU only."""
        if model is None:
            from pocketmoe.demo_model import demo_model_path

            model = demo_model_path()
        self.bundle = open_bundle(model)
        self.tokenizer = Tokenizer.from_metadata(self.bundle.metadata)
        cfg = RunnerConfig(n_ctx=n_ctx, chunk_size=chunk_size, threads=threads, kv_dtype=kv_dtype, backend=backend,
                           placement=placement)
        self.runner = ModelRunner(self.bundle, cfg)
        self.backend_name, self.backend_detail = self.runner.ops.name, self.runner.ops.detail
        self.n_ctx = n_ctx

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
        ids = self.encode_prompt(prompt)
        self._check_prompt(len(ids))
        out = output if output is not None else CompletionOutput(prompt_token_ids=ids)
        out.prompt_token_ids = ids
        sampler, stop = Sampler(params, self.tokenizer), StopChecker(params.stop, params.include_stop_str_in_output)
        decoder = self.tokenizer.stream_decoder(params.skip_special_tokens)
        history = list(ids)

        t0 = time.perf_counter()
        logits = self.runner.forward(ids, 0, last_only=True)[0]
        out.prefill_s = time.perf_counter() - t0
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
            out.decode_s = time.perf_counter() - t_first
            yield StreamChunk(token, text)
            if stopped or sampler.complete:
                finish = "stop"
                break
            if len(out.token_ids) >= params.max_tokens or pos >= self.n_ctx:
                break
            logits = self.runner.decode(token, pos)
            pos += 1
        tail = stop.end(decoder.flush())
        out.text += tail
        out.finish_reason = finish
        yield StreamChunk(None, tail, finish)

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | None = None
                 ) -> list[CompletionOutput]:
        """Complete each prompt (a string, or a list of token ids); one output per prompt, in order."""
        batch = [prompts] if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)) else list(prompts)
        outputs = []
        for prompt in batch:
            out = CompletionOutput(prompt_token_ids=[])
            for _ in self.stream(prompt, params, out):
                pass
            outputs.append(out)
        return outputs

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None) -> CompletionOutput:
        return self.generate([self.encode_chat(messages)], params)[0]

    def close(self) -> None:
        self.bundle.close()
