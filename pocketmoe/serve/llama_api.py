"""llama.cpp's own completion endpoint, POST /completion (and /completions), over the same engine as /v1.

llama-server's web UI, editor plugins (llama.vim) and many scripts speak this dialect rather than OpenAI's:
its request fields and defaults (`n_predict` -1 = up to the context, temperature 0.8, top_k 40, top_p 0.95,
min_p 0.05, `repeat_last_n` 64, seed -1 = random, `logit_bias` as [[id, bias or false], ...], `n_probs`),
a flat response (`content`, `stop_type` eos / limit / word, `stopping_word`, `tokens_predicted`,
`tokens_evaluated`, `tokens_cached`, `timings`, `generation_settings`) and a stream of
`data: {"content": ..., "stop": false}` events closed by the full result with `"stop": true` and no
`[DONE]`. A prompt is a string, token ids, or the two mixed (one prompt), or a list of those (several, answered
as a list). llama.cpp's other samplers run in its order (DRY, top-n-sigma, typical, XTC, dynamic temperature:
engine/llama_samplers.py), and mirostat 1 or 2 as llama.cpp runs it (the temperature, then mirostat: `samplers` and
the other filters then unused).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field, StrictStr

from pocketmoe.engine.sampler import (
    LLAMA_CHAIN,
    MAX_INFILL_CANDIDATES,
    MIROSTAT_CHAIN,
    SamplingParams,
    sampler_chain,
)
from pocketmoe.engine.structured import Grammar
from pocketmoe.serve.protocol import (
    EXTRA_DEFAULTS,
    MAX_TOP_LOGPROBS,
    NonNegInt,
    RequestError,
    SamplingFields,
    _Body,
)
from pocketmoe.tokenizer import Tokenizer

if TYPE_CHECKING:
    from pocketmoe.serve.engine import Seq

DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0}
RANDOM_SEED = -1  # llama.cpp's LLAMA_DEFAULT_SEED (0xFFFFFFFF as an int32)
# /infill's window for the text around the cursor: llama-server's n_batch (2048), or half the context where that
# is less; the prefix's last 3/4 of it, the suffix's first 1/4 less the typed prompt; the extra context fills the
# rest of the context but 2 x n_predict
FIM_WINDOW = 2048
MAX_EXTRA_CHUNKS = 1024
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"  # between extra chunks, for a model without a file-separator token

Piece = StrictStr | NonNegInt


class LlamaCompletionRequest(SamplingFields):
    """POST /completion: llama.cpp's fields; those it shares with /v1 are validated as there."""

    prompt: StrictStr | Annotated[list[Piece | list[Piece]], Field(min_length=1)]
    n_predict: Annotated[int, Field(ge=-1)] | None = None
    n_probs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] = 0
    # n_probs from the distribution each token is drawn from, as probabilities, instead of the model's logprobs
    post_sampling_probs: bool = False
    repeat_last_n: Annotated[int, Field(ge=-1)] = 64
    return_tokens: bool = False
    cache_prompt: bool = True  # the engine reuses cached prompt starts where the tokens stay the same
    logit_bias: list[Annotated[list[Any], Field(min_length=2, max_length=2)]] | dict[StrictStr, Any] | None = None
    n_indent: NonNegInt = 0  # code completion: end where a later line is indented less
    # the final result holds only these fields, each a path ("timings/prompt_n") kept as its own key
    response_fields: Annotated[list[StrictStr], Field(max_length=256)] | None = None
    skip_special_tokens: bool = True  # llama-server writes no control token's text unless started with --special
    t_max_predict_ms: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0  # end at a newline after this long
    # the sampler chain's order: names (llama.vim sends ["top_k", "top_p", "infill"]) or one-letter codes ("kpmt");
    # default llama.cpp's (penalties, top_k, top_p, min_p, temperature: the filters before the temperature)
    samplers: Annotated[list[StrictStr] | StrictStr, Field(max_length=32)] | None = None
    id_slot: Annotated[int, Field(ge=-1)] = -1  # run in this slot (waiting while it is taken); -1: any free one

    def check(self) -> None:
        self.check_common()
        if self.n != 1:
            raise RequestError("/completion gives one completion per prompt; send the prompt n times, or use "
                               "/v1/completions with n.", "n")
        if self.stream_options is not None:
            raise RequestError("stream_options belongs to /v1/completions; /completion streams its own events.",
                               "stream_options")
        if self.prompt_logprobs is not None:
            raise RequestError("prompt_logprobs belongs to /v1/completions and /v1/chat/completions; /completion "
                               "reports the generated tokens' probabilities (n_probs).", "prompt_logprobs")
        self.chain()

    def chain(self) -> tuple[str, ...]:
        """The sampler chain `samplers` gives (llama.cpp's default without it), in the engine's step names."""
        if self.samplers is None:
            return LLAMA_CHAIN
        try:
            chain = sampler_chain(self.samplers)
        except ValueError as e:
            raise RequestError(f"samplers {e}", "samplers") from None
        if "infill" in chain:
            top_k = DEFAULTS["top_k"] if self.top_k is None else self.top_k
            if "top_k" not in chain[:chain.index("infill")] or not 0 < top_k <= MAX_INFILL_CANDIDATES:
                raise RequestError(f"the infill sampler compares every pair of candidates, so it needs a top_k in "
                                   f"1..{MAX_INFILL_CANDIDATES} ahead of it in samplers (as llama.vim sends "
                                   "[\"top_k\", \"top_p\", \"infill\"]).", "samplers")
        return chain

    def several(self) -> bool:
        """Whether the prompt is a list of prompts (answered with a list): a list with no token id at its top
        level; one string, or a list holding a token id there, is one prompt."""
        return isinstance(self.prompt, list) and not any(isinstance(x, int) for x in self.prompt)

    def prompts(self) -> list[list[str | int]]:
        """Each prompt as its pieces (strings and token ids, in order); see several."""
        p = self.prompt
        if isinstance(p, str):
            return [[p]]
        if not self.several():
            if any(isinstance(x, list) for x in p):
                raise RequestError("prompt mixes token ids with lists; give one prompt (strings and token ids) or "
                                   "a list of prompts.", "prompt")
            return [list(p)]  # type: ignore[arg-type]
        return [[x] if isinstance(x, str) else list(x) for x in p]  # type: ignore[list-item]

    def max_new_tokens(self, n_prompt: int, max_model_len: int) -> int:
        """n_predict (or max_tokens), -1 meaning as many as the context leaves; never past the context."""
        n = self.n_predict if self.n_predict is not None else (self.max_tokens or -1)
        room = max_model_len - n_prompt
        return room if n < 0 else min(n, room)

    def bias(self, vocab: int) -> tuple[tuple[int, float], ...]:
        """logit_bias as (id, bias) pairs; false bans the token (a bias of -inf)."""
        pairs = list(self.logit_bias.items()) if isinstance(self.logit_bias, dict) else \
            [tuple(x) for x in self.logit_bias or []]
        out = []
        for k, v in pairs:
            tid = int(k) if isinstance(k, int) or (isinstance(k, str) and k.isdigit()) else None
            if tid is None or isinstance(k, bool) or not 0 <= tid < vocab:
                raise RequestError(f"logit_bias names {k!r}, which is not a token id of this model (0..{vocab - 1}); "
                                   "give [[token id, bias], ...].", "logit_bias")
            if v is False:
                out.append((tid, float("-inf")))
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and -100 <= v <= 100:
                out.append((tid, float(v)))
            else:
                raise RequestError(f"logit_bias for token {tid} is {v!r}; give a number in [-100, 100] or false.",
                                   "logit_bias")
        return tuple(out)

    def sampling(self, grammar: Grammar | None, max_tokens: int, vocab: int) -> SamplingParams:
        """The engine's parameters for llama.cpp's fields and defaults."""
        pick = {name: getattr(self, name) if getattr(self, name) is not None else default
                for name, default in DEFAULTS.items()}
        rep = self.repetition_penalty if self.repetition_penalty is not None else pick["repeat_penalty"]
        presence, frequency = self.presence_penalty or 0.0, self.frequency_penalty or 0.0
        if self.repeat_last_n == 0:  # llama.cpp: the penalties look at no tokens
            rep, presence, frequency = 1.0, 0.0, 0.0
        seed = None if self.seed is None or self.seed == RANDOM_SEED else self.seed % 2**64
        return SamplingParams(
            temperature=pick["temperature"], top_k=max(pick["top_k"], 0), top_p=pick["top_p"], min_p=pick["min_p"],
            repetition_penalty=rep, presence_penalty=presence, frequency_penalty=frequency,
            penalty_last_n=max(self.repeat_last_n, 0), seed=seed, max_tokens=max_tokens, stop=self.stop_list(),
            ignore_eos=self.ignore_eos, logit_bias=self.bias(vocab), grammar=grammar,
            stop_token_ids=tuple(self.stop_token_ids or ()), min_tokens=min(self.min_tokens, max_tokens),
            skip_special_tokens=self.skip_special_tokens, logprobs=self.n_probs or None,
            logprobs_mode="processed_logprobs" if self.post_sampling_probs else "raw_logprobs",
            n_indent=self.n_indent, max_predict_ms=float(self.t_max_predict_ms),
            chain=MIROSTAT_CHAIN if self.mirostat else self.chain(), **self.extras())

    def settings(self, params: SamplingParams, n_ctx: int, model: str) -> dict[str, Any]:
        """generation_settings: what the request ran with."""
        return {"n_ctx": n_ctx, "model": model, **sampling_settings(params), **content_settings(params),
                "repeat_last_n": self.repeat_last_n, "stream": self.stream, "grammar": self.grammar or "",
                "cache_prompt": self.cache_prompt}


