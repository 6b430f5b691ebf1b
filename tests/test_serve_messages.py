"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), driven by the official `anthropic`
client (what Claude Code uses): its request becomes the chat request a test writes by hand (the same prompt reaches
the engine), its reply the thinking / text / tool_use blocks the chat route's reply holds, whole and streamed (the
client's own stream accumulator builds the message), errors in Anthropic's body, the key as x-api-key."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import openai
import pytest

from pocketmoe.serve.tools import MINIMAX, parse
from pocketmoe.testing.scripted import MM_CALL, TOOLS, app_for, thinking_tokenizer
from pocketmoe.testing.synth import write_fixture
from pocketmoe.tokenizer import Tokenizer

ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
THINK = "Check the weather first.\n</think>\n\n"
ASK = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return thinking_tokenizer(tmp_path_factory.mktemp("messages"))


def clients(tok: Tokenizer, script: str, api_key: str | None = None):  # noqa: ANN201
    http, eng = app_for(tok, script, api_key=api_key)
    a = anthropic.Anthropic(base_url="http://testserver", api_key=api_key or "x", http_client=http, max_retries=0)
    o = openai.OpenAI(base_url="http://testserver/v1", api_key=api_key or "x", http_client=http, max_retries=0)
    return a, o, eng


def blocks(m) -> list[tuple]:  # noqa: ANN001
    out = []
    for b in m.content:
        out.append((b.type, b.thinking if b.type == "thinking" else b.text if b.type == "text" else (b.name, b.input)))
    return out


def test_reply_is_the_chat_reply_as_blocks(tok: Tokenizer) -> None:
    a, o, eng = clients(tok, THINK + MM_CALL)
    m = a.messages.create(model="m", max_tokens=100, system="Be brief.", messages=ASK, tools=ANTHROPIC_TOOLS)
    o.chat.completions.create(model="m", max_tokens=100, messages=[{"role": "system", "content": "Be brief."}, *ASK],
                              tools=TOOLS)
    assert eng.prompts[-2] == eng.prompts[-1]  # the prompt the chat request renders
    content, calls = parse(MINIMAX, MM_CALL, TOOLS)
    assert blocks(m) == [("thinking", "Check the weather first."), ("text", content),
                         *[("tool_use", (c.name, json.loads(c.arguments))) for c in calls]]
    assert m.stop_reason == "tool_use" and m.role == "assistant" and m.type == "message"
    n_out = -(-len(THINK + MM_CALL) // 5)  # the scripted engine's tokens: five characters each
    assert (m.usage.input_tokens + m.usage.cache_read_input_tokens, m.usage.output_tokens) == (len(eng.prompts[-1]),
                                                                                              n_out)
    assert eng.params[-2][0].max_tokens == 100


def test_stream_builds_the_same_message(tok: Tokenizer) -> None:
    a, _, _ = clients(tok, THINK + MM_CALL)
    whole = a.messages.create(model="m", max_tokens=100, messages=ASK, tools=ANTHROPIC_TOOLS)
    with a.messages.stream(model="m", max_tokens=100, messages=ASK, tools=ANTHROPIC_TOOLS) as s:
        events = list(s)
        final = s.get_final_message()
    assert blocks(final) == blocks(whole) and final.stop_reason == "tool_use"
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    starts = [e.index for e in events if e.type == "content_block_start"]
    assert starts == list(range(len(whole.content)))
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_history_renders_as_the_chat_history(tok: Tokenizer) -> None:
    """A second turn with the first reply (thinking, text, tool_use) and the tool results renders the prompt the same
    conversation renders through the chat route."""
    a, o, eng = clients(tok, THINK + MM_CALL)
    first = a.messages.create(model="m", max_tokens=100, messages=ASK, tools=ANTHROPIC_TOOLS)
    uses = [b for b in first.content if b.type == "tool_use"]
    results = [{"type": "tool_result", "tool_use_id": b.id, "content": f"result {k}"} for k, b in enumerate(uses)]
    a.messages.create(model="m", max_tokens=100, tools=ANTHROPIC_TOOLS, messages=[
        *ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [*results, {"type": "text", "text": "and Rome?"}]}])
    text = next(b.text for b in first.content if b.type == "text")
    history = [*ASK, {"role": "assistant", "content": text, "reasoning_content": "Check the weather first.",
                      "tool_calls": [{"id": b.id, "type": "function",
                                      "function": {"name": b.name, "arguments": json.dumps(b.input)}} for b in uses]},
               *[{"role": "tool", "tool_call_id": r["tool_use_id"], "content": r["content"]} for r in results],
               {"role": "user", "content": "and Rome?"}]
    via_messages = eng.prompts[-1]
    o.chat.completions.create(model="m", max_tokens=100, messages=history, tools=TOOLS)
    assert via_messages == eng.prompts[-1]
    count = a.messages.count_tokens(model="m", messages=ASK, tools=ANTHROPIC_TOOLS, system="Be brief.")
    a.messages.create(model="m", max_tokens=5, messages=ASK, tools=ANTHROPIC_TOOLS, system="Be brief.")
    assert count.input_tokens == len(eng.prompts[-1])
    # a forced tool decides the output from its first token: the block the template opens is closed, in both
    forced = {"type": "tool", "name": ANTHROPIC_TOOLS[0]["name"]}
    count = a.messages.count_tokens(model="m", messages=ASK, tools=ANTHROPIC_TOOLS, tool_choice=forced)
    a.messages.create(model="m", max_tokens=5, messages=ASK, tools=ANTHROPIC_TOOLS, tool_choice=forced)
    assert count.input_tokens == len(eng.prompts[-1])


