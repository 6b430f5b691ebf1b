"""LLM.generate over several prompts: one continuous batch whose every output equals the prompt's own
single-sequence run (LLM.stream, which never goes through the batching engine); and the single sequence
continuing from the rows its previous run left, against an LLM that computes every prompt whole."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pocketmoe import LLM, Grammar, PocketMoEError, SamplingParams
from pocketmoe.engine.llm import CompletionOutput
from pocketmoe.testing.synth import write_fixture

N_CTX = 128


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("batch") / "tiny.gguf"
    write_fixture("deepseek2", "tiny", "Q8_0", path, seed=11)
    return path


@pytest.fixture(scope="module")
def llm(model) -> LLM:
    return LLM(model, n_ctx=N_CTX, threads=1, max_num_seqs=3)


def solo(llm: LLM, prompt, params: SamplingParams) -> CompletionOutput:
    out = CompletionOutput(prompt_token_ids=[])
    for _ in llm.stream(prompt, params, out):
        pass
    return out


def same(a: CompletionOutput, b: CompletionOutput) -> bool:
    return (a.prompt_token_ids, a.token_ids, a.text, a.finish_reason) == \
        (b.prompt_token_ids, b.token_ids, b.text, b.finish_reason)


def mixed(vocab: int, n: int, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """n prompts of 3-40 random tokens, with greedy, seeded, stop-string and short-max_tokens params in turn."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab, size=int(rng.integers(3, 41))).tolist() for _ in range(n)]
    kinds = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
             SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=16),
             SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=24, repetition_penalty=1.2),
             SamplingParams(temperature=0, max_tokens=5)]
    return prompts, [kinds[i % len(kinds)] for i in range(n)]


def test_batch_equals_each_prompt_alone(llm):
    """More prompts than max_num_seqs: later ones are admitted as earlier ones finish, and each output (tokens,
    text, finish reason) is its solo run's."""
    prompts, params = mixed(llm.runner.vocab_size, 8)
    want = [solo(llm, p, q) for p, q in zip(prompts, params, strict=True)]
    got = llm.generate(prompts, params)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        assert same(a, b), i
        assert b.ttft_s > 0 and b.decode_s >= 0
    assert {o.finish_reason for o in got} >= {"length"}


def test_the_batch_pool_comes_with_the_first_batch(model):
    from pocketmoe.engine.kv_cache import PAGE

    llm = LLM(model, n_ctx=64, threads=1, max_num_seqs=4)
    assert llm.runner.cache.n_pages == 64 // PAGE  # one sequence's until a batch runs
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    before = llm.generate([[5, 6, 7]], params)[0]
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    got = llm.generate(prompts, params)
    assert llm.runner.cache.n_pages >= 4 * 64 // PAGE  # the server's rule for 4 sequences of 64
    assert same(before, got[0]) and all(same(solo(llm, p, params), b) for p, b in zip(prompts, got, strict=True))
    llm.close()


def test_one_params_for_all_and_text_prompts(llm):
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=12, stop=["e"])
    prompts = ["Hello world", "Once upon a time", "abc", "Hello world"]
    got = llm.generate(prompts, params)
    for p, b in zip(prompts, got, strict=True):
        assert same(solo(llm, p, params), b)
    assert got[0].token_ids == got[3].token_ids  # the same prompt and seed: the same tokens in one batch


