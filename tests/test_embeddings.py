"""Embeddings (engine/pooling.py, serve/embeddings.py) against llama.cpp's on the same GGUF files, and the server's
routes against the engine alone.

llama.cpp (llama-cpp-python's C API: a context with embeddings on and a pooling type) pools the same final hidden
states (the output norm's, the head's input) by last, mean and cls: each architecture's F32 fixture must give its
vectors to float noise. The engine must give a prompt the same vector alone, in a batch beside generation, from
cached prefix pages, and over HTTP.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import gguf
import httpx
import llama_parity
import numpy as np
import openai
import pytest
import torch
from gguf.quants import dequantize

from pocketmoe import native
from pocketmoe.engine.llm import LLM
from pocketmoe.engine.pooling import Pooler, chunk_rows, embd_normalize, model_pooling
from pocketmoe.engine.sampler import SamplingParams
from pocketmoe.errors import PocketMoEError
from pocketmoe.testing.live_server import LiveServer
from pocketmoe.testing.synth import write_fixture

PROMPT = [1, 17, 42, 99, 250, 7, 300, 5, 8, 9, 100, 200, 311, 400, 2, 3, 50, 60, 70]
EMB_TOL = 3e-4  # max |d| between unit vectors (the logits of these files agree to 1e-4)
ARCHS = ["deepseek2", "minimax-m2", "deepseek4"]
NAME = "tiny"


def llama_embedding(path: Path, prompt: list[int], pooling: str) -> np.ndarray:
    """llama.cpp's pooled embedding of the prompt, as llama_get_embeddings_seq gives it (not normalized)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    kind = {"last": llama_cpp.LLAMA_POOLING_TYPE_LAST, "mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN,
            "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS}[pooling]
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, n_ubatch=64, n_threads=2, embedding=True,
                          pooling_type=kind, type_k=0, type_v=0, flash_attn=False, verbose=False)
    try:
        llm.eval(prompt)
        ptr = llama_cpp.llama_get_embeddings_seq(llm.ctx, 0)
        return np.ctypeslib.as_array(ptr, shape=(llm.n_embd(),)).copy()
    finally:
        llm.close()


@pytest.fixture(scope="module", params=ARCHS)
def f32_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fixture(request.param, "tiny", "F32", tmp_path_factory.mktemp("emb") / "f32.gguf", seed=3)[0]


def head_weight(path: Path) -> torch.Tensor:
    """output.weight (token_embd.weight where the head is tied) [V, D], read with gguf's own reader."""
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    t = tensors.get("output.weight", tensors["token_embd.weight"])
    return torch.from_numpy(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32))


@pytest.mark.parity
def test_states_are_the_heads_input(f32_model: Path) -> None:
    """Every token's state (pooling none), through the file's head matrix, is llama.cpp's logits at that position:
    the states are what the head reads, for each architecture (DeepSeek-V4's too, whose states llama.cpp does not
    pool)."""
    theirs, _ = llama_parity.llama_run(f32_model, PROMPT, 0, 64)
    rows = LLM(f32_model, n_ctx=64, threads=1, chunk_size=5).embed([PROMPT], pooling="none", normalize=-1,
                                                                   use_tqdm=False)[0].embedding
    assert rows.shape[0] == len(PROMPT)
    logits = (rows.double() @ head_weight(f32_model).double().T).float()
    assert float((logits - torch.from_numpy(theirs)).abs().max()) <= 1e-4


