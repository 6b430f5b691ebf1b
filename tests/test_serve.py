"""The OpenAI-compatible server, live on 127.0.0.1, driven by the official `openai` client and raw httpx.

The reference for each answer is independent of the server: the same model run through `LLM` (one
sequence at a time, no batching, no HTTP) gives the tokens, text and logprobs a request must get.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch

from pocketmoe.engine.llm import LLM
from pocketmoe.engine.sampler import SamplingParams
from pocketmoe.engine.structured import Grammar
from pocketmoe.errors import PocketMoEError
from pocketmoe.testing.live_server import LiveServer
from pocketmoe.testing.synth import write_fixture

NAME = "tiny"
PROMPTS = ["hello world", "the quick brown fox", "a b c d e f g", "lorem ipsum dolor", "one two three four five",
           "zzz", "tensor parallel", "mixture of experts"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_fixture("deepseek2", "tiny", "Q4_K_M", tmp_path_factory.mktemp("serve") / "m.gguf", seed=11)[0]


@pytest.fixture(scope="module")
def server(model: Path):
    with LiveServer(["--model", str(model), "--served-model-name", NAME, "--max-num-seqs", "16",
                     "--max-model-len", "256", "--threads", "1"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm(model: Path) -> LLM:
    return LLM(model, n_ctx=256, threads=1, enable_prefix_caching=False)  # every prompt computed whole


def solo(llm: LLM, prompt, **kw):  # noqa: ANN001
    return llm.generate([prompt], SamplingParams(**kw))[0]


def test_models_and_health(server: LiveServer, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    assert httpx.get(server.url + "/health").status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    # llama-server's names for clients whose base URL leaves out /v1: the same answers
    bare = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    assert [m.id for m in bare.models.list().data] == [NAME]
    assert httpx.get(server.url + "/v1/health").json() == httpx.get(server.url + "/health").json() == {"status": "ok"}
    msgs = [{"role": "user", "content": "hi"}]
    assert bare.chat.completions.create(model=NAME, messages=msgs, max_tokens=4, temperature=0).choices[0].message \
        == client.chat.completions.create(model=NAME, messages=msgs, max_tokens=4, temperature=0).choices[0].message


def test_completion_matches_the_engine_alone(client: openai.OpenAI, llm: LLM) -> None:
    want = solo(llm, "hello world", temperature=0, max_tokens=12, ignore_eos=True)
    r = client.completions.create(model=NAME, prompt="hello world", max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(want.prompt_token_ids) and r.usage.completion_tokens == 12
    chunks = list(client.completions.create(model=NAME, prompt="hello world", max_tokens=12, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(server: LiveServer, client: openai.OpenAI,
                                                               llm: LLM) -> None:
    """vLLM's truncate_prompt_tokens: the completion of the prompt's last k tokens, on /v1/completions, the chat
    route (its rendered prompt cut) and llama.cpp's /completion; -1 keeps the most that leave max_tokens room."""
    ids = [(7 * i) % 200 + 3 for i in range(300)]  # longer than the server's context of 256
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True)
    want = solo(llm, ids[-40:], **greedy)
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True, "truncate_prompt_tokens": 40, "return_token_ids": True})
    assert r.choices[0].text == want.text and r.usage.prompt_tokens == 40
    assert r.choices[0].prompt_token_ids == ids[-40:]
    fitted = solo(llm, ids[-(256 - 6):], **greedy)
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True, "truncate_prompt_tokens": -1})
    assert r.choices[0].text == fitted.text and r.usage.prompt_tokens == 250
    llama = httpx.post(server.url + "/completion", json={"prompt": ids, "n_predict": 6, "temperature": 0,
                                                          "ignore_eos": True, "truncate_prompt_tokens": -1}).json()
    assert llama["content"] == fitted.text and llama["tokens_evaluated"] == 250

    chat = {"model": NAME, "messages": [{"role": "user", "content": "the quick brown fox " * 10}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    rendered = httpx.post(server.url + "/v1/chat/completions", json=chat).json()["prompt_token_ids"]
    assert len(rendered) > 40
    want = solo(llm, rendered[-40:], **greedy)
    r = httpx.post(server.url + "/v1/chat/completions", json={**chat, "truncate_prompt_tokens": 40}).json()
    assert r["choices"][0]["message"]["content"] == want.text and r["usage"]["prompt_tokens"] == 40
    assert r["prompt_token_ids"] == rendered[-40:]


@pytest.mark.parametrize(("body", "message"), [
    ({"prompt": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens 0 would leave no prompt"),
    ({"prompt": "hi", "truncate_prompt_tokens": 999}, "truncate_prompt_tokens is 999 but this server's context holds 256"),
    ({"prompt": "hi", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"prompt": "hi", "truncate_prompt_tokens": 4, "suffix": "x"}, "would cut the insertion layout"),
    ({"prompt": "hi", "truncate_prompt_tokens": -1, "max_tokens": 256}, "max_tokens 256 leaves no room for a prompt"),
])
def test_truncate_prompt_tokens_errors(server: LiveServer, body: dict, message: str) -> None:
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_suffix_fills_in_the_middle(server: LiveServer, client: openai.OpenAI, llm: LLM) -> None:
    """OpenAI's suffix: the prompt is the text before the insertion, laid out with the suffix in the vocabulary's
    fill-in-the-middle tokens (BOS, <｜fim▁begin｜> prefix, <｜fim▁hole｜> suffix, <｜fim▁end｜>; special-token texts in
    the code read as text), and completed as that prompt is alone and as /infill completes the same text."""
    tok = llm.tokenizer
    pre, suf, mid = (tok.tokens.index(t) for t in ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"))
    before, after = "def add(a, b):\n    # <｜fim▁hole｜>\n    ", "\n\nprint(add(1, 2))\n"
    ids = [tok.bos_id, pre, *tok.encode(before, add_bos=False, parse_special=False), suf,
           *tok.encode(after, add_bos=False, parse_special=False), mid]
    want = solo(llm, ids, temperature=0, max_tokens=8, ignore_eos=True)
    r = client.completions.create(model=NAME, prompt=before, suffix=after, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == want.text and r.usage.prompt_tokens == len(ids)
    infill = httpx.post(server.url + "/infill", json={"input_prefix": before, "input_suffix": after, "n_predict": 8,
                                                      "temperature": 0, "ignore_eos": True}, timeout=60).json()
    assert infill["content"] == want.text
    r = client.completions.create(model=NAME, prompt=ids[2:ids.index(suf)], suffix=after, max_tokens=8,
                                  temperature=0, extra_body={"ignore_eos": True})  # the prefix as token ids
    assert r.choices[0].text == want.text
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=NAME, prompt=before, suffix=after, echo=True, max_tokens=2)


def test_return_token_ids(client: openai.OpenAI, llm: LLM) -> None:
    """vLLM's return_token_ids: each choice's generated ids and its prompt's, as the engine alone gives them, whole
    and streamed (each chunk its own tokens, the first chunk the prompt's), on both routes; without it, neither."""
    greedy = {"max_tokens": 6, "temperature": 0}
    extra = {"ignore_eos": True, "return_token_ids": True}
    want = solo(llm, "hello world", ignore_eos=True, **greedy)
    r = client.completions.create(model=NAME, prompt="hello world", extra_body=extra, **greedy)
    got = r.choices[0].model_extra
    assert (got["prompt_token_ids"], got["token_ids"]) == (want.prompt_token_ids, want.token_ids)
    chunks = list(client.completions.create(model=NAME, prompt="hello world", stream=True, extra_body=extra, **greedy))
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == want.prompt_token_ids
    assert not any("prompt_token_ids" in c.choices[0].model_extra for c in chunks[1:])
    assert sum((c.choices[0].model_extra["token_ids"] for c in chunks), []) == want.token_ids
    r = client.completions.create(model=NAME, prompt="hello world", **greedy)
    assert "token_ids" not in (r.choices[0].model_extra or {})

    messages = [{"role": "user", "content": "hello world"}]
    ids = llm.tokenizer.encode_chat(messages)
    want = solo(llm, ids, ignore_eos=True, **greedy)
    r = client.chat.completions.create(model=NAME, messages=messages, extra_body=extra, **greedy)
    assert (r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]) == (ids, want.token_ids)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, stream=True, extra_body=extra,
                                                 **greedy))
    assert chunks[0].model_extra["prompt_token_ids"] == ids
    assert sum((c.choices[0].model_extra["token_ids"] for c in chunks), []) == want.token_ids


def test_null_fields_take_their_defaults(server: LiveServer) -> None:
    body = {"model": NAME, "prompt": "hi", "max_tokens": 2, "n": None, "stream": None, "echo": None, "stop": None,
            "temperature": None, "logprobs": None, "stream_options": None, "seed": None, "user": None}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": None,
            "logprobs": None, "top_logprobs": None, "tools": None, "tool_choice": None, "response_format": None}
    assert httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=30).status_code == 200
    r = httpx.post(server.url + "/v1/completions", json={"prompt": None}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_chat_and_chat_stream(client: openai.OpenAI, llm: LLM) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi "},
                                                                                     {"type": "text", "text": "there"}]}]
    ids = llm.encode_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}])
    want = solo(llm, ids, temperature=0, max_tokens=10)
    r = client.chat.completions.create(model=NAME, messages=msgs, max_completion_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_logprobs_are_the_models(client: openai.OpenAI, llm: LLM) -> None:
    ids = llm.encode_prompt("the quick brown fox")
    logits = llm.prompt_logits(ids)[-1]
    lp = torch.log_softmax(logits, -1)
    top = torch.topk(lp, 3)
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                       temperature=0, logprobs=True, top_logprobs=3)
    assert len(r.choices[0].logprobs.content[0].top_logprobs) == 3
    c = client.completions.create(model=NAME, prompt=ids, max_tokens=1, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    got = c.choices[0].logprobs
    assert got.token_logprobs[0] == pytest.approx(float(top.values[0]), abs=1e-5)
    assert list(got.top_logprobs[0].values()) == pytest.approx(top.values.tolist(), abs=1e-5)
    e = client.completions.create(model=NAME, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True,
                                  extra_body={"ignore_eos": True})
    pl = e.choices[0].logprobs.token_logprobs
    full = torch.log_softmax(llm.prompt_logits(ids), -1)
    assert pl[0] is None and len(pl) == len(ids) + 1
    for j in range(1, len(ids)):
        assert pl[j] == pytest.approx(float(full[j - 1, ids[j]]), abs=1e-5)
    assert e.choices[0].text.startswith(llm.tokenizer.decode(ids))


def test_vllm_prompt_logprobs(server: LiveServer, llm: LLM) -> None:
    """vLLM's prompt_logprobs: per prompt token {id: {logprob, rank, decoded_token}} for it and the k most likely,
    the model's (log_softmax of the logits before it); beside echo's legacy object, each with its own top count;
    refused with stream and on /completion."""
    ids = llm.encode_prompt("mixture of experts")
    full = torch.log_softmax(llm.prompt_logits(ids), -1)
    body = {"model": NAME, "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 3, "logprobs": 1,
            "echo": True}
    c = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    plp = c["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for j in range(1, len(ids)):
        row, tok = full[j - 1], ids[j]
        top = torch.topk(row, 3).indices.tolist()
        assert set(plp[j]) == {str(t) for t in [tok, *top]}
        for t in [tok, *top]:
            e = plp[j][str(t)]
            assert e["logprob"] == pytest.approx(float(row[t]), abs=1e-5)
            assert e["rank"] == 1 + int((row > row[t]).sum())
            assert e["decoded_token"] == llm.tokenizer.token_to_piece(t).decode("utf-8", "replace")
    legacy = c["logprobs"]["top_logprobs"]
    assert legacy[0] is None and all(len(x) == 1 for x in legacy[1:])  # echo's own top count, logprobs=1
    chat = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "temperature": 0, "n": 2,
            "prompt_logprobs": 0}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).json()
    cids = llm.encode_chat([{"role": "user", "content": "x"}])
    want = solo(llm, cids, temperature=0, max_tokens=2, prompt_logprobs=0).prompt_logprobs
    got = r["prompt_logprobs"]
    assert len(got) == len(want) == len(cids) and got[0] is want[0] is None
    for g, w in zip(got[1:], want[1:], strict=True):
        assert [int(t) for t in g] == list(w)  # the prompt token alone (k = 0)
        assert [v["logprob"] for v in g.values()] == pytest.approx([v.logprob for v in w.values()], abs=1e-5)
    for url, extra in [("/v1/completions", {"stream": True}), ("/v1/chat/completions", {"stream": True}),
                       ("/completion", {})]:
        req = {**(chat if "chat" in url else body), **extra}
        req.pop("echo", None) if url == "/completion" else None
        bad = httpx.post(server.url + url, json=req, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs", (url, bad.text)


def test_n_seed_and_stop(client: openai.OpenAI, llm: LLM) -> None:
    kw = dict(model=NAME, prompt="a b c", max_tokens=16, temperature=1.0, top_p=0.9)
    r1 = client.completions.create(n=2, seed=1234, **kw)
    r2 = client.completions.create(n=2, seed=1234, **kw)
    assert [c.index for c in r1.choices] == [0, 1]
    assert [c.text for c in r1.choices] == [c.text for c in r2.choices]
    want = solo(llm, "a b c", temperature=1.0, top_p=0.9, max_tokens=16, seed=1234)
    assert r1.choices[0].text == want.text
    # stop: never emitted, cut where it starts, even when it spans tokens
    full = solo(llm, "hello world", temperature=0, max_tokens=24, ignore_eos=True).text
    stop = full[5:9]
    assert stop.strip()
    r = client.completions.create(model=NAME, prompt="hello world", max_tokens=24, temperature=0, stop=[stop, "@@@"],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model=NAME, prompt="hello world", max_tokens=24, temperature=0, stop=stop,
                                       stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks) == full[:full.index(stop)]


def _stream_text(url: str, prompt: str, n_tokens: int) -> tuple[str, list]:
    body = {"model": NAME, "prompt": prompt, "max_tokens": n_tokens, "temperature": 0, "stream": True,
            "logprobs": 3, "ignore_eos": True}
    text, lps = "", []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = json.loads(line[6:])["choices"][0]
                text += ch["text"]
                lps.append(ch["logprobs"])
    return text, lps


def test_sixteen_concurrent_streams_equal_each_alone(server: LiveServer) -> None:
    prompts = [PROMPTS[i % len(PROMPTS)] + f" {i}" for i in range(16)]
    lengths = [8 + 3 * (i % 5) for i in range(16)]
    alone = [_stream_text(server.url, p, n) for p, n in zip(prompts, lengths, strict=True)]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda a: _stream_text(server.url, *a), zip(prompts, lengths, strict=True)))
    # logprobs (top 3 of the raw logits, as JSON floats) equal means the logits were bitwise equal
    assert together == alone


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_disconnect_mid_stream_frees_kv(server: LiveServer) -> None:
    body = {"model": NAME, "prompt": "hello", "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert _metric(server.url, "pocketmoe_kv_cache_usage_ratio") > 0
    deadline = time.monotonic() + 10
    while _metric(server.url, "pocketmoe_kv_cache_usage_ratio") > 0:
        assert time.monotonic() < deadline, "the KV pages of a closed stream were not freed"
        time.sleep(0.05)
    text = httpx.get(server.url + "/metrics").text
    assert 'pocketmoe_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert "pocketmoe_time_to_first_token_seconds_count" in text


def test_usage_reports_the_prompt_tokens_the_prefix_cache_gave(server: LiveServer, client: openai.OpenAI) -> None:
    """A prompt sent again takes its full KV pages from the prefix cache (usage.prompt_tokens_details.cached_tokens,
    as OpenAI reports it) and gets the same text and logprobs."""
    prompt = " ".join(f"cached{i}" for i in range(24))
    kw = {"model": NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 2,
          "extra_body": {"ignore_eos": True}}
    hits = _metric(server.url, "pocketmoe_prefix_cache_hits_total")
    first = client.completions.create(**kw)
    second = client.completions.create(**kw)
    n = second.usage.prompt_tokens
    assert n > 16 and first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    assert second.choices[0].text == first.choices[0].text
    assert second.choices[0].logprobs.top_logprobs == first.choices[0].logprobs.top_logprobs
    assert _metric(server.url, "pocketmoe_prefix_cache_hits_total") == hits + (n - 1) // 16 * 16
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    messages = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model=NAME, messages=messages, max_tokens=2)
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2)
    assert chat.usage.prompt_tokens_details.cached_tokens == (chat.usage.prompt_tokens - 1) // 16 * 16 > 0


