"""The serving engine's scheduler without HTTP: preemption, chunked prefill beside decode, aborts, the queue cap.

Each sequence's tokens are checked against the same request run alone in the same engine (greedy,
ignore_eos), which is what a client sees when the server is idle.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from pocketmoe import native
from pocketmoe.engine import ModelRunner, RunnerConfig, Step
from pocketmoe.engine.kv_cache import PAGE
from pocketmoe.engine.sampler import SamplingParams
from pocketmoe.engine.structured import Constraint, Grammar, GrammarError
from pocketmoe.gguf import open_bundle
from pocketmoe.serve.engine import Engine, EngineConfig, QueueFullError
from pocketmoe.serve.metrics import Metrics
from pocketmoe.testing.synth import write_fixture
from pocketmoe.tokenizer import Tokenizer

BACKEND = "native" if native.available() else "reference"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_fixture("deepseek2", "tiny", "Q4_K_M", tmp_path_factory.mktemp("eng") / "m.gguf", seed=13)[0]


def make_engine(model: Path, n_ctx: int, kv_bytes: int | None = None, chunk: int = 256, seqs: int = 8,
                max_queue: int = 64, prefix_caching: bool | None = None) -> tuple[Engine, list[Step]]:
    bundle = open_bundle(model)
    runner = ModelRunner(bundle, RunnerConfig(n_ctx=n_ctx, backend=BACKEND, threads=1, max_seqs=seqs,
                                              kv_cache_bytes=kv_bytes, chunk_size=chunk))
    steps: list[Step] = []
    run_step = runner.run_step

    def recorded(step):  # noqa: ANN001, ANN202
        steps.append(step)
        return run_step(step)

    runner.run_step = recorded  # type: ignore[method-assign]
    eng = Engine(runner, Tokenizer.from_metadata(bundle.metadata), EngineConfig(seqs, max_queue, chunk, n_ctx, prefix_caching),
                 Metrics())
    return eng, steps


def greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


async def tokens(eng: Engine, prompt: list[int], n: int) -> list[int]:
    req = eng.submit(prompt, [greedy(n)])
    return [t async for d in req.deltas() for t in d.token_ids]


def run(coro):  # noqa: ANN001, ANN201
    return asyncio.run(coro)


async def together(eng: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt's greedy tokens, all submitted at once."""
    return list(await asyncio.gather(*(tokens(eng, p, n) for p in prompts)))


def one_at_a_time(model: Path, prompts: list[list[int]], n: int, **engine_kw: object) -> tuple[list[list[int]], Engine]:
    """Each prompt's greedy tokens from a fresh engine, one request after the other (and the stopped engine)."""
    eng, _ = make_engine(model, **engine_kw)  # type: ignore[arg-type]
    eng.start()
    out = [run(tokens(eng, p, n)) for p in prompts]
    eng.stop()
    return out, eng


def kv_bytes_of(eng: Engine, pages: int) -> int:
    """The float32 KV budget of `pages` pages for eng's model."""
    return pages * PAGE * eng.runner.model.n_layer * eng.runner.spec.kv_values_per_token() * 4


PROMPTS = [[5 + i + 3 * j for j in range(10)] for i in range(3)]


def test_preempted_sequences_resume_with_their_solo_tokens(model: Path) -> None:
    alone, eng = one_at_a_time(model, PROMPTS, 30, n_ctx=48, seqs=3)
    # 5 pages of 16 positions for three sequences of 40: the newest is preempted and recomputed
    small, steps = make_engine(model, n_ctx=48, kv_bytes=kv_bytes_of(eng, 5), seqs=3)
    assert small.cache.n_pages == 5
    small.start()
    assert run(together(small, PROMPTS, 30)) == alone
    small.stop()
    assert small.metrics.preemptions._value.get() > 0
    assert small.cache.used_pages == 0


