"""vLLM's logprobs in the Python API: SamplingParams(logprobs=k, prompt_logprobs=k) give, per generated and per
prompt token, a dict of Logprob (logprob, rank, decoded_token) for the token and the k most likely ones. Checked
against the model's own logits (LLM.prompt_logits over the prompt and the output, log-softmaxed and ranked in numpy),
on the single-sequence path with the prompt over several chunks and in a batch."""

from __future__ import annotations

import numpy as np
import pytest

from pocketmoe import LLM, SamplingParams
from pocketmoe.engine.llm import CompletionOutput, LogprobEntry
from pocketmoe.engine.sampler import MAX_LOGPROBS, SamplingParamsError
from pocketmoe.testing.synth import write_fixture


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    path = tmp_path_factory.mktemp("logprobs") / "tiny.gguf"
    write_fixture("deepseek2", "tiny", "Q8_0", path, seed=5)
    return LLM(path, n_ctx=128, threads=1, chunk_size=16, max_num_seqs=3)


def log_softmax(rows: np.ndarray) -> np.ndarray:
    rows = rows.astype(np.float64)
    m = rows.max(axis=-1, keepdims=True)
    return rows - m - np.log(np.exp(rows - m).sum(axis=-1, keepdims=True))


def check_entry(llm: LLM, entry: LogprobEntry, token: int, row: np.ndarray, k: int) -> None:
    """entry holds `token` and the k most likely tokens of `row` (log-probabilities), each with its rank and text."""
    top = np.argsort(-row, kind="stable")[:k].tolist()
    assert set(entry) == {token, *top}
    assert list(entry)[0] == token
    for t, x in entry.items():
        assert x.logprob == pytest.approx(row[t], abs=1e-4)
        assert x.rank == 1 + int((row > row[t] + 1e-6).sum())
        assert x.decoded_token == llm.tokenizer.token_to_piece(t).decode("utf-8", "replace")


def check_output(llm: LLM, out: CompletionOutput, params: SamplingParams) -> None:
    """Every generated token's entry (and every prompt token's after the first) against the model's logits at the
    position before it."""
    rows = log_softmax(llm.prompt_logits(out.prompt_token_ids + out.token_ids).numpy())
    n = len(out.prompt_token_ids)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) > 0
    for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        check_entry(llm, entry, token, rows[n - 1 + j], params.logprobs)
    if params.prompt_logprobs is None:
        assert out.prompt_logprobs is None
        return
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == n and out.prompt_logprobs[0] is None
    for p in range(1, n):
        check_entry(llm, out.prompt_logprobs[p], out.prompt_token_ids[p], rows[p - 1], params.prompt_logprobs)


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 300, size=n).tolist()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2),
    SamplingParams(temperature=1.5, seed=4, max_tokens=8, ignore_eos=True, logprobs=0),
    SamplingParams(temperature=0.8, top_k=5, repetition_penalty=1.3, seed=9, max_tokens=8, ignore_eos=True,
                   logprobs=MAX_LOGPROBS, prompt_logprobs=0),
], ids=["greedy", "hot", "filtered"])
def test_single_sequence_logprobs_are_the_models_raw_ones(llm, params):
    """A 40-token prompt over three chunks of 16; the logprobs are the raw model's, whatever the temperature,
    penalties and filters (OpenAI's and vLLM's default), and the tokens are those drawn without logprobs."""
    p = prompt(40, 1)
    out = llm.generate(p, params)[0]
    check_output(llm, out, params)
    plain = llm.generate(p, SamplingParams(**{**params.__dict__, "logprobs": None, "prompt_logprobs": None}))[0]
    assert plain.token_ids == out.token_ids and plain.logprobs is None and plain.prompt_logprobs is None
    if params.greedy:
        assert all(e[t].rank == 1 for t, e in zip(out.token_ids, out.logprobs, strict=True))


def test_stream_chunks_carry_the_entries(llm):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
    out = CompletionOutput(prompt_token_ids=[])
    chunks = list(llm.stream(prompt(12, 2), params, out))
    assert [c.logprobs for c in chunks if c.token_id is not None] == out.logprobs
    assert chunks[-1].token_id is None and chunks[-1].logprobs is None


def test_batch_logprobs_equal_each_prompt_alone(llm):
    """Four prompts in one batch (one without logprobs, one with those of the distribution drawn from) give the
    entries their solo runs give."""
    prompts = [prompt(30, 3), prompt(7, 4), prompt(19, 5), prompt(9, 6)]
    params = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=4, prompt_logprobs=1),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=2, max_tokens=6, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.9, top_p=0.9, seed=8, max_tokens=6, ignore_eos=True, logprobs=3,
                             logprobs_mode="processed_logprobs")]
    got = llm.generate(prompts, params)
    assert got[1].logprobs is None and got[1].prompt_logprobs is None and got[2].prompt_logprobs is None
    for p, q, out in zip(prompts, params, got, strict=True):
        alone = llm.generate(p, q)[0]
        assert out.token_ids == alone.token_ids
        if q.logprobs is None:
            continue
        if q.logprobs_mode == "raw_logprobs":
            check_output(llm, out, q)
        for a, b in zip(out.logprobs, alone.logprobs, strict=True):
            assert a.keys() == b.keys()
            assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) and a[t].rank == b[t].rank for t in a)


@pytest.mark.parametrize("field,value", [("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("prompt_logprobs", 99)])
def test_out_of_range_counts_are_refused(field, value):
    with pytest.raises(SamplingParamsError, match=f"{field}={value}"):
        SamplingParams(**{field: value})