BAD = [
    ("not json", "{", 400),
    ("not an object", "[1, 2]", 400),
    ("missing prompt", {"model": NAME}, 400),
    ("prompt wrong type", {"prompt": 5}, 400),
    ("max_tokens string", {"prompt": "x", "max_tokens": "5"}, 400),
    ("max_tokens zero", {"prompt": "x", "max_tokens": 0}, 400),
    ("temperature high", {"prompt": "x", "temperature": 3}, 400),
    ("top_p zero", {"prompt": "x", "top_p": 0}, 400),
    ("n too big", {"prompt": "x", "n": 1000}, 400),
    ("too many choices", {"prompt": ["x"] * 20, "n": 4}, 400),
    ("empty stop", {"prompt": "x", "stop": [""]}, 400),
    ("bad logit_bias key", {"prompt": "x", "logit_bias": {"abc": 1}}, 400),
    ("logit_bias out of vocab", {"prompt": "x", "logit_bias": {"999999": 1}}, 400),
    ("logprobs too many", {"prompt": "x", "logprobs": 50}, 400),
    ("token id out of vocab", {"prompt": [1, 2, 10**9]}, 400),
    ("negative token id", {"prompt": [-1]}, 400),
    ("empty prompt list", {"prompt": []}, 400),
    ("prompt too long", {"prompt": list(range(300))}, 400),
    ("prompt + max_tokens too long", {"prompt": [1, 2, 3], "max_tokens": 300}, 400),
    ("unknown response_format", {"prompt": "x", "response_format": {"type": "xml"}}, 400),
    ("json_schema without its object", {"prompt": "x", "response_format": {"type": "json_schema"}}, 400),
    ("json_schema without a name", {"prompt": "x", "response_format": {"type": "json_schema",
                                                                       "json_schema": {"schema": {}}}}, 400),
    ("schema that does not compile", {"prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "frob"}, "strict": True}}}, 400),
    ("regex that does not parse", {"prompt": "x", "structured_outputs": {"regex": "(ab"}}, 400),
    ("gbnf that does not parse", {"prompt": "x", "grammar": "root ::= ("}, 400),
    ("two structured outputs", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400),
    ("response_format and grammar", {"prompt": "x", "response_format": {"type": "json_object"},
                                     "grammar": 'root ::= "a"'}, 400),
    ("empty choice list", {"prompt": "x", "structured_outputs": {"choice": []}}, 400),
    ("structured json not JSON", {"prompt": "x", "structured_outputs": {"json": "{nope"}}, 400),
    ("unknown model", {"prompt": "x", "model": "gpt-4"}, 404),
    ("seed float", {"prompt": "x", "seed": 1.5}, 400),
    ("stream string", {"prompt": "x", "stream": "yes"}, 400),
]
BAD_CHAT = [
    ("no messages", {"messages": []}, 400),
    ("bad role", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("image part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400),
    ("content number", {"messages": [{"role": "user", "content": 5}]}, 400),
    ("top_logprobs without logprobs", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400),
    ("top_logprobs too many", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     400),
    ("tools", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400),
]


@pytest.mark.parametrize("path,case", [("/v1/completions", c) for c in BAD] + [("/v1/chat/completions", c)
                                                                                 for c in BAD_CHAT],
                         ids=[c[0] for c in BAD] + ["chat " + c[0] for c in BAD_CHAT])
def test_bad_requests_get_their_4xx_and_the_server_goes_on(server: LiveServer, path: str, case) -> None:  # noqa: ANN001
    _, body, status = case
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server.url + path, content=data, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in r.text
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def test_limits_routes_and_context_message(server: LiveServer) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"prompt": list(range(300))})
    assert "300" in r.json()["error"]["message"] and "256" in r.json()["error"]["message"]
    big = b'{"prompt": "' + b"a" * (17 << 20) + b'"}'
    r = httpx.post(server.url + "/v1/completions", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert httpx.get(server.url + "/v1/nothing").status_code == 404
    assert httpx.get(server.url + "/v1/completions").status_code == 405
    assert httpx.get(server.url + "/health").status_code == 200


def test_api_key_and_full_queue(model: Path) -> None:
    args = ["--model", str(model), "--served-model-name", NAME, "--threads", "1", "--max-model-len", "2048",
            "--max-num-seqs", "1", "--max-queue", "1"]
    with LiveServer(args, env={"POCKETMOE_API_KEY": "sekrit"}) as srv:
        url = srv.url + "/v1/models"
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer sekrit"}).status_code == 200
        assert httpx.get(srv.url + "/health").status_code == httpx.get(srv.url + "/v1/health").status_code == 200
        assert httpx.get(srv.url + "/models").status_code == 401
        assert httpx.post(srv.url + "/chat/completions", json={"messages": []}).status_code == 401
        assert httpx.post(srv.url + "/tokenize", json={"prompt": "x"}).status_code == 401
        for path in ("/completion", "/completions", "/apply-template"):  # llama.cpp's routes too
            assert httpx.post(srv.url + path, json={"prompt": "x"}).status_code == 401
        assert httpx.get(srv.url + "/props").status_code == 401
        assert httpx.get(srv.url + "/props", headers={"Authorization": "Bearer sekrit"}).status_code == 200
        assert httpx.post(srv.url + "/detokenize", json={"tokens": [1]},
                          headers={"Authorization": "Bearer sekrit"}).status_code == 200
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekrit", max_retries=0)
        assert c.completions.create(model=NAME, prompt="x", max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="bad", max_retries=0).models.list()
        # one running, one waiting: the third gets a 503 at once, and the first two still finish
        auth = {"Authorization": "Bearer sekrit"}
        body = {"prompt": "x", "max_tokens": 2000, "ignore_eos": True}
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, srv.url + "/v1/completions", json=body, headers=auth, timeout=60)
            time.sleep(0.3)
            second = pool.submit(httpx.post, srv.url + "/v1/completions", json=body, headers=auth, timeout=60)
            time.sleep(0.3)
            third = httpx.post(srv.url + "/v1/completions", json=body, headers=auth, timeout=60)
            assert third.status_code == 503 and third.json()["error"]["code"] == "queue_full"
            assert first.result().status_code == 200 and second.result().status_code == 200


def test_health_is_503_while_loading() -> None:
    from fastapi.testclient import TestClient

    from pocketmoe.serve.api import ServerState, create_app

    with TestClient(create_app(ServerState(model_name="m", max_model_len=16))) as tc:
        assert tc.get("/health").status_code == 503
        r = tc.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        assert tc.get("/metrics").status_code == 200


def test_sigterm_ends_streams_and_exits_zero(model: Path) -> None:
    srv = LiveServer(["--model", str(model), "--threads", "1", "--max-model-len", "512"])
    srv.start()
    got: list[str] = []

    def read() -> None:
        body = {"prompt": "x", "max_tokens": 500, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            got.extend(r.iter_lines())

    t = threading.Thread(target=read)
    t.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    srv.signal(signal.SIGTERM)
    assert srv.wait(10) == 0
    assert time.monotonic() - t0 < 10
    t.join(5)
    data = [json.loads(x[6:]) for x in got if x.startswith("data: {")]
    assert data and data[-1]["choices"][0]["finish_reason"] == "length"
    assert [x for x in got if x.startswith("data:")][-1] == "data: [DONE]"


def _fuzz_values(rng) -> list:  # noqa: ANN001
    return [None, True, False, 0, -1, 1, 2**70, -(2**70), 0.5, -3.5, 1e308, "", "x", "0", [], [1], ["a"], [[1]], {},
            {"a": 1}, {"type": "text"}, [{"role": "user", "content": "x"}], rng.random(), "\u0000\ud7ff", "<|EOT|>"]


FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
          "seed", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "echo", "stream",
          "stream_options", "response_format", "user", "top_k", "min_p", "repeat_penalty", "ignore_eos", "suffix",
          "best_of", "tools", "tool_choice", "structured_outputs", "json_schema", "grammar", "min_tokens",
          "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens", "chat_template_kwargs",
          "return_token_ids", "reasoning_effort", "thinking_budget_tokens", "thinking_token_budget",
          "thinking_budget_message", "return_progress", "timings_per_token",
          "add_generation_prompt", "continue_final_message"]


def test_schema_fuzz_never_500s(server: LiveServer) -> None:
    """Valid requests with one to three fields replaced by values of any JSON type: every answer is a 200 or a
    4xx with OpenAI's error body, and the server keeps answering."""
    import random

    rng = random.Random(0)
    values = _fuzz_values(rng)
    bases = {"/v1/completions": {"model": NAME, "prompt": "hi", "max_tokens": 3},
             "/v1/chat/completions": {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for _ in range(200):
            path = rng.choice(list(bases))
            body = dict(bases[path])
            for f in rng.sample(FIELDS, rng.randint(1, 3)):
                body[f] = rng.choice(values)
            if body.get("stream") is True:
                with http.stream("POST", path, json=body) as r:
                    text = r.read().decode()
            else:
                r = http.post(path, json=body)
                text = r.text
            assert r.status_code in (200, 400, 404, 503), (body, r.status_code, text)
            if r.status_code != 200:
                assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}, text
            elif body.get("stream") is True:
                assert text.rstrip().endswith("data: [DONE]"), (body, text[-300:])
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


def test_structured_output_on_both_routes(server: LiveServer, client: openai.OpenAI, llm: LLM) -> None:
    """OpenAI's response_format, vLLM's structured_outputs and llama.cpp's grammar: every choice keeps to its
    grammar (checked by jsonschema and re), and the tokens are the engine's alone under the same grammar."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "who?"}], n=3, seed=4,
                                       temperature=1.0, max_tokens=80, response_format=fmt)
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), PERSON)
    stream = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "who?"}], seed=4,
                                            temperature=1.0, max_tokens=80, response_format=fmt, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == r.choices[0].message.content
    want = solo(llm, "pick one:", temperature=0, max_tokens=20, grammar=Grammar.choice(["red", "green", "blue"]))
    got = client.completions.create(model=NAME, prompt="pick one:", temperature=0, max_tokens=20,
                                    extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert got.choices[0].text == want.text and want.text in ("red", "green", "blue")
    pattern = r"[a-f0-9]{4}-[0-9]{2}"
    got = client.completions.create(model=NAME, prompt=["id:", "key:"], temperature=0.9, seed=1, max_tokens=20,
                                    extra_body={"structured_outputs": {"regex": pattern}})
    assert all(re.fullmatch(pattern, c.text) and c.finish_reason == "stop" for c in got.choices)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "ok?", "max_tokens": 10, "temperature": 0,
                                                          "grammar": 'root ::= ("yes" | "no") "!"'}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes!", "no!")
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], temperature=0,
                                       max_tokens=60, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer",
                                                                                      "minimum": 1, "maximum": 5}},
    "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]


def test_tool_choice_required_and_named_give_calls(client: openai.OpenAI) -> None:
    """tool_choice 'required' / a named function on a model that would not call a tool by itself: the answer is
    tool calls, their arguments valid for the tool's schema (jsonschema), streamed as they are sent whole. (This
    vocabulary spells DeepSeek's tool markers in many tokens, hence the room in max_tokens.)"""
    msgs = [{"role": "user", "content": "weather in Paris for 3 days?"}]
    r = client.chat.completions.create(model=NAME, messages=msgs, tools=WEATHER, tool_choice="required",
                                       temperature=0, max_tokens=220)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls and not c.message.content
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in WEATHER}
    for call in c.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    stream = client.chat.completions.create(model=NAME, messages=msgs, tools=WEATHER, tool_choice="required",
                                            temperature=0, max_tokens=220, stream=True)
    got = [tc for ch in stream for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices]
    assert [(t.function.name, t.function.arguments) for t in got] == \
        [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=NAME, messages=msgs, tools=WEATHER, tool_choice=named, temperature=0.9,
                                       seed=2, max_tokens=220, parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert [t.function.name for t in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].function.arguments), schemas["get_weather"])


def test_tokenize_and_detokenize(server: LiveServer, client: openai.OpenAI, llm: LLM) -> None:
    """vLLM's /tokenize and /detokenize: the ids the completion routes count, with the file's BOS or without, of a
    prompt or of chat messages; bad input is a 400 naming the field."""
    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(server.url + path, json=body, timeout=60)

    want = llm.tokenizer.encode("hello world")
    r = post("/tokenize", {"model": NAME, "prompt": "hello world"}).json()
    assert r == {"count": len(want), "max_model_len": 256, "tokens": want}
    assert client.completions.create(model=NAME, prompt="hello world", max_tokens=1).usage.prompt_tokens == len(want)
    bare = post("/tokenize", {"prompt": "hello world", "add_special_tokens": False}).json()["tokens"]
    assert bare == llm.tokenizer.encode("hello world", add_bos=False)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    chat = post("/tokenize", {"messages": messages}).json()
    assert chat["tokens"] == llm.encode_chat(messages)
    assert chat["count"] == client.chat.completions.create(model=NAME, messages=messages, max_tokens=1).usage.prompt_tokens
    opened = post("/tokenize", {"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    assert opened == llm.encode_chat(messages, add_generation_prompt=False)
    text = llm.tokenizer.decode(want)
    assert post("/detokenize", {"model": NAME, "tokens": want}).json() == {"prompt": text, "content": text}
    # llama-server's fields: content (no BOS unless add_special), parse_special, with_pieces
    tok = llm.tokenizer
    special = tok.tokens[tok.eos_id]
    for body, add_bos, parse in [({}, False, True), ({"add_special": True}, True, True),
                                 ({"parse_special": False}, False, False)]:
        got = post("/tokenize", {"content": f"hello {special} world", **body}).json()["tokens"]
        assert got == tok.encode(f"hello {special} world", add_bos=None if add_bos else False, parse_special=parse)
    han = post("/tokenize", {"content": "héllo 中", "with_pieces": True}).json()["tokens"]
    assert [x["id"] for x in han] == tok.encode("héllo 中", add_bos=False)
    pieces = [tok.token_to_piece(x["id"]) for x in han]
    assert [bytes(x["piece"]) if isinstance(x["piece"], list) else x["piece"].encode() for x in han] == pieces
    assert any(isinstance(x["piece"], list) for x in han)  # a character split over tokens comes as bytes
    assert "hello world" in llm.tokenizer.decode(want)
    for path, body, param in [("/tokenize", {}, "messages"), ("/tokenize", {"prompt": "a", "messages": messages}, "messages"),
                              ("/tokenize", {"prompt": "a", "content": "b"}, "content"),
                              ("/tokenize", {"content": "a", "add_special": True, "add_special_tokens": False},
                               "add_special"), ("/apply-template", {"messages": messages, "content": "x"}, "messages"),
                              ("/tokenize", {"prompt": 5}, "prompt"), ("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/detokenize", {"tokens": [-1]}, "tokens.0"), ("/detokenize", {}, "tokens")]:
        e = post(path, body)
        assert e.status_code == 400 and e.json()["error"]["param"] == param, (path, body, e.text)
    assert post("/tokenize", {"model": "nope", "prompt": "a"}).status_code == 404


def test_vllm_sampling_and_template_extras(server: LiveServer, client: openai.OpenAI, llm: LLM) -> None:
    """vLLM's stop_token_ids, min_tokens, include_stop_str_in_output, skip_special_tokens, continue_final_message and
    chat_template_kwargs: each against the engine alone with the same params, or against the text it must give."""
    prompt = "the quick brown fox"
    free = solo(llm, prompt, temperature=0, max_tokens=12)
    k = next(i for i in range(2, 12) if free.token_ids[i] not in free.token_ids[:i])
    stop_id = free.token_ids[k]
    r = client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=12,
                                  extra_body={"stop_token_ids": [stop_id]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == k
    assert r.choices[0].text == solo(llm, prompt, temperature=0, max_tokens=12, stop_token_ids=(stop_id,)).text
    eos = llm.tokenizer.eot_ids[0]
    for min_tokens in (0, 5):
        r = client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=12,
                                      logit_bias={str(eos): 100}, extra_body={"min_tokens": min_tokens})
        assert r.usage.completion_tokens == min_tokens and r.choices[0].finish_reason == "stop"
    stop = free.text[4:7]
    cut = free.text.find(stop)
    for include, want in ((False, free.text[:cut]), (True, free.text[:cut + len(stop)])):
        r = client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=12, stop=[stop],
                                      extra_body={"include_stop_str_in_output": include})
        assert r.choices[0].text == want
    bos = llm.tokenizer.bos_id
    for skip, want in ((False, llm.tokenizer.tokens[bos] * 3), (True, "")):
        r = client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=3,
                                      logit_bias={str(bos): 100}, extra_body={"skip_special_tokens": skip})
        assert r.choices[0].text == want
    # continue_final_message: the rendered chat stops right after the assistant's text, and the answer goes on from it
    messages = [{"role": "user", "content": "name a fruit"}, {"role": "assistant", "content": "My answer is"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    ids = httpx.post(server.url + "/tokenize", json=body, timeout=30).json()["tokens"]
    text = llm.tokenizer.decode(ids)
    assert text.endswith("My answer is") and llm.tokenizer.apply_chat_template(messages, False).startswith(text)
    r = client.chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=6,
                                       extra_body={"add_generation_prompt": False, "continue_final_message": True,
                                                   "chat_template_kwargs": {"unused_flag": True}})
    assert r.choices[0].message.content == solo(llm, ids, temperature=0, max_tokens=6).text
    for extra, param in [({"continue_final_message": True}, "continue_final_message"),
                         ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                         ({"chat_template_kwargs": {"continue_final_message": True}}, "chat_template_kwargs"),
                         ({"chat_template_kwargs": {"source": "{{ 1 }}"}}, "chat_template_kwargs"),
                         ({"add_generation_prompt": False, "continue_final_message": True,
                           "messages": [{"role": "user", "content": "hi"}]}, "messages"),
                         ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
                         ({"stop_token_ids": [10**9]}, "stop_token_ids")]:
        e = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 4, **extra},
                       timeout=30)
        assert e.status_code == 400 and e.json()["error"]["param"] == param, (extra, e.text)


