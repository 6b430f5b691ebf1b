"""A llama-server command line given to `pocketmoe.serve`: the flags that mean one of its own set it, those it
always honours are noted, those it cannot honour stop it with one line before anything loads; and the server-wide
--chat-template-kwargs reaches every chat's template unless the request sets the variable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pocketmoe.serve import llama_flags
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
    assert (a.device, a.kv_dtype, a.chunk_size, a.log_level) == ("cpu", "f16", 256, "debug") and a.llama_notes == []
    a = parse_args(["-ngl", "99", "--reasoning-format", "deepseek"])
    assert a.device == "auto" and a.reasoning_format == "auto" and "-ngl 99" in a.llama_notes[0]
    for argv in (["-ot", "blk\\..*\\.ffn_.*_exps\\.=CPU"], ["--cpu-moe"], ["-ncmoe", "30"]):
        monkeypatch.setattr(llama_flags, "gpu_visible", lambda: True)
        assert parse_args(argv).mode == "heterogeneous", argv
        monkeypatch.setattr(llama_flags, "gpu_visible", lambda: False)
        a = parse_args(argv)
        assert a.mode == "auto" and "no GPU is in use" in a.llama_notes[0], argv
    a = parse_args(["-ot", "attn=CUDA0"])
    assert a.mode == "auto" and "only routed experts on the CPU" in a.llama_notes[0]
    key = tmp_path / "key"
    key.write_text("s3cret\nignored\n")
    assert parse_args(["--api-key-file", str(key)]).api_key == "s3cret"
    assert parse_args(["--chat-template-kwargs", '{"enable_thinking": false}']).chat_template_kwargs == {
        "enable_thinking": False}
    assert parse_args([]).chat_template_kwargs == {}


def test_noted_flags_change_nothing_and_say_so() -> None:
    plain = vars(parse_args([]))
    a = parse_args(["--jinja", "-fa", "-fa", "on", "-cb", "--metrics", "--mlock", "--no-mmap", "-b", "4096", "-tb",
                    "8", "--cache-reuse", "256", "--no-context-shift", "-sm", "row", "--no-webui", "--fit", "on"])
    notes = a.llama_notes
    assert len(notes) == 13 and all(n.endswith(".") and "\n" not in n for n in notes)
    assert any(n.startswith("--flash-attn") for n in notes) and any(n.startswith("--batch-size") for n in notes)
    ours = {k: v for k, v in vars(a).items() if not k.startswith("llama_")}
    assert ours == {k: v for k, v in plain.items() if not k.startswith("llama_")}


@pytest.mark.parametrize("argv, words", [
    (["--context-shift"], "never shifted"),
    (["-hf", "org/model"], "downloads nothing"),
    (["--temp", "0.6"], "per request"),
    (["-n", "128"], "per request"),
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