def test_long_prefill_runs_in_chunks_beside_running_decode(model: Path) -> None:
    # without the prefix cache, which would give the second run of the long prompt its pages
    eng, steps = make_engine(model, n_ctx=256, chunk=16, prefix_caching=False)
    eng.start()
    long_prompt = [(7 * i) % 400 + 3 for i in range(100)]
    alone_long = run(tokens(eng, long_prompt, 5))

    async def both() -> tuple[list[int], list[int]]:
        a = eng.submit([1, 2, 3], [greedy(60)])
        got_a: list[int] = []
        async for d in a.deltas():
            got_a += d.token_ids
            if len(got_a) == 3:
                break
        first = len(steps)
        b = asyncio.ensure_future(tokens(eng, long_prompt, 5))
        async for d in a.deltas():
            got_a += d.token_ids
        return got_a, await b, first

    steps.clear()
    got_a, got_b, first = run(both())
    eng.stop()
    assert got_b == alone_long and len(got_a) == 60
    prefill = [s for s in steps[first:] if any(len(c.tokens) > 1 for c in s.chunks)]
    assert len(prefill) >= 100 // 16
    for s in prefill:
        assert sum(len(c.tokens) for c in s.chunks if len(c.tokens) > 1) <= 16
        assert any(len(c.tokens) == 1 for c in s.chunks), "a prefill chunk ran without the running decode"


def test_abort_mid_prefill_frees_the_pages_before_the_next_step(model: Path) -> None:
    eng, steps = make_engine(model, n_ctx=256, chunk=16)
    eng.start()

    async def go() -> None:
        req = eng.submit(list(range(3, 203)), [greedy(5)])
        while not steps:
            await asyncio.sleep(0.001)
        eng.abort(req)
        n = len(steps)
        while eng.cache.used_pages and len(steps) <= n + 1:
            await asyncio.sleep(0.001)
        assert eng.cache.used_pages == 0
        key = req.seqs[0].key
        assert all(c.seq != key for s in steps[n + 1:] for c in s.chunks)

    run(go())
    eng.stop()


def test_queue_cap(model: Path) -> None:
    eng, _ = make_engine(model, n_ctx=64, max_queue=2)

    async def go() -> None:
        eng.submit([1, 2], [greedy(2)])
        eng.submit([1, 2], [greedy(2)])
        with pytest.raises(QueueFullError, match="2 requests waiting"):
            eng.submit([1, 2], [greedy(2)])

    run(go())


def test_prompt_logprobs_across_chunks(model: Path) -> None:
    """Echo logprobs of a prompt prefilled in three chunks: entry p is log_softmax(logits at p - 1)[token p]."""
    import torch

    eng, _ = make_engine(model, n_ctx=128, chunk=16)
    prompt = [(11 * i) % 300 + 2 for i in range(40)]
    want = torch.log_softmax(eng.runner.forward(prompt, 0), -1)
    eng.runner.free("solo")
    eng.start()

    async def go() -> list:
        req = eng.submit(prompt, [greedy(2, logprobs=0, prompt_logprobs=0)])
        return [e for d in [d async for d in req.deltas()] for e in (d.prompt_logprobs or [])]

    got = run(go())
    eng.stop()
    assert len(got) == len(prompt) and got[0] is None
    for p in range(1, len(prompt)):
        assert got[p].token_id == prompt[p]
        assert got[p].logprob == pytest.approx(float(want[p - 1, prompt[p]]), abs=1e-5)


async def outputs(eng: Engine, prompt: list[int], n: int, prompt_logprobs: bool = False) -> tuple:
    """(tokens, logprobs with the top 2, cached prompt tokens, prompt logprobs) of one greedy request."""
    req = eng.submit(prompt, [greedy(n, logprobs=2, prompt_logprobs=2 if prompt_logprobs else None)])
    toks, lps, plps, cached = [], [], [], None
    async for d in req.deltas():
        toks += d.token_ids
        lps += d.logprobs
        plps += d.prompt_logprobs or []
        cached = d.cached_tokens if d.cached_tokens is not None else cached
    return toks, lps, cached, plps


NATIVE_ONLY = pytest.mark.skipif(BACKEND != "native", reason="the torch reference ops' rows are not bitwise the same "
                                 "however a prompt is chunked (prefix caching is off there by default)")


@NATIVE_ONLY
def test_prefix_cache_gives_a_later_turn_its_pages_and_the_same_tokens(model: Path) -> None:
    """A second turn (the first's prompt and answer, then more) takes the first turn's full pages and gets the
    tokens and logprobs (floats compared exactly) an engine without the cache computes."""
    on, _ = make_engine(model, n_ctx=128, chunk=32)
    off, _ = make_engine(model, n_ctx=128, chunk=32, prefix_caching=False)
    on.start()
    off.start()
    p = [(5 * i) % 300 + 3 for i in range(40)]
    t1, lp1, c1, _ = run(outputs(on, p, 12))
    assert (t1, lp1, c1) == run(outputs(off, p, 12))[:3] and c1 == 0
    q = p + t1 + [7, 8, 9, 10, 11]  # turn 1 computed 51 positions: three full pages of 16
    got = run(outputs(on, q, 12))
    want = run(outputs(off, q, 12))
    assert got[2] == 48 and want[2] == 0
    assert got[:2] == want[:2]
    again = run(outputs(on, q, 12))  # the same prompt again: every full page but the one of its last token
    assert again[2] == (len(q) - 1) // 16 * 16 and again[:2] == want[:2]
    aligned = run(outputs(on, q[:48], 5))  # three cached pages, but the last token's logits are computed
    assert aligned[2] == 32 and aligned[:2] == run(outputs(off, q[:48], 5))[:2]
    on.stop()
    off.stop()
    assert on.metrics.prefix_cache_hits._value.get() == 128
    assert on.metrics.prefix_cache_queries._value.get() == len(p) + 2 * len(q) + 48
    assert on.cache.used_pages == 0 and on.cache.cached_pages > 0


