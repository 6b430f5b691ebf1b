"""Next-token sampling: penalties -> logit bias -> grammar -> temperature -> top-k -> top-p -> min-p -> draw.

Every request owns a `Sampler` with its own torch.Generator, so the same seed gives the same tokens. Where its
reasoning budget is spent, the tokens that close the block are written without a draw (engine/budget.py).
Sampling runs on the CPU in float32 whatever device the logits come from, so the draw does not depend
on where the model ran.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pocketmoe.engine.budget import BudgetTracker, ReasoningBudget
from pocketmoe.engine.llama_samplers import (
    DryPenalty,
    Mirostat,
    apply_top_n_sigma,
    apply_typical,
    apply_xtc,
    descending,
    dry_breakers,
    dynamic_temperature,
)
from pocketmoe.engine.structured import Constraint, Grammar
from pocketmoe.errors import PocketMoEError

if TYPE_CHECKING:
    from pocketmoe.tokenizer import Tokenizer


MAX_LOGPROBS = 20  # the most likely tokens one logprobs entry may list (vLLM's max_logprobs, OpenAI's top_logprobs)
# vLLM's names: the model's own distribution, or the one a token is drawn from (llama.cpp's post_sampling_probs)
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
# the steps of llama.cpp's sampler chain this engine runs, in an order a request gives (SamplingParams.chain)
CHAIN_STEPS = ("penalties", "dry", "top_n_sigma", "top_k", "typical_p", "top_p", "min_p", "xtc", "temperature",
               "infill", "mirostat")
LLAMA_CHAIN = CHAIN_STEPS[:-2]  # llama.cpp's default order
MIROSTAT_CHAIN = ("temperature", "mirostat")  # llama.cpp's chain with mirostat on (its order then ignored)
# a chain given as llama.cpp's sampler names (and the other spellings it reads), or as its one-letter codes
SAMPLER_NAMES = {"penalties": "penalties", "top_k": "top_k", "top-k": "top_k", "top_p": "top_p", "top-p": "top_p",
                 "nucleus": "top_p", "min_p": "min_p", "min-p": "min_p", "temperature": "temperature",
                 "temp": "temperature", "infill": "infill", "dry": "dry", "typ_p": "typical_p",
                 "typical_p": "typical_p", "typical-p": "typical_p", "typical": "typical_p", "typ-p": "typical_p",
                 "typ": "typical_p", "xtc": "xtc", "top_n_sigma": "top_n_sigma", "top-n-sigma": "top_n_sigma"}
SAMPLER_CODES = {"e": "penalties", "k": "top_k", "p": "top_p", "m": "min_p", "t": "temperature", "i": "infill",
                 "d": "dry", "y": "typical_p", "x": "xtc", "s": "top_n_sigma"}
DRY_BREAKERS = ("\n", ":", "\"", "*")  # llama.cpp's default DRY sequence breakers
MAX_DRY_BREAKERS, MAX_DRY_BREAKER_CHARS = 64, 40
MAX_MIN_KEEP = 2**31 - 1  # llama.cpp's min_keep is an int32
MAX_INFILL_CANDIDATES = 1024  # the infill step compares every pair of candidates' texts: a top_k ahead bounds them


class SamplingParamsError(PocketMoEError, ValueError):
    """A sampling parameter is out of range (`param`: its name, where one is to blame)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model's raw output (before penalties, bias, temperature and the filters:
    OpenAI's and vLLM's default), its rank in the vocabulary (1 = the most likely) and the most likely tokens."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()   # (id, logprob) of the most likely tokens, best first
    rank: int = 1


@dataclass(frozen=True)
class Logprob:
    """vLLM's: a token's log-probability (under the model's raw output, or with logprobs_mode processed_logprobs the
    distribution it was drawn from), its rank there (1: the most likely) and its text."""

    logprob: float
    rank: int
    decoded_token: str


# one token's entry: itself and the `logprobs` most likely tokens (vLLM's dict; the token first)
LogprobEntry = dict[int, Logprob]


def logprob_entry(x: TokenLogprob, tokenizer: Tokenizer, k: int | None = None) -> LogprobEntry:
    """vLLM's entry for x: the token, then at most k (default: all) of the most likely tokens x lists."""
    def piece(t: int) -> str:
        return tokenizer.token_to_piece(t).decode("utf-8", "replace")

    out = {x.token_id: Logprob(x.logprob, x.rank, piece(x.token_id))}
    for rank, (t, lp) in enumerate(x.top[:k], 1):
        out.setdefault(t, Logprob(lp, rank, piece(t)))
    return out