def test_settings_reach_the_engine(tok: Tokenizer) -> None:
    a, _, eng = clients(tok, "Paris is nice.")
    m = a.messages.create(model="m", max_tokens=50, messages=ASK, stop_sequences=["END"], thinking={"type": "disabled"},
                          extra_body={"temperature": 0.5, "top_k": 7})  # older clients' fields
    assert (m.stop_reason, m.stop_sequence, m.content[0].text) == ("end_turn", None, "Paris is nice.")
    p = eng.params[-1][0]
    assert (p.max_tokens, p.temperature, p.top_k, p.stop) == (50, 0.5, 7, ("END",))
    assert tok.decode(eng.prompts[-1]).endswith("<think>\n</think>\n\n")  # thinking disabled: the block closed


def test_output_format(tok: Tokenizer) -> None:
    a, _, eng = clients(tok, '{"a": 1}')
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    m = a.messages.create(model="m", max_tokens=20, messages=ASK,
                          output_config={"format": {"type": "json_schema", "schema": schema}})
    assert eng.params[-1][0].grammar is not None and json.loads(m.content[-1].text) == {"a": 1}


def test_tool_choice(tok: Tokenizer) -> None:
    a, _, eng = clients(tok, MM_CALL)
    a.messages.create(model="m", max_tokens=100, messages=ASK, tools=ANTHROPIC_TOOLS,
                      tool_choice={"type": "tool", "name": "now"})
    assert eng.params[-1][0].grammar is not None  # held to a call of that tool
    a.messages.create(model="m", max_tokens=100, messages=ASK, tools=ANTHROPIC_TOOLS, tool_choice={"type": "none"})
    assert eng.params[-1][0].grammar is None


@pytest.mark.parametrize("body,needle", [
    ({"max_tokens": 5, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "server tool"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image'"),
    ({"messages": ASK}, "max_tokens is required"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": ASK, "model": "claude-x"}, "claude-x"),
])
def test_errors_are_anthropics(tok: Tokenizer, body: dict, needle: str) -> None:
    http, eng = app_for(tok, "ok")
    r = http.post("/v1/messages", json={"model": "m", **body})
    err = r.json()
    assert r.status_code == (404 if "claude" in needle else 400) and err["type"] == "error", err
    assert needle in err["error"]["message"] and err["error"]["message"].endswith(".")
    assert err["error"]["type"] == ("not_found_error" if "claude" in needle else "invalid_request_error")
    assert not eng.prompts


def test_x_api_key(tok: Tokenizer) -> None:
    a, _, _ = clients(tok, "ok", api_key="secret")
    assert a.messages.create(model="m", max_tokens=5, messages=ASK, thinking={"type": "disabled"}).content[0].text == "ok"
    bad = anthropic.Anthropic(base_url="http://testserver", api_key="wrong", http_client=a._client, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="m", max_tokens=5, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"


def test_live_server_answers_as_its_chat_route(tmp_path: Path) -> None:
    """On the real engine: the greedy text is the chat route's for the same message; max_tokens stops it."""
    from pocketmoe.testing.live_server import LiveServer

    model = write_fixture("deepseek2", "tiny", "Q4_K_M", tmp_path / "m.gguf", seed=11)[0]
    with LiveServer(["--model", str(model), "--served-model-name", "tiny", "--max-model-len", "256",
                     "--threads", "1"]) as srv:
        o = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        a = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
        msgs = [{"role": "user", "content": "hello world"}]
        chat = o.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
        greedy = {"temperature": 0}  # older clients' field (the SDK no longer has it)
        m = a.messages.create(model="tiny", messages=msgs, max_tokens=8, extra_body=greedy)
        assert m.content[0].text == chat.choices[0].message.content
        assert m.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
        assert (m.usage.input_tokens + m.usage.cache_read_input_tokens, m.usage.output_tokens) == (
            chat.usage.prompt_tokens, chat.usage.completion_tokens)
        word = m.content[0].text[2:5]  # a stop string inside the reply: it ends there
        cut = a.messages.create(model="tiny", messages=msgs, max_tokens=8, extra_body=greedy, stop_sequences=[word])
        assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", word)
        assert cut.content[0].text == m.content[0].text[:m.content[0].text.index(word)]
