"""OpenAI's Responses API (POST /v1/responses), driven by the official `openai` client: its request becomes the
chat request a test writes by hand (the same prompt reaches the engine), its reply the output items the chat
route's reply holds, whole and streamed (the client's own stream accumulator checks the event order), and what
the server cannot do is a 400 naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from pocketmoe.serve.tools import MINIMAX, parse
from pocketmoe.testing.scripted import MM_CALL, TOOLS, client_for, thinking_tokenizer
from pocketmoe.testing.synth import write_fixture
from pocketmoe.tokenizer import Tokenizer

RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
THINK = "Check the weather first.\n</think>\n\n"


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return thinking_tokenizer(tmp_path_factory.mktemp("responses"))


def items(r) -> list[tuple]:  # noqa: ANN001
    """(type, its text or call) of each output item."""
    out = []
    for it in r.output:
        if it.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in it.content)))
        elif it.type == "message":
            out.append(("message", "".join(c.text for c in it.content)))
        else:
            out.append(("function_call", it.name, json.loads(it.arguments)))
    return out


def test_reply_is_the_chat_reply_as_output_items(tok: Tokenizer) -> None:
    c, eng = client_for(tok, THINK + MM_CALL)
    r = c.responses.create(model="m", instructions="Be brief.", input="weather in Paris?", tools=RESPONSES_TOOLS)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather in Paris?"}]
    c.chat.completions.create(model="m", messages=chat, tools=TOOLS)
    assert eng.prompts[-2] == eng.prompts[-1]  # the prompt the chat request renders
    content, calls = parse(MINIMAX, MM_CALL, TOOLS)
    assert items(r) == [("reasoning", "Check the weather first."), ("message", content),
                        *[("function_call", x.name, json.loads(x.arguments)) for x in calls]]
    assert r.object == "response" and r.status == "completed" and r.output_text == content
    n_out = -(-len(THINK + MM_CALL) // 5)  # the scripted engine's tokens: five characters each
    assert r.store is False and r.instructions == "Be brief."
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        len(eng.prompts[-1]), n_out, len(eng.prompts[-1]) + n_out)
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    assert len({it.id for it in r.output}) == len(r.output) and all(it.status == "completed" for it in r.output)


def test_stream_forms_the_same_items(tok: Tokenizer) -> None:
    c, _ = client_for(tok, THINK + MM_CALL)
    whole = c.responses.create(model="m", input="weather in Paris?", tools=RESPONSES_TOOLS)
    with c.responses.stream(model="m", input="weather in Paris?", tools=RESPONSES_TOOLS) as s:
        events = list(s)
        final = s.get_final_response()
    assert items(final) == items(whole) and final.status == "completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Check the weather first."
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_earlier_output_items_render_as_the_chat_history(tok: Tokenizer) -> None:
    """A second turn that sends the first turn's output items and the tools' results back renders the prompt the
    same conversation renders through the chat route (reasoning, content and calls in one assistant turn)."""
    c, eng = client_for(tok, THINK + MM_CALL)
    first = c.responses.create(model="m", input="weather in Paris?", tools=RESPONSES_TOOLS)
    calls = [it for it in first.output if it.type == "function_call"]
    results = [{"type": "function_call_output", "call_id": it.call_id, "output": f"result {k}"}
               for k, it in enumerate(calls)]
    c.responses.create(model="m", tools=RESPONSES_TOOLS, input=[
        {"role": "user", "content": "weather in Paris?"}, *[it.model_dump(exclude_none=True) for it in first.output],
        *results])
    history = [{"role": "user", "content": "weather in Paris?"},
               {"role": "assistant", "content": first.output_text, "reasoning_content": "Check the weather first.",
                "tool_calls": [{"id": it.call_id, "type": "function",
                                "function": {"name": it.name, "arguments": it.arguments}} for it in calls]},
               *[{"role": "tool", "tool_call_id": r["call_id"], "content": r["output"]} for r in results]]
    via_responses = eng.prompts[-1]
    c.chat.completions.create(model="m", messages=history, tools=TOOLS)
    assert via_responses == eng.prompts[-1]
    assert tok.decode(via_responses).count("Check the weather first.") == 1


def test_format_effort_and_max_tokens(tok: Tokenizer) -> None:
    c, eng = client_for(tok, '{"a": 1}')
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = c.responses.create(model="m", input="x", reasoning={"effort": "none"},
                           text={"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}})
    grammar = eng.params[-1][0].grammar
    assert grammar is not None and json.loads(r.output_text) == {"a": 1}
    assert tok.decode(eng.prompts[-1]).endswith("<think>\n</think>\n\n")  # no reasoning wanted: the block closed
    c.responses.create(model="m", input="x", max_output_tokens=7, temperature=0.5, top_p=0.9)
    p = eng.params[-1][0]
    assert (p.max_tokens, p.temperature, p.top_p) == (7, 0.5, 0.9)


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input.0.content.0.type"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "x", "background": True}, "background"),
    ({"input": [{"role": "robot", "content": "x"}]}, None),
    ({}, "input"),
    ({"input": []}, "input"),
])
def test_what_it_cannot_do_is_a_400(tok: Tokenizer, body: dict, param: str | None) -> None:
    c, eng = client_for(tok, "ok")
    r = c._client.post("http://testserver/v1/responses", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"].endswith(".") and (param is None or err["param"] == param), err
    assert not eng.prompts


def test_stream_event_lines(tok: Tokenizer) -> None:
    """Each event of the stream is named (`event:` line, its type) and the stream has no [DONE]."""
    c, _ = client_for(tok, "Paris.")
    with c._client.stream("POST", "http://testserver/v1/responses", json={"input": "x", "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in data] and "[DONE]" not in "".join(lines)
    assert data[-1]["response"]["output"][0]["content"][0]["text"] == "Paris."


def test_live_server_answers_as_its_chat_route(tmp_path: Path) -> None:
    """On the real engine: greedy output_text is the chat route's content for the same message, and a reply cut at
    max_output_tokens is incomplete."""
    from pocketmoe.testing.live_server import LiveServer

    model = write_fixture("deepseek2", "tiny", "Q4_K_M", tmp_path / "m.gguf", seed=11)[0]
    with LiveServer(["--model", str(model), "--served-model-name", "tiny", "--max-model-len", "256",
                     "--threads", "1"]) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello world"}],
                                              max_tokens=8, temperature=0)
        r = client.responses.create(model="tiny", input="hello world", max_output_tokens=8, temperature=0)
        assert r.output_text == chat.choices[0].message.content
        assert (r.status, r.incomplete_details and r.incomplete_details.reason) == (
            ("incomplete", "max_output_tokens") if chat.choices[0].finish_reason == "length" else ("completed", None))
        assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
        assert httpx.get(srv.url + "/metrics").text.count('endpoint="/v1/responses"') > 0
