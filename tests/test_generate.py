"""The generate CLI and the LLM API on a tiny deepseek2 fixture: outputs, determinism, errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pocketmoe import LLM, SamplingParams
from pocketmoe.testing.synth import write_fixture

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gen") / "tiny.gguf"
    write_fixture("deepseek2", "tiny", "Q8_0", path, seed=5)
    return path


@pytest.fixture(scope="module")
def llm(model) -> LLM:
    return LLM(model, n_ctx=128, threads=1)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pocketmoe.generate", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)


def test_json_output_matches_api(model, llm, tmp_path):
    dump = tmp_path / "logits.npy"
    r = run_cli("--model", str(model), "--token-ids", "5,17,99,3,250", "--max-tokens", "6",
                "--json", "--dump-logits", str(dump), "--threads", "1", "--n-ctx", "128")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("token_ids", "text", "prompt_tokens", "prefill_tok_s", "decode_tok_s", "peak_rss_mib"):
        assert key in out
    assert out["prompt_tokens"] == 5  # --token-ids adds no BOS
    api = llm.generate([[5, 17, 99, 3, 250]], SamplingParams(temperature=0, max_tokens=6))[0]
    assert out["token_ids"] == api.token_ids
    assert out["text"] == api.text == llm.tokenizer.decode(api.token_ids)
    logits = np.load(dump)
    assert logits.dtype == np.float32 and logits.shape == (5, llm.runner.vocab_size)
    np.testing.assert_array_equal(logits, llm.prompt_logits([5, 17, 99, 3, 250]).numpy())
    # greedy: the first generated token is the argmax of the last prompt position
    assert api.token_ids[0] == int(logits[-1].argmax())


def test_greedy_is_repeatable_and_streaming_concatenates(llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = llm.generate(["Hello world"], params)[0]
    chunks = list(llm.stream("Hello world", params))
    assert [c.token_id for c in chunks if c.token_id is not None] == a.token_ids
    assert "".join(c.text for c in chunks) == a.text
    assert chunks[-1].finish_reason == "length"


def test_seed_gives_same_tokens(llm):
    p = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    a = llm.generate(["seeded"], p)[0].token_ids
    b = llm.generate(["seeded"], p)[0].token_ids
    assert a == b
    others = {tuple(llm.generate(["seeded"], SamplingParams(temperature=1.0, seed=s, max_tokens=10,
                                                             ignore_eos=True))[0].token_ids)
              for s in range(4)}
    assert len(others) > 1


def test_stop_string_ends_output(llm):
    full = llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    text = full.text
    if len(text) < 3:
        pytest.skip("the random model produced too little text to cut")
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=12, stop=[stop],
                                               ignore_eos=True))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == text[:text.index(stop)]


def test_chat_uses_template(llm):
    ids = llm.encode_chat([{"role": "user", "content": "hi"}])
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert llm.tokenizer.decode(ids) == text
    assert ids.count(llm.tokenizer.bos_id) == 1 if llm.tokenizer.bos_id is not None else True


@pytest.mark.parametrize("args, needle", [
    (["--model", "/nonexistent/model.gguf", "--prompt", "x"], "nonexistent"),
    (["--token-ids", "1,x,3"], "--token-ids"),
    (["--token-ids", "1,999999"], "outside the vocabulary"),
    (["--prompt", "word " * 200, "--n-ctx", "64"], "context"),
    (["--prompt", "x", "--top-p", "0"], "top_p"),
    (["--prompt", "x", "--json-schema", "{bad"], "not JSON"),
    (["--prompt", "x", "--regex", "(ab"], "unclosed group"),
    (["--prompt", "x", "--grammar-file", "/nonexistent/g.gbnf"], "/nonexistent/g.gbnf"),
    (["--prompt", "x", "--samplers", "top_k;warmth"], "'warmth'"),
    (["--prompt", "x", "--sampling-seq", "kq"], "--sampling-seq has 'q'"),
    (["--prompt", "x", "--typical", "0"], "typical_p"),
    (["--prompt", "x", "--min-keep", "-1"], "min_keep"),
])
def test_user_errors_are_one_line(model, args, needle):
    if "--model" not in args:
        args = ["--model", str(model), *args]
    r = run_cli(*args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0], r.stderr


def test_structured_output_flags(model, llm, tmp_path):
    """--json-schema-file / --regex / --grammar: the CLI's text is the LLM API's under the same grammar, and it
    keeps to the grammar (checked by json and re, not by the grammar engine)."""
    from pocketmoe.engine.structured import Grammar

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["n"]}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    cases = [(["--json-schema-file", str(tmp_path / "s.json")], Grammar.json_schema(schema),
              lambda t: 1 <= json.loads(t)["n"] <= 9),
             (["--regex", "[a-c]{2}-[0-9]"], Grammar.regex("[a-c]{2}-[0-9]"),
              lambda t: re.fullmatch("[a-c]{2}-[0-9]", t)),
             (["--grammar", 'root ::= "x" [0-9]'], Grammar("gbnf", 'root ::= "x" [0-9]'),
              lambda t: re.fullmatch("x[0-9]", t))]
    for flags, grammar, keeps in cases:
        r = run_cli("--model", str(model), "--prompt", "out:", "--max-tokens", "40", "--json", "--threads", "1",
                    "--n-ctx", "128", *flags)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        api = llm.generate(["out:"], SamplingParams(temperature=0, max_tokens=40, grammar=grammar))[0]
        assert out["text"] == api.text and out["finish_reason"] == "stop"
        assert keeps(out["text"]), (flags, out["text"])


def test_llama_cli_sampler_flags(model, llm):
    """llama-cli's flags for llama.cpp's other samplers: the tokens LLM.generate draws with the same params in
    llama.cpp's chain; --samplers and --sampling-seq give the order; mirostat its own chain."""
    from pocketmoe.engine.sampler import LLAMA_CHAIN, MIROSTAT_CHAIN

    def cli_ids(*flags: str) -> list[int]:
        r = run_cli("--model", str(model), "--prompt", "the cat sat on the mat and the cat", "--max-tokens", "12",
                    "--json", "--threads", "1", "--n-ctx", "128", "--temperature", "0.9", "--seed", "7", *flags)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["token_ids"]

    def api_ids(**kw) -> list[int]:  # noqa: ANN003
        p = SamplingParams(temperature=0.9, seed=7, max_tokens=12, **kw)
        return llm.generate(["the cat sat on the mat and the cat"], p)[0].token_ids

    dry = dict(dry_multiplier=0.8, dry_allowed_length=1, dry_sequence_breakers=("\n",), typical_p=0.9,
               xtc_probability=0.5, xtc_threshold=0.05, min_keep=3, top_n_sigma=2.0, penalty_last_n=16)
    assert cli_ids("--dry-multiplier", "0.8", "--dry-allowed-length", "1", "--dry-sequence-breaker", "\n",
                   "--typical", "0.9", "--xtc-probability", "0.5", "--xtc-threshold", "0.05", "--min-keep", "3",
                   "--top-nsigma", "2", "--repeat-last-n", "16") == api_ids(chain=LLAMA_CHAIN, **dry)
    assert cli_ids("--samplers", "top_k;top_p;temperature", "--top-k", "5") == \
        cli_ids("--sampling-seq", "kpt", "--top-k", "5") == api_ids(top_k=5, chain=("top_k", "top_p", "temperature"))
    assert cli_ids("--mirostat", "2", "--mirostat-ent", "3", "--mirostat-lr", "0.2") == api_ids(
        mirostat=2, mirostat_tau=3.0, mirostat_eta=0.2, chain=MIROSTAT_CHAIN)
    assert cli_ids() == api_ids() != api_ids(chain=LLAMA_CHAIN, **dry)  # none of them: the engine's own order


