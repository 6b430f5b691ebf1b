"""llama.cpp's sampler chain (a request's `samplers`) against llama.cpp's own samplers, run through llama-cpp-python's
C API on the same candidates: after each chain, in any order, the same tokens are left with the same logits (so the
draw, a softmax over those, is over the same distribution), the infill step included."""

from __future__ import annotations

import ctypes
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pocketmoe.engine.sampler import Sampler, SamplingParams, SamplingParamsError, apply_infill, infill_vocab
from pocketmoe.engine.structured import Grammar
from pocketmoe.gguf import open_bundle
from pocketmoe.testing.synth import write_fixture
from pocketmoe.tokenizer import Tokenizer

llama_cpp = pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):  # noqa: ANN201
    """(our tokenizer, llama.cpp's vocabulary) of one GGUF file."""
    path = write_fixture("deepseek2", "tiny", "Q8_0", tmp_path_factory.mktemp("chain") / "m.gguf")[0]
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    assert model
    yield Tokenizer.from_metadata(open_bundle(path).metadata), llama_cpp.llama_model_get_vocab(model)
    llama_cpp.llama_model_free(model)


def theirs(lib_vocab, logits: torch.Tensor, chain: tuple[str, ...], p: SamplingParams,  # noqa: ANN001
           history: Sequence[int] = ()) -> dict[int, float]:
    """The candidates llama.cpp's samplers leave, in this order, given the finite logits (and the history its DRY
    sampler has accepted): {id: logit}."""
    given = [(i, v) for i, v in enumerate(logits.tolist()) if v > -math.inf]
    n = len(given)
    arr = (llama_cpp.llama_token_data * n)(*[llama_cpp.llama_token_data(i, v, 0.0) for i, v in given])
    cur = llama_cpp.llama_token_data_array(arr, n, -1, False)
    make = {"top_k": lambda: llama_cpp.llama_sampler_init_top_k(p.top_k),
            "top_p": lambda: llama_cpp.llama_sampler_init_top_p(p.top_p, p.min_keep),
            "min_p": lambda: llama_cpp.llama_sampler_init_min_p(p.min_p, p.min_keep),
            "temperature": lambda: llama_cpp.llama_sampler_init_temp_ext(p.temperature, p.dynatemp_range,
                                                                         p.dynatemp_exponent),
            "infill": lambda: llama_cpp.llama_sampler_init_infill(lib_vocab),
            "typical_p": lambda: llama_cpp.llama_sampler_init_typical(p.typical_p, p.min_keep),
            "top_n_sigma": lambda: llama_cpp.llama_sampler_init_top_n_sigma(p.top_n_sigma),
            "xtc": lambda: llama_cpp.llama_sampler_init_xtc(p.xtc_probability, p.xtc_threshold, p.min_keep, 7),
            "dry": lambda: llama_cpp.llama_sampler_init_dry(
                lib_vocab, p.dry_multiplier, p.dry_base, p.dry_allowed_length,
                # -1: llama-server's whole context (its training length, past any history here); the C API, which
                # is not given that length, reads -1 as none
                p.dry_penalty_last_n if p.dry_penalty_last_n >= 0 else 1 << 16,
                (ctypes.c_char_p * len(p.dry_sequence_breakers))(*[b.encode() for b in p.dry_sequence_breakers]),
                len(p.dry_sequence_breakers))}
    for step in chain:
        s = make[step]()
        if step == "dry":
            for t in history:
                llama_cpp.llama_sampler_accept(s, t)
        llama_cpp.llama_sampler_apply(s, ctypes.byref(cur))
        llama_cpp.llama_sampler_free(s)
    return {cur.data[i].id: cur.data[i].logit for i in range(cur.size) if cur.data[i].logit > -math.inf}


def ours(tok: Tokenizer, logits: torch.Tensor, p: SamplingParams, history: Sequence[int] = ()) -> dict[int, float]:
    ids, x = Sampler(p, tok)._candidates(logits, list(history))
    return dict(zip(ids.tolist(), x.tolist(), strict=True))


