"""Sampler checks against plain re-derivations (numpy / python loops / torch.topk)."""

from __future__ import annotations

import math
import random
import re

import numpy as np
import pytest
import torch

from pocketmoe.engine.llama_samplers import descending
from pocketmoe.engine.sampler import (
    Sampler,
    SamplingParams,
    SamplingParamsError,
    StopChecker,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    argmax,
    draw,
)
from pocketmoe.errors import PocketMoEError

V = 64


def _logits(seed: int, n: int = V) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3


def _ref_penalties(logits: np.ndarray, history: list[int], rep: float, freq: float, pres: float) -> np.ndarray:
    out = logits.astype(np.float64).copy()
    for t in set(history):
        if out[t] > 0:
            out[t] /= rep
        else:
            out[t] *= rep
        c = history.count(t)
        out[t] -= c * freq + pres
    return out


def _ref_top_p_keep(logits: np.ndarray, p: float) -> set[int]:
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    keep, mass = set(), 0.0
    for i in order:
        keep.add(i)
        mass += probs[i]
        if mass >= p:
            break
    return keep


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=-1), dict(temperature=math.nan), dict(top_k=-1), dict(top_p=0), dict(top_p=1.5),
     dict(min_p=-0.1), dict(min_p=2), dict(repetition_penalty=0), dict(frequency_penalty=2.5),
     dict(presence_penalty=-3), dict(max_tokens=0), dict(penalty_last_n=-1), dict(stop=[""]), dict(n=0)],
)
def test_params_validation(kwargs: dict) -> None:
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kwargs)
    assert isinstance(e.value, PocketMoEError) and str(e.value).count(".") >= 1


def test_params_defaults_and_lists() -> None:
    p = SamplingParams(stop=["a", "bc"], stop_token_ids=[3, 4])
    assert p.stop == ("a", "bc") and p.stop_token_ids == (3, 4)
    assert p.end_ids([7]) == {3, 4, 7} and SamplingParams(ignore_eos=True).end_ids([7]) == set()
    hash(p)


def test_penalties_match_reference() -> None:
    logits = _logits(0)
    history = [1, 2, 2, 5, 9, 9, 9, 63]
    p = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25)
    ours = apply_penalties(logits, history, p).numpy()
    ref = _ref_penalties(logits.numpy(), history, 1.3, 0.5, 0.25)
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-6)
    last = SamplingParams(repetition_penalty=2.0, penalty_last_n=3)
    ours = apply_penalties(logits, history, last).numpy()
    np.testing.assert_allclose(ours, _ref_penalties(logits.numpy(), history[-3:], 2.0, 0, 0), rtol=1e-6)
    assert torch.equal(apply_penalties(logits, [], p), logits)


def test_greedy_is_argmax_of_penalised_logits() -> None:
    for seed in range(20):
        logits = _logits(seed)
        history = [int(torch.argmax(logits))]
        assert Sampler(SamplingParams(temperature=0))(logits, history) == int(np.argmax(logits.numpy()))
        p = SamplingParams(temperature=0, repetition_penalty=5.0, presence_penalty=2.0)
        ref = _ref_penalties(logits.numpy(), history, 5.0, 0.0, 2.0)
        assert Sampler(p)(logits, history) == int(np.argmax(ref))
        assert Sampler(SamplingParams(top_k=1, seed=seed))(logits) == int(np.argmax(logits.numpy()))


def test_top_k_matches_torch_topk() -> None:
    for k in (1, 5, 17, V):
        logits = _logits(k)
        kept = torch.isfinite(apply_top_k(logits, k)).nonzero().flatten().tolist()
        assert sorted(kept) == sorted(torch.topk(logits, k).indices.tolist())
    assert torch.equal(apply_top_k(_logits(1), 0), _logits(1))


def test_top_p_keeps_smallest_prefix() -> None:
    for seed, p in [(0, 0.1), (1, 0.5), (2, 0.9), (3, 0.999), (4, 1.0)]:
        logits = _logits(seed)
        kept = set(torch.isfinite(apply_top_p(logits, p)).nonzero().flatten().tolist())
        assert kept == _ref_top_p_keep(logits.numpy().astype(np.float64), p)


