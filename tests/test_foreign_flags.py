"""A llama-server command line given to `pocketmoe.serve`: the flags that mean one of its own set it, those it
always honours are noted, those it cannot honour stop it with one line before anything loads; and the server-wide
--chat-template-kwargs reaches every chat's template unless the request sets the variable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pocketmoe import foreign_flags
from pocketmoe.serve.__main__ import parse_args


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("python -m pocketmoe.serve: error: ")
    return err


def test_mapped_flags_set_the_servers_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    a = parse_args(["-m", "x.gguf", "-ngl", "0", "-ctk", "f16", "-ctv", "F16", "-ub", "256", "-v"])
    assert (a.device, a.kv_dtype, a.chunk_size, a.log_level) == ("cpu", "f16", 256, "debug") and a.foreign_notes == []
    a = parse_args(["-ngl", "99", "--reasoning-format", "deepseek"])
    assert a.device == "auto" and a.reasoning_format == "auto" and "-ngl 99" in a.foreign_notes[0]
    for argv in (["-ot", "blk\\..*\\.ffn_.*_exps\\.=CPU"], ["--cpu-moe"], ["-ncmoe", "30"]):
        monkeypatch.setattr(foreign_flags, "gpu_memory_gib", lambda: [24.0])
        assert parse_args(argv).mode == "heterogeneous", argv
        monkeypatch.setattr(foreign_flags, "gpu_memory_gib", lambda: [])
        a = parse_args(argv)
        assert a.mode == "auto" and "no GPU is in use" in a.foreign_notes[0], argv
    a = parse_args(["-ot", "attn=CUDA0"])
    assert a.mode == "auto" and "only routed experts on the CPU" in a.foreign_notes[0]
    key = tmp_path / "key"
    key.write_text("s3cret\nignored\n")
    assert parse_args(["--api-key-file", str(key)]).api_key == "s3cret"
    assert parse_args(["--chat-template-kwargs", '{"enable_thinking": false}']).chat_template_kwargs == {
        "enable_thinking": False}
    assert parse_args([]).chat_template_kwargs == {} and parse_args([]).sampling_defaults == {}
    a = parse_args(["--temp", "0.6", "--top-k", "20", "--top-p", "0.95", "--min-p", "0", "--repeat-penalty", "1.1",
                    "-s", "7"])
    assert a.sampling_defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0,
                                   "repeat_penalty": 1.1, "seed": 7} and a.foreign_notes == []


def test_noted_flags_change_nothing_and_say_so() -> None:
    plain = vars(parse_args([]))
    a = parse_args(["--jinja", "-fa", "-fa", "on", "-cb", "--metrics", "--mlock", "--no-mmap", "-b", "4096", "-tb",
                    "8", "--cache-reuse", "256", "--no-context-shift", "-sm", "row", "--no-webui", "--fit", "on"])
    notes = a.foreign_notes
    assert len(notes) == 13 and all(n.endswith(".") and "\n" not in n for n in notes)
    assert any(n.startswith("--flash-attn") for n in notes) and any(n.startswith("--batch-size") for n in notes)
    def own(flags: dict) -> dict:
        return {k: v for k, v in flags.items() if not k.startswith(("llama_", "foreign_"))}

    assert own(vars(a)) == own(plain)


@pytest.mark.parametrize("argv, words", [
    (["--context-shift"], "never shifted"),
    (["-hf", "org/model"], "nothing is downloaded"),
    (["--temp", "3"], "less than or equal to 2"),
    (["--top-p", "0"], "greater than 0"),
    (["-n", "128"], "send max_tokens"),
    (["-md", "draft.gguf"], "speculative decoding"),
    (["-ctk", "q8_0"], "f32, f16, bf16"),
    (["-ctk", "f16", "-ctv", "bf16"], "give the same to both"),
    (["-ctk", "f16", "--kv-dtype", "bf16"], "give one of them"),
    (["-ngl", "0", "--device", "cuda"], "give one of them"),
    (["-ngl", "lots"], "not a layer count"),
    (["-ub", "0"], ">= 1"),
    (["--api-key-file", "/nonexistent/key"], "--api-key-file"),
    (["--chat-template-kwargs", "{nope"], "not JSON"),
    (["--chat-template-kwargs", "[1]"], "not an object"),
    (["--chat-template-kwargs", '{"messages": []}'], "may not set messages"),
])
def test_refused_flags_stop_with_one_line(argv: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert words in refused(argv, capsys)


def test_server_chat_template_kwargs_are_every_chats_unless_it_sets_them(tmp_path: Path) -> None:
    """DeepSeek-V3.1's template opens its reasoning with `thinking`: --chat-template-kwargs '{"thinking": true}'
    opens it for a request that says nothing; the request's reasoning_effort or own kwargs still decide theirs."""
    from pocketmoe.gguf import open_bundle
    from pocketmoe.serve.api import ServerState, create_app
    from pocketmoe.testing.scripted import ScriptedEngine
    from pocketmoe.testing.synth import write_fixture
    from pocketmoe.testing.vocab import DEEPSEEK_V31_SHAPED_TEMPLATE
    from pocketmoe.tokenizer import Tokenizer

    model = write_fixture("deepseek2", "tiny", "Q4_K_M", tmp_path / "m.gguf", seed=3)[0]
    tok = Tokenizer.from_metadata(open_bundle(model).metadata)
    tok.chat_template = DEEPSEEK_V31_SHAPED_TEMPLATE
    eng = ScriptedEngine(tok, "deepseek2", "Paris.")

    def opened(server: dict[str, Any], **extra: Any) -> bool:
        http = TestClient(create_app(ServerState(model_name="m", max_model_len=4096, engine=eng,  # type: ignore[arg-type]
                                                 tokenizer=tok, chat_template_kwargs=server)))
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **extra}
        assert http.post("/v1/chat/completions", json=body).status_code == 200
        return tok.decode(eng.prompts[-1]).endswith("<think>")

    assert not opened({}) and opened({"thinking": True}) and opened({"enable_thinking": True})
    assert not opened({"thinking": True}, reasoning_effort="none")
    assert not opened({"thinking": True}, chat_template_kwargs={"thinking": False})
    assert opened({"enable_thinking": False}, reasoning_effort="high")
    assert not opened({"enable_thinking": False})


