"""llama.cpp's other samplers, as steps of a sampler chain (SamplingParams.chain): locally typical sampling
(`typical_p`), top-n-sigma, XTC (exclude top choices), dynamic temperature (`dynatemp_range`, in the temperature
step), DRY (don't repeat yourself) and mirostat (versions 1 and 2: a target surprise, `Mirostat`). What roleplay
and writing front ends (SillyTavern's presets among them) send llama-server; each is written from its published
description and checked against llama.cpp's own sampler, through llama-cpp-python's C API, on the same candidates
(tests/test_sampler_chain.py).

Each step takes the candidates as logits x (-inf: excluded) and returns new ones; probabilities are a softmax over
the finite logits, in float64.

Legend: C candidates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

FLOAT_MAX_LOG = 88.7228391  # log of float32's largest value: DRY's penalty exponent stops where base^e would overflow


def _probs(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.double(), dim=-1)


def descending(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The ids of every finite logit at least the k-th largest (ties included), largest first, ties by lower id
    (a token at -inf has no probability: it never counts toward a top-p mass)."""
    finite = logits > -math.inf
    if k < logits.numel():
        finite &= logits >= torch.topk(logits, k).values[-1]
    if bool(finite.all()):
        ids, values = torch.arange(logits.numel()), logits
    else:
        ids = torch.nonzero(finite).flatten()
        values = logits[ids]
    # one int64 key per token, (value descending, id ascending), sorted by numpy: 0.6 ms for 102400 tokens where
    # torch's stable sort takes 7. A float32's bits, read as an integer, order as the float does once a negative
    # one's magnitude is negated (so -0.0 and 0.0 tie, as they compare).
    bits = values.float().contiguous().numpy().view(np.int32)
    magnitude = bits & 0x7FFFFFFF
    rank = np.where(bits < 0, -magnitude, magnitude).astype(np.int64)
    shift = max(1, logits.numel().bit_length())
    keys = np.sort((-rank << shift) | ids.numpy())
    return torch.from_numpy(keys & ((1 << shift) - 1))