def _sorted_top_k(logits: torch.Tensor, k: int) -> set[int]:
    return set(torch.sort(logits, descending=True, stable=True).indices[:k].tolist())


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])  # flat (top-p needs thousands of tokens) to peaked
def test_top_k_and_top_p_on_a_vocabulary_with_ties_match_a_full_sort(scale: float) -> None:
    """The partial selections against a full stable sort (top-k) and the float64 reference (top-p), on a
    102400-token row whose values repeat (rounded to 1/8), so ties sit at every boundary."""
    logits = torch.round(_logits(int(scale * 10), 102400) * scale * 8) / 8
    logits[torch.arange(0, 102400, 97)] = -math.inf  # a grammar's or a filter's exclusions
    for k in (1, 40, 257, 5000):
        kept = set(torch.isfinite(apply_top_k(logits, k)).nonzero().flatten().tolist())
        assert kept == _sorted_top_k(logits, k), k
    for p in (0.3, 0.9, 0.95, 0.999):
        kept = set(torch.isfinite(apply_top_p(logits, p)).nonzero().flatten().tolist())
        assert kept == _ref_top_p_keep(logits.numpy().astype(np.float64), p), p


def test_the_key_sort_orders_as_torch_stable_sort() -> None:
    """top-p's order (numpy sort of integer keys) against torch's stable descending sort: ties by lower id, -0.0
    tying 0.0, subnormals, extremes, and -inf tokens left out."""
    for seed in range(4):
        y = torch.round(torch.randn(5000, generator=torch.Generator().manual_seed(seed)) * 4) / 4
        y[::7], y[::11], y[::17], y[::19], y[::23], y[::29] = -0.0, 0.0, 3e38, -3e38, 1e-40, -1e-40
        y[::31] = -math.inf
        want = torch.sort(y, descending=True, stable=True).indices
        want = want[y[want] > -math.inf]
        assert torch.equal(descending(y, y.numel()), want)
        head = descending(y, 100)  # the 100 largest and every tie of the 100th
        assert torch.equal(head, want[:len(head)]) and len(head) >= 100


def test_min_p_matches_reference() -> None:
    logits = _logits(7)
    probs = torch.softmax(logits.double(), -1).numpy()
    for m in (0.01, 0.1, 0.5, 1.0):
        kept = set(torch.isfinite(apply_min_p(logits, m)).nonzero().flatten().tolist())
        assert kept == {i for i in range(V) if probs[i] >= m * probs.max() * (1 - 1e-9)}


def test_process_order_penalties_temperature_filters() -> None:
    logits, history = _logits(11), [3, 3, 8]
    p = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05, repetition_penalty=1.2, seed=0)
    ref = _ref_penalties(logits.numpy(), history, 1.2, 0, 0) / 0.7
    top20 = set(np.argsort(-ref, kind="stable")[:20].tolist())
    masked = np.where([i in top20 for i in range(V)], ref, -np.inf)
    keep = _ref_top_p_keep(masked, 0.8)
    masked = np.where([i in keep for i in range(V)], masked, -np.inf)
    probs = np.exp(masked - masked.max())
    keep = {i for i in range(V) if probs[i] >= 0.05 * probs.max()}
    out = Sampler(p).process(logits, history)
    assert set(torch.isfinite(out).nonzero().flatten().tolist()) == keep
    np.testing.assert_allclose(out[sorted(keep)].numpy(), ref[sorted(keep)], rtol=1e-5)


def test_seed_determinism_and_distribution() -> None:
    logits = _logits(3, 8)
    a = [Sampler(SamplingParams(seed=42))(logits) for _ in range(3)]
    s1, s2 = Sampler(SamplingParams(seed=42)), Sampler(SamplingParams(seed=42))
    seq1 = [s1(logits) for _ in range(200)]
    assert seq1 == [s2(logits) for _ in range(200)] and len(set(a)) == 1
    s3 = Sampler(SamplingParams(seed=43))
    assert seq1 != [s3(logits) for _ in range(200)]
    draws = np.bincount([s1(logits) for _ in range(4000)], minlength=8) / 4000
    probs = torch.softmax(logits.double(), -1).numpy()
    np.testing.assert_allclose(draws, probs, atol=0.03)
    assert Sampler(SamplingParams(seed=1))(logits.to(torch.bfloat16)) in range(8)


