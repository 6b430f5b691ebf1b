"""llama.cpp's POST /completion on the live server: its defaults, response fields and stream, each answer held to
the same model run through `LLM` (one sequence, no HTTP) with the parameters llama.cpp documents."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch

from pocketmoe.engine.llm import LLM
from pocketmoe.engine.sampler import LLAMA_CHAIN, SamplingParams
from pocketmoe.testing.live_server import LiveServer
from pocketmoe.testing.synth import write_fixture

MAX_LEN = 256
# its defaults, in its order (the filters at temperature 1, then the temperature)
LLAMA = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "penalty_last_n": 64, "chain": LLAMA_CHAIN}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_fixture("deepseek2", "tiny", "Q4_K_M", tmp_path_factory.mktemp("llama") / "m.gguf", seed=11)[0]


@pytest.fixture(scope="module")
def server(model: Path):
    with LiveServer(["--model", str(model), "--served-model-name", "tiny", "--max-model-len", str(MAX_LEN),
                     "--threads", "1"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def llm(model: Path) -> LLM:
    return LLM(model, n_ctx=MAX_LEN, threads=1, max_num_seqs=1, enable_prefix_caching=False)


def post(server: LiveServer, body: dict, path: str = "/completion") -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def events(server: LiveServer, body: dict) -> list[str]:
    with httpx.stream("POST", server.url + "/completion", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [line for line in r.iter_lines() if line]


def test_greedy_completion_and_its_fields(server, llm):
    want = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    for path in ("/completion", "/completions"):
        r = post(server, {"prompt": "hello world", "n_predict": 10, "temperature": 0, "ignore_eos": True,
                          "return_tokens": True}, path)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["content"] == want.text and out["tokens"] == want.token_ids and out["stop"] is True
        assert out["tokens_predicted"] == 10 and out["tokens_evaluated"] == len(want.prompt_token_ids)
        assert (out["stop_type"], out["stopping_word"], out["truncated"]) == ("limit", "", False)
        assert out["model"] == "tiny" and out["generation_settings"]["n_predict"] == 10
        t = out["timings"]
        assert t["predicted_n"] == 10 and t["prompt_n"] + t["cache_n"] == len(want.prompt_token_ids)
        assert t["prompt_ms"] > 0 and t["predicted_per_second"] > 0
    # without return_tokens the ids stay out, as llama.cpp leaves them
    assert post(server, {"prompt": "hello world", "n_predict": 2, "temperature": 0}).json()["tokens"] == []


def test_llama_defaults_are_the_sampling_used(server, llm):
    """Only a seed given: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05 over the last 64 tokens."""
    for seed in (1, 7):
        want = llm.generate(["the quick brown fox"], SamplingParams(seed=seed, max_tokens=16, **LLAMA))[0]
        out = post(server, {"prompt": "the quick brown fox", "n_predict": 16, "seed": seed}).json()
        assert out["content"] == want.text and out["tokens_predicted"] == len(want.token_ids)
        assert out["stop_type"] == ("eos" if want.finish_reason == "stop" else "limit")
        s = out["generation_settings"]
        assert (s["temperature"], s["top_k"], s["top_p"], s["min_p"], s["seed"]) == (0.8, 40, 0.95, 0.05, seed)


def test_samplers_set_the_chain(server, llm):
    """samplers: llama.cpp's chain in the order given, the steps left out not run: llama.vim's ["top_k", "top_p",
    "infill"] draws at temperature 1 (no temperature step) from what the infill step leaves; names or letters; the
    samplers this engine lacks (at their off values) leave the chain."""
    prompt = "def add(a, b):\n    return"
    for seed in (2, 9):
        want = llm.generate([prompt], SamplingParams(seed=seed, max_tokens=12, top_k=40, top_p=0.99, min_p=0.05,
                                                     temperature=0.8, penalty_last_n=64,
                                                     chain=("top_k", "top_p", "infill")))[0]
        body = {"prompt": prompt, "n_predict": 12, "seed": seed, "top_k": 40, "top_p": 0.99}
        out = post(server, {**body, "samplers": ["top_k", "top_p", "infill"]}).json()
        assert out["content"] == want.text and out["generation_settings"]["samplers"] == ["top_k", "top_p", "infill"]
        assert post(server, {**body, "samplers": "kpi"}).json()["content"] == want.text
        assert post(server, {**body, "samplers": ["dry", "top-k", "nucleus", "xtc", "infill"]}).json()["content"] \
            == want.text
    want = llm.generate([prompt], SamplingParams(seed=4, max_tokens=8, top_k=5, temperature=0.5, penalty_last_n=64,
                                                 chain=("temperature", "top_k")))[0]
    out = post(server, {"prompt": prompt, "n_predict": 8, "seed": 4, "top_k": 5, "temperature": 0.5,
                        "samplers": ["temperature", "top_k"]}).json()
    assert out["content"] == want.text
    for bad in (["top_k", "warp"], ["infill", "top_k"], "kz"):
        r = post(server, {"prompt": prompt, "samplers": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "samplers", r.text
    r = post(server, {"prompt": prompt, "samplers": ["top_k", "infill"], "top_k": 0})
    assert r.status_code == 400 and "top_k" in r.json()["error"]["message"]


def test_stop_word_and_stream(server, llm):
    full = llm.generate(["a b c d e f g"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].text
    word = full[len(full) // 2:len(full) // 2 + 2]
    want = full[:full.index(word)]
    out = post(server, {"prompt": "a b c d e f g", "n_predict": 24, "temperature": 0, "ignore_eos": True,
                        "stop": [word]}).json()
    assert (out["content"], out["stop_type"], out["stopping_word"]) == (want, "word", word)
    lines = events(server, {"prompt": "a b c d e f g", "n_predict": 24, "temperature": 0, "ignore_eos": True,
                            "stop": [word]})
    assert all(line.startswith("data: ") for line in lines) and "[DONE]" not in lines[-1]
    got = [json.loads(line[6:]) for line in lines]
    assert all(not e["stop"] for e in got[:-1]) and got[-1]["stop"] is True and got[-1]["content"] == ""
    assert "".join(e["content"] for e in got) == want
    assert (got[-1]["stop_type"], got[-1]["stopping_word"]) == ("word", word)


def test_n_probs_are_the_model_logprobs(server, llm):
    ids = llm.encode_prompt("lorem ipsum dolor")
    lp = torch.log_softmax(llm.prompt_logits(ids)[-1].double(), dim=-1)
    out = post(server, {"prompt": "lorem ipsum dolor", "n_predict": 3, "temperature": 0, "n_probs": 4}).json()
    first = out["completion_probabilities"][0]
    top = torch.topk(lp, 4)
    assert first["id"] == int(top.indices[0]) and first["logprob"] == pytest.approx(float(top.values[0]), abs=1e-4)
    assert [t["id"] for t in first["top_logprobs"]] == top.indices.tolist()
    assert bytes(first["bytes"]).decode("utf-8", "replace") == first["token"]
    assert len(out["completion_probabilities"]) == 3


def test_post_sampling_probs_are_the_distribution_drawn_from(server, llm):
    """post_sampling_probs: prob / top_probs instead of logprob / top_logprobs, the probabilities of what each token
    is drawn from after llama.cpp's default filters (the same as LLM's processed_logprobs, from one sequence); greedy
    draws with probability 1."""
    body = {"prompt": "lorem ipsum dolor", "n_predict": 4, "n_probs": 5, "post_sampling_probs": True, "seed": 3,
            "temperature": 1.5, "top_k": 4, "min_p": 0.0, "top_p": 1.0}
    out = post(server, body).json()
    want = llm.generate(["lorem ipsum dolor"], SamplingParams(temperature=1.5, top_k=4, seed=3, max_tokens=4,
                                                             penalty_last_n=64, logprobs=5,
                                                             logprobs_mode="processed_logprobs"))[0]
    got = out["completion_probabilities"]
    assert [g["id"] for g in got] == want.token_ids and out["generation_settings"]["post_sampling_probs"] is True
    for g, w in zip(got, want.logprobs, strict=True):
        assert "logprob" not in g and "top_logprobs" not in g
        assert g["prob"] == pytest.approx(math.exp(w[g["id"]].logprob), abs=1e-6)
        top = sorted(w.items(), key=lambda t: t[1].rank)  # top_k 4: the four that can be drawn (the token among them)
        assert len(top) == len(g["top_probs"]) == 4 and sum(t["prob"] for t in g["top_probs"]) == pytest.approx(1.0)
        assert [t["id"] for t in g["top_probs"]] == [t for t, _ in top]
        assert [t["prob"] for t in g["top_probs"]] == pytest.approx([math.exp(v.logprob) for _, v in top], abs=1e-6)
    greedy = post(server, {**body, "temperature": 0}).json()["completion_probabilities"]
    assert all(g["prob"] == 1.0 and [(t["id"], t["prob"]) for t in g["top_probs"]] == [(g["id"], 1.0)] for g in greedy)


def test_several_and_mixed_prompts(server, llm):
    ids = llm.encode_prompt("zzz")
    greedy = {"n_predict": 6, "temperature": 0, "ignore_eos": True}
    many = post(server, {"prompt": ["tensor parallel", ids], **greedy}).json()
    assert isinstance(many, list) and [m["index"] for m in many] == [0, 1]
    assert many[0]["content"] == post(server, {"prompt": "tensor parallel", **greedy}).json()["content"]
    assert many[1]["content"] == post(server, {"prompt": ids, **greedy}).json()["content"]
    # ids then text: one prompt, the text tokenized without a BOS
    mixed = post(server, {"prompt": [*ids, " more"], **greedy}).json()
    tail = llm.tokenizer.encode(" more", add_bos=False)
    want = llm.generate([ids + tail], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert isinstance(mixed, dict) and mixed["tokens_evaluated"] == len(ids) + len(tail)
    assert mixed["content"] == want.text


def test_logit_bias_and_penalty_window(server, llm):
    base = {"prompt": "one two three four five", "n_predict": 8, "temperature": 0, "ignore_eos": True,
            "return_tokens": True}
    first = post(server, base).json()["tokens"][0]
    banned = post(server, {**base, "logit_bias": [[first, False]]}).json()
    assert first not in banned["tokens"] and banned["generation_settings"]["logit_bias"] == [[first, False]]
    # repeat_last_n 0: the penalties look at nothing, so a strong one changes nothing
    assert post(server, {**base, "repeat_penalty": 3.0, "repeat_last_n": 0}).json()["tokens"] == \
        post(server, base).json()["tokens"]
    # a window of 4 against the whole history: different tokens, and the server's are the window's
    text = " ".join(f"w{i % 7}" for i in range(40))
    ref = {k: llm.generate([text], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=3.0,
                                                  penalty_last_n=k))[0].token_ids for k in (4, 0)}
    assert ref[4] != ref[0]
    body = {**base, "prompt": text, "n_predict": 16, "repeat_penalty": 3.0}
    assert post(server, {**body, "repeat_last_n": 4}).json()["tokens"] == ref[4]
    assert post(server, {**body, "repeat_last_n": -1}).json()["tokens"] == ref[0]


def test_n_predict_zero_and_to_the_context(server, llm):
    out = post(server, {"prompt": "hello", "n_predict": 0}).json()
    assert (out["content"], out["tokens_predicted"], out["stop_type"]) == ("", 0, "limit")
    # n_predict 0 still computes the prompt, which the prefix cache then gives the next request (llama.vim's
    # warm-up); with cache_prompt false it is not computed
    for cache_prompt, text in ((True, "warm the cache " * 20), (False, "leave it cold " * 20)):
        for stream in (False, True):
            body = {"prompt": f"{stream} {text}", "n_predict": 0, "cache_prompt": cache_prompt, "stream": stream}
            if stream:
                got = [json.loads(line[6:]) for line in events(server, body)]
                assert len(got) == 1 and (got[0]["content"], got[0]["tokens_predicted"]) == ("", 0)
            else:
                assert post(server, body).json()["tokens_predicted"] == 0
            then = post(server, {"prompt": f"{stream} {text}", "n_predict": 1}).json()
            assert (then["tokens_cached"] > 0) == cache_prompt, then
    n_prompt = len(llm.encode_prompt("hello"))
    out = post(server, {"prompt": "hello", "n_predict": -1, "temperature": 0, "ignore_eos": True}).json()
    assert out["tokens_predicted"] == MAX_LEN - n_prompt and out["truncated"] is True


@pytest.mark.parity
def test_control_tokens_write_no_text_as_in_llama_server(server, model, llm):
    """A control token the model writes (BOS, pushed up by logit_bias) adds no text, as llama-server and
    llama-cpp-python write none; skip_special_tokens false shows it."""
    llama_cpp = pytest.importorskip("llama_cpp")
    bos = llm.tokenizer.bos_id
    body = {"prompt": "hello", "n_predict": 3, "temperature": 0, "logit_bias": [[bos, 100]], "return_tokens": True}
    out = post(server, body).json()
    assert (out["content"], out["tokens"]) == ("", [bos] * 3)
    assert post(server, {**body, "skip_special_tokens": False}).json()["content"] == llm.tokenizer.tokens[bos] * 3
    ref = llama_cpp.Llama(model_path=str(model), n_ctx=64, n_threads=1, verbose=False)
    theirs = ref.create_completion("hello", max_tokens=3, temperature=0, logit_bias={bos: 100.0})
    assert (theirs["choices"][0]["text"], theirs["usage"]["completion_tokens"]) == ("", 3)


def test_n_indent_and_t_max_predict_ms_end_a_code_completion(server, llm):
    """A grammar writes a block; n_indent ends the output where a line is indented less (that line's spaces kept,
    as llama.cpp keeps them), streamed and whole, and the LLM API does the same; t_max_predict_ms ends it at a
    newline once that long has passed since its first token."""
    code = "ab\n  cd\n ef\ngh"
    body = {"prompt": "x", "n_predict": 40, "grammar": f"root ::= {json.dumps(code)}", "temperature": 0}
    assert post(server, body).json()["content"] == code
    out = post(server, {**body, "n_indent": 2}).json()
    assert (out["content"], out["stop_type"]) == ("ab\n  cd\n ", "limit")
    assert out["generation_settings"]["n_indent"] == 2
    got = [json.loads(line[6:]) for line in events(server, {**body, "n_indent": 2})]
    assert "".join(e["content"] for e in got) == "ab\n  cd\n " and got[-1]["stop_type"] == "limit"
    assert post(server, {**body, "n_indent": 1}).json()["content"] == "ab\n  cd\n ef\n"
    grammar = post(server, {**body, "n_predict": 0}).json()  # (the grammar as the LLM API takes it)
    assert grammar["content"] == ""
    from pocketmoe.engine.structured import Grammar

    want = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=40, n_indent=2,
                                               grammar=Grammar("gbnf", f"root ::= {json.dumps(code)}")))[0]
    assert (want.text, want.finish_reason) == ("ab\n  cd\n ", "length")
    out = post(server, {**body, "t_max_predict_ms": 1e-3}).json()
    assert out["stop_type"] == "limit" and out["content"].endswith("\n") and code.startswith(out["content"])
    assert out["content"] != code


def test_infill_lays_out_the_text_around_the_cursor(server, llm):
    """POST /infill: the prompt is llama-server's fill-in-the-middle layout (extra chunks behind the snippet
    separator, as this vocabulary has no file-separator token; BOS; then <｜fim▁begin｜> prefix + typed text,
    <｜fim▁hole｜> suffix, <｜fim▁end｜>), with special-token texts in the code read as text, and the answer is the
    one the model gives that prompt; a long prefix keeps its end and a long suffix its start."""
    tok = llm.tokenizer
    pre, suf, mid = (tok.tokens.index(t) for t in ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"))

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_bos=False, parse_special=False)

    def want(ids: list[int]) -> str:
        return llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].text

    prefix, suffix, typed = "def add(a, b):\n    # <｜fim▁end｜>\n    ", "\n\nprint(add(1, 2))\n", "ret"
    extra = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}]
    ids = [*enc("\n\n--- snippet ---\n\n"), *enc(extra[0]["text"]), tok.bos_id, pre, *enc(prefix), *enc(typed), suf,
           *enc(suffix), mid]
    body = {"input_prefix": prefix, "input_suffix": suffix, "prompt": typed, "input_extra": extra, "n_predict": 8,
            "temperature": 0, "ignore_eos": True}
    out = post(server, body, "/infill").json()
    assert (out["content"], out["tokens_evaluated"], out["prompt"]) == (want(ids), len(ids), tok.decode(ids))

    long_prefix, long_suffix = "x = 1\n" * 60, "y = 2\n" * 40
    window = MAX_LEN // 2  # llama-server's n_batch (2048), or half this small context
    head, tail = enc(long_prefix)[-(3 * window // 4):], enc(long_suffix)[:window // 4 - 2 - len(enc(typed))]
    assert len(head) < len(enc(long_prefix)) and len(tail) < len(enc(long_suffix))
    chunk = [*enc("\n\n--- snippet ---\n\n"), *enc(extra[0]["text"])]
    ids = [*chunk, tok.bos_id, pre, *head, *enc(typed), suf, *tail, mid]
    out = post(server, {**body, "input_prefix": long_prefix, "input_suffix": long_suffix}, "/infill").json()
    assert (out["content"], out["tokens_evaluated"]) == (want(ids), len(ids))
    # the extra context fills what the window and 2 x n_predict leave of the context: its last tokens
    n_predict = (MAX_LEN - window - len(chunk) + 5) // 2
    n_extra = MAX_LEN - window - 2 * n_predict
    assert 0 < n_extra < len(chunk)
    ids = [*chunk[len(chunk) - n_extra:], tok.bos_id, pre, *head, *enc(typed), suf, *tail, mid]
    out = post(server, {**body, "input_prefix": long_prefix, "input_suffix": long_suffix, "n_predict": n_predict},
               "/infill").json()
    assert out["tokens_evaluated"] == len(ids) and out["prompt"] == tok.decode(ids)

    # n_predict -1 (to the end of the context): the extra context still leaves room for at least one token
    big = {**body, "input_extra": [{"filename": "big.py", "text": "z = 3\n" * 200}], "n_predict": -1}
    out = post(server, big, "/infill").json()
    assert out["tokens_evaluated"] < MAX_LEN and out["tokens_evaluated"] + out["tokens_predicted"] == MAX_LEN
    assert "z = 3\n" in out["prompt"]
    # llama.vim asks for the fields it reads: each a path, kept as its own key (one the result lacks left out)
    fields = ["content", "timings/prompt_n", "timings/nope", "truncated"]
    picked = post(server, {**body, "response_fields": fields}, "/infill").json()
    full = post(server, body, "/infill").json()
    assert picked == {"content": full["content"], "timings/prompt_n": full["timings"]["prompt_n"],
                      "truncated": full["truncated"]}

    bad = post(server, {"input_prefix": "x", "input_extra": [{"filename": 3}]}, "/infill")
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("input_extra")


def test_llamas_other_samplers_run_as_the_engine_runs_them(server, llm):
    """DRY, XTC, typical, top-n-sigma and dynamic temperature from /completion's fields (SillyTavern's presets send
    them) in llama.cpp's default order: the text LLM.generate gives with the same SamplingParams; with them at their
    defaults, the text without them."""
    from pocketmoe.engine.sampler import LLAMA_CHAIN, MIROSTAT_CHAIN

    prompt = "the cat sat on the mat. the cat sat on the"
    fields = {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1,
              "dry_sequence_breakers": ["\n", ":"], "xtc_probability": 0.5, "xtc_threshold": 0.1, "typical_p": 0.9,
              "top_n_sigma": 2.0, "dynatemp_range": 0.3, "dynatemp_exponent": 1.5}
    for seed in (1, 5):
        want = llm.generate([prompt], SamplingParams(
            seed=seed, max_tokens=16, top_k=40, top_p=0.95, min_p=0.05, temperature=0.8, penalty_last_n=64,
            chain=LLAMA_CHAIN, **{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}))[0]
        out = post(server, {"prompt": prompt, "n_predict": 16, "seed": seed, **fields}).json()
        assert out["content"] == want.text
        settings = out["generation_settings"]
        assert settings["dry_multiplier"] == 0.8 and settings["dry_sequence_breakers"] == ["\n", ":"]
        assert settings["samplers"] == list(LLAMA_CHAIN)
        plain = llm.generate([prompt], SamplingParams(seed=seed, max_tokens=16, top_k=40, top_p=0.95, min_p=0.05,
                                                      temperature=0.8, penalty_last_n=64, chain=LLAMA_CHAIN))[0]
        off = {"dry_multiplier": 0, "xtc_probability": 0, "typical_p": 1, "top_n_sigma": -1, "dynatemp_range": 0}
        assert post(server, {"prompt": prompt, "n_predict": 16, "seed": seed, **off}).json()["content"] == plain.text
        # min_keep: a top-p that leaves the likeliest token alone leaves five (llama.cpp's field, on every route)
        narrow = SamplingParams(seed=seed, max_tokens=16, top_k=40, top_p=0.05, min_p=0.05, temperature=0.8,
                                penalty_last_n=64, chain=LLAMA_CHAIN)
        kept = llm.generate([prompt], replace(narrow, min_keep=5))[0]
        assert kept.text != llm.generate([prompt], narrow)[0].text
        out = post(server, {"prompt": prompt, "n_predict": 16, "seed": seed, "top_p": 0.05, "min_keep": 5}).json()
        assert out["content"] == kept.text and out["generation_settings"]["min_keep"] == 5
        for version in (1, 2):  # mirostat: the temperature, then mirostat (samplers and the filters unused)
            want = llm.generate([prompt], SamplingParams(
                seed=seed, max_tokens=16, temperature=0.8, mirostat=version, mirostat_tau=4.0, mirostat_eta=0.2,
                chain=MIROSTAT_CHAIN))[0]
            out = post(server, {"prompt": prompt, "n_predict": 16, "seed": seed, "mirostat": version,
                                "mirostat_tau": 4.0, "mirostat_eta": 0.2, "samplers": "kt"}).json()
            assert out["content"] == want.text and out["generation_settings"]["samplers"] == list(MIROSTAT_CHAIN)


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "mirostat": 3}, "mirostat"),
    ({"prompt": "hi", "mirostat": 2, "mirostat_tau": 0}, "mirostat_tau"),
    ({"prompt": "hi", "typical_p": 0}, "typical_p"),
    ({"prompt": "hi", "min_keep": -1}, "min_keep"),
    ({"prompt": "hi", "dry_multiplier": -1}, "dry_multiplier"),
    ({"prompt": "hi", "dry_sequence_breakers": []}, "dry_sequence_breakers"),
    ({"prompt": "hi", "xtc_threshold": 2}, "xtc_threshold"),
    ({"prompt": "hi", "n": 2}, "n"),
    ({"prompt": "hi", "logit_bias": [["x", 1.0]]}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": [[5, "high"]]}, "logit_bias"),
    ({"prompt": [5, [6]]}, "prompt"),
    ({"prompt": [999999]}, "prompt"),
    ({"prompt": "word " * 400}, "prompt"),
    ({"prompt": "hi", "n_predict": -2}, "n_predict"),
])
def test_bad_requests_are_one_sentence(server, body, param):
    r = post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "\n" not in err["message"]
    assert post(server, {"prompt": "hi", "n_predict": 1}).status_code == 200  # the server is still up


def test_props_and_apply_template(server, llm):
    props = httpx.get(server.url + "/props", timeout=30).json()
    assert props["default_generation_settings"]["n_ctx"] == MAX_LEN and props["model_alias"] == "tiny"
    assert props["total_slots"] == 16 and props["chat_template"] == llm.tokenizer.chat_template
    params = props["default_generation_settings"]["params"]
    assert (params["temperature"], params["top_k"], params["top_p"], params["min_p"]) == (0.8, 40, 0.95, 0.05)
    assert props["bos_token"] == llm.tokenizer.tokens[llm.tokenizer.bos_id]
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    r = httpx.post(server.url + "/apply-template", json={"messages": msgs}, timeout=30)
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt"]
    assert prompt == llm.tokenizer.apply_chat_template(msgs, True)
    assert llm.tokenizer.encode_rendered_chat(prompt) == llm.encode_chat(msgs)
    # the rendered prompt's tokens complete as the chat route answers (as text, /completion would add a BOS in
    # front of the template's own, as llama.cpp does)
    chat = httpx.post(server.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "temperature": 0},
                      timeout=60).json()["choices"][0]["message"]["content"]
    ids = llm.tokenizer.encode_rendered_chat(prompt)
    assert post(server, {"prompt": ids, "n_predict": 6, "temperature": 0}).json()["content"] == chat
    bad = httpx.post(server.url + "/apply-template", json={"prompt": "x"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"


def test_infill_needs_fim_tokens():
    """A model whose vocabulary has no fill-in-the-middle tokens (this SentencePiece one's) cannot infill (/infill,
    or /v1/completions with a suffix): a 501 that says so; /infill is gated by --api-key as /completion is."""
    from pocketmoe.testing.scripted import app_for
    from pocketmoe.testing.vocab import tokenizer_metadata
    from pocketmoe.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(tokenizer_metadata(700, model="llama"))
    assert not tok.fim
    http, eng = app_for(tok, "x")
    r = http.post("/infill", json={"input_prefix": "def f(", "input_suffix": ")"})
    assert r.status_code == 501 and "fill-in-the-middle" in r.json()["error"]["message"] and not eng.prompts
    r = http.post("/v1/completions", json={"prompt": "def f(", "suffix": ")"})  # OpenAI's insertion, likewise
    assert (r.status_code, r.json()["error"]["param"]) == (501, "suffix") and not eng.prompts
    http, _ = app_for(tok, "x", api_key="k")
    assert http.post("/infill", json={"input_prefix": "a"}).status_code == 401


def test_spm_infill_puts_the_suffix_first(llm):
    """--spm-infill: /infill and a /v1/completions suffix lay the prompt out suffix first (<｜fim▁hole｜> suffix,
    then <｜fim▁begin｜> prefix, then <｜fim▁end｜>), the extra chunks and BOS where they were."""
    from fastapi.testclient import TestClient

    from pocketmoe.serve.__main__ import parse_args
    from pocketmoe.serve.api import ServerState, create_app
    from pocketmoe.testing.scripted import ScriptedEngine

    assert parse_args(["--spm-infill"]).spm_infill and not parse_args([]).spm_infill
    tok = llm.tokenizer
    pre, suf, mid = (tok.tokens.index(t) for t in ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"))

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_bos=False, parse_special=False)

    eng = ScriptedEngine(tok, "deepseek2", "x")
    http = TestClient(create_app(ServerState(model_name="m", max_model_len=MAX_LEN, engine=eng,  # type: ignore[arg-type]
                                             tokenizer=tok, spm_infill=True)))
    extra = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}]
    body = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\nprint(add(1, 2))\n", "prompt": "ret",
            "input_extra": extra, "n_predict": 4}
    assert http.post("/infill", json=body).status_code == 200
    assert eng.prompts[-1] == [*enc("\n\n--- snippet ---\n\n"), *enc(extra[0]["text"]), tok.bos_id,
                               suf, *enc(body["input_suffix"]), pre, *enc(body["input_prefix"]), *enc("ret"), mid]
    assert http.post("/v1/completions", json={"prompt": "def f(", "suffix": "):", "max_tokens": 4}).status_code == 200
    assert eng.prompts[-1] == [tok.bos_id, suf, *enc("):"), pre, *enc("def f("), mid]


def test_slots_show_what_each_slot_ran(server, llm):
    """GET /slots on the live server: one entry per --parallel slot; a /completion pinned by id_slot runs there
    (its reply and stream say so), and that slot then shows the finished task: its counts match the reply, its
    params the reply's generation_settings, and nothing of its text without --slots-debug."""
    idle = httpx.get(server.url + "/slots", timeout=30).json()
    assert [s["id"] for s in idle] == list(range(16))
    assert all(s["n_ctx"] == MAX_LEN and s["is_processing"] is False and s["speculative"] is False for s in idle)
    want = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    out = post(server, {"prompt": "hello world", "n_predict": 7, "temperature": 0, "ignore_eos": True,
                        "id_slot": 5, "top_k": 12}).json()
    assert out["id_slot"] == 5 and out["content"] == want.text
    streamed = [json.loads(e[6:]) for e in events(server, {"prompt": "hi", "n_predict": 3, "id_slot": 3,
                                                           "return_progress": True})]
    assert {e["id_slot"] for e in streamed} == {3} and "prompt_progress" in streamed[0]
    five = httpx.get(server.url + "/slots", timeout=30).json()[5]
    assert five["is_processing"] is False and five["n_prompt_tokens"] == out["tokens_evaluated"]
    assert five["n_prompt_tokens_processed"] + five["n_prompt_tokens_cache"] == out["tokens_evaluated"]
    assert five["n_prompt_tokens_cache"] == out["tokens_cached"]
    assert five["next_token"] == [{"has_next_token": False, "has_new_line": "\n" in want.text, "n_remain": 0,
                                   "n_decoded": 7}]
    settings = out["generation_settings"]
    for key in ("temperature", "top_k", "top_p", "min_p", "seed", "n_predict", "repeat_penalty", "samplers",
                "ignore_eos", "min_keep", "typical_p", "dry_multiplier"):
        assert five["params"][key] == settings[key], key
    assert "prompt" not in five and "generated" not in five and "stop" not in five["params"]
    assert httpx.get(server.url + "/slots?fail_on_no_slot=1", timeout=30).status_code == 200
    assert httpx.get(server.url + "/props", timeout=30).json()["endpoint_slots"] is True
    bad = post(server, {"prompt": "hi", "n_predict": 1, "id_slot": 16})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "id_slot"
    assert "0..15" in bad.json()["error"]["message"]