def test_llama_server_flag_spellings() -> None:
    from pocketmoe.serve.__main__ import parse_args

    theirs = parse_args(["-m", "x.gguf", "-c", "8192", "-np", "4", "-t", "2", "-a", "foo", "--chat-template-file", "t"])
    ours = parse_args(["--model", "x.gguf", "--max-model-len", "8192", "--max-num-seqs", "4", "--threads", "2",
                       "--served-model-name", "foo", "--chat-template", "t"])
    assert vars(theirs) == vars(ours) and ours.max_model_len == 8192
    assert vars(parse_args(["--ctx-size", "64", "--parallel", "2", "--alias", "a"])) == vars(parse_args(
        ["--max-model-len", "64", "--max-num-seqs", "2", "--served-model-name", "a"]))


def test_prefix_caching_flag() -> None:
    from pocketmoe.serve.__main__ import parse_args

    assert parse_args([]).enable_prefix_caching is None  # the engine's default: on where the ops are chunk-invariant
    assert parse_args(["--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert parse_args(["--enable-prefix-caching"]).enable_prefix_caching is True


@pytest.mark.parametrize("kv,size", [("f32", 4), ("f16", 2), ("bf16", 2)])
def test_kv_pool_is_sized_by_kv_dtype(model: Path, kv: str, size: int) -> None:
    """--kv-cache-gib buys positions at the --kv-dtype's bytes each (layers x latent width x size); the runner's
    cache stores that dtype, and a pool too small for one sequence is refused with the numbers."""
    from pocketmoe.engine.kv_cache import PAGE
    from pocketmoe.engine.runner import KV_DTYPES
    from pocketmoe.gguf import open_bundle
    from pocketmoe.serve.__main__ import kv_budget, parse_args, runner_config
    from pocketmoe.specs import spec_from_bundle

    with open_bundle(model) as b:
        spec = spec_from_bundle(b)
        per_pos = spec.config.n_layer * spec.kv_values_per_token() * size
        args = parse_args(["--model", str(model), "--kv-cache-gib", "0.01", "--kv-dtype", kv])
        budget, max_len = kv_budget(b, spec, args)
        assert budget == int(0.01 * 2**30) and max_len == min(int(spec.config.n_ctx), budget // per_pos // PAGE * PAGE)
        assert KV_DTYPES[runner_config(args, budget, max_len).kv_dtype].itemsize == size
        tight = parse_args(["--model", str(model), "--kv-cache-gib", str(per_pos * 100 / 2**30),
                            "--max-model-len", "200", "--kv-dtype", kv])
        with pytest.raises(PocketMoEError, match=f"{per_pos} bytes each"):
            kv_budget(b, spec, tight)


def test_stop_reason_names_what_ended_a_choice(server: LiveServer, llm: LLM) -> None:
    """vLLM's stop_reason: the stop string, or the end token's id; null at max_tokens."""
    full = solo(llm, "mixture of experts", temperature=0, max_tokens=20, ignore_eos=True)
    word = full.text[len(full.text) // 2:len(full.text) // 2 + 2]
    body = {"model": NAME, "prompt": "mixture of experts", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    c = httpx.post(server.url + "/v1/completions", json={**body, "stop": [word]}, timeout=60).json()["choices"][0]
    assert (c["finish_reason"], c["stop_reason"], c["text"]) == ("stop", word, full.text[:full.text.index(word)])
    c = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert (c["finish_reason"], c["stop_reason"]) == ("length", None)
    end = full.token_ids[3]  # that token, named as a stop token, ends the choice where it is drawn
    r = httpx.post(server.url + "/v1/completions", json={**body, "stop_token_ids": [end]}, timeout=60)
    c = r.json()["choices"][0]
    assert (c["finish_reason"], c["stop_reason"]) == ("stop", end)
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stop": [word], "stream": True},
                      timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [c["choices"][0]["stop_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [word]
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0}
    c = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]
    assert "stop_reason" in c
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=60) as r:
        last = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")][-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == (c["finish_reason"], c["stop_reason"])


def test_cors_only_for_the_allowed_origins(model: Path) -> None:
    """--allowed-origins: a browser page of an allowed origin gets CORS headers, its preflight answered before the
    API key is asked for (a preflight carries none); other origins, and every origin by default, get none."""
    from fastapi.testclient import TestClient

    from pocketmoe.gguf import open_bundle
    from pocketmoe.serve.__main__ import origins, parse_args
    from pocketmoe.serve.api import ServerState, create_app
    from pocketmoe.testing.scripted import ScriptedEngine
    from pocketmoe.tokenizer import Tokenizer

    assert parse_args(["--allowed-origins", "http://localhost:5173, https://a.example"]).allowed_origins == (
        "http://localhost:5173", "https://a.example")
    assert origins('["*"]') == ("*",) and origins(None) == ()
    for bad in ("localhost:5173", "http://a.example/path", '["http://a.example", 3]', "[nope"):
        with pytest.raises(ValueError):
            origins(bad)
    tok = Tokenizer.from_metadata(open_bundle(model).metadata)
    site, other = "http://localhost:5173", "http://evil.example"
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for allowed in ((), (site,)):
        state = ServerState(model_name="m", max_model_len=4096, engine=ScriptedEngine(tok, "deepseek2", "ok"),  # type: ignore[arg-type]
                            tokenizer=tok, api_key="k", allowed_origins=allowed)
        http = TestClient(create_app(state))
        pre = http.options("/v1/chat/completions", headers={"Origin": site, **preflight})
        r = http.post("/v1/chat/completions", json=body, headers={"Origin": site, "Authorization": "Bearer k"})
        assert r.status_code == 200
        no_key = http.post("/v1/chat/completions", json=body, headers={"Origin": site})
        assert no_key.status_code == 401
        if allowed:
            assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == site
            assert r.headers["access-control-allow-origin"] == site
            assert no_key.headers["access-control-allow-origin"] == site  # the page can read why it failed
            evil = http.post("/v1/chat/completions", json=body, headers={"Origin": other, "Authorization": "Bearer k"})
            assert "access-control-allow-origin" not in evil.headers
            assert http.options("/v1/chat/completions", headers={"Origin": other, **preflight}).status_code == 400
        else:
            assert pre.status_code != 200 and "access-control-allow-origin" not in pre.headers
            assert "access-control-allow-origin" not in r.headers


def _sse_objects(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:") and "[DONE]" not in line]


def test_return_progress_streams_the_prompts_progress(model: Path) -> None:
    """llama.cpp's return_progress: with stream, chunks of prompt_progress as each prefill chunk is computed (the
    first at admission, processed = what the prefix cache gave; the last processed = total), before the first
    token, on every stream route; the tokens are those of the same request without it."""
    prompt = " ".join(f"w{i}" for i in range(60))
    with LiveServer(["--model", str(model), "--served-model-name", NAME, "--max-model-len", "256", "--threads", "1",
                     "--chunk-size", "32"]) as srv:
        def progress_of(objs: list[dict], key: str = "prompt_progress") -> list[dict]:
            return [o[key] for o in objs if key in o]

        chat = {"model": NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": 6, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        for attempt in range(2):  # the second time the prefix cache gives most of the prompt
            objs = _sse_objects(srv.url + "/v1/chat/completions", {**chat, "return_progress": True})
            plain = _sse_objects(srv.url + "/v1/chat/completions", chat)
            got = progress_of(objs)
            total = objs[-1]["usage"]["prompt_tokens"]
            assert {p["total"] for p in got} == {total} and got[-1]["processed"] == total
            assert got[0]["processed"] == got[0]["cache"] and [p["processed"] for p in got] == sorted(
                p["processed"] for p in got)
            assert (got[0]["cache"] > 0) == (attempt == 1) and len(got) >= (2 if attempt else 5)
            assert all(o["choices"] == [] for o in objs if "prompt_progress" in o)
            first_token = next(i for i, o in enumerate(objs) if o["choices"] and o["choices"][0]["delta"].get("content"))
            assert max(i for i, o in enumerate(objs) if "prompt_progress" in o) < first_token
            text = "".join(o["choices"][0]["delta"].get("content") or "" for o in objs if o["choices"])
            assert text == "".join(o["choices"][0]["delta"].get("content") or "" for o in plain if o["choices"])
        comp = _sse_objects(srv.url + "/v1/completions", {"model": NAME, "prompt": prompt + " again", "max_tokens": 3,
                                                          "stream": True, "return_progress": True})
        assert progress_of(comp)[-1]["processed"] == progress_of(comp)[-1]["total"]
        native = _sse_objects(srv.url + "/completion", {"prompt": prompt + " once more", "n_predict": 3,
                                                        "stream": True, "return_progress": True})
        assert progress_of(native)[-1]["processed"] == progress_of(native)[-1]["total"] > 0
        assert all(o["content"] == "" and not o["stop"] for o in native if "prompt_progress" in o)
        whole = httpx.post(srv.url + "/v1/chat/completions", json={**chat, "stream": False, "return_progress": True,
                                                                   "stream_options": None}, timeout=120).json()
        assert whole["choices"][0]["message"]["content"] == text  # no stream: nothing changes


def test_chat_carries_llama_servers_timings(server: LiveServer, client: openai.OpenAI) -> None:
    """llama-server's timings on a chat reply (the body, and the stream's last chunk): the prompt and generated
    token counts the usage gives, the prefix cache's apart, and rates that follow from the times."""
    msgs = [{"role": "user", "content": "timings please"}]
    whole = httpx.post(server.url + "/v1/chat/completions", json={"model": NAME, "messages": msgs, "max_tokens": 5,
                                                                 "temperature": 0}, timeout=60).json()
    t, u = whole["timings"], whole["usage"]
    assert t["predicted_n"] == u["completion_tokens"] and t["prompt_n"] + t["cache_n"] == u["prompt_tokens"]
    assert t["cache_n"] == u["prompt_tokens_details"]["cached_tokens"] and t["prompt_ms"] > 0
    assert t["predicted_per_second"] == pytest.approx(t["predicted_n"] / t["predicted_ms"] * 1e3)
    objs = _sse_objects(server.url + "/v1/chat/completions", {"model": NAME, "messages": msgs, "max_tokens": 5,
                                                             "temperature": 0, "stream": True, "n": 2})
    timed = [o for o in objs if "timings" in o]
    assert len(timed) == 1 and timed[0]["choices"][0]["finish_reason"] and objs.index(timed[0]) == len(objs) - 1
    assert timed[0]["timings"]["predicted_n"] == 2 * t["predicted_n"]  # both choices
    assert timed[0]["timings"]["cache_n"] > 0  # the prompt was computed once before
    assert client.chat.completions.create(model=NAME, messages=msgs, max_tokens=5, temperature=0).model_extra["timings"]
    every = _sse_objects(server.url + "/v1/chat/completions", {"model": NAME, "messages": msgs, "max_tokens": 5,
                                                              "temperature": 0, "stream": True,
                                                              "timings_per_token": True})
    counts = [o["timings"]["predicted_n"] for o in every if o["choices"] and o["choices"][0]["delta"].get("content")]
    assert counts == sorted(set(counts)) and len(counts) > 1 and counts[-1] <= 5  # more tokens each chunk
    assert "timings" not in every[0]  # before the first token there is no speed yet


def test_a_stream_waiting_on_a_long_prefill_keeps_alive(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While no event comes (a prompt prefilling for minutes on a CPU), the stream sends SSE comment lines, which
    the SDKs skip: the chunks that follow are the same."""
    import asyncio

    from fastapi.testclient import TestClient

    import pocketmoe.serve.api as api
    from pocketmoe.gguf import open_bundle
    from pocketmoe.serve.api import ServerState, create_app
    from pocketmoe.testing.scripted import ScriptedEngine
    from pocketmoe.tokenizer import Tokenizer

    class SlowEngine(ScriptedEngine):
        def submit(self, ids, params, *, out=None, index_base=0, progress=False, slot=-1):  # noqa: ANN001, ANN201
            later: asyncio.Queue = asyncio.Queue()
            req = super().submit(ids, params, out=later, index_base=index_base)

            async def relay() -> None:
                await asyncio.sleep(0.35)  # the prefill
                while not later.empty():
                    out.put_nowait(later.get_nowait())

            asyncio.get_running_loop().create_task(relay())
            return req

    monkeypatch.setattr(api, "KEEPALIVE_S", 0.1)
    tok = Tokenizer.from_metadata(open_bundle(model).metadata)
    http = TestClient(create_app(ServerState(model_name="m", max_model_len=4096,  # type: ignore[arg-type]
                                             engine=SlowEngine(tok, "deepseek2", "Hello there."), tokenizer=tok)))
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    alive = [i for i, line in enumerate(lines) if line.startswith(":")]
    assert len(alive) >= 2 and lines[-1] == "data: [DONE]"
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or "" for line in lines
                   if line.startswith("data: {") and json.loads(line[6:])["choices"])
    assert text == "Hello there."
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
    chunks = list(client.chat.completions.create(model="m", messages=body["messages"], max_tokens=5, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello there."


def test_llama_samplers_on_v1_run_in_llamas_order(client: openai.OpenAI, llm: LLM) -> None:
    """A /v1 request with llama.cpp's DRY / XTC / typical / mirostat fields (as llama-server reads them on its OpenAI
    routes, and front ends send them in extra body) is sampled as LLM samples those params in llama.cpp's order."""
    from pocketmoe.engine.sampler import LLAMA_CHAIN, MIROSTAT_CHAIN

    extra = {"dry_multiplier": 0.8, "dry_allowed_length": 2, "xtc_probability": 0.5, "xtc_threshold": 0.1,
             "typical_p": 0.9, "top_k": 40, "min_p": 0.05}
    want = solo(llm, "the cat sat on the", temperature=0.8, max_tokens=12, seed=3, top_k=40, min_p=0.05,
                dry_multiplier=0.8, dry_allowed_length=2, xtc_probability=0.5, xtc_threshold=0.1, typical_p=0.9,
                chain=LLAMA_CHAIN)
    r = client.completions.create(model=NAME, prompt="the cat sat on the", max_tokens=12, temperature=0.8, seed=3,
                                  extra_body=extra)
    assert r.choices[0].text == want.text
    msgs = [{"role": "user", "content": "tell me about cats"}]
    ids = llm.encode_chat(msgs)
    want = solo(llm, ids, temperature=0.8, max_tokens=10, seed=4, mirostat=2, mirostat_tau=3.0, chain=MIROSTAT_CHAIN)
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=0.8, seed=4,
                                       extra_body={"mirostat": 2, "mirostat_tau": 3.0})
    assert r.choices[0].message.content == llm.tokenizer.decode(want.token_ids)
    # min_keep without llama.cpp's chain: top-p that leaves one token leaves three
    want = solo(llm, "the cat sat on the", temperature=0.8, max_tokens=12, seed=3, top_p=0.05, min_keep=3)
    assert want.text != solo(llm, "the cat sat on the", temperature=0.8, max_tokens=12, seed=3, top_p=0.05).text
    r = client.completions.create(model=NAME, prompt="the cat sat on the", max_tokens=12, temperature=0.8, seed=3,
                                  top_p=0.05, extra_body={"min_keep": 3})
    assert r.choices[0].text == want.text