def _run_stop(pieces: list[str], stop: list[str], include: bool = False) -> tuple[str, bool]:
    sc = StopChecker(stop, include)
    out = []
    for piece in pieces:
        text, stopped = sc.push(piece)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + sc.flush(), False


def test_stop_strings_across_tokens() -> None:
    assert _run_stop(["Hel", "lo", " wo", "rld", "!"], ["o wor"]) == ("Hell", True)
    assert _run_stop(["ab", "c<", "|e", "nd|>", "tail"], ["<|end|>"]) == ("abc", True)
    assert _run_stop(["ab", "c<", "|x"], ["<|end|>"]) == ("abc<|x", False)
    sc = StopChecker(["###"])
    assert sc.push("a#") == ("a", False) and sc.push("#b") == ("##b", False) and sc.push("##") == ("", False)
    assert sc.push("#") == ("", True) and sc.matched == "###"


def test_stop_strings_random_splits() -> None:
    rng = random.Random(0)
    alphabet = "ab<|>\n "
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        hits = [text.find(s) for s in stops if s in text]
        expected = (text[: min(hits)], True) if hits else (text, False)
        assert _run_stop(pieces, stops) == expected, (text, stops, pieces)
        if hits:  # include_stop_str_in_output: through the first stop string found (at a tie, the least)
            first = min((text.find(s), s) for s in stops if s in text)
            assert _run_stop(pieces, stops, include=True) == (text[: first[0] + len(first[1])], True)


def test_draw_follows_softmax_and_never_takes_an_excluded_token() -> None:
    """The inverse-CDF draw against the distribution it samples: frequencies within 4 standard errors of
    softmax(x) over 40000 draws, and tokens at -inf (a filter's or a grammar's) never drawn."""
    x = _logits(11, 24)
    x[[0, 5, 23]] = -math.inf  # the first and the last ids among them: the edges of the cumulative sum
    gen = torch.Generator().manual_seed(3)
    counts = np.bincount([draw(x, gen) for _ in range(40000)], minlength=24)
    probs = torch.softmax(x.double(), -1).numpy()
    assert counts[[0, 5, 23]].sum() == 0
    np.testing.assert_array_less(np.abs(counts / 40000 - probs), 4 * np.sqrt(probs * (1 - probs) / 40000) + 1e-9)
    xb = x.to(torch.bfloat16)
    assert argmax(torch.tensor([1.0, 3.0, 3.0, -2.0])) == 1 and argmax(xb) == int(torch.argmax(xb))


def test_min_tokens_holds_back_the_end_ids() -> None:
    """The end ids cannot be drawn for min_tokens draws, whatever their logits; after that they win again."""
    logits = _logits(5, 16)
    logits[7] = logits[3] = 50.0
    for temperature in (0.0, 1.0):
        sampler = Sampler(SamplingParams(temperature=temperature, seed=1, min_tokens=4, stop_token_ids=(7, 3)))
        draws = [sampler(logits) for _ in range(6)]
        assert all(d not in (3, 7) for d in draws[:4]) and all(d in (3, 7) for d in draws[4:])
    with pytest.raises(SamplingParamsError, match="min_tokens"):
        SamplingParams(min_tokens=9, max_tokens=8)


@pytest.mark.parametrize("kw", [dict(temperature=1.3, top_k=5), dict(temperature=0.7, top_p=0.8),
                                dict(temperature=1.0, min_p=0.1, repetition_penalty=1.5)],
                         ids=["top_k", "top_p", "min_p+penalty"])