@NATIVE_ONLY
def test_prefix_cache_with_evictions_and_preemption_gives_the_solo_tokens(model: Path) -> None:
    """A shared system prompt over a pool too small to keep every prefix: pages are evicted and sequences
    preempted, and each request still gets its tokens from an engine without the cache."""
    system = list(range(3, 35))  # two pages
    prompts = [system + [40 + i, 41 + i, 42 + i] for i in range(4)]
    alone, off = one_at_a_time(model, prompts, 20, n_ctx=64, prefix_caching=False)
    small, _ = make_engine(model, n_ctx=64, kv_bytes=kv_bytes_of(off, 7), seqs=4)
    assert small.cache.n_pages == 7
    small.start()
    assert [run(tokens(small, p, 20)) for p in prompts] == alone  # one at a time: the system pages are shared
    assert run(together(small, prompts, 20)) == alone
    small.stop()
    assert small.metrics.prefix_cache_hits._value.get() >= 3 * 32
    assert small.metrics.preemptions._value.get() > 0
    assert small.cache.used_pages == 0 and small.cache.cached_pages <= 7


@NATIVE_ONLY
def test_prompt_logprobs_compute_the_whole_prompt_even_when_cached(model: Path) -> None:
    on, _ = make_engine(model, n_ctx=128, chunk=16)
    off, _ = make_engine(model, n_ctx=128, chunk=16, prefix_caching=False)
    on.start()
    off.start()
    p = [(11 * i) % 250 + 4 for i in range(37)]
    run(outputs(on, p, 3))  # caches p's first two pages
    got = run(outputs(on, p, 3, prompt_logprobs=True))
    want = run(outputs(off, p, 3, prompt_logprobs=True))
    on.stop()
    off.stop()
    assert got[2] == 0 and len(got[3]) == len(p)
    assert got == want


@NATIVE_ONLY
def test_the_choices_of_a_request_compute_their_prompt_once(model: Path) -> None:
    eng, steps = make_engine(model, n_ctx=128, chunk=16)
    eng.start()
    p = [(3 * i) % 200 + 5 for i in range(45)]
    alone = run(tokens(eng, list(p), 6))
    eng.stop()
    on, steps = make_engine(model, n_ctx=128, chunk=32)
    on.start()

    async def three() -> list[list[int]]:
        req = on.submit(p, [greedy(6)] * 3)
        out: list[list[int]] = [[], [], []]
        async for d in req.deltas():
            out[d.index] += d.token_ids
        return out

    assert run(three()) == [alone] * 3
    on.stop()
    # the first choice computes all 45 positions, the other two only the last page's 13
    assert on.metrics.prefix_cache_hits._value.get() == 2 * 32
    assert sum(len(c.tokens) for s in steps for c in s.chunks if len(c.tokens) > 1) == 45 + 2 * 13
    # and the second starts as soon as those two pages are in the cache: beside the first choice's last 13
    first = steps[0].chunks[0].seq
    assert [(c.seq == first, c.start, len(c.tokens)) for c in steps[1].chunks] == [(True, 32, 13), (False, 32, 13)]