def scene(tok: Tokenizer, rng: random.Random) -> torch.Tensor:
    """Logits where tokens whose texts begin one another are among the likeliest, and the end of generation now and
    then too (so every branch of the infill step is taken)."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    x = torch.randn(tok.vocab_size, generator=g) * rng.choice([0.5, 1.0, 3.0])
    pieces = [tok.token_to_piece(i, special=False) for i in range(tok.vocab_size)]
    by_text = {t: i for i, t in enumerate(pieces) if t}
    for _ in range(rng.randrange(1, 5)):
        long = rng.choice([i for i, t in enumerate(pieces) if len(t) >= 3])
        for k in range(1, len(pieces[long]) + 1):
            if pieces[long][:k] in by_text:
                x[by_text[pieces[long][:k]]] = 4.0 + rng.random() * 3
    if rng.random() < 0.4:
        x[list(tok.eot_ids)] = 3.0 + rng.random() * 5
    return x


def test_every_order_leaves_llama_cpps_candidates(vocab) -> None:  # noqa: ANN001
    tok, lib_vocab = vocab
    rng = random.Random(0)
    orders = [o for n in range(1, 6) for o in itertools.permutations(
        ("top_k", "top_p", "min_p", "temperature", "infill"), n)
        if "infill" not in o or "top_k" in o[:o.index("infill")]]
    checked = set()
    for trial in range(400):
        chain = rng.choice(orders)
        p = SamplingParams(temperature=rng.choice([0.0, 0.3, 0.8, 1.7]), top_k=rng.choice([5, 40, 200]),
                           top_p=rng.choice([0.5, 0.9, 0.99, 1.0]), min_p=rng.choice([0.0, 0.05, 0.2]),
                           chain=chain)
        x = scene(tok, rng)
        want, got = theirs(lib_vocab, x, chain, p), ours(tok, x, p)
        assert got.keys() == want.keys(), (trial, chain)
        assert all(math.isclose(got[i], want[i], rel_tol=1e-6, abs_tol=1e-6) for i in got), (trial, chain)
        checked.add(len(got))
    assert len(checked) > 5  # from one token left to many


def test_infill_branches_against_llama_cpp(vocab) -> None:  # noqa: ANN001
    """The three ends of the infill step, each seen: the end of generation alone, merged prefixes and thresholds,
    and no text left (the end-of-turn token alone, whatever the candidates)."""
    tok, lib_vocab = vocab
    eog, pieces, fallback = infill_vocab(tok)
    rng = random.Random(1)
    seen = set()
    for _ in range(300):
        x = scene(tok, rng)
        x = torch.where(x >= torch.topk(x, 40).values[-1], x, torch.full_like(x, -math.inf))
        ids, got = apply_infill(torch.arange(x.numel()), x, eog, pieces, fallback)
        kept = {i: v for i, v in zip(ids.tolist(), got.tolist(), strict=True) if v > -math.inf}
        assert kept == pytest.approx(theirs(lib_vocab, x, ("infill",), SamplingParams()))
        seen.add("eog" if set(kept) <= set(tok.eot_ids) and kept != {fallback: 1.0} else
                 "fallback" if kept == {fallback: 1.0} else "text")
    assert seen == {"eog", "fallback", "text"}


def test_chain_rules(vocab) -> None:  # noqa: ANN001
    tok, _ = vocab
    with pytest.raises(SamplingParamsError, match="chain"):
        SamplingParams(chain=("top_k", "mirostat"))
    with pytest.raises(SamplingParamsError, match="infill"):
        SamplingParams(top_k=40, chain=("infill", "top_k"))
    with pytest.raises(SamplingParamsError, match="infill"):
        SamplingParams(top_k=0, chain=("top_k", "infill"))
    for bad in ({"grammar": Grammar.json_object()}, {"min_tokens": 3}):
        with pytest.raises(SamplingParamsError, match="infill ends it"):
            SamplingParams(top_k=40, chain=("top_k", "infill"), **bad)
    with pytest.raises(SamplingParamsError, match="tokenizer"):
        Sampler(SamplingParams(top_k=40, chain=("top_k", "infill")))
    x = scene(tok, random.Random(2))
    # no temperature step: temperature 0 is not greedy (llama.cpp then draws at temperature 1)
    p = SamplingParams(temperature=0.0, top_k=40, chain=("top_k",))
    assert not p.greedy and len(ours(tok, x, p)) == 40
    # with one, temperature 0 keeps the most likely token, wherever the step is
    p = SamplingParams(temperature=0.0, top_k=40, chain=("temperature", "top_k"))
    assert p.greedy and list(ours(tok, x, p)) == [int(x.argmax())]
    # penalties run only where the chain has them
    hist = [int(x.argmax())] * 3
    plain = SamplingParams(temperature=1.0, repetition_penalty=1.5, chain=("temperature",))
    assert Sampler(plain, tok)._candidates(x, hist)[1].tolist() == x.tolist()
    assert Sampler(SamplingParams(temperature=1.0, repetition_penalty=1.5, chain=("penalties", "temperature")),
                   tok)._candidates(x, hist)[1].tolist() != x.tolist()


def test_fixture_has_what_the_checks_need(vocab, tmp_path: Path) -> None:  # noqa: ANN001
    tok, _ = vocab
    pieces = [tok.token_to_piece(i, special=False) for i in range(tok.vocab_size)]
    assert sum(1 for a in pieces for b in pieces if a and a != b and b.startswith(a)) > 100
    assert tok.eot_id is not None and not pieces[tok.eot_id]


def history_with_repeats(tok: Tokenizer, rng: random.Random) -> list[int]:
    """A history whose end repeats earlier stretches (what DRY penalizes), some of them across a sequence breaker."""
    newline = tok.encode("\n", False, False)
    base = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(4, 30))]
    out = list(base)
    for _ in range(rng.randrange(1, 4)):
        at = rng.randrange(len(out))
        out += out[at:at + rng.randrange(1, 12)]
        if rng.random() < 0.3:
            out += newline
        out += [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 4))]
    if rng.random() < 0.7:  # the end repeats an earlier stretch
        at = rng.randrange(len(out) - 1)
        out += out[at:at + rng.randrange(1, 8)]
    return out


LLAMA_STEPS = ("dry", "top_n_sigma", "top_k", "typical_p", "top_p", "min_p", "xtc", "temperature")


def test_llamas_other_samplers_leave_its_candidates(vocab) -> None:  # noqa: ANN001
    """DRY, top-n-sigma, typical, XTC (at probability 1 and 0: one draw decides it, and each side draws its own) and
    dynamic temperature, in random orders beside the others, with random histories: llama.cpp's candidates and
    logits."""
    tok, lib_vocab = vocab
    rng = random.Random(3)
    seen: dict[str, set[bool]] = {}
    for trial in range(400):
        chain = tuple(rng.sample(LLAMA_STEPS, rng.randrange(1, len(LLAMA_STEPS) + 1)))
        if "typical_p" in chain and "top_n_sigma" in chain[:chain.index("typical_p")]:
            # llama.cpp's typical sampler then takes the entropy of the tokens top-n-sigma set to -inf, but still
            # holds, as NaN (0 * log 0), and orders by it: no order to compare with
            chain = tuple(s for s in chain if s != "top_n_sigma")
        p = SamplingParams(temperature=rng.choice([0.3, 0.8, 1.7]), top_k=rng.choice([0, 5, 40, 200]),
                           top_p=rng.choice([0.5, 0.95, 1.0]), min_p=rng.choice([0.0, 0.05]),
                           typical_p=rng.choice([0.2, 0.5, 0.9, 1.0]), top_n_sigma=rng.choice([-1.0, 0.5, 1.0, 2.5]),
                           xtc_probability=rng.choice([0.0, 1.0]), xtc_threshold=rng.choice([0.02, 0.1, 0.3]),
                           dynatemp_range=rng.choice([0.0, 0.5, 1.5]), dynatemp_exponent=rng.choice([0.5, 1.0, 2.0]),
                           dry_multiplier=rng.choice([0.0, 0.8, 3.0]), dry_base=rng.choice([1.75, 2.0]),
                           dry_allowed_length=rng.choice([1, 2, 3]), dry_penalty_last_n=rng.choice([-1, 8, 64]),
                           dry_sequence_breakers=rng.choice([("\n", ":", "\"", "*"), ("\n",), ("ab", "zz")]),
                           chain=chain)
        x = scene(tok, rng)
        history = history_with_repeats(tok, rng)
        if "typical_p" in chain:
            before = list(ours(tok, x, replace(p, chain=chain[:chain.index("typical_p")]), history).values())
            if max(before) - min(before) > 100:
                # a candidate's float32 probability underflows to 0 (a long run's DRY penalty): llama.cpp's typical
                # sampler then takes an entropy of NaN (0 * log 0) and orders by it; here that token has none
                p = replace(p, chain=tuple(s for s in chain if s != "typical_p"))
                chain = p.chain
        want, got = theirs(lib_vocab, x, chain, p, history), ours(tok, x, p, history)
        assert got.keys() == want.keys(), (trial, chain, p)
        assert all(math.isclose(got[i], want[i], rel_tol=1e-5, abs_tol=1e-5) for i in got), (trial, chain, p)
        unchanged = ours(tok, x, replace(p, chain=tuple(s for s in chain if s not in ("dry", "top_n_sigma",
                                                                                       "typical_p", "xtc"))))
        for step, on in (("dry", p.dry_multiplier > 0), ("typical_p", p.typical_p < 1),
                         ("top_n_sigma", p.top_n_sigma > 0), ("xtc", p.xtc_probability > 0)):
            if step in chain and on:
                seen.setdefault(step, set()).add(got != unchanged)
    assert all(True in seen[s] for s in ("dry", "typical_p", "top_n_sigma", "xtc"))  # each changed some candidates


def test_min_keep_leaves_llama_cpps_candidates(vocab) -> None:  # noqa: ANN001
    """min_keep (llama.cpp's): top-p, min-p, typical and XTC each leave at least that many candidates, in any order
    beside top-k and the temperature, as llama.cpp's samplers given it do; the filters set to cut deep, so it often
    decides."""
    tok, lib_vocab = vocab
    rng = random.Random(5)
    steps = ("top_k", "typical_p", "top_p", "min_p", "xtc", "temperature")
    decided = 0
    for trial in range(300):
        chain = tuple(rng.sample(steps, rng.randrange(1, len(steps) + 1)))
        p = SamplingParams(temperature=rng.choice([0.5, 1.0]), top_k=rng.choice([0, 8, 100]),
                           top_p=rng.choice([0.2, 0.6, 1.0]), min_p=rng.choice([0.0, 0.1, 0.5]),
                           typical_p=rng.choice([0.1, 0.4, 1.0]), xtc_probability=rng.choice([0.0, 1.0]),
                           xtc_threshold=rng.choice([0.01, 0.05]), min_keep=rng.choice([0, 1, 2, 5, 30, 400]),
                           chain=chain)
        x = scene(tok, rng)
        want, got = theirs(lib_vocab, x, chain, p), ours(tok, x, p)
        assert got.keys() == want.keys(), (trial, chain, p.min_keep)
        assert all(math.isclose(got[i], want[i], rel_tol=1e-5, abs_tol=1e-5) for i in got), (trial, chain)
        decided += len(got) != len(ours(tok, x, replace(p, min_keep=0)))
    assert decided > 30  # min_keep changed what was left in many trials


def test_min_keep_off_the_chain_too(vocab) -> None:  # noqa: ANN001
    """Without a chain (the /v1 routes' top-k, top-p, min-p) min_keep holds as well: llama.cpp's order of those."""
    tok, lib_vocab = vocab
    rng = random.Random(6)
    for _ in range(50):
        p = SamplingParams(temperature=0.7, top_k=rng.choice([0, 50]), top_p=rng.choice([0.3, 1.0]),
                           min_p=rng.choice([0.0, 0.4]), min_keep=rng.choice([3, 20, 300]))
        x = scene(tok, rng)
        want = theirs(lib_vocab, x / p.temperature, ("top_k", "top_p", "min_p"), p)
        got = {i: v for i, v in enumerate(Sampler(p, tok).process(x).tolist()) if v > -math.inf}
        assert got.keys() == want.keys() and got == pytest.approx(want, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_keeps_llama_cpps_candidates_as_mu_moves(vocab, version: int) -> None:  # noqa: ANN001
    """Mirostat over 12 tokens a run: each token's candidates are the ones llama.cpp's sampler leaves, where mu has
    moved by the surprise of the token llama.cpp drew (its own draw: the two draw with different generators)."""
    from pocketmoe.engine.sampler import MIROSTAT_CHAIN

    tok, _ = vocab
    rng = random.Random(5)
    sizes = set()
    for tau, eta, temp in ((3.0, 0.1, 0.8), (5.0, 0.5, 1.0), (2.0, 0.3, 1.5)):
        p = SamplingParams(temperature=temp, mirostat=version, mirostat_tau=tau, mirostat_eta=eta, chain=MIROSTAT_CHAIN)
        mine = Sampler(p, tok)
        theirs_ = (llama_cpp.llama_sampler_init_mirostat(tok.vocab_size, 1, tau, eta, 100) if version == 1 else
                   llama_cpp.llama_sampler_init_mirostat_v2(1, tau, eta))
        try:
            for step in range(12):
                x = scene(tok, rng)
                n = x.numel()
                arr = (llama_cpp.llama_token_data * n)(*[llama_cpp.llama_token_data(i, v, 0.0)
                                                         for i, v in enumerate(x.tolist())])
                cur = llama_cpp.llama_token_data_array(arr, n, -1, False)
                temp_s = llama_cpp.llama_sampler_init_temp(temp)
                llama_cpp.llama_sampler_apply(temp_s, ctypes.byref(cur))
                llama_cpp.llama_sampler_free(temp_s)
                llama_cpp.llama_sampler_apply(theirs_, ctypes.byref(cur))
                want = {cur.data[i].id for i in range(cur.size)}
                drawn = cur.data[cur.selected].id
                ids, xs = mine._candidates(x, [])
                assert set(ids.tolist()) == want, (tau, eta, step)
                mine.mirostat.observe(xs, int(torch.nonzero(ids == drawn)[0]))
                sizes.add(len(want))
        finally:
            llama_cpp.llama_sampler_free(theirs_)
    assert len(sizes) > 3  # mu moved the cut


def test_greedy_keeps_what_dry_and_xtc_leave(vocab) -> None:  # noqa: ANN001
    """Temperature 0 in a chain with DRY or XTC: the most likely token of what they leave (llama.cpp's temperature
    step keeps the largest logit it is given), not of the model's logits."""
    tok, _ = vocab
    x = torch.zeros(tok.vocab_size)
    x[7], x[9] = 5.0, 4.0
    history = [1, 2, 3, 7, 4, 1, 2, 3]  # "1 2 3" was followed by 7: DRY pushes 7 down
    dry = SamplingParams(temperature=0.0, dry_multiplier=3.0, chain=("dry", "temperature"))
    assert Sampler(dry, tok)(x, history) == 9
    xtc = SamplingParams(temperature=0.0, xtc_probability=1.0, xtc_threshold=0.1, top_k=2,
                         chain=("top_k", "xtc", "temperature"))
    assert Sampler(xtc, tok)(x, []) == 9  # 7 and 9 both above the threshold: the likelier goes
    assert Sampler(SamplingParams(temperature=0.0, chain=("temperature",)), tok)(x, history) == 7