def test_n_completions_are_the_seeded_single_runs(llm):
    """SamplingParams.n: the prompt's n completions in `outputs`, completion c the solo run seeded seed + c (the
    server's rule for n), alongside a prompt with n = 1; an unseeded n draws n different completions."""
    params = SamplingParams(temperature=1.0, top_k=30, seed=2**64 - 2, max_tokens=10, n=3)
    prompts = [[5, 9, 14, 3], "Once upon a time"]
    got = llm.generate(prompts, [params, SamplingParams(temperature=0, max_tokens=6)])
    assert [len(o.outputs) for o in got] == [3, 1] and got[1].outputs == [got[1]]
    assert got[0].outputs[0] is got[0]
    seeds = [2**64 - 2, 2**64 - 1, 0]
    for c, (o, seed) in enumerate(zip(got[0].outputs, seeds, strict=True)):
        assert o.index == c
        assert same(solo(llm, prompts[0], SamplingParams(temperature=1.0, top_k=30, seed=seed, max_tokens=10)), o), c
    assert len({tuple(o.token_ids) for o in got[0].outputs}) == 3
    assert same(solo(llm, prompts[1], SamplingParams(temperature=0, max_tokens=6)), got[1])
    alone = llm.generate("Hello world", SamplingParams(temperature=1.0, max_tokens=12, n=4, ignore_eos=True))[0]
    assert len({tuple(o.token_ids) for o in alone.outputs}) > 1
    assert llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=4, n=1))[0].choices is None


def test_stream_takes_one_completion(llm):
    with pytest.raises(PocketMoEError, match="SamplingParams.n is 2"):
        next(llm.stream("abc", SamplingParams(n=2)))


def test_tiny_pool_preempts_and_still_gives_solo_tokens(model):
    """A KV pool of just over one context: sequences are preempted and recomputed, outputs unchanged."""
    from pocketmoe.engine.kv_cache import PAGE

    small = LLM(model, n_ctx=64, threads=1, max_num_seqs=4, kv_cache_bytes=None)
    row = small.runner.cache.nbytes // (small.runner.cache.n_pages * PAGE)
    tight = LLM(model, n_ctx=64, threads=1, max_num_seqs=4, kv_cache_bytes=(64 // PAGE + 1) * PAGE * row)
    assert tight.runner.cache.n_pages == 64 // PAGE + 1
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, tight.runner.vocab_size, size=20).tolist() for _ in range(5)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    got = tight.generate(prompts, params)
    assert tight._engine.metrics.preemptions._value.get() > 0
    for p, b in zip(prompts, got, strict=True):
        assert same(solo(small, p, params), b)
    small.close()
    tight.close()


def test_prefix_cache_reuses_prompt_starts_with_the_same_tokens(model):
    llm = LLM(model, n_ctx=N_CTX, threads=1, max_num_seqs=2)
    assert llm.runner.ops.chunk_invariant  # the native kernels: caching is on by default
    rng = np.random.default_rng(5)
    system = rng.integers(3, llm.runner.vocab_size, size=50).tolist()
    prompts = [system + rng.integers(3, llm.runner.vocab_size, size=k).tolist() for k in (3, 9, 17, 5)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    first = llm.generate(prompts, params)
    again = llm.generate(prompts, params)
    for p, a, b in zip(prompts, first, again, strict=True):
        assert same(solo(llm, p, params), a) and same(a, b)
        assert b.cached_tokens >= 48  # the system prompt's full pages (16 positions each) at least
    # the first two run side by side and compute the system prompt each; the last two, admitted as those
    # finish, attach its pages
    assert [a.cached_tokens for a in first[:2]] == [0, 0] and min(a.cached_tokens for a in first[2:]) >= 48
    off = LLM(model, n_ctx=N_CTX, threads=1, max_num_seqs=4, enable_prefix_caching=False)
    assert [o.cached_tokens for o in off.generate(prompts, params)] == [0] * 4
    llm.close()
    off.close()


def test_context_limit_matches_the_single_sequence_path(llm):
    """A sequence that runs into n_ctx stops where the single-sequence path stops (the last sampled token
    takes no KV position)."""
    rng = np.random.default_rng(9)
    prompts = [rng.integers(3, llm.runner.vocab_size, size=n).tolist() for n in (N_CTX - 5, N_CTX - 1, 10)]
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    got = llm.generate(prompts, params)
    for p, b in zip(prompts, got, strict=True):
        a = solo(llm, p, params)
        assert same(a, b)
    assert len(got[0].token_ids) == 6 and len(got[1].token_ids) == 2 and len(got[2].token_ids) == 50


def test_grammar_in_a_batch(llm):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    constrained = SamplingParams(temperature=0.8, seed=2, max_tokens=40, grammar=Grammar.json_schema(schema))
    free = SamplingParams(temperature=0.8, seed=2, max_tokens=40)
    prompts = ["json:", "free text", "json again:"]
    params = [constrained, free, constrained]
    for p, q, b in zip(prompts, params, llm.generate(prompts, params), strict=True):
        assert same(solo(llm, p, q), b)


def test_chat_over_several_conversations(llm):
    convs = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "What is 2+2?"}]]
    params = SamplingParams(temperature=0, max_tokens=8)
    got = llm.chat(convs, params)
    assert isinstance(got, list) and len(got) == 2
    for c, b in zip(convs, got, strict=True):
        assert same(llm.chat(c, params), b)