def test_a_llama_cli_line_runs(model, llm, tmp_path):
    """llama-cli's spellings (-m, -f, -n, -c, -t, --temp, -s, --repeat-penalty) and its placement and cache flags
    (-ngl 0, -ctk f16, -fa, --no-mmap: the last two noted) give the tokens the same request gets through the API;
    a flag asking for what is not done here stops with one line."""
    from pocketmoe.generate import parse_args

    a = parse_args(["-m", "x.gguf", "-p", "hi", "-n", "9", "-c", "256", "-t", "1", "--temp", "0.5", "-s", "3",
                    "--repeat-penalty", "1.1", "-ngl", "0", "-ctk", "bf16", "-ub", "64"])
    assert (a.model, a.prompt, a.max_tokens, a.n_ctx, a.threads, a.temperature, a.seed, a.repetition_penalty) == (
        "x.gguf", "hi", 9, 256, 1, 0.5, 3, 1.1)
    assert (a.device, a.kv_dtype, a.chunk_size, a.foreign_notes) == ("cpu", "bf16", 64, [])
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("the cat sat on the mat")
    r = run_cli("-m", str(model), "-f", str(prompt), "-n", "8", "-c", "128", "-t", "1", "--temp", "0.9", "-s", "7",
                "--repeat-penalty", "1.2", "-ngl", "0", "-fa", "--no-mmap", "--json")
    assert r.returncode == 0, r.stderr
    want = llm.generate(["the cat sat on the mat"], SamplingParams(temperature=0.9, seed=7, max_tokens=8,
                                                                   repetition_penalty=1.2))[0]
    assert json.loads(r.stdout)["token_ids"] == want.token_ids
    notes = [line for line in r.stderr.splitlines() if line.startswith("note: ")]
    assert [n.split(" is taken as llama.cpp's but changes nothing: ")[0] for n in notes] == [
        "note: --flash-attn", "note: --no-mmap"]
    r = run_cli("-m", str(model), "-p", "hi", "--lora", "a.gguf")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith(
        "--lora: LoRA adapters and control vectors are not supported here.")