def test_a_grammar_shapes_its_own_sequence_only_and_a_dead_end_fails_it_alone(model: Path, monkeypatch) -> None:  # noqa: ANN001
    """A constrained choice beside free ones: each gets the tokens it gets alone (the mask is per sequence), and a
    grammar error mid-generation ends that choice with an error while the others and the engine go on."""
    regex = SamplingParams(temperature=0, max_tokens=20, grammar=Grammar.regex(r"[0-9]{2}(, [0-9]{2}){0,3}"))
    eng, _ = make_engine(model, n_ctx=128)
    eng.start()

    async def choices(prompt: list[int], params: list[SamplingParams]) -> list[tuple[list[int], str | None]]:
        req = eng.submit(prompt, params)
        out: list[list[int]] = [[] for _ in params]
        errors: list[str | None] = [None] * len(params)
        async for d in req.deltas():
            out[d.index] += d.token_ids
            errors[d.index] = errors[d.index] or d.error
        return list(zip(out, errors, strict=True))

    alone = [run(choices(p, [regex])) for p in PROMPTS] + [run(tokens(eng, p, 12)) for p in PROMPTS]

    async def mixed() -> list:
        return list(await asyncio.gather(*(choices(p, [regex]) for p in PROMPTS), *(tokens(eng, p, 12) for p in PROMPTS)))

    assert run(mixed()) == alone
    text = eng.tok.decode(alone[0][0][0])
    assert re.fullmatch(r"[0-9]{2}(, [0-9]{2}){0,3}", text), text

    def dead_end(self, token: int) -> None:  # noqa: ANN001
        raise GrammarError("the regex grammar failed: test dead end")

    monkeypatch.setattr(Constraint, "accept", dead_end)
    got = run(choices(PROMPTS[0], [regex, greedy(12)]))
    assert got[0] == ([], "the regex grammar failed: test dead end")
    assert got[1] == (alone[len(PROMPTS)], None)
    assert run(tokens(eng, PROMPTS[1], 12)) == alone[len(PROMPTS) + 1]
    eng.stop()


def test_a_preempted_embedding_pools_its_prompt_afresh(model: Path) -> None:
    """An embedding in mid-prefill (chunks of 4), preempted for two decoding sequences' pages, gives the vector it
    gets alone."""
    from pocketmoe.engine.pooling import Pooler

    emb_prompt = [7 + (11 * j) % 200 for j in range(60)]

    def embed(eng: Engine) -> torch.Tensor:
        got: list[torch.Tensor] = []
        eng.submit_embed([emb_prompt], "mean", sink=lambda d: d is not None and got.append(d.embedding))
        eng.run_until_done()
        return got[0]

    alone_eng, _ = make_engine(model, n_ctx=64, chunk=4, seqs=3)
    want = embed(alone_eng)
    small, _ = make_engine(model, n_ctx=64, chunk=4, seqs=3, kv_bytes=kv_bytes_of(alone_eng, 8))
    victims: list[Any] = []
    preempt = small._preempt

    def spy() -> Any:  # noqa: ANN401
        victims.append(preempt())
        return victims[-1]

    small._preempt = spy  # type: ignore[method-assign]
    for i in range(2):
        small.submit([5 + i + 3 * j for j in range(15)], [greedy(40)], sink=lambda d: None)
    assert torch.equal(embed(small), want)
    assert any(isinstance(v.pooler, Pooler) for v in victims)  # the embedding itself was preempted
    assert small.cache.used_pages == 0


def test_slots_lowest_free_or_the_one_asked_for_in_fifo_order(model: Path) -> None:
    """A running sequence holds a slot: the lowest free one, or the one its request names, which it waits for
    (and the queue behind it, though another slot is free); its deltas name it; the tokens are the solo ones."""
    alone, _ = one_at_a_time(model, PROMPTS, 6, n_ctx=64, seqs=2)
    eng, steps = make_engine(model, n_ctx=64, seqs=2)
    got: dict[int, list] = {0: [], 1: [], 2: []}
    reqs = [eng.submit(p, [greedy(6)], sink=got[i].append, slot=0 if i == 1 else -1)
            for i, p in enumerate(PROMPTS)]
    with pytest.raises(ValueError, match="slot 2 is not -1 nor in"):
        eng.submit(PROMPTS[0], [greedy(1)], sink=got[0].append, slot=2)
    eng.run_until_done()
    a, b, c = (r.seqs[0] for r in reqs)
    assert (a.slot, b.slot, c.slot) == (0, 0, 1)
    for i, s in enumerate((a, b, c)):
        deltas = [d for d in got[i] if d is not None]
        assert {d.slot for d in deltas} == {s.slot}
        assert [t for d in deltas for t in d.token_ids] == alone[i]
    ran = [[c.seq for c in step.chunks] for step in steps]
    a_last = max(k for k, keys in enumerate(ran) if a.key in keys)
    assert min(k for k, keys in enumerate(ran) if c.key in keys) > a_last, "c ran ahead of b, which waits for slot 0"
    assert eng.slots == [None, None] and eng.slot_last == [b, c]