@pytest.mark.parametrize("case, needle", [
    ("params", "got 2 SamplingParams for 3 prompts"),
    ("long", "prompt 1: the prompt has 200 tokens but the context holds 128"),
    ("empty", "prompt 2: the prompt is empty"),
    ("vocab", "prompt 0: token id 999999 is outside the vocabulary"),
    ("grammar", "prompt 1:"),
])
def test_bad_batch_is_refused_before_any_work(llm, case, needle):
    ok = [5, 6, 7]
    prompts, params = {
        "params": ([ok, ok, ok], [SamplingParams()] * 2),
        "long": ([ok, [5] * 200, ok], SamplingParams(max_tokens=2)),
        "empty": ([ok, ok, []], SamplingParams(max_tokens=2)),
        "vocab": ([[999999], ok], SamplingParams(max_tokens=2)),
        "grammar": ([ok, ok], [SamplingParams(), SamplingParams(grammar=Grammar.regex("(unclosed"))]),
    }[case]
    with pytest.raises(PocketMoEError, match=None) as e:
        llm.generate(prompts, params)
    assert needle in str(e.value) and "\n" not in str(e.value)
    engine = llm._engine
    assert engine is None or (not engine.running and not engine.waiting)
    # nothing half-run is left behind: the next batch is as it would be
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for b in llm.generate([ok, [9, 8]], p):
        assert same(solo(llm, b.prompt_token_ids, p), b)


def test_failed_step_and_interrupt_leave_the_engine_clean(model, monkeypatch):
    llm = LLM(model, n_ctx=N_CTX, threads=1, max_num_seqs=2)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12]]
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [solo(llm, q, p) for q in prompts]
    real = llm.runner.run_step
    for exc, match in ((RuntimeError("boom"), "prompt 0 failed: the step failed: boom"), (KeyboardInterrupt(), None)):
        calls = {"n": 0}

        def flaky(step, exc=exc, calls=calls):
            calls["n"] += 1
            if calls["n"] == 3:
                raise exc
            return real(step)

        monkeypatch.setattr(llm.runner, "run_step", flaky)
        with pytest.raises(type(exc) if match is None else PocketMoEError, match=match):
            llm.generate(prompts, p)
        monkeypatch.setattr(llm.runner, "run_step", real)
        assert not llm._engine.running and not llm._engine.waiting
        assert llm.runner.cache.used_pages == 0  # cached prefix pages no sequence holds count as free
        for a, b in zip(want, llm.generate(prompts, p), strict=True):
            assert same(a, b)
    llm.close()


# -- the single sequence's prefix reuse --------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain(model) -> LLM:
    return LLM(model, n_ctx=N_CTX, threads=1, max_num_seqs=1, enable_prefix_caching=False)


