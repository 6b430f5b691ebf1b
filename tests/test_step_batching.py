"""Several sequences in one step: each sequence's logits are bitwise its solo logits (ModelRunner.forward(Step)).

The schedule mixes prefill chunks and decode tokens of three sequences, as a server's continuous
batching does; the solo runs feed each sequence the same chunks alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pocketmoe import native
from pocketmoe.engine import ContextLengthError, KVPoolFullError, ModelRunner, RunnerConfig, SeqChunk, Step
from pocketmoe.errors import PocketMoEError
from pocketmoe.gguf import open_bundle
from pocketmoe.testing.synth import write_fixture

PROMPTS = {"a": list(range(3, 23)), "b": [7, 8, 9, 10, 11, 12, 13], "c": list(range(100, 113))}
# Per step: sequence -> prompt slice [i, j) or "decode"
SCHEDULE = [
    {"a": (0, 8), "b": (0, 7)},
    {"a": (8, 16), "b": "decode", "c": (0, 13)},
    {"a": (16, 20), "b": "decode", "c": "decode"},
    {"a": "decode", "b": "decode", "c": "decode"},
    {"c": "decode", "a": "decode"},
]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_fixture("deepseek2", "tiny", "Q4_K_M", tmp_path_factory.mktemp("batch") / "m.gguf", seed=5)[0]


def backends() -> list[str]:
    return ["reference"] + (["native"] if native.available() else [])


def run(runner: ModelRunner, steps: list[dict[str, object]], tokens: dict[str, list[int]]) -> dict[str, list]:
    """Runs the steps (all sequences of a step in one forward); returns each sequence's logits per step.
    Decode tokens come from `tokens` (what the solo runs fed)."""
    pos = {s: 0 for s in PROMPTS}
    made = {s: 0 for s in PROMPTS}
    out: dict[str, list] = {s: [] for s in PROMPTS}
    for step in steps:
        chunks = []
        for s, what in step.items():
            if what == "decode":
                toks = [tokens[s][made[s]]]
                made[s] += 1
            else:
                toks = PROMPTS[s][what[0]:what[1]]
            chunks.append(SeqChunk(s, toks, pos[s], "all"))
            pos[s] += len(toks)
        logits = runner.forward(Step(chunks))
        i = 0
        for c in chunks:
            out[c.seq].append(logits[i:i + len(c.tokens)])
            i += len(c.tokens)
    return out


@pytest.mark.parametrize("backend", backends())
def test_batched_step_gives_each_sequence_its_solo_logits(model: Path, backend: str) -> None:
    cfg = RunnerConfig(n_ctx=64, backend=backend, max_seqs=3)
    solo_runner = ModelRunner(open_bundle(model), cfg)
    # Solo: each sequence's chunks alone; a decode step feeds the previous step's argmax.
    solo: dict[str, list] = {}
    feed: dict[str, list[int]] = {}
    for s in PROMPTS:
        pos, prev, solo[s], feed[s] = 0, -1, [], []
        for st in (st for st in SCHEDULE if s in st):
            what = st[s]
            if what == "decode":
                feed[s].append(prev)
            t = [prev] if what == "decode" else PROMPTS[s][what[0]:what[1]]
            lg = solo_runner.forward(Step([SeqChunk(s, t, pos, "all")]))
            pos += len(t)
            solo[s].append(lg)
            prev = int(lg[-1].argmax())
        solo_runner.free(s)
    batched = run(ModelRunner(open_bundle(model), cfg), SCHEDULE, feed)
    for s in PROMPTS:
        assert len(batched[s]) == len(solo[s])
        for got, want in zip(batched[s], solo[s], strict=True):
            assert torch.equal(got, want), (backend, s)


def test_step_errors(model: Path) -> None:
    r = ModelRunner(open_bundle(model), RunnerConfig(n_ctx=16, max_seqs=1))
    with pytest.raises(PocketMoEError, match="a sequence appears twice"):
        Step([SeqChunk("x", [1], 0), SeqChunk("x", [2], 1)])
    with pytest.raises(PocketMoEError, match="token id 512 is outside the vocabulary of 512"):
        r.forward(Step([SeqChunk("x", [512], 0)]))
    with pytest.raises(ContextLengthError, match="continues at position 3 but only 0 positions are cached"):
        r.forward(Step([SeqChunk("y", [1], 3)]))
    with pytest.raises(ContextLengthError, match="positions 0..16 do not fit in the context of 16"):
        r.forward(Step([SeqChunk("y", list(range(8)), 0), SeqChunk("z", list(range(17)), 0)]))
    r.free("y")
    r.forward(Step([SeqChunk("p", list(range(16)), 0)]))
    with pytest.raises(KVPoolFullError, match="the KV pool has 0 free pages"):
        r.forward(Step([SeqChunk("q", [1], 0)]))
    r.free("p")
    assert r.forward(Step([SeqChunk("q", [1, 2], 0, "last")])).shape == (1, r.vocab_size)


@pytest.mark.skipif(not native.available(), reason="native kernels")
@pytest.mark.parametrize("arch,preset,quant,kv", [
    ("deepseek2", "tiny", "Q4_K_M", "f32"), ("deepseek2", "tiny-legacy", "Q8_0", "f32"),
    ("deepseek2", "tiny-qlora", "F32", "f32"), ("minimax-m2", "tiny", "Q4_K_M", "f32"),
    ("deepseek2", "tiny", "Q4_K_M", "f16"), ("minimax-m2", "tiny", "Q4_K_M", "bf16")])
def test_recorded_steps_replay_bitwise(tmp_path, arch: str, preset: str, quant: str, kv: str) -> None:
    """Steps whose every token wants logits run as one recorded native call after the first (MLA or GQA
    attention, over a cache of each dtype); the logits and the cache are bitwise those of the same steps run op
    by op, over the mixed schedule (the decode steps are replayed)."""
    (path,) = write_fixture(arch, preset, quant, tmp_path / "m.gguf", seed=7)
    runs = {}
    for replay in (True, False):
        r = ModelRunner(open_bundle(path), RunnerConfig(n_ctx=64, backend="native", max_seqs=3, kv_dtype=kv))
        r.ops.replay = replay
        feed = {s: [int(t) % r.vocab_size for t in range(40, 50)] for s in PROMPTS}
        runs[replay] = (run(r, SCHEDULE, feed), r)
    (replayed, r_rep), (op_by_op, _) = runs[True], runs[False]
    assert any(program for _, program in r_rep.ops._programs.values()), "no step was recorded"
    for s in PROMPTS:
        for got, want in zip(replayed[s], op_by_op[s], strict=True):
            assert torch.equal(got, want), s
    assert torch.equal(r_rep.cache.data, runs[False][1].cache.data)


@pytest.mark.skipif(not native.available(), reason="native kernels")
def test_a_step_with_other_ops_is_not_recorded(model: Path) -> None:
    """A model that calls an op a StepProgram does not hold runs op by op every time."""
    r = ModelRunner(open_bundle(model), RunnerConfig(n_ctx=64, backend="native"))
    ops, model_fn = r.ops, r.model
    extra = ops.finalize  # recorded as "other"
    original = type(model_fn).__call__

    def call(self, ctx):
        out = original(self, ctx)
        extra(out.new_zeros(1, 1), out.new_zeros(1, 1))
        return out

    type(model_fn).__call__ = call
    try:
        r.forward(Step([SeqChunk("a", [1, 2, 3], 0, "all")]))
        assert [p for _, p in ops._programs.values()] == [False]
    finally:
        type(model_fn).__call__ = original


def test_decode_one_is_the_step_build_makes(model: Path) -> None:
    """StepContext.decode_one (the runner's decode path) gives the arrays build gives for the same token."""
    from pocketmoe.engine import PagedKVCache, StepContext

    fields = ("tokens", "positions", "seq", "write_rows", "keys", "page_table", "logit_rows")
    for pos in (0, 5, 15, 16, 40):
        a, b = (PagedKVCache(1, 8, 8, 64, page=16) for _ in range(2))
        for cache in (a, b):
            if pos:
                cache.reserve("s", pos)
        built = StepContext.build(Step([SeqChunk("s", [7], pos)]), a, 100)
        fast = StepContext.decode_one("s", 7, pos, b, 100)
        for f in fields:
            x, y = getattr(built, f), getattr(fast, f)
            assert x.dtype == y.dtype and np.array_equal(x, y), (pos, f)
        assert (built.seq_spans, built.contiguous) == (fast.seq_spans, fast.contiguous)
        assert a.length("s") == b.length("s") == pos + 1
    with pytest.raises(PocketMoEError, match="token id 100 is outside the vocabulary of 100"):
        StepContext.decode_one("s", 100, 0, PagedKVCache(1, 8, 8, 64), 100)
    with pytest.raises(ContextLengthError, match="continues at position 3 but only 0"):
        StepContext.decode_one("t", 1, 3, PagedKVCache(1, 8, 8, 64), 100)


@pytest.mark.parametrize("arch", ["deepseek2", "minimax-m2", "deepseek4"])
def test_a_kv_cache_of_one_tensor_per_layer_gives_the_same_logits(tmp_path, arch: str) -> None:
    """A model split by layer over several GPUs keeps each layer's cache rows on its own device (PagedKVCache with
    one device per layer: `data` is None). Each attention kind (MLA, GQA, DeepSeek-V4's window + compressed rows)
    writes and reads them through layer_rows: the batched schedule's logits are bitwise the one-tensor cache's."""
    from pocketmoe.engine import PagedKVCache

    path = write_fixture(arch, "tiny", "F32", tmp_path / "m.gguf", seed=5)[0]
    with open_bundle(path) as b:
        r = ModelRunner(b, RunnerConfig(n_ctx=64, max_seqs=3, backend="reference"))
        tokens = {s: [int(t) % 50 + 3 for t in range(40 + i, 46 + i)] for i, s in enumerate(PROMPTS)}
        one = run(r, SCHEDULE, tokens)
        c = r.cache
        r.cache = PagedKVCache(r.model.n_layer, c.layer_rows(0).shape[-1], c.n_pages, c.max_seq_len, c.dtype,
                               device=["cpu"] * r.model.n_layer, page=c.page)
        assert r.cache.data is None and r.cache.nbytes == c.nbytes
        per_layer = run(r, SCHEDULE, tokens)
    for s in PROMPTS:
        for a, b_ in zip(one[s], per_layer[s], strict=True):
            assert torch.equal(a, b_), s
