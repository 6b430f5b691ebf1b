"""A server over a scripted engine, for tests of what the API makes of a model's output: every choice
'generates' a fixed text, a few characters a token, and the prompts and parameters it was given are kept."""

from __future__ import annotations

from pathlib import Path

import openai
from fastapi.testclient import TestClient

from pocketmoe.engine.sampler import TokenLogprob
from pocketmoe.serve.api import ServerState, create_app
from pocketmoe.serve.engine import Delta, EngineConfig
from pocketmoe.tokenizer import Tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
MM_CALL = ('Let me check.<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
           '<parameter name="days">3</parameter>\n</invoke>\n<invoke name="now">\n</invoke>\n</minimax:tool_call>')


class ScriptedEngine:
    """Stands in for the engine: every choice 'generates' `script`, a few characters a token. Where logprobs are
    asked for, token k (counting from 0) is id k + 1 with logprob -k / 8, and its top alternatives are ids k + 1 + j
    with logprob -k / 8 - j."""

    alive = True
    prefix_caching = False
    cfg = EngineConfig()
    hold = False  # True: each choice sends its first token, then nothing until aborted (a reply that runs on)

    def __init__(self, tok: Tokenizer, architecture: str, script: str) -> None:
        self.tok, self.script, self.prompts, self.params = tok, script, [], []
        self.aborted: list[object] = []
        self.runner = type("R", (), {"vocab_size": tok.vocab_size,
                                     "bundle": type("B", (), {"architecture": architecture})()})()

    def submit(self, ids, params, *, out=None, index_base=0, progress=False, slot=-1):  # noqa: ANN001, ANN201
        self.prompts.append(list(ids))
        self.params.append(list(params))
        for i, ps in enumerate(params):
            pieces = [self.script[j:j + 5] for j in range(0, len(self.script), 5)]
            for k, p in enumerate(pieces[:1] if self.hold else pieces):
                lps = [] if ps.logprobs is None else [
                    TokenLogprob(k + 1, -k / 8, tuple((k + 1 + j, -k / 8 - j) for j in range(ps.logprobs)))]
                out.put_nowait(Delta(index_base + i, p, [1], lps,
                                     finish_reason="stop" if k == len(pieces) - 1 else None))
        if not self.hold:
            out.put_nowait(None)
        return object()

    def abort(self, req) -> None:  # noqa: ANN001
        self.aborted.append(req)


def thinking_tokenizer(directory: Path) -> Tokenizer:
    """The tiny MiniMax-M2 fixture's tokenizer (written into `directory`) with MINIMAX_SHAPED_TEMPLATE: a template
    that opens a reasoning block and keeps history's reasoning."""
    from pocketmoe.gguf import open_bundle
    from pocketmoe.testing.synth import write_fixture
    from pocketmoe.testing.vocab import MINIMAX_SHAPED_TEMPLATE

    path = write_fixture("minimax-m2", "tiny", "Q4_K_M", directory / "m.gguf")[0]
    tok = Tokenizer.from_metadata(open_bundle(path).metadata)
    tok.chat_template = MINIMAX_SHAPED_TEMPLATE
    return tok


def app_for(tok: Tokenizer, script: str, arch: str = "minimax-m2", reasoning_format: str = "auto",
            api_key: str | None = None) -> tuple[TestClient, ScriptedEngine]:
    """The server's app (model name "m") over a ScriptedEngine, in process: an httpx client for any SDK."""
    eng = ScriptedEngine(tok, arch, script)
    state = ServerState(model_name="m", max_model_len=4096, engine=eng, tokenizer=tok,  # type: ignore[arg-type]
                        reasoning_format=reasoning_format, api_key=api_key)
    return TestClient(create_app(state), base_url="http://testserver"), eng


def client_for(tok: Tokenizer, script: str, arch: str = "minimax-m2",
               reasoning_format: str = "auto") -> tuple[openai.OpenAI, ScriptedEngine]:
    """An OpenAI client of app_for's app."""
    http, eng = app_for(tok, script, arch, reasoning_format)
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0), eng