def _descending_probs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices of the finite candidates, most probable first, ties by index; their probabilities)."""
    idx = descending(x, x.numel())
    return idx, _probs(x[idx])


def _keep(x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(x, -math.inf)
    out[kept] = x[kept]
    return out


def apply_typical(x: torch.Tensor, p: float, min_keep: int = 0) -> torch.Tensor:
    """Locally typical sampling: the candidates ordered by how far their information (-log prob) is from the
    distribution's entropy, closest first; the fewest of them whose probability passes p are kept, and at least
    min_keep (p = 1: off)."""
    if p >= 1.0:
        return x
    idx, probs = _descending_probs(x)
    if len(idx) == 0:
        return x
    logp = torch.log(probs)
    entropy = -float(torch.sum(probs * logp))
    shifted = torch.abs(-logp - entropy)
    order = torch.from_numpy(np.argsort(shifted.numpy(), kind="stable"))
    cum = torch.cumsum(probs[order], dim=0)
    over = torch.nonzero(cum > p).flatten()
    last = int(over[0]) + 1 if len(over) else len(order)
    return _keep(x, idx[order[:max(last, min_keep)]])


def apply_top_n_sigma(x: torch.Tensor, n: float) -> torch.Tensor:
    """Top-n-sigma: keep the candidates whose logit is at least the largest minus n standard deviations of the
    finite logits (n <= 0: off)."""
    if n <= 0:
        return x
    finite = x[x > -math.inf].double()
    if len(finite) == 0:
        return x
    mean = float(finite.mean())
    std = math.sqrt(float(((finite - mean) ** 2).mean()))
    floor = float(finite.max()) - n * std
    return torch.where(x.double() >= floor, x, torch.full_like(x, -math.inf))


def apply_xtc(x: torch.Tensor, probability: float, threshold: float, generator: torch.Generator, min_keep: int = 0,
              size: int | None = None) -> torch.Tensor:
    """XTC, exclude top choices: with `probability` (one uniform draw a token), of the candidates whose probability
    is at least `threshold` all but the least probable go, so the likeliest continuations give way to other good
    ones. Off where probability <= 0, threshold > 0.5 (then at most one candidate passes it) or fewer than two
    candidates are left, and where fewer than min_keep of llama.cpp's `size` candidates (default: the finite ones)
    would stay."""
    if probability <= 0 or threshold > 0.5:
        return x
    idx, probs = _descending_probs(x)
    if len(idx) < 2:
        return x
    chance = float(torch.rand(1, generator=generator))
    if chance > probability:
        return x
    above = int((probs >= threshold).sum())
    if above < 2 or (len(idx) if size is None else size) - (above - 1) < min_keep:
        return x
    return _keep(x, idx[above - 1:])


def dynamic_temperature(x: torch.Tensor, temperature: float, spread: float, exponent: float, size: int
                        ) -> torch.Tensor:
    """Dynamic temperature: the candidates' entropy, as a fraction of the largest `size` candidates could have
    (llama.cpp's array length, which counts the masked tokens it still holds), sets the temperature between
    temperature - spread (at least 0) and temperature + spread (raised to `exponent`); x divided by it."""
    n = size
    if n <= 1:
        return x
    lo, hi = max(0.0, temperature - spread), temperature + spread
    probs = _probs(x[x > -math.inf])
    probs = probs[probs > 0]
    entropy = -float(torch.sum(probs * torch.log(probs)))
    t = lo + (hi - lo) * (entropy / math.log(n)) ** exponent
    if t <= 0:  # temperature 0 at no entropy: the most likely token
        return torch.where(x == x.max(), x, torch.full_like(x, -math.inf))
    return x / t


class DryPenalty:
    """DRY: a token that would continue a run of the recent history repeating an earlier stretch of it is penalized
    by multiplier * base ** (run length - allowed_length), once the run is at least allowed_length tokens; runs stop
    at a sequence breaker (a text such as a newline, whose tokens `breakers` lists: a token holding one whole, or
    one holding its start followed by the tokens of the rest), and, as in llama.cpp, a token holding a whole breaker
    is never penalized. `last_n` tokens of history are looked at (-1: all).
    """

    def __init__(self, multiplier: float, base: float, allowed_length: int, last_n: int,
                 breakers: dict[int, list[tuple[int, ...]]]) -> None:
        # in float32, as llama.cpp holds them; the exponent's cap is a whole number, as there
        self.multiplier, self.base = float(np.float32(multiplier)), float(np.float32(base))
        self.allowed, self.last_n, self.breakers = allowed_length, last_n, breakers
        self._heads = np.fromiter(breakers, dtype=np.int64, count=len(breakers))  # tokens a breaker starts with
        self.max_exponent = int(FLOAT_MAX_LOG / math.log(self.base)) if self.base > 1.000001 else 0

    @property
    def on(self) -> bool:
        return self.multiplier != 0 and self.base >= 1 and self.last_n != 0

    def __call__(self, ids: torch.Tensor, x: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        """x [C] (candidates ids [C]) with the penalty of each candidate that would extend a repeat."""
        if not self.on:
            return x
        h = history if self.last_n < 0 else history[-self.last_n:]
        n = len(h)
        if n <= self.allowed:
            return x
        rev = np.asarray(h, dtype=np.int64)[::-1]  # rev[i]: the token i from the end (0: the last)
        limit = self._restart_limit(rev)
        if limit < self.allowed:
            return x
        ks, runs = _repeats(rev, limit)  # the stretch ending k tokens before the end repeats the last `run` tokens
        keep = runs >= self.allowed
        if not keep.any():
            return x
        tokens, runs = rev[ks[keep] - 1], runs[keep]  # what followed each earlier stretch, and its run
        order = np.lexsort((runs, tokens))  # by token, then run: each token's longest run last
        tokens, runs = tokens[order], runs[order]
        last = np.r_[tokens[1:] != tokens[:-1], True]
        tokens, runs = tokens[last], runs[last]
        exempt = np.array([() in self.breakers.get(int(t), ()) for t in tokens], dtype=bool)  # a whole breaker
        tokens, runs = tokens[~exempt], runs[~exempt]  # ends a run: never penalized, as in llama.cpp
        if len(tokens) == 0:
            return x
        e = runs - self.allowed
        if self.max_exponent > 0:
            e = np.minimum(e, self.max_exponent)
        penalty = (self.multiplier * np.power(self.base, e.astype(np.float64))).astype(np.float32)
        cand = ids.numpy()
        at = np.searchsorted(tokens, cand)  # tokens ascending
        hit = tokens[np.minimum(at, len(tokens) - 1)] == cand
        out = x.clone()
        out[torch.from_numpy(np.nonzero(hit)[0])] -= torch.from_numpy(penalty[at[hit]])  # float32, as llama.cpp
        return out

    def _restart_limit(self, rev: np.ndarray) -> int:
        """How far back a run may reach: to the latest sequence breaker in the history (the whole history without
        one)."""
        heads = np.nonzero(np.isin(rev, self._heads))[0]
        for i in heads.tolist():
            longest = -1
            for tail in self.breakers[int(rev[i])]:
                if longest < len(tail) <= i and all(tail[o] == rev[i - o - 1] for o in range(len(tail))):
                    longest = len(tail)
            if longest >= 0:
                return i - longest
        return len(rev)


def _repeats(rev: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """(k, z[k]) for each k in 1..n-1 with z[k] >= 1: z[k] the length of the longest common prefix of rev and rev[k:]
    (how many of the history's last tokens the stretch ending k tokens earlier repeats), at most `limit`. One
    vectorized comparison per token of the longest run."""
    n = len(rev)
    ks = np.arange(1, n)
    runs = np.zeros(n - 1, dtype=np.int64)
    live = np.arange(n - 1)  # indices into ks still matching
    for t in range(min(limit, n - 1)):
        live = live[ks[live] + t < n]
        live = live[rev[ks[live] + t] == rev[t]]
        if len(live) == 0:
            break
        runs[live] += 1
    found = runs > 0
    return ks[found], runs[found]


def dry_breakers(pieces: Sequence[bytes], encode: object, breakers: Sequence[str], max_tail: int = 20
                 ) -> dict[int, list[tuple[int, ...]]]:
    """The token sequences that make up each breaker text: each token whose text holds the whole breaker (no tail),
    and each token whose text ends with the breaker's start, with the tokens of the rest of it (at most max_tail).
    pieces[i]: token i's bytes; encode(text) -> token ids (no BOS, special texts not parsed)."""
    out: dict[int, list[tuple[int, ...]]] = {}
    for text in breakers:
        b = text.encode("utf-8")
        if not b:
            continue
        for token, word in enumerate(pieces):
            if b in word:
                _add(out, token, ())
                continue
            pos = word.find(b[:1])
            while pos >= 0:
                i = 1
                while i < len(b) and pos + i < len(word) and word[pos + i] == b[i]:
                    i += 1
                if i == len(b) or pos + i == len(word):  # the token ends with the breaker's first i bytes
                    rest = b[i:].decode("utf-8", "ignore")
                    _add(out, token, tuple(encode(rest))[:max_tail] if rest else ())  # type: ignore[operator]
                pos = word.find(b[:1], pos + 1)
    return out


def _add(out: dict[int, list[tuple[int, ...]]], token: int, tail: tuple[int, ...]) -> None:
    tails = out.setdefault(token, [])
    if tail not in tails:
        tails.append(tail)


class Mirostat:
    """Mirostat (llama.cpp's versions 1 and 2): candidates whose surprise (-log2 of their probability) is above mu
    go (version 2), or the top k that a Zipf fit of the m most likely tokens says reaches mu (version 1); after each
    draw mu moves by eta towards the target surprise tau (mu starts at 2 tau). One per sequence: it keeps mu."""

    M = 100  # version 1: the most likely tokens its Zipf exponent is fit to

    def __init__(self, version: int, tau: float, eta: float, n_vocab: int) -> None:
        self.version, self.n_vocab = version, n_vocab
        self.tau, self.eta = float(np.float32(tau)), float(np.float32(eta))
        self.mu = 2 * self.tau

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        idx, probs = _descending_probs(x)
        if len(idx) == 0:
            return x
        if self.version == 2:
            over = torch.nonzero(-torch.log2(probs) > self.mu).flatten()
            keep = max(int(over[0]) if len(over) else len(idx), 1)
        else:
            keep = max(int(self._zipf_k(probs)), 1)
        return _keep(x, idx[:keep])

    def _zipf_k(self, probs: torch.Tensor) -> float:
        """Version 1's k: the Zipf exponent s of the top m probabilities, then the k whose surprise is mu."""
        n = min(self.M - 1, len(probs) - 1)
        if n <= 0:
            return 1.0
        i = torch.arange(n, dtype=torch.float64)
        t = torch.log((i + 2) / (i + 1))
        b = torch.log(probs[:n] / probs[1:n + 1])
        s_hat = float((t * b).sum() / (t * t).sum())
        eps = s_hat - 1
        try:
            return (eps * 2 ** self.mu / (1 - self.n_vocab ** -eps)) ** (1 / s_hat)
        except (ZeroDivisionError, OverflowError):
            return float(self.n_vocab)

    def observe(self, x: torch.Tensor, at: int) -> None:
        """After a draw of candidate `at` from x (the logits this sampler left): mu -= eta * (its surprise - tau)."""
        p = float(torch.softmax(x.double(), dim=-1)[at])
        surprise = -math.log2(p) if p > 0 else math.inf
        self.mu -= self.eta * (surprise - self.tau)