class SlotFileRequest(_Body):
    """POST /slots/{id}?action=save|restore: the file, a plain name in --slot-save-path."""

    filename: StrictStr

    def check(self) -> None:
        name = self.filename
        if not 0 < len(name.encode()) <= 255 or name.startswith((".", " ")) or name.endswith(" ") or \
                any(c in name for c in "/\\:") or not name.isprintable():
            raise RequestError(f"filename {name[:80]!r} is not a plain file name (1 to 255 bytes, printable, no path "
                               "separator or colon, not starting with a dot or space); give one such as "
                               "\"chat.bin\".", "filename")


def sampling_settings(params: SamplingParams) -> dict[str, Any]:
    """llama-server's settings of params that carry nothing of a request's text (what /slots shows: its
    only_metrics set)."""
    return {"n_predict": params.max_tokens, "max_tokens": params.max_tokens, "temperature": params.temperature,
            "top_k": params.top_k, "top_p": params.top_p, "min_p": params.min_p,
            "repeat_penalty": params.repetition_penalty, "repeat_last_n": params.penalty_last_n or -1,
            "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
            "seed": RANDOM_SEED if params.seed is None else params.seed, "ignore_eos": params.ignore_eos,
            "n_probs": params.logprobs or 0, "post_sampling_probs": params.logprobs_mode == "processed_logprobs",
            "n_indent": params.n_indent, "t_max_predict_ms": params.max_predict_ms,
            "samplers": list(params.chain or ()), **{name: getattr(params, name) for name in EXTRA_DEFAULTS},
            "mirostat": params.mirostat, "mirostat_tau": params.mirostat_tau, "mirostat_eta": params.mirostat_eta,
            "min_keep": params.min_keep}


