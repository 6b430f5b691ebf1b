"""DeepSeek-V4 generation (models/deepseek4.py) against llama.cpp on the same GGUF files.

The tiny preset has a window-only layer, two ratio-4 layers (indexer top-16) and a ratio-128 layer, one
hash-routed layer and three biased top-k layers, a 32-token window. The 140-token prompt makes 35 ratio-4
entries (so the indexer's top-k drops some), one ratio-128 entry, and outruns the window; our side prefills
it in chunks of 50, so blocks complete across steps, and greedy decoding completes more.

F32 fixture: max |dlogit| <= 1e-4 at every prompt position and the same greedy tokens, on both backends.
MXFP4 experts + Q8_0 dense: within llama.cpp's activation-quantization noise, the same greedy tokens. Also:
several sequences in one step give each its solo logits; native = reference on F32 weights; the server.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import llama_parity
import numpy as np
import pytest
import torch

from pocketmoe import native
from pocketmoe.engine import ModelRunner, RunnerConfig, SeqChunk, Step
from pocketmoe.gguf import open_bundle
from pocketmoe.testing.synth import write_fixture

PROMPT = [int(t) for t in np.random.default_rng(7).integers(2, 512, 140)]
GEN = 8
N_CTX = 256
F32_TOL = 1e-4
BACKENDS = ["reference"] + (["native"] if native.available() else [])


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("ds4")
    return {q: write_fixture("deepseek4", "tiny", q, d / f"{q}.gguf", seed=3)[0] for q in ("F32", "MXFP4_MOE")}


def llama_run(path: Path, prompt: list[int], gen: int) -> tuple[np.ndarray, list[int]]:
    return llama_parity.llama_run(path, prompt, gen, N_CTX)


def runner(path: Path, backend: str, **kw: object) -> ModelRunner:
    return ModelRunner(open_bundle(path), RunnerConfig(n_ctx=N_CTX, backend=backend, chunk_size=50, **kw))


@pytest.fixture(scope="module")
def llama_f32(fixtures: dict[str, Path]) -> tuple[np.ndarray, list[int]]:
    return llama_run(fixtures["F32"], PROMPT, GEN)


@pytest.mark.parity
@pytest.mark.parametrize("backend", BACKENDS)
def test_f32_matches_llama_cpp(fixtures: dict[str, Path], llama_f32: tuple[np.ndarray, list[int]],
                               backend: str) -> None:
    theirs, their_tokens = llama_f32
    r = runner(fixtures["F32"], backend)
    ours = r.forward(PROMPT, 0).numpy()
    assert float(np.abs(ours - theirs).max()) <= F32_TOL
    assert r.generate_greedy(PROMPT, GEN) == their_tokens


@pytest.mark.parity
@pytest.mark.skipif(not native.available(), reason="native kernels")
def test_mxfp4_q8_0_greedy_matches_llama_cpp(fixtures: dict[str, Path]) -> None:
    _, their_tokens = llama_run(fixtures["MXFP4_MOE"], PROMPT, GEN)
    assert runner(fixtures["MXFP4_MOE"], "native").generate_greedy(PROMPT, GEN) == their_tokens


@pytest.mark.parity
@pytest.mark.skipif(not native.available(), reason="native kernels")
@pytest.mark.xfail(strict=True, reason="open (issue 13): on quantized files a window-only layer followed by a "
                   "ratio-4 layer differs from llama.cpp by ~0.03 typical, up to 1.6 at a few positions; a (4) or "
                   "(4, 4) model matches to 2e-7")
def test_mxfp4_q8_0_logits_match_llama_cpp(fixtures: dict[str, Path]) -> None:
    theirs, _ = llama_run(fixtures["MXFP4_MOE"], PROMPT, GEN)
    ours = runner(fixtures["MXFP4_MOE"], "native").forward(PROMPT, 0).numpy()
    spread = float(theirs.max() - theirs.min())
    assert float(np.abs(ours - theirs).max()) <= 1e-3 * spread


@pytest.mark.skipif(not native.available(), reason="native kernels")
def test_native_is_the_reference_on_f32(fixtures: dict[str, Path]) -> None:
    """Native linears and norms against torch's: the same math in another float order."""
    want = runner(fixtures["F32"], "reference").forward(PROMPT, 0)
    got = runner(fixtures["F32"], "native").forward(PROMPT, 0)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_step_gives_each_sequence_its_solo_logits(fixtures: dict[str, Path], backend: str) -> None:
    prompts = {"a": PROMPT[:131], "b": PROMPT[5:12], "c": PROMPT[40:47]}
    solo = {}
    r = runner(fixtures["MXFP4_MOE"], backend, max_seqs=3)
    for s, p in prompts.items():
        solo[s] = (r.forward(Step([SeqChunk(s, p, 0, "all")])),
                   r.forward(Step([SeqChunk(s, [11], len(p), "all")])))
        r.free(s)
    r = runner(fixtures["MXFP4_MOE"], backend, max_seqs=3)
    first = r.forward(Step([SeqChunk(s, p, 0, "all") for s, p in prompts.items()]))
    second = r.forward(Step([SeqChunk(s, [11], len(p), "all") for s, p in prompts.items()]))
    i = 0
    for j, (s, p) in enumerate(prompts.items()):
        assert torch.equal(first[i:i + len(p)], solo[s][0]), s
        assert torch.equal(second[j:j + 1], solo[s][1]), s
        i += len(p)


def test_cache_row_and_capability(fixtures: dict[str, Path]) -> None:
    """The cache holds one row per position of the widest layer (ratio 4: kv, compressor and indexer states,
    entries) and the spec says the architecture generates."""
    r = runner(fixtures["F32"], "reference")
    c = r.spec.config
    d, i = c.head_dim, c.indexer_head_dim
    assert r.cache.data.shape[-1] == r.spec.kv_values_per_token() == d + 2 * 2 * d + d + 2 * 2 * i + i
    assert r.spec.capability_details()["generate"] is True


def test_served(fixtures: dict[str, Path]) -> None:
    from pocketmoe.testing.live_server import LiveServer
    from pocketmoe.tokenizer import Tokenizer

    path = fixtures["MXFP4_MOE"]
    want = runner(path, "auto").generate_greedy(PROMPT, 4)
    args = ["--model", str(path), "--served-model-name", "ds4", "--max-model-len", str(N_CTX), "--threads", "1"]
    with LiveServer(args) as srv:
        body = {"model": "ds4", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 0,
                "ignore_eos": True}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120).json()
    lp = r["choices"][0]["logprobs"]
    tok = Tokenizer.from_metadata(open_bundle(path).metadata)
    assert lp["tokens"] == [tok.token_to_piece(t).decode("utf-8", "replace") for t in want]