@pytest.mark.parity
@pytest.mark.parametrize("arch", ["deepseek2", "minimax-m2"])  # llama.cpp's deepseek4 graph pools no embeddings
def test_pooled_states_match_llama_cpp(arch: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Each pooling's unit vector is llama.cpp's, prefilled in chunks of 5; the poolings differ far beyond the
    tolerance, so a wrong row or pooling cannot pass."""
    path = write_fixture(arch, "tiny", "F32", tmp_path_factory.mktemp("emb") / "f32.gguf", seed=3)[0]
    llm = LLM(path, n_ctx=64, threads=1, chunk_size=5)
    ours = {p: llm.embed([PROMPT], pooling=p, use_tqdm=False)[0].embedding for p in ("last", "mean", "cls")}
    for pooling, v in ours.items():
        theirs = torch.from_numpy(llama_embedding(path, PROMPT, pooling))
        assert float((v - theirs / theirs.norm()).abs().max()) <= EMB_TOL, pooling
        assert abs(float(v.norm()) - 1.0) < 1e-5
    assert min(float((ours[a] - ours[b]).abs().max()) for a, b in (("last", "mean"), ("last", "cls"),
                                                                     ("mean", "cls"))) > 100 * EMB_TOL


def test_normalize_is_llama_cpps() -> None:
    v = torch.tensor([[3.0, -4.0, 0.0], [0.0, 0.0, 0.0]])
    assert embd_normalize(v, -1) is v
    assert torch.allclose(embd_normalize(v, 2)[0], torch.tensor([0.6, -0.8, 0.0]))
    assert torch.allclose(embd_normalize(v, 1)[0], torch.tensor([3 / 7, -4 / 7, 0.0]))
    assert torch.allclose(embd_normalize(v, 0)[0], torch.tensor([24570.0, -32760.0, 0.0]))
    p3 = (27 + 64) ** (1 / 3)
    assert torch.allclose(embd_normalize(v, 3)[0], torch.tensor([3 / p3, -4 / p3, 0.0]))
    assert embd_normalize(v, 2)[1].eq(0).all()  # a zero row stays zero
    with pytest.raises(PocketMoEError, match="embd_normalize -2"):
        embd_normalize(v, -2)


def test_pooler_reads_the_rows_chunk_rows_names() -> None:
    """Chunks of a 7-token prompt in 3s: the rows each pooling asks for, pooled as one pass over all rows would."""
    rows = torch.randn(7, 4, generator=torch.Generator().manual_seed(0))
    for pooling, want in (("last", rows[-1]), ("mean", rows.double().mean(0).float()), ("cls", rows[0]),
                          ("none", rows)):
        pool = Pooler(pooling)
        for a in range(0, 7, 3):
            b = min(a + 3, 7)
            which = chunk_rows(pooling, a, b, 7)
            pool.add({"none": rows[:0], "first": rows[a:a + 1], "last": rows[b - 1:b], "all": rows[a:b]}[which])
        assert torch.equal(pool.result(), want), pooling
    assert model_pooling("deepseek2", {}) == "last"
    assert model_pooling("deepseek2", {"deepseek2.pooling_type": 1}) == "mean"
    with pytest.raises(PocketMoEError, match="pooling_type is 4"):
        model_pooling("deepseek2", {"deepseek2.pooling_type": 4})


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fixture("deepseek2", "tiny", "Q4_K_M", tmp_path_factory.mktemp("emb") / "m.gguf", seed=11)[0]


@pytest.fixture(scope="module")
def alone(model: Path) -> LLM:
    return LLM(model, n_ctx=256, threads=1, max_num_seqs=1, enable_prefix_caching=False)


TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog " * 6, "zzz", "mixture of experts"]


@pytest.mark.skipif(not native.available(), reason="bitwise rows across chunkings need the native kernels")
@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_batch_prefix_cache_and_chunking_give_a_prompt_its_vector(model: Path, alone: LLM, pooling: str) -> None:
    """Each text's vector computed one at a time with no prefix cache is bitwise the one it gets in a batch of
    eight beside generation, with prefix caching on (a repeated text then finds its pages cached), and in
    another chunking."""
    want = [o.embedding for o in alone.embed(TEXTS, pooling=pooling, use_tqdm=False)]
    batched = LLM(model, n_ctx=256, threads=1, max_num_seqs=8, chunk_size=7, enable_prefix_caching=True)
    batched.generate(TEXTS[:2], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # pages to reuse
    engine = batched._batch_engine()
    got: dict[int, torch.Tensor] = {}
    gen = engine.submit(batched.encode_prompt("a b c d e f"), [SamplingParams(max_tokens=8, temperature=0)],
                        sink=lambda d: None)
    def keep(d: Any) -> None:  # noqa: ANN401
        if d is not None and d.embedding is not None:
            got[d.index] = d.embedding

    emb = engine.submit_embed([batched.encode_prompt(t) for t in TEXTS], pooling, sink=keep)
    engine.run_until_done()
    assert gen.open == emb.open == 0
    for i, w in enumerate(want):
        assert torch.equal(embd_normalize(got[i], 2), w), (pooling, i)
    hits = batched._engine.metrics.prefix_cache_hits._value.get()
    assert (hits > 0) == (pooling == "last")  # only the last token's state lets cached pages stand in


def test_embed_checks_its_input(alone: LLM) -> None:
    with pytest.raises(PocketMoEError, match="pooling 'max'"):
        alone.embed("hi", pooling="max")
    with pytest.raises(PocketMoEError, match="prompt 1 has 300 tokens; an embedding takes 1 to 256"):
        alone.embed(["hi", [5] * 300])
    raw = alone.embed("hi", normalize=-1, use_tqdm=False)[0].embedding
    assert torch.allclose(alone.embed("hi", use_tqdm=False)[0].embedding, raw / raw.norm())
    every = alone.embed("hello world", pooling="none", normalize=-1, use_tqdm=False)[0].embedding
    assert every.shape == (len(alone.encode_prompt("hello world")), raw.shape[0])
    assert torch.equal(every[-1], alone.embed("hello world", pooling="last", normalize=-1,
                                              use_tqdm=False)[0].embedding)


@pytest.fixture(scope="module")
def server(model: Path):
    with LiveServer(["--model", str(model), "--served-model-name", NAME, "--max-model-len", "256", "--threads", "1",
                     "--embeddings"]) as srv:
        yield srv


def test_openai_embeddings_are_the_engines(server: LiveServer, alone: LLM) -> None:
    """The OpenAI SDK (which asks for base64 and decodes it) and floats get LLM.embed's vectors bitwise, for text
    and token-id inputs, with OpenAI's usage."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    want = [o.embedding for o in alone.embed(TEXTS, use_tqdm=False)]
    r = client.embeddings.create(model=NAME, input=TEXTS)
    assert [d.index for d in r.data] == list(range(len(TEXTS)))
    for d, w in zip(r.data, want, strict=True):
        assert torch.equal(torch.tensor(d.embedding), w)
    n = sum(len(alone.encode_prompt(t)) for t in TEXTS)
    assert (r.usage.prompt_tokens, r.usage.total_tokens) == (n, n)
    ids = alone.encode_prompt(TEXTS[0])
    body = httpx.post(server.url + "/v1/embeddings", json={"input": ids, "encoding_format": "float"}).json()
    assert torch.equal(torch.tensor(body["data"][0]["embedding"]), want[0])
    b64 = httpx.post(server.url + "/v1/embeddings", json={"input": [ids], "encoding_format": "base64"}).json()
    raw = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    assert torch.equal(torch.from_numpy(raw.copy()), want[0])
    unnormed = httpx.post(server.url + "/v1/embeddings", json={"input": ids, "normalize": False}).json()
    assert torch.equal(torch.tensor(unnormed["data"][0]["embedding"]),
                       alone.embed([ids], normalize=-1, use_tqdm=False)[0].embedding)
    # vLLM's truncate_prompt_tokens keeps the last k tokens
    long = alone.encode_prompt(TEXTS[1] * 3)
    cut = httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS[1] * 3, "truncate_prompt_tokens": 40}).json()
    assert cut["usage"]["prompt_tokens"] == 40
    assert torch.equal(torch.tensor(cut["data"][0]["embedding"]),
                       alone.embed([long[-40:]], use_tqdm=False)[0].embedding)