def content_settings(params: SamplingParams) -> dict[str, Any]:
    """llama-server's settings of params that carry a request's text: stop strings, biases, grammar, DRY's
    breakers."""
    return {"stop": list(params.stop),
            "logit_bias": [[t, b if b != float("-inf") else False] for t, b in params.logit_bias],
            "grammar": params.grammar.source if params.grammar is not None else "",
            "dry_sequence_breakers": list(params.dry_sequence_breakers)}


def slot_view(slot: int, seq: Seq | None, busy: bool, n_ctx: int, decode: Callable[[list[int]], str],
              debug: bool = False) -> dict[str, Any]:
    """One entry of llama-server's /slots: the slot, and the sequence it runs (busy) or ran last. Its prompt and
    text, and the settings that carry text, only with `debug` (llama-server's LLAMA_SERVER_SLOTS_DEBUG)."""
    out: dict[str, Any] = {"id": slot, "n_ctx": n_ctx, "speculative": False, "is_processing": busy}
    if seq is None:
        return out
    tokens = list(seq.tokens)  # the engine thread appends to it
    text = decode(tokens[seq.prompt_len:])
    out.update({
        "id_task": seq.request.id, "n_prompt_tokens": seq.prompt_len,
        "n_prompt_tokens_processed": max(min(seq.computed, seq.prompt_len) - seq.cached, 0),
        "n_prompt_tokens_cache": seq.cached,
        "params": {**sampling_settings(seq.params), **(content_settings(seq.params) if debug else {})},
        "next_token": [{"has_next_token": busy, "has_new_line": "\n" in text,
                        "n_remain": seq.params.max_tokens - seq.generated, "n_decoded": seq.generated}]})
    if debug:
        out.update(prompt=decode(tokens[:seq.prompt_len]), generated=text)
    return out