def test_processed_logprobs_are_the_distribution_drawn_from(kw: dict) -> None:
    """logprobs_mode processed_logprobs: the entry's logprobs are those of softmax over the kept tokens, computed
    here from the filters' definitions (numpy), and 8000 seeded draws land on each token at that rate."""
    logits, history = _logits(21), [3, 3, 7]
    x = _ref_penalties(logits.numpy(), history, kw.get("repetition_penalty", 1.0), 0, 0) / kw["temperature"]
    if "top_k" in kw:
        keep = set(np.argsort(-x, kind="stable")[:kw["top_k"]].tolist())
    elif "top_p" in kw:
        keep = _ref_top_p_keep(x, kw["top_p"])
    else:
        keep = {i for i in range(V) if x[i] >= x.max() + math.log(kw["min_p"])}
    ids = sorted(keep)
    ref = np.full(V, -np.inf)
    ref[ids] = x[ids] - x.max() - np.log(np.exp(x[ids] - x.max()).sum())
    counts = np.zeros(V)
    for seed in range(8000):
        s = Sampler(SamplingParams(**kw, seed=seed, logprobs=3, logprobs_mode="processed_logprobs"))
        t = s(logits, history)
        counts[t] += 1
        if seed < 50:
            e = s.logprob(logits, t)
            assert e.logprob == pytest.approx(ref[t], abs=1e-5) and e.rank == 1 + int((ref > ref[t] + 1e-9).sum())
            want = sorted(ids, key=lambda i: -ref[i])[:3]
            assert [i for i, _ in e.top] == want and [lp for _, lp in e.top] == pytest.approx(ref[want], abs=1e-5)
    p = np.exp(ref)
    assert counts[p == 0].sum() == 0
    np.testing.assert_array_less(np.abs(counts / 8000 - p), 4 * np.sqrt(p * (1 - p) / 8000) + 1e-9)


def test_processed_logprobs_of_greedy_and_raw_mode() -> None:
    """Greedy draws its token with probability 1 (llama.cpp's post-sampling probs); raw_logprobs ignore the
    temperature and filters; no logprobs asked, no entry."""
    logits = _logits(4)
    g = Sampler(SamplingParams(temperature=0, logprobs=2, logprobs_mode="processed_logprobs"))
    t = g(logits)
    e = g.logprob(logits, t)
    assert (e.token_id, e.logprob, e.rank, e.top) == (t, 0.0, 1, ((t, 0.0),))
    raw = Sampler(SamplingParams(temperature=0.5, top_k=2, seed=1, logprobs=2))
    t = raw(logits)
    lp = torch.log_softmax(logits.double(), -1)
    assert raw.logprob(logits, t).logprob == pytest.approx(float(lp[t]), abs=1e-5)
    assert Sampler(SamplingParams()).logprob(logits, 0) is None
    with pytest.raises(SamplingParamsError, match="logprobs_mode"):
        SamplingParams(logprobs_mode="processed")


def _indent_cut(text: str, n: int) -> int | None:
    """Where llama.cpp's n_indent ends `text`: at the first character of the first line after a newline that
    starts with fewer than n spaces or tabs and has another character (a newline too) after them."""
    for m in re.finditer(r"\n([ \t]*)(?=[^ \t])", text):
        if len(m.group(1)) < n:
            return m.end()
    return None


def test_n_indent_ends_at_the_first_line_indented_less() -> None:
    """StopChecker's n_indent over random texts, split into random tokens and with stop strings beside it, against
    a regular expression over the whole text: the output ends before the first under-indented line's first
    character (its spaces kept), as a limit (`limited`, no stop string matched) unless a stop string comes first."""
    rng = random.Random(3)
    alphabet = "ab \t\n\n"
    limited = 0
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        n = rng.randint(0, 3)
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randint(1, 3)))] if rng.random() < 0.5 else []
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        sc = StopChecker(stops, n_indent=n)
        out = ""
        for piece in pieces:
            shown, stopped = sc.push(piece)
            out += shown
            if stopped:
                break
        out += sc.end("")
        hits = [text.find(s) for s in stops if s in text]
        before_stop = text[:min(hits)] if hits else text
        cut = _indent_cut(before_stop, n) if n else None
        assert out == (before_stop if cut is None else before_stop[:cut]), (text, n, stops, pieces)
        assert (sc.limited, sc.stopped, sc.matched is not None) == (cut is not None, cut is not None or bool(hits),
                                                                      cut is None and bool(hits))
        limited += cut is not None
    assert limited > 300  # the cases reach the rule
    sc = StopChecker([], n_indent=4)  # a worked case: the block's lines, then the dedented line's own spaces
    assert sc.push("if x:\n    y = 1\n") == ("if x:\n    y = 1\n", False)
    assert sc.push("  z") == ("  ", True) and sc.limited
    with pytest.raises(SamplingParamsError, match="n_indent"):
        SamplingParams(n_indent=-1)