def test_single_sequence_reuses_the_previous_rows(model, plain):
    llm = LLM(model, n_ctx=N_CTX, threads=1, max_num_seqs=1)
    assert llm.runner.ops.chunk_invariant  # on by default where the rows are bitwise the same
    rng = np.random.default_rng(21)
    p1 = rng.integers(3, llm.runner.vocab_size, size=30).tolist()
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=4, max_tokens=12, ignore_eos=True)
    first = llm.generate([p1], greedy)[0]
    turn = p1 + first.token_ids + rng.integers(3, llm.runner.vocab_size, size=7).tolist()  # the next turn
    other = rng.integers(3, llm.runner.vocab_size, size=20).tolist()
    # (prompt, params, rows the previous run left that hold its start); the last sampled token is never fed
    runs = [(turn, greedy, 30 + 12 - 1), (turn, seeded, len(turn) - 1), (p1[:10], greedy, 10 - 1),
            (other, seeded, 0), (p1, greedy, 0), (p1 + other, seeded, 30)]
    assert first.cached_tokens == 0
    for prompt, params, cached in runs:
        got, want = llm.generate([prompt], params)[0], plain.generate([prompt], params)[0]
        assert same(want, got) and want.cached_tokens == 0
        assert got.cached_tokens == cached
    llm.close()


def test_reused_rows_give_bitwise_the_same_logits(model, plain):
    llm = LLM(model, n_ctx=N_CTX, threads=1, max_num_seqs=1, chunk_size=16)
    rng = np.random.default_rng(22)
    ids = rng.integers(3, llm.runner.vocab_size, size=70).tolist()
    llm.prompt_logits(ids[:45])  # rows 0..44 in 16-token chunks from position 0
    k = llm.runner.solo_prefix(ids)
    assert k == 45
    got = llm.runner.forward(ids[k:], k)  # chunks from position 45: a different cut of the same rows
    np.testing.assert_array_equal(got.numpy(), plain.prompt_logits(ids)[k:].numpy())
    llm.close()


def test_rows_written_another_way_or_lost_are_not_reused(model, plain, monkeypatch):
    llm = LLM(model, n_ctx=N_CTX, threads=1, max_num_seqs=1, chunk_size=8)
    rng = np.random.default_rng(23)
    p1, x = (rng.integers(3, llm.runner.vocab_size, size=30).tolist() for _ in range(2))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate([p1], params)
    llm.runner.forward(x[:12], 0)  # the rows now hold x's start, whoever wrote them
    assert llm.runner.solo_tokens == x[:12]
    got = llm.generate([p1], params)[0]
    assert got.cached_tokens == 0 and same(plain.generate([p1], params)[0], got)
    llm.runner.decode(x[0], 3)  # overwrites row 3: rows 0..3 are p1[:3] + x[0]
    assert llm.runner.solo_tokens == p1[:3] + [x[0]]
    llm.runner.decode(x[1], 5)  # row 4 is not known any more
    assert llm.runner.solo_tokens == []
    # a forward that fails after its first chunk wrote rows leaves nothing to reuse
    llm.generate([p1], params)
    real, calls = llm.runner._run, {"n": 0}

    def flaky(ctx):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real(ctx)

    monkeypatch.setattr(llm.runner, "_run", flaky)
    with pytest.raises(RuntimeError, match="boom"):
        llm.runner.forward(x, 5)
    monkeypatch.setattr(llm.runner, "_run", real)
    assert llm.runner.solo_tokens == []
    got = llm.generate([p1], params)[0]
    assert got.cached_tokens == 0 and same(plain.generate([p1], params)[0], got)
    # a batch takes the single sequence's pages
    llm2 = LLM(model, n_ctx=N_CTX, threads=1, max_num_seqs=2)
    llm2.generate([p1], params)
    llm2.generate([p1, x], params)
    assert llm2.runner.solo_tokens == [] and llm2.generate([p1], params)[0].cached_tokens == 0
    llm.close()
    llm2.close()


def test_reference_ops_do_not_reuse_by_default(model):
    ref = LLM(model, n_ctx=N_CTX, threads=1, max_num_seqs=1, backend="reference")
    assert not ref.runner.ops.chunk_invariant
    ids = [5, 6, 7, 8, 9, 10]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ref.generate([ids], params)
    assert ref.generate([ids], params)[0].cached_tokens == 0
    ref.close()