def pick_fields(paths: list[str], result: dict[str, Any]) -> dict[str, Any]:
    """response_fields: the values at these paths of a final result ("a/b": result["a"]["b"]), keyed by path; a
    path the result does not have is left out, as llama-server leaves it."""
    out = {}
    for path in paths:
        value: Any = result
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


def stop_fields(finish_reason: str | None, stop_reason: str | int | None) -> dict[str, Any]:
    """stop_type (eos / limit / word) and stopping_word of a finished completion."""
    if finish_reason == "length":
        return {"stop_type": "limit", "stopping_word": ""}
    if isinstance(stop_reason, str):
        return {"stop_type": "word", "stopping_word": stop_reason}
    return {"stop_type": "eos", "stopping_word": ""}


def timings(n_prompt: int, n_cached: int, n_predicted: int, t0: float, t_first: float | None, t_end: float
            ) -> dict[str, float | int]:
    """llama.cpp's timings: the prompt from arrival to the first token, the rest as generation (ms)."""
    first = t_first if t_first is not None else t_end
    prompt_ms, predicted_ms = (first - t0) * 1e3, (t_end - first) * 1e3
    computed = max(n_prompt - n_cached, 0)
    return {"cache_n": n_cached, "prompt_n": computed, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / computed if computed else 0.0,
            "prompt_per_second": computed / prompt_ms * 1e3 if prompt_ms > 0 else 0.0,
            "predicted_n": n_predicted, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / n_predicted if n_predicted else 0.0,
            "predicted_per_second": n_predicted / predicted_ms * 1e3 if predicted_ms > 0 else 0.0}


def probabilities(piece: Any, lps: list[Any], post_sampling: bool = False) -> list[dict[str, Any]]:
    """completion_probabilities: per generated token its id, text, bytes, logprob and the n_probs most likely
    (post_sampling: prob and top_probs, probabilities of the distribution it was drawn from)."""
    value, top = ("prob", "top_probs") if post_sampling else ("logprob", "top_logprobs")

    def one(tid: int, lp: float) -> dict[str, Any]:
        text, b = piece(tid)
        return {"id": tid, "token": text, "bytes": b, value: math.exp(lp) if post_sampling else lp}

    return [{**one(x.token_id, x.logprob), top: [one(t, lp) for t, lp in x.top]} for x in lps]


class ExtraChunk(_Body):
    """One piece of /infill's input_extra: a file's name and (part of) its text."""

    filename: StrictStr = "tmp"
    text: StrictStr = ""