def token_logprob(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """The logprob of `token` given the logits [V] of its position, with the k most likely tokens."""
    return _ranked(torch.log_softmax(logits.float().reshape(-1), dim=-1), token, token, k)


def _ranked(lp: torch.Tensor, at: int, token: int, k: int, ids: torch.Tensor | None = None,
            masked: bool = False) -> TokenLogprob:
    """`token`'s entry from logprobs lp over the vocabulary, or over the token ids `ids` (ascending), where it is
    lp[at]: its logprob, its rank, and the k most likely tokens (masked: lp may hold -inf, and those tokens, having
    no probability, are never listed; the model's raw output holds none, so it is not searched for them)."""
    mine = lp[at]
    top = torch.topk(lp, min(k, int((lp > -math.inf).sum())) if masked else k)
    names = top.indices if ids is None else ids[top.indices]
    pairs = tuple(zip(names.tolist(), top.values.tolist(), strict=True))
    return TokenLogprob(token, float(mine), pairs, 1 + int((lp > mine).sum()))


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature: 0 means greedy (argmax after penalties). top_k: 0 = off. top_p in (0, 1], 1 = off.
    min_p in [0, 1], 0 = off: drop tokens whose probability is below min_p * the top probability.
    repetition_penalty > 0, 1 = off (llama.cpp/HF: positive logits of seen tokens are divided by it,
    negative ones multiplied). frequency_penalty and presence_penalty in [-2, 2] (OpenAI: subtract
    count * frequency + presence from a seen token's logit). All three penalties look at the last
    `penalty_last_n` tokens of prompt + output (0 = all of them).
    stop: strings that end the output (not included in it unless include_stop_str_in_output); stop_token_ids:
    ids that end it; ignore_eos: keep going past the model's end-of-generation tokens. min_tokens: the ids that
    end the output cannot be drawn before this many tokens (vLLM's; not where a grammar decides the end).
    skip_special_tokens: control tokens add no text to the output (vLLM's default and llama-server's are true).
    logit_bias: (token id, bias) pairs added to the logits after the penalties (OpenAI's logit_bias).
    grammar: structured output (engine/structured.py): only tokens that keep the output inside it are drawn.
    logprobs: report each generated token's logprob with this many most likely tokens' (None: none; 0: the token's
    alone); prompt_logprobs: the same for each prompt token after the first (the whole prompt is computed: no prefix
    reuse). At most MAX_LOGPROBS. logprobs_mode "raw_logprobs": the generated tokens' from the model's output
    (TokenLogprob); "processed_logprobs": from the distribution each is drawn from, after penalties, bias, grammar,
    temperature and the filters, its excluded tokens never listed (greedy: the token alone, logprob 0). Prompt
    logprobs are always the model's.
    n: completions per prompt (LLM.generate's CompletionOutput.outputs; choices()); stream takes n = 1.
    n_indent (llama.cpp's, for code completion): the output ends (finish "length") where a line after its first
    starts with fewer than this many spaces or tabs, that line's first other character and the rest left out (an
    empty line ends it too; 0: off). max_predict_ms (llama.cpp's t_max_predict_ms): the output ends at a token
    holding a newline once this many milliseconds have passed since its first token (0: off).
    reasoning_budget: at most this many tokens inside `<think>` blocks, then the sampler closes the block
    (engine/budget.py; None: no bound). Not with a grammar, which decides the output from its first token.
    chain: llama.cpp's sampler order (its `samplers`), steps of CHAIN_STEPS, after the logit bias and the grammar; a
    step left out does not run (no temperature step: the draw is at temperature 1, as in llama.cpp; temperature 0
    there keeps the most likely token). "infill" is llama.cpp's fill-in-the-middle step (apply_infill), after a
    top_k of at most MAX_INFILL_CANDIDATES. None: penalties, bias, grammar, temperature, top-k, top-p, min-p.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    grammar: Grammar | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprobs_mode: str = "raw_logprobs"
    n: int = 1
    n_indent: int = 0
    max_predict_ms: float = 0.0
    reasoning_budget: ReasoningBudget | None = None
    chain: tuple[str, ...] | None = None
    # llama.cpp's other samplers (engine/llama_samplers.py), steps of a chain only: typical_p (1: off), top_n_sigma
    # (<= 0: off), xtc_probability (0: off) with xtc_threshold, dynatemp_range (0: off; the temperature step's) with
    # dynatemp_exponent, dry_multiplier (0: off) with dry_base, dry_allowed_length, dry_penalty_last_n (-1: the
    # whole history) and dry_sequence_breakers
    typical_p: float = 1.0
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: tuple[str, ...] = DRY_BREAKERS
    mirostat: int = 0  # 1, 2: llama.cpp's mirostat version (its chain: MIROSTAT_CHAIN), 0: off
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    min_keep: int = 0  # llama.cpp's: top-p, min-p, typical and XTC each leave at least this many candidates (0: off)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.chain is not None:
            object.__setattr__(self, "chain", tuple(self.chain))
        object.__setattr__(self, "dry_sequence_breakers", tuple(self.dry_sequence_breakers))
        checks = [
            (math.isfinite(self.temperature) and self.temperature >= 0, "temperature", ">= 0"),
            (self.top_k >= 0, "top_k", ">= 0 (0 turns it off)"),
            (0 < self.top_p <= 1, "top_p", "in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p", "in [0, 1]"),
            (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
             "> 0 (1 turns it off)"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]"),
            (self.penalty_last_n >= 0, "penalty_last_n", ">= 0 (0 means the whole history)"),
            (self.max_tokens >= 1, "max_tokens", ">= 1"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens", "in [0, max_tokens]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "a list of non-empty strings"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", f"None or in [0, {MAX_LOGPROBS}]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
             f"None or in [0, {MAX_LOGPROBS}]"),
            (self.logprobs_mode in LOGPROBS_MODES, "logprobs_mode", f"one of {', '.join(LOGPROBS_MODES)}"),
            (self.n >= 1, "n", ">= 1"),
            (self.n_indent >= 0, "n_indent", ">= 0 (0 turns it off)"),
            (math.isfinite(self.max_predict_ms) and self.max_predict_ms >= 0, "max_predict_ms",
             ">= 0 (0 turns it off)"),
            (self.reasoning_budget is None or self.grammar is None, "reasoning_budget",
             "None with a grammar (which decides the output from its first token, so no reasoning block is open)"),
            (self.chain is None or set(self.chain) <= set(CHAIN_STEPS), "chain",
             f"None or steps of {', '.join(CHAIN_STEPS)}"),
            (self.chain is None or "infill" not in self.chain or
             0 < self.top_k <= MAX_INFILL_CANDIDATES and "top_k" in self.chain[:self.chain.index("infill")], "chain",
             f"with infill after a top_k step, top_k in 1..{MAX_INFILL_CANDIDATES} (infill compares every pair of "
             "candidates)"),
            (0 < self.typical_p <= 1, "typical_p", "in (0, 1] (1 turns it off)"),
            (math.isfinite(self.top_n_sigma), "top_n_sigma", "a number (<= 0 turns it off)"),
            (0 <= self.xtc_probability <= 1, "xtc_probability", "in [0, 1] (0 turns it off)"),
            (0 <= self.xtc_threshold <= 1, "xtc_threshold", "in [0, 1]"),
            (math.isfinite(self.dynatemp_range) and self.dynatemp_range >= 0, "dynatemp_range",
             ">= 0 (0 turns it off)"),
            (math.isfinite(self.dynatemp_exponent) and self.dynatemp_exponent >= 0, "dynatemp_exponent", ">= 0"),
            (math.isfinite(self.dry_multiplier) and self.dry_multiplier >= 0, "dry_multiplier",
             ">= 0 (0 turns it off)"),
            (math.isfinite(self.dry_base) and 1 <= self.dry_base <= 100, "dry_base", "in [1, 100]"),
            (self.dry_allowed_length >= 1, "dry_allowed_length", ">= 1"),
            (self.dry_penalty_last_n >= -1, "dry_penalty_last_n", ">= -1 (-1: the whole history, 0 turns it off)"),
            (0 < len(self.dry_sequence_breakers) <= MAX_DRY_BREAKERS and all(
                isinstance(b, str) and 0 < len(b) <= MAX_DRY_BREAKER_CHARS for b in self.dry_sequence_breakers),
             "dry_sequence_breakers", f"1 to {MAX_DRY_BREAKERS} strings of 1 to {MAX_DRY_BREAKER_CHARS} characters"),
            (self.mirostat in (0, 1, 2), "mirostat", "0 (off), 1 or 2"),
            (0 <= self.min_keep <= MAX_MIN_KEEP, "min_keep", f"in [0, {MAX_MIN_KEEP}]"),
            (math.isfinite(self.mirostat_tau) and self.mirostat_tau > 0, "mirostat_tau", "> 0"),
            (math.isfinite(self.mirostat_eta) and 0 < self.mirostat_eta <= 1, "mirostat_eta", "in (0, 1]"),
            ((self.mirostat != 0) == ("mirostat" in (self.chain or ())), "mirostat",
             "given with a chain that has the mirostat step (MIROSTAT_CHAIN), and only then"),
            (self.chain is not None or not self.llama_extras, "chain",
             "given for " + ", ".join(self.llama_extras) + " (llama.cpp's samplers run in its sampler chain: "
             "chain=LLAMA_CHAIN, or /completion)"),
            (self.chain is None or "infill" not in self.chain or (self.grammar is None and not self.min_tokens),
             "chain", "without infill where a grammar or min_tokens decides when the output may end (infill ends it "
             "with the end-of-turn token where no text is likely enough)"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise SamplingParamsError(f"sampling parameter {name}={getattr(self, name)!r} must be {rule}.", name)

    def choices(self) -> list[SamplingParams]:
        """The n choices' params, each with n = 1: choice i is seeded seed + i (mod 2**64; unseeded ones stay
        unseeded), so it draws what the same request with n = 1 and that seed draws (OpenAI's and vLLM's n)."""
        if self.n == 1:
            return [self]
        return [replace(self, n=1, seed=self.seed if self.seed is None or i == 0 else (self.seed + i) % 2**64)
                for i in range(self.n)]

    @property
    def greedy(self) -> bool:
        """The output is the most likely token after the steps (temperature 0; in a chain, a temperature step)."""
        if self.chain is None:
            return self.temperature == 0
        return "temperature" in self.chain and self.temperature <= 0 and self.dynatemp_range == 0

    @property
    def llama_extras(self) -> list[str]:
        """The llama.cpp samplers of engine/llama_samplers.py these params turn on."""
        return llama_extras_on(self.__dict__)

    @property
    def penalized(self) -> bool:
        """Whether any of the three penalties changes a logit."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def out_of_time(self, text: str, since_first_s: float) -> bool:
        """max_predict_ms: whether the output ends at this token (its text `text`), since_first_s seconds after the
        first token."""
        return bool(self.max_predict_ms) and "\n" in text and since_first_s * 1e3 > self.max_predict_ms

    def end_ids(self, eot_ids: Sequence[int]) -> frozenset[int]:
        """Token ids that end generation: stop_token_ids, plus the model's EOG ids unless ignore_eos."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(eot_ids)
        return frozenset(ids)


# SamplingParams' defaults (a CLI's or an API's own defaults start from these)
SAMPLING_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(SamplingParams) if f.default is not MISSING}
# llama.cpp's other samplers' knobs, at its defaults (each sampler off but for its own knobs)
LLAMA_EXTRA_DEFAULTS: dict[str, Any] = {name: SAMPLING_DEFAULTS[name] for name in (
    "typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold", "dynatemp_range", "dynatemp_exponent",
    "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n")}


def sampler_chain(samplers: str | Sequence[str]) -> tuple[str, ...]:
    """The chain steps of llama.cpp's `samplers`: a list of its names, or a string of its one-letter codes
    (ValueError, a sentence's end naming the first it does not know)."""
    table, names = (SAMPLER_CODES, list(samplers)) if isinstance(samplers, str) else (SAMPLER_NAMES, list(samplers))
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"has {unknown[0]!r}, which is not one of llama.cpp's ({', '.join(table)}).")
    return tuple(table[n] for n in names)


def llama_extras_on(values: Mapping[str, Any]) -> list[str]:
    """Which of llama.cpp's other samplers the SamplingParams fields in `values` turn on (SamplingParams.llama_extras;
    a request's, before its params are made)."""
    on = {"typical_p": values["typical_p"] < 1, "top_n_sigma": values["top_n_sigma"] > 0,
          "xtc": values["xtc_probability"] > 0, "dynatemp": values["dynatemp_range"] > 0,
          "dry": values["dry_multiplier"] > 0, "mirostat": values["mirostat"] != 0}
    return [name for name, yes in on.items() if yes]


def apply_penalties(logits: torch.Tensor, history: Sequence[int], params: SamplingParams) -> torch.Tensor:
    """logits [V] float32 (a new tensor). Penalises each distinct token of the history window."""
    window = history[-params.penalty_last_n:] if params.penalty_last_n else history
    if not window or not params.penalized:
        return logits.clone()
    distinct, times = np.unique(np.fromiter(window, dtype=np.int64, count=len(window)), return_counts=True)
    ids, n = torch.from_numpy(distinct), torch.from_numpy(times.astype(np.float32))
    out = logits.clone()
    seen = out[ids]
    if params.repetition_penalty != 1.0:
        p = params.repetition_penalty
        seen = torch.where(seen > 0, seen / p, seen * p)
    seen = seen - n * params.frequency_penalty - (n > 0).float() * params.presence_penalty
    out[ids] = seen
    return out


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits (ties at the boundary: lower ids first), the rest -> -inf. One partial
    selection (torch.topk) for the k-th value, not a sort of the vocabulary (7 ms for 102400 tokens)."""
    if k <= 0 or k >= logits.numel():
        return logits
    kth = torch.topk(logits, k).values[-1]
    keep = logits > kth
    ties = torch.nonzero(logits == kth).flatten()[:k - int(keep.sum())]  # ascending ids
    keep[ties] = True
    return torch.where(keep, logits, torch.full_like(logits, -math.inf))


def apply_top_p(logits: torch.Tensor, p: float, min_keep: int = 0) -> torch.Tensor:
    """Keep the smallest prefix of tokens sorted by probability whose mass reaches p, and at least the min_keep
    likeliest (probabilities and their sums in float64: in float32 a flat distribution's sum over 10^5 tokens
    drifts by more than a token's mass). Only the head of the order is sorted where it can hold the mass (the top
    256 tokens), else the whole row."""
    if p >= 1.0:
        return logits
    probs = torch.softmax(logits.double(), dim=-1)
    # fewer than p / max tokens cannot reach p
    head_k = 256 if float(probs.max()) * 256 >= p and min_keep <= 256 else logits.numel()
    order = descending(logits, head_k)
    head = probs[order]
    if head_k < logits.numel() and float(head.sum()) < p:
        order = descending(logits, logits.numel())
        head = probs[order]
    mass_before = torch.cumsum(head, dim=-1) - head
    keep = order[(mass_before < p) | (torch.arange(len(order)) < min_keep)]
    out = torch.full_like(logits, -math.inf)
    out[keep] = logits[keep]
    return out


def apply_min_p(logits: torch.Tensor, min_p: float, min_keep: int = 0) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the largest probability, but for the min_keep likeliest
    (ties by lower id)."""
    if min_p <= 0.0:
        return logits
    # p_i >= min_p * p_max  <=>  logit_i >= logit_max + ln(min_p)
    keep = logits >= logits.max() + math.log(min_p)
    if min_keep > int(keep.sum()):
        keep[descending(logits, min_keep)[:min_keep]] = True
    return torch.where(keep, logits, torch.full_like(logits, -math.inf))


def keep_max(logits: torch.Tensor) -> torch.Tensor:
    """Temperature 0 in llama.cpp's chain: the largest logit alone (the first of ties), the rest -inf."""
    out = torch.full_like(logits, -math.inf)
    i = argmax(logits)
    out[i] = logits[i]
    return out


_INFILL_VOCABS: weakref.WeakKeyDictionary[Tokenizer, tuple[torch.Tensor, list[bytes], int]] = \
    weakref.WeakKeyDictionary()


def infill_vocab(tok: Tokenizer) -> tuple[torch.Tensor, list[bytes], int]:
    """apply_infill's view of a vocabulary: which ids end generation, each id's text (control tokens none), and the
    token it falls back to (end of turn, else end of sequence); built once per tokenizer."""
    if tok not in _INFILL_VOCABS:
        _INFILL_VOCABS[tok] = _infill_vocab(tok)
    return _INFILL_VOCABS[tok]


def _infill_vocab(tok: Tokenizer) -> tuple[torch.Tensor, list[bytes], int]:
    eog = torch.zeros(tok.vocab_size, dtype=torch.bool)
    eog[list(tok.eot_ids)] = True
    fallback = tok.eot_id if tok.eot_id is not None else tok.eos_id
    if fallback is None:
        raise SamplingParamsError("the infill step needs an end-of-turn or end-of-sequence token, which this model's "
                                  "vocabulary lacks; leave infill out of samplers.")
    return eog, [tok.token_to_piece(i, special=False) for i in range(tok.vocab_size)], fallback


def apply_infill(ids: torch.Tensor, logits: torch.Tensor, eog: torch.Tensor, pieces: Sequence[bytes], fallback: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's infill step, for fill-in-the-middle (after a top-k: it compares every pair of candidates), on the
    candidates `ids` (token ids, ascending) with `logits` (-inf: out); returns the candidates it leaves the same way.
    Over the candidates' probabilities: where the end-of-generation tokens hold more than 1 / (3 n) of the text
    tokens' mass (n candidates), they alone stay. Otherwise, most likely first, a candidate whose text begins
    another's takes that one's probability into the likelier of the two and the other is dropped; then a text token
    stays only at probability 0.2 or more, and, among those left (renormalized), 1 / (text tokens left + 1) or more;
    no text token left: the fallback token alone. The survivors keep their logits (the draw is over those)."""
    at = descending(logits, logits.numel())  # positions of the finite ones, most likely first
    tid = ids[at]
    p = torch.softmax(logits[at].double(), dim=-1)
    end = eog[tid]
    out = torch.full_like(logits, -math.inf)
    if 3 * float(p[end].sum()) * len(at) > float(p[~end].sum()):
        out[at[end]] = logits[at[end]]
        return ids, out
    prob = p.tolist()
    text = [pieces[i] for i in tid.tolist()]
    dropped = [False] * len(at)
    for a in range(len(at)):
        for b in range(len(at)):
            if dropped[a]:
                break
            if a == b or dropped[b] or not text[a] or not text[b].startswith(text[a]):
                continue
            into, src = (b, a) if prob[b] > prob[a] else (a, b)
            prob[into] += prob[src]
            prob[src], dropped[src] = 0.0, True
    keep = [i for i in range(len(at)) if end[i] or prob[i] >= 0.2]
    n_text = sum(1 for i in keep if not end[i])
    if n_text == 0:
        return torch.tensor([fallback]), torch.tensor([1.0])
    total = sum(prob[i] for i in keep)
    for i in keep:
        if not dropped[i] and (end[i] or prob[i] / total >= 1.0 / (n_text + 1)):
            out[at[i]] = logits[at[i]]
    return ids, out


def argmax(x: torch.Tensor) -> int:
    """The index of the largest value (the first of ties), as torch.argmax gives it; through numpy, which takes
    5 us for a 102400-token row where torch.argmax takes 130 (a CPU vocabulary row, each token of each sequence)."""
    return int(x.detach().to("cpu", torch.float32).reshape(-1).numpy().argmax())


def draw(x: torch.Tensor, generator: torch.Generator) -> int:
    """A token drawn with probability softmax(x): one uniform number from `generator` looked up in the float64
    cumulative distribution (inverse CDF). 87 us for a 102400-token row where torch.multinomial, which draws an
    exponential number per token, takes 1.8 ms. Tokens at -inf have probability 0 and are never drawn."""
    p = torch.softmax(x, dim=-1)
    cdf = torch.cumsum(p, 0, dtype=torch.float64)
    u = torch.rand(1, generator=generator, dtype=torch.float64)
    i = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    return i if i < cdf.numel() else int(torch.nonzero(p).max())  # u * total rounded up to the total


class Sampler:
    """Picks the next token of one sequence from its logits and its token history. With a grammar in the
    params it needs the model's tokenizer, and each token it returns advances the sequence in the grammar."""

    def __init__(self, params: SamplingParams, tokenizer: Tokenizer | None = None) -> None:
        self.params = params
        self.constraint: Constraint | None = None
        self.drawn = 0  # tokens this sampler has returned (min_tokens counts them)
        # the ids that end the output (stop_token_ids, and the tokenizer's end-of-generation ids unless ignore_eos)
        self.end_ids = params.end_ids(tokenizer.eot_ids if tokenizer is not None else ())
        self._end_ids = torch.tensor(sorted(self.end_ids), dtype=torch.long)
        if params.grammar is not None:
            if tokenizer is None:
                raise SamplingParamsError("a sampler with a grammar needs the model's tokenizer.")
            self.constraint = Constraint(params.grammar, tokenizer)
        self._drawn_from: tuple[torch.Tensor | None, torch.Tensor] | None = None  # the last draw's _candidates
        self.budget = BudgetTracker(params.reasoning_budget, tokenizer) if params.reasoning_budget else None
        self._infill: tuple[torch.Tensor, list[bytes], int] | None = None  # apply_infill's view of the vocabulary
        if params.chain is not None and "infill" in params.chain:
            if tokenizer is None:
                raise SamplingParamsError("a sampler with the infill step needs the model's tokenizer.")
            self._infill = infill_vocab(tokenizer)
        self.dry: DryPenalty | None = None
        if params.dry_multiplier > 0 and params.chain is not None and "dry" in params.chain:
            if tokenizer is None:
                raise SamplingParamsError("a sampler with the DRY step needs the model's tokenizer.")
            self.dry = DryPenalty(params.dry_multiplier, params.dry_base, params.dry_allowed_length,
                                  params.dry_penalty_last_n, dry_breakers_of(tokenizer, params.dry_sequence_breakers))
        self.mirostat = Mirostat(params.mirostat, params.mirostat_tau, params.mirostat_eta,
                                 tokenizer.vocab_size if tokenizer is not None else 0) if params.mirostat else None
        self.generator = torch.Generator(device="cpu")
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def process(self, logits: torch.Tensor, history: Sequence[int] = ()) -> torch.Tensor:
        """The filtered, temperature-scaled logits [V] the draw is made from (-inf = excluded)."""
        ids, x = self._candidates(logits, history)
        if ids is None:
            return x
        out = torch.full((logits.numel(),), -math.inf)
        out[ids] = x
        return out

    def _candidates(self, logits: torch.Tensor, history: Sequence[int]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(ids, their processed logits): after top-k (or a grammar) only the tokens still in the draw, ids ascending,
        so top-p, min-p and the draw run on a few values instead of the vocabulary; ids None: x is [V]."""
        p = self.params
        x = logits.detach().to("cpu", torch.float32).reshape(-1)
        x = apply_penalties(x, history, p) if p.chain is None or "penalties" in p.chain else x.clone()
        if p.logit_bias:
            ids, bias = zip(*p.logit_bias, strict=True)
            x[torch.tensor(ids)] += torch.tensor(bias, dtype=torch.float32)
        if self.constraint is not None:
            self.constraint.mask_(x)
        elif self.drawn < p.min_tokens and len(self._end_ids):
            x[self._end_ids[self._end_ids < x.numel()]] = -math.inf
        if p.chain is not None:
            return self._chain(x, history)
        if p.greedy:
            return None, x
        x = apply_top_k(x / p.temperature, p.top_k)
        kept = None
        if p.top_k or self.constraint is not None:  # few finite values left: go on with those alone
            kept = torch.nonzero(x > -math.inf).flatten()
            x = x[kept]
        return kept, apply_min_p(apply_top_p(x, p.top_p, p.min_keep), p.min_p, p.min_keep)

    def _chain(self, x: torch.Tensor, history: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """_candidates for params.chain: its steps in its order on x [V] (penalized, biased, masked); after a top-k
        the rest run on the candidates it leaves, not the vocabulary. `size` follows the length of llama.cpp's
        candidate array, which holds the tokens set to -inf (masked, or left by top-n-sigma) until a step that
        shrinks it: dynamic temperature's largest entropy is that of `size` tokens."""
        p = self.params
        ids = torch.arange(x.numel())
        size = x.numel()

        def finite() -> int:
            return int((x > -math.inf).sum())

        def kept(size: int) -> int:  # after a step that shrinks llama.cpp's array to min_keep or more
            return max(finite(), min(p.min_keep, size))

        for step in p.chain or ():
            if step == "dry":
                x = self.dry(ids, x, history) if self.dry is not None else x
            elif step == "top_n_sigma":
                x = apply_top_n_sigma(x, p.top_n_sigma)
            elif step == "typical_p" and p.typical_p < 1:
                x = apply_typical(x, p.typical_p, p.min_keep)
                size = kept(size)
            elif step == "xtc":
                before = finite()
                x = apply_xtc(x, p.xtc_probability, p.xtc_threshold, self.generator, p.min_keep, size)
                size -= before - finite()
            elif step == "temperature" and p.dynatemp_range > 0:
                x = dynamic_temperature(x, p.temperature, p.dynatemp_range, p.dynatemp_exponent, size)
            elif step == "top_k":
                x = apply_top_k(x, p.top_k)
                if p.top_k:
                    keep = x > -math.inf
                    ids, x = ids[keep], x[keep]
                    size = min(size, p.top_k)
            elif step == "top_p" and p.top_p < 1:
                x = apply_top_p(x, p.top_p, p.min_keep)
                size = kept(size)
            elif step == "min_p" and p.min_p > 0:
                x = apply_min_p(x, p.min_p, p.min_keep)
                size = kept(size)
            elif step == "temperature":
                x = x / p.temperature if p.temperature > 0 else keep_max(x)
            elif step == "infill":
                assert self._infill is not None
                ids, x = apply_infill(ids, x, *self._infill)
                size = finite()
            elif step == "mirostat":
                assert self.mirostat is not None
                x = self.mirostat(x)
        keep = x > -math.inf
        return ids[keep], x[keep]

    def __call__(self, logits: torch.Tensor, history: Sequence[int] = ()) -> int:
        p = self.params
        forced = self.budget.forced() if self.budget is not None else None
        if forced is not None:  # the reasoning budget is spent: its message and closing tag, drawn with probability 1
            token = forced
            self._drawn_from = None
        elif p.greedy and not p.penalized and not p.logit_bias and self.constraint is None and \
                self.drawn >= p.min_tokens and self._infill is None and not (self.dry or p.xtc_probability > 0):
            token = argmax(logits)  # argmax of the logits as they are
            self._drawn_from = None
        else:
            ids, x = self._candidates(logits, history)
            self._drawn_from = ids, x
            token = argmax(x) if p.greedy else draw(x, self.generator)
            if self.mirostat is not None:
                self.mirostat.observe(x, token)
            token = token if ids is None else int(ids[token])
            if self.constraint is not None:
                self.constraint.accept(token)
        if self.budget is not None:
            self.budget.accept(token)
        self.drawn += 1
        return token

    sample = __call__

    def logprob(self, logits: torch.Tensor, token: int) -> TokenLogprob | None:
        """The entry of `token`, just drawn from `logits`, as params.logprobs and logprobs_mode ask (None: none)."""
        k = self.params.logprobs
        if k is None:
            return None
        if self.params.logprobs_mode == "raw_logprobs":
            return token_logprob(logits, token, k)
        if self.params.greedy or self._drawn_from is None:  # drawn with probability 1
            return TokenLogprob(token, 0.0, ((token, 0.0),) if k else (), 1)
        ids, x = self._drawn_from
        at = token if ids is None else int(torch.searchsorted(ids, token))  # ids ascending
        return _ranked(torch.log_softmax(x, dim=-1), at, token, k, ids, masked=True)

    @property
    def complete(self) -> bool:
        """The sequence's grammar (if any) is satisfied and admits nothing more: the output is done."""
        return self.constraint is not None and self.constraint.complete


class StopChecker:
    """Finds stop strings in streamed text, even when one spans several tokens, and with n_indent > 0 the first
    line (after a newline) indented less than n_indent.

    `push(text)` returns (text safe to show now, stopped). Text that could be the start of a stop string
    is held back until it is known not to be one; on a stop, the text before the stop string comes out
    and the rest is dropped (`matched`: the stop string; `limited`: an under-indented line, cut at its first
    character other than a space or tab). `flush()` releases what is held when the stream ends without a stop.
    """

    def __init__(self, stop: Sequence[str], include: bool = False, n_indent: int = 0) -> None:
        self.stop = tuple(s for s in stop if s)
        self.include = include  # the stop string itself ends the shown text
        self.n_indent = n_indent
        self._held = ""
        self._indent: int | None = None  # spaces and tabs since the last newline, while nothing else came
        self.stopped = self.limited = False
        self.matched: str | None = None

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        buf = self._held + text
        hits = [(i, s) for s in self.stop if (i := buf.find(s)) >= 0]
        if hits:
            i, s = min(hits)
            out, self._held, self.stopped, self.matched = buf[:i + len(s) if self.include else i], "", True, s
        else:
            keep = max(partial_prefix(buf, s) for s in self.stop) if self.stop else 0
            out, self._held = buf[:len(buf) - keep], buf[len(buf) - keep:]
        return self._limit(out), self.stopped

    def _limit(self, out: str) -> str:
        """`out`, cut before the first character of a line indented less than n_indent (then: stopped)."""
        for i, ch in enumerate(out if self.n_indent else ""):
            if self._indent is not None:
                if ch in " \t":
                    self._indent += 1
                    continue
                if self._indent < self.n_indent:
                    self._held, self.stopped, self.limited, self.matched = "", True, True, None
                    return out[:i]
                self._indent = None
            if ch == "\n":
                self._indent = 0
        return out

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else self._limit(held)

    def end(self, tail: str) -> str:
        """The text still to show when the stream ends: `tail` (the decoder's flush) and what is held,
        unless a stop string was already found."""
        return "" if self.stopped else self.push(tail)[0] + self.flush()


def partial_prefix(text: str, target: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `target` (0: none)."""
    for n in range(min(len(target) - 1, len(text)), 0, -1):
        if text.endswith(target[:n]):
            return n
    return 0


_DRY_BREAKERS: weakref.WeakKeyDictionary[Tokenizer, dict[tuple[str, ...], dict[int, list[tuple[int, ...]]]]] = \
    weakref.WeakKeyDictionary()


def dry_breakers_of(tokenizer: Tokenizer, breakers: tuple[str, ...]) -> dict[int, list[tuple[int, ...]]]:
    """dry_breakers for this tokenizer's vocabulary, made once per set of breakers (a pass over the vocabulary)."""
    cache = _DRY_BREAKERS.setdefault(tokenizer, {})
    if breakers not in cache:
        pieces = [tokenizer.token_to_piece(i) for i in range(tokenizer.vocab_size)]
        cache[breakers] = dry_breakers(pieces, lambda text: tokenizer.encode(text, False, False), breakers)
    return cache[breakers]