def test_chat_form_embeds_the_rendered_chat(server: LiveServer, alone: LLM) -> None:
    """vLLM's chat form: the messages as /tokenize renders them (no generation prompt unless asked) embedded."""
    msgs = [{"role": "user", "content": "what is a mixture of experts?"}]
    for gen in (False, True):
        ids = httpx.post(server.url + "/tokenize", json={"messages": msgs, "add_generation_prompt": gen}).json()
        got = httpx.post(server.url + "/v1/embeddings", json={"messages": msgs, "add_generation_prompt": gen}).json()
        assert got["usage"]["prompt_tokens"] == ids["count"]
        assert torch.equal(torch.tensor(got["data"][0]["embedding"]),
                           alone.embed([ids["tokens"]], use_tqdm=False)[0].embedding)


@pytest.mark.parametrize(("body", "status", "message"), [
    ({}, 400, "give input (texts or token ids) or messages"),
    ({"input": "hi", "messages": [{"role": "user", "content": "hi"}]}, 400, "one of them"),
    ({"input": ""}, 400, "input 0 is an empty string"),
    ({"input": []}, 400, "input"),
    ({"input": "hi", "dimensions": 3}, 400, "have 256 dimensions"),
    ({"input": "x " * 300}, 400, "input 0 has 601 tokens but this server's context holds 256"),
    ({"input": [[1, 2], [999999]]}, 400, "input token id 999999 is outside the vocabulary"),
    ({"input": [-1]}, 400, "input"),
    ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "hi", "normalize": True, "embd_normalize": 1}, 400, "not both"),
    ({"input": "hi", "embd_normalize": -3}, 400, "embd_normalize -3"),
    ({"input": "hi", "truncate_prompt_tokens": 999}, 400, "truncate_prompt_tokens is 999"),
    ({"input": ["a"] * 2049}, 400, "input"),
    ({"input": "hi", "model": "other"}, 404, "other"),
])
def test_bad_requests_are_400s_and_the_server_keeps_serving(server: LiveServer, body: dict, status: int,
                                                           message: str) -> None:
    r = httpx.post(server.url + "/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]
    assert httpx.post(server.url + "/v1/embeddings", json={"input": "ok"}).status_code == 200


def test_score_and_rerank_are_cosine_similarities_of_the_vectors(server: LiveServer, alone: LLM) -> None:
    """vLLM's /score (1:1, 1:N, N:N) and /rerank (Jina's and Cohere's shape) over the vectors LLM.embed gives."""
    v = {t: o.embedding.double() for t, o in zip(TEXTS, alone.embed(TEXTS, use_tqdm=False), strict=True)}

    def cos(a: str, b: str) -> float:
        return float(v[a] @ v[b] / (v[a].norm() * v[b].norm()))

    for body, pairs in (({"text_1": TEXTS[0], "text_2": TEXTS[1]}, [(0, 1)]),
                        ({"text_1": [TEXTS[0]], "text_2": TEXTS[1:]}, [(0, 1), (0, 2), (0, 3)]),
                        ({"text_1": TEXTS[:2], "text_2": TEXTS[2:]}, [(0, 2), (1, 3)])):
        r = httpx.post(server.url + "/v1/score", json=body).json()
        assert [d["index"] for d in r["data"]] == list(range(len(pairs)))
        assert np.allclose([d["score"] for d in r["data"]], [cos(TEXTS[a], TEXTS[b]) for a, b in pairs], atol=1e-6)
    bad = httpx.post(server.url + "/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[:3]})
    assert bad.status_code == 400 and "1:1, 1:N" in bad.json()["error"]["message"]
    want = sorted(range(3), key=lambda i: -cos(TEXTS[0], TEXTS[1 + i]))
    for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = httpx.post(server.url + route, json={"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 2}).json()
        assert [x["index"] for x in r["results"]] == want[:2]
        assert [x["document"]["text"] for x in r["results"]] == [TEXTS[1 + i] for i in want[:2]]
        assert np.allclose([x["relevance_score"] for x in r["results"]],
                           [cos(TEXTS[0], TEXTS[1 + i]) for i in want[:2]], atol=1e-6)
    r = httpx.post(server.url + "/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:],
                                                 "return_documents": False}).json()
    assert [x["index"] for x in r["results"]] == want and "document" not in r["results"][0]


def test_llama_server_embedding_route(server: LiveServer, alone: LLM) -> None:
    """llama-server's /embedding: `content` (or `input`), a list of {index, embedding: [row]}, embd_normalize."""
    want = alone.embed(TEXTS[:2], use_tqdm=False)
    for route, key in (("/embedding", "content"), ("/embeddings", "input")):
        body = httpx.post(server.url + route, json={key: TEXTS[:2]}).json()
        assert [b["index"] for b in body] == [0, 1]
        for b, w in zip(body, want, strict=True):
            assert len(b["embedding"]) == 1 and torch.equal(torch.tensor(b["embedding"][0]), w.embedding)
    taxicab = httpx.post(server.url + "/embedding", json={"content": TEXTS[0], "embd_normalize": 1}).json()
    assert torch.equal(torch.tensor(taxicab[0]["embedding"][0]),
                       alone.embed(TEXTS[0], normalize=1, use_tqdm=False)[0].embedding)
    assert httpx.post(server.url + "/embedding", json={}).status_code == 400


def test_pooling_none_gives_each_tokens_state(model: Path, alone: LLM) -> None:
    """--pooling none: /embedding gives every token's state as computed; /v1/embeddings, which gives one vector an
    input, says what to do."""
    with LiveServer(["--model", str(model), "--max-model-len", "256", "--threads", "1", "--pooling", "none"]) as srv:
        rows = httpx.post(srv.url + "/embedding", json={"content": TEXTS[0]}).json()[0]["embedding"]
        want = alone.embed(TEXTS[0], pooling="none", normalize=-1, use_tqdm=False)[0].embedding
        assert torch.equal(torch.tensor(rows), want)
        for route, body in (("/v1/embeddings", {"input": TEXTS[0]}), ("/rerank", {"query": "a", "documents": ["b"]}),
                            ("/score", {"text_1": "a", "text_2": "b"})):
            r = httpx.post(srv.url + route, json=body)
            assert r.status_code == 400 and "--pooling none" in r.json()["error"]["message"], route


def test_api_key_guards_the_embedding_routes(model: Path) -> None:
    with LiveServer(["--model", str(model), "--max-model-len", "64", "--threads", "1", "--api-key", "k"]) as srv:
        for route in ("/v1/embeddings", "/embedding", "/embeddings", "/score", "/rerank", "/v2/rerank"):
            assert httpx.post(srv.url + route, json={"input": "hi"}).status_code == 401, route
        ok = httpx.post(srv.url + "/embedding", json={"input": "hi"}, headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200


def test_embed_cli_prints_llama_embeddings_formats(model: Path, alone: LLM, capsys: pytest.CaptureFixture) -> None:
    """python -m pocketmoe.embed: the text split at the separator, each part's vector as LLM.embed gives it, in
    llama-embedding's formats (plain values, array, OpenAI's object with the cosine similarity matrix)."""
    from pocketmoe.embed import main

    want = torch.stack([o.embedding for o in alone.embed(TEXTS[:3], use_tqdm=False)])
    base = ["--model", str(model), "--threads", "1", "--n-ctx", "256"]
    assert main([*base, "--prompt", "|".join(TEXTS[:3]), "--embd-separator", "|", "--embd-output-format", "json+"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert torch.equal(torch.tensor([d["embedding"] for d in body["data"]]), want)
    unit = want.double() / want.double().norm(dim=-1, keepdim=True)
    assert np.allclose(body["cosineSimilarity"], (unit @ unit.T).numpy(), atol=1e-12)
    assert body["usage"]["prompt_tokens"] == sum(len(alone.encode_prompt(t)) for t in TEXTS[:3])
    assert main([*base, "--prompt", "\n".join(TEXTS[:2]) + "\n", "--embd-output-format", "array"]) == 0
    assert torch.equal(torch.tensor(json.loads(capsys.readouterr().out)), want[:2])
    assert main([*base, "--prompt", TEXTS[0]]) == 0
    values = [float(x) for x in capsys.readouterr().out.split()]
    assert np.allclose(values, want[0].numpy(), atol=5e-7)
    from pocketmoe.cli_util import run_cli

    assert run_cli(main, [*base, "--prompt", "x", "--pooling", "none", "--embd-output-format", "json"]) == 2
    assert "--pooling none gives each token's vector" in capsys.readouterr().err