class InfillRequest(LlamaCompletionRequest):
    """POST /infill (llama.vim, llama.vscode): fill in the middle. input_prefix and input_suffix are the file's text
    before and after the cursor (a string, or strings and token ids), prompt the text typed at the cursor, and
    input_extra other files' chunks for context; the rest is /completion's."""

    prompt: StrictStr = ""  # type: ignore[assignment]
    input_prefix: StrictStr | list[Piece] = ""
    input_suffix: StrictStr | list[Piece] = ""
    input_extra: Annotated[list[ExtraChunk], Field(max_length=MAX_EXTRA_CHUNKS)] = Field(default_factory=list)

    def several(self) -> bool:
        return False

    def prompts(self) -> list[list[str | int]]:
        raise AssertionError("an infill prompt is built from its parts (infill_ids)")

    def infill_ids(self, tok: Tokenizer, n_ctx: int, spm: bool = False) -> list[int]:
        """The prompt as llama-server lays it out: the extra chunks (a repo token and 'myproject', then per chunk a
        file-separator token and its name, or the snippet separator; then a separator and 'filename'), cut to their
        last tokens that fit, before fim_layout's prefix (its last tokens + the typed prompt) and suffix (its first
        tokens), in suffix-prefix-middle order with spm (--spm-infill). Parts are tokenized with no BOS and
        special-token texts as plain text."""
        fim = fim_tokens(tok, "input_prefix")

        def ids(part: str | list[str | int], field_name: str) -> list[int]:
            out: list[int] = []
            for x in [part] if isinstance(part, str) else part:
                if isinstance(x, int) and x >= tok.vocab_size:
                    raise RequestError(f"{field_name} has token id {x}, outside the vocabulary of {tok.vocab_size} "
                                       "tokens.", field_name)
                out += [x] if isinstance(x, int) else tok.encode(x, add_bos=False, parse_special=False)
            return out

        extra = [fim["rep"], *ids("myproject\n", "")] if "rep" in fim else []
        for chunk in self.input_extra:
            extra += [fim["sep"], *ids(chunk.filename + "\n", "")] if "sep" in fim else ids(SNIPPET_SEPARATOR, "")
            extra += ids(chunk.text, "input_extra")
        if "sep" in fim:
            extra += [fim["sep"], *ids("filename\n", "")]
        prefix, suffix, typed = ids(self.input_prefix, "input_prefix"), ids(self.input_suffix, "input_suffix"), \
            ids(self.prompt, "prompt")
        window = min(FIM_WINDOW, n_ctx // 2)
        n_prefix = min(len(prefix), 3 * (window // 4))
        n_suffix = min(len(suffix), max(0, window // 4 - (2 + len(typed))))
        n_predict = self.n_predict if self.n_predict is not None else (self.max_tokens or -1)
        middle = fim_layout(tok, [*prefix[len(prefix) - n_prefix:], *typed], suffix[:n_suffix], "input_prefix", spm)
        # (and never so many that the prompt leaves no room for n_predict, where llama-server would overflow)
        n_extra = min(max(0, n_ctx - window - 2 * n_predict), len(extra),
                      max(0, n_ctx - len(middle) - max(n_predict, 1)))
        return [*extra[len(extra) - n_extra:], *middle]


def fim_tokens(tok: Tokenizer, field_name: str) -> dict[str, int]:
    """The vocabulary's fill-in-the-middle tokens, or a 501 (naming `field_name`) where it lacks one of the three a
    layout needs."""
    missing = [role for role in ("pre", "suf", "mid") if role not in tok.fim]
    if missing:
        raise RequestError(f"this model has no fill-in-the-middle {'/'.join(missing)} token, so it cannot fill in "
                           "text between a prefix and a suffix; use a code model with FIM tokens (such as "
                           "DeepSeek-Coder-V2-Lite) or leave the suffix out.", field_name, status=501,
                           type_="not_supported_error")
    return tok.fim


def fim_layout(tok: Tokenizer, prefix: list[int], suffix: list[int], field_name: str, spm: bool = False
               ) -> list[int]:
    """The fill-in-the-middle prompt: BOS as the file asks, FIM-prefix + prefix, FIM-suffix + suffix (the two the
    other way round with spm: llama-server's --spm-infill, the suffix-prefix-middle order some models were trained
    on), FIM-middle, after which the model writes the text between them."""
    fim = fim_tokens(tok, field_name)
    bos = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    before, after = [fim["pre"], *prefix], [fim["suf"], *suffix]
    return [*bos, *(after + before if spm else before + after), fim["mid"]]