def test_slots_while_a_task_runs(model: Path, llm):
    """In-process, one slot, the engine held inside a step: /slots shows the running task's progress, and with
    fail_on_no_slot a 503 (every slot busy); released, the reply is the solo greedy one and the slot idle again.
    --slots-debug adds the prompt and text; --no-slots answers 501; --api-key guards /slots."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from pocketmoe.serve.__main__ import parse_args

    assert not parse_args(["--no-slots"]).slots and parse_args([]).slots and parse_args(["--slots-debug"]).slots_debug
    held, go, n = threading.Event(), threading.Event(), [0]

    def gate() -> None:
        n[0] += 1
        if n[0] == 3:  # the prompt, one decode, then hold: two tokens drawn
            held.set()
            go.wait(60)

    tok = llm.tokenizer
    eng = started_engine(model, tok, 1, gate)
    try:
        http = client(eng, tok, slots_debug=True)
        body = {"prompt": "the quick brown fox", "n_predict": 9, "temperature": 0, "ignore_eos": True,
                "return_tokens": True}
        with ThreadPoolExecutor(2) as pool:
            reply = pool.submit(http.post, "/completion", json=body)
            assert held.wait(60)
            (busy,) = http.get("/slots").json()
            assert http.get("/slots?fail_on_no_slot=1").status_code == 503
            assert http.get("/slots?fail_on_no_slot=0").status_code == 200
            queued, call = threading.Event(), eng.call

            def noted_call(fn):  # noqa: ANN001, ANN202
                fut = call(fn)
                queued.set()
                return fut

            eng.call = noted_call  # type: ignore[method-assign]
            erase = pool.submit(http.post, "/slots/0?action=erase")  # runs between steps: the slot is still busy
            assert queued.wait(60)  # in the engine's inbox before the held step ends
            go.set()
            out = reply.result(60).json()
            assert erase.result(60).status_code == 409 and erase.result().json()["error"]["code"] == "slot_busy", erase.result().text
        want = llm.generate(["the quick brown fox"], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))[0]
        assert out["content"] == want.text and out["id_slot"] == 0
        assert busy["is_processing"] is True and busy["id"] == 0 and busy["n_prompt_tokens"] == out["tokens_evaluated"]
        assert busy["next_token"] == [{"has_next_token": True, "has_new_line": "\n" in tok.decode(out["tokens"][:2]),
                                       "n_remain": 7, "n_decoded": 2}]
        assert busy["prompt"] == tok.decode(want.prompt_token_ids) and busy["generated"] == tok.decode(out["tokens"][:2])
        assert busy["params"]["stop"] == [] and busy["params"]["n_predict"] == 9
        (done,) = http.get("/slots").json()
        assert done["is_processing"] is False and done["next_token"][0]["n_decoded"] == 9
        assert done["id_task"] == busy["id_task"] and done["generated"] == tok.decode(out["tokens"])
        assert http.get("/slots?fail_on_no_slot=1").status_code == 200
        off = client(eng, tok, slots_endpoint=False).get("/slots")
        assert off.status_code == 501 and "--no-slots" in off.json()["error"]["message"]
        keyed = client(eng, tok, api_key="k")
        assert keyed.get("/slots").status_code == 401
        assert keyed.get("/slots", headers={"Authorization": "Bearer k"}).status_code == 200
    finally:
        go.set()
        eng.stop()


def started_engine(model: Path, tok, seqs: int, gate=None):  # noqa: ANN001, ANN201
    """A running serving engine over the model with `seqs` slots; `gate` (if given) is called before each step."""
    from pocketmoe.engine import ModelRunner, RunnerConfig
    from pocketmoe.gguf import open_bundle
    from pocketmoe.serve.engine import Engine, EngineConfig
    from pocketmoe.serve.metrics import Metrics

    runner = ModelRunner(open_bundle(model), RunnerConfig(n_ctx=MAX_LEN, threads=1, max_seqs=seqs, backend="auto"))
    if gate is not None:
        run_step = runner.run_step

        def gated(step):  # noqa: ANN001, ANN202
            gate()
            return run_step(step)

        runner.run_step = gated  # type: ignore[method-assign]
    eng = Engine(runner, tok, EngineConfig(max_num_seqs=seqs, max_model_len=MAX_LEN), Metrics())
    eng.start()
    return eng


def client(eng, tok, **state):  # noqa: ANN001, ANN003, ANN201
    """An in-process client of the app over `eng` (ServerState's other fields as given)."""
    from fastapi.testclient import TestClient

    from pocketmoe.serve.api import ServerState, create_app

    return TestClient(create_app(ServerState(model_name="m", max_model_len=MAX_LEN, engine=eng, tokenizer=tok, **state)))


def test_slot_save_erase_restore_and_restore_after_a_restart(model: Path, llm, tmp_path: Path):
    """POST /slots/{id}?action=...: save writes the full KV pages of what the slot ran last; erase drops them from
    the prefix cache (the prompt is computed again); restore puts them back, in this server or a restarted one,
    and the same prompt then takes them from the cache with the same tokens. Bad names, actions, slots, missing or
    foreign files are clear errors; without --slot-save-path save and restore answer 501."""
    from pocketmoe.engine.kv_cache import PAGE
    from pocketmoe.engine.prefix_store import write_slot_file
    from pocketmoe.serve.__main__ import parse_args

    assert parse_args(["--slot-save-path", "d"]).slot_save_path == "d" and parse_args([]).slot_save_path is None
    tok = llm.tokenizer
    body = {"prompt": " ".join(f"w{i}" for i in range(40)), "n_predict": 6, "temperature": 0, "ignore_eos": True,
            "id_slot": 1}
    eng = started_engine(model, tok, 2)
    if not eng.prefix_caching:
        eng.stop()
        pytest.skip("slot actions work on the prefix cache, on with the native kernels (not built here)")
    try:
        http = client(eng, tok, slot_save_path=tmp_path)
        first = http.post("/completion", json=body).json()
        n_prompt = first["tokens_evaluated"]
        full = (n_prompt + 5) // PAGE * PAGE  # the prompt and 5 of the 6 tokens drawn have KV rows
        reused = (n_prompt - 1) // PAGE * PAGE  # a prompt attaches pages of all but its last token
        assert reused >= 2 * PAGE
        saved = http.post("/slots/1?action=save", json={"filename": "chat.bin"}).json()
        assert (saved["id_slot"], saved["filename"], saved["n_saved"]) == (1, "chat.bin", full)
        assert saved["n_written"] == (tmp_path / "chat.bin").stat().st_size and saved["timings"]["save_ms"] > 0
        assert http.post("/slots/0?action=save", json={"filename": "none.bin"}).json()["n_saved"] == 0
        assert http.post("/slots/1?action=erase").json() == {"id_slot": 1, "n_erased": full}
        again = http.post("/completion", json=body).json()
        assert again["tokens_cached"] == 0 and again["content"] == first["content"]
        assert http.post("/slots/1?action=erase").json()["n_erased"] == full
        restored = http.post("/slots/0?action=restore", json={"filename": "chat.bin"}).json()
        assert (restored["n_restored"], restored["n_read"]) == (full, saved["n_written"])
        third = http.post("/completion", json={**body, "id_slot": 0}).json()
        assert third["tokens_cached"] == reused and third["content"] == first["content"]
        for url, payload, status, param in [
                ("/slots/1?action=save", {"filename": "../x.bin"}, 400, "filename"),
                ("/slots/1?action=save", {"filename": ".hidden"}, 400, "filename"),
                ("/slots/1?action=save", {}, 400, "filename"),
                ("/slots/1?action=load", {"filename": "a"}, 400, "action"),
                ("/slots/2?action=save", {"filename": "a"}, 404, "id_slot"),
                ("/slots/-1?action=erase", None, 404, "id_slot"),
                ("/slots/0?action=restore", {"filename": "missing.bin"}, 404, "filename")]:
            r = http.post(url, json=payload)
            assert (r.status_code, r.json()["error"]["param"]) == (status, param), (url, r.text)
        write_slot_file(tmp_path / "other.bin", b"z" * 16, [], [])
        r = http.post("/slots/0?action=restore", json={"filename": "other.bin"})
        assert r.status_code == 400 and "another model" in r.json()["error"]["message"]
        bare = client(eng, tok)
        assert bare.post("/slots/1?action=save", json={"filename": "a.bin"}).status_code == 501
        assert bare.post("/slots/1?action=erase").status_code == 200
        eng.cache.mirror = object()  # tensor parallel: each rank holds a share of the rows
        r = http.post("/slots/1?action=erase")
        assert r.status_code == 501 and "tensor parallelism" in r.json()["error"]["message"]
        eng.cache.mirror = None
    finally:
        eng.stop()
    restarted = started_engine(model, tok, 2)
    try:
        http = client(restarted, tok, slot_save_path=tmp_path)
        assert http.post("/slots/1?action=restore", json={"filename": "chat.bin"}).json()["n_restored"] == full
        out = http.post("/completion", json=body).json()
        assert out["tokens_cached"] == reused and out["content"] == first["content"]
    finally:
        restarted.stop()


def test_llama_server_metrics_count_what_ran(server, llm):
    """/metrics also carries llama-server's series (llamacpp:*): one /completion adds its computed prompt tokens and
    its generated tokens, at least one step per token, and leaves nothing processing or deferred."""
    import re

    def metrics() -> dict[str, float]:
        text = httpx.get(server.url + "/metrics", timeout=30).text
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(llamacpp:\w+) (\S+)$", text, re.M)}

    before = metrics()
    out = post(server, {"prompt": "counting the tokens of this prompt", "n_predict": 5, "temperature": 0,
                        "ignore_eos": True, "cache_prompt": False}).json()
    after = metrics()

    def added(name: str) -> float:
        return after[name] - before[name]

    assert added("llamacpp:prompt_tokens_total") == out["tokens_evaluated"] - out["tokens_cached"]
    assert added("llamacpp:tokens_predicted_total") == 5 and added("llamacpp:n_decode_total") >= 5
    assert added("llamacpp:prompt_seconds_total") > 0 and added("llamacpp:tokens_predicted_seconds_total") > 0
    assert after["llamacpp:predicted_tokens_seconds"] > 0 and after["llamacpp:prompt_tokens_seconds"] > 0
    assert after["llamacpp:requests_processing"] == after["llamacpp:requests_deferred"] == 0
    assert after["llamacpp:n_tokens_max"] >= out["tokens_evaluated"] + 4
    assert 1 <= after["llamacpp:n_busy_slots_per_decode"] <= 16