def test_server_sampling_defaults_fill_what_a_request_leaves_out(tmp_path: Path) -> None:
    """--temp / --top-k / --seed ... (llama-server's): the engine gets them on every route where the request does not
    give that field, and the request's own where it does; GET /props shows them."""
    from pocketmoe.gguf import open_bundle
    from pocketmoe.serve.api import ServerState, create_app
    from pocketmoe.testing.scripted import ScriptedEngine
    from pocketmoe.testing.synth import write_fixture
    from pocketmoe.tokenizer import Tokenizer

    model = write_fixture("deepseek2", "tiny", "Q4_K_M", tmp_path / "m.gguf", seed=3)[0]
    tok = Tokenizer.from_metadata(open_bundle(model).metadata)
    eng = ScriptedEngine(tok, "deepseek2", "Paris.")
    eng.runner.bundle.paths = [model]
    defaults = {"temperature": 0.25, "top_k": 7, "top_p": 0.5, "repeat_penalty": 1.3, "seed": 11}
    http = TestClient(create_app(ServerState(model_name="m", max_model_len=4096, engine=eng,  # type: ignore[arg-type]
                                             tokenizer=tok, sampling_defaults=defaults)))
    msgs = [{"role": "user", "content": "hi"}]
    vllm = {"temperature": 0.9, "top_k": 3, "seed": 5, "repetition_penalty": 1.05}
    for path, body, own in [
            ("/v1/chat/completions", {"messages": msgs}, vllm), ("/v1/completions", {"prompt": "hi"}, vllm),
            ("/completion", {"prompt": "hi"}, {"temperature": 0.9, "top_k": 3, "seed": 5, "repeat_penalty": 1.05}),
            ("/v1/messages", {"messages": msgs}, {"temperature": 0.9, "top_k": 3}),  # Anthropic's fields
            ("/v1/responses", {"input": "hi"}, {"temperature": 0.9})]:
        assert http.post(path, json={**body, "max_tokens": 4}).status_code == 200, path
        p = eng.params[-1][0]
        assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.seed) == (0.25, 7, 0.5, 1.3, 11), path
        assert http.post(path, json={**body, **own, "max_tokens": 4}).status_code == 200, path
        p = eng.params[-1][0]
        got = {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "seed": p.seed,
               "repetition_penalty": p.repetition_penalty}
        want = {"temperature": 0.25, "top_k": 7, "top_p": 0.5, "seed": 11, "repetition_penalty": 1.3,
                **{k.replace("repeat_", "repetition_"): v for k, v in own.items()}}
        assert got == want, path
    params = http.get("/props").json()["default_generation_settings"]["params"]
    assert (params["temperature"], params["top_k"], params["seed"]) == (0.25, 7, 11)


def test_a_vllm_serve_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`vllm serve MODEL ...`'s flags: the model first, --gpu-memory-utilization as each GPU's share,
    --max-num-batched-tokens as --chunk-size, --kv-cache-dtype, --uvicorn-log-level; its other common flags noted,
    and those asking for what is not done here refused."""
    monkeypatch.setattr(foreign_flags, "gpu_memory_gib", lambda: [80.0, 24.0])
    a = parse_args(["m.gguf", "--served-model-name", "x", "--max-model-len", "8192", "--gpu-memory-utilization", "0.5",
                    "--max-num-batched-tokens", "1024", "--kv-cache-dtype", "bfloat16", "--uvicorn-log-level", "info",
                    "-pp", "1", "--trust-remote-code", "--dtype", "auto", "--tokenizer", "org/repo",
                    "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enable-prefix-caching"])
    assert (a.model, a.served_model_name, a.max_model_len, a.gpu_memory_gib, a.chunk_size, a.kv_dtype, a.log_level) \
        == ("m.gguf", "x", 8192, "40.00,12.00", 1024, "bf16", "info")
    assert [n.split(" is taken as vLLM's")[0] for n in a.foreign_notes] == [
        "--trust-remote-code", "--dtype", "--tokenizer", "--enable-auto-tool-choice", "--tool-call-parser"]
    assert parse_args(["--model", "m.gguf", "--kv-cache-dtype", "auto"]).kv_dtype == parse_args([]).kv_dtype
    monkeypatch.setattr(foreign_flags, "gpu_memory_gib", lambda: [])
    assert "no GPU is visible" in parse_args(["--gpu-memory-utilization", "0.9"]).foreign_notes[0]
    for argv, words in [(["a.gguf", "--model", "b.gguf"], "give one of them"),
                        (["--kv-cache-dtype", "fp8"], "f32, f16, bf16"),
                        (["--gpu-memory-utilization", "1.5"], "not in (0, 1]"),
                        (["--pipeline-parallel-size", "2"], "torchrun"),
                        (["--speculative-config", "{}"], "speculative decoding"),
                        (["--enable-lora"], "LoRA"),
                        (["--uvicorn-log-level", "loud"], "not a log level")]:
        assert words in refused(argv, capsys), argv
