"""OpenAI's Responses API (POST /v1/responses), driven by the official `openai` client: its request becomes the
chat request a test writes by hand (the same prompt reaches the engine), its reply the output items the chat
route's reply holds, whole and streamed (the client's own stream accumulator checks the event order); a stored
reply is read back, listed and continued (previous_response_id renders the prompt the whole conversation renders);
the output text's logprobs are its own tokens'; and what the server cannot do is a 400 naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from pocketmoe.serve.responses import LOGPROBS, ResponseStore
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
    assert r.store is True and r.instructions == "Be brief."
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


def test_previous_response_id_continues_the_stored_conversation(tok: Tokenizer) -> None:
    """Turns that name the previous response and send only what is new render the prompt the whole conversation
    renders when it is sent in input; the earlier turn's instructions are not carried over (OpenAI's rule), and a
    chain of three walks back to the first."""
    c, eng = client_for(tok, THINK + MM_CALL)
    first = c.responses.create(model="m", instructions="Be brief.", input="weather in Paris?", tools=RESPONSES_TOOLS)
    results = [{"type": "function_call_output", "call_id": it.call_id, "output": f"result {k}"}
               for k, it in enumerate(it for it in first.output if it.type == "function_call")]
    second = c.responses.create(model="m", instructions="Be kind.", previous_response_id=first.id, input=results,
                                tools=RESPONSES_TOOLS)
    chained = eng.prompts[-1]
    history = [{"role": "user", "content": "weather in Paris?"},
               *[it.model_dump(exclude_none=True) for it in first.output], *results]
    c.responses.create(model="m", instructions="Be kind.", input=history, tools=RESPONSES_TOOLS, store=False)
    assert chained == eng.prompts[-1] and "Be brief." not in tok.decode(chained)
    assert second.previous_response_id == first.id and second.store is True

    c.responses.create(model="m", previous_response_id=second.id, input="and Rome?", tools=RESPONSES_TOOLS)
    chained = eng.prompts[-1]
    history += [*[it.model_dump(exclude_none=True) for it in second.output], {"role": "user", "content": "and Rome?"}]
    c.responses.create(model="m", input=history, tools=RESPONSES_TOOLS, store=False)
    assert chained == eng.prompts[-1]


def test_input_tokens_counts_the_prompt_the_route_runs(tok: Tokenizer) -> None:
    """POST /v1/responses/input_tokens (the SDK's responses.input_tokens.count): the prompt tokens the same request
    runs with, a stored conversation it continues included."""
    c, eng = client_for(tok, THINK + MM_CALL)
    first = c.responses.create(model="m", instructions="Be brief.", input="weather in Paris?", tools=RESPONSES_TOOLS)
    assert c.responses.input_tokens.count(model="m", instructions="Be brief.", input="weather in Paris?",
                                          tools=RESPONSES_TOOLS).input_tokens == len(eng.prompts[-1])
    ask = {"model": "m", "previous_response_id": first.id, "input": "and Rome?", "tools": RESPONSES_TOOLS}
    counted = c.responses.input_tokens.count(**ask)
    c.responses.create(**ask)
    assert (counted.object, counted.input_tokens) == ("response.input_tokens", len(eng.prompts[-1]))


def test_stored_response_is_read_listed_and_deleted(tok: Tokenizer) -> None:
    c, _ = client_for(tok, "Paris.")
    sent = [{"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "input_text", "text": "capital of France?"}]}]
    r = c.responses.create(model="m", input=sent, metadata={"k": "v"})
    assert c.responses.retrieve(r.id).model_dump() == r.model_dump()

    def listed(**query: object) -> dict:
        got = c._client.get(f"http://testserver/v1/responses/{r.id}/input_items", params=query)
        assert got.status_code == 200, got.text
        return got.json()

    every = listed(order="asc")
    assert [(x["role"], x["content"]) for x in every["data"]] == [
        ("developer", [{"type": "input_text", "text": "Be brief."}]),
        ("user", [{"type": "input_text", "text": "capital of France?"}])]
    ids = [x["id"] for x in every["data"]]
    assert len(set(ids)) == 2 and (every["first_id"], every["last_id"], every["has_more"]) == (*ids, False)
    newest = listed(limit=1)  # desc by default
    assert [x["id"] for x in newest["data"]] == ids[1:] and newest["has_more"]
    assert [x["id"] for x in listed(limit=1, after=ids[1])["data"]] == ids[:1]
    assert [x.id for x in c.responses.input_items.list(r.id, order="asc")] == ids  # the SDK's pager reads it too
    for query, param in (({"limit": 0}, "limit"), ({"limit": "many"}, "limit"), ({"order": "up"}, "order"),
                         ({"after": "msg_x"}, "after")):
        bad = c._client.get(f"http://testserver/v1/responses/{r.id}/input_items", params=query)
        assert (bad.status_code, bad.json()["error"]["param"]) == (400, param)

    metrics = c._client.get("http://testserver/metrics").text
    assert "pocketmoe_responses_stored 1.0" in metrics and "pocketmoe_responses_store_bytes 0.0" not in metrics
    c.responses.delete(r.id)
    assert "pocketmoe_responses_store_bytes 0.0" in c._client.get("http://testserver/metrics").text
    for call in (lambda: c.responses.retrieve(r.id), lambda: c.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError, match="no stored response"):
            call()
    forgotten = c.responses.create(model="m", input="x", store=False)
    assert forgotten.store is False
    with pytest.raises(openai.BadRequestError, match="not stored here") as e:
        c.responses.create(model="m", input="y", previous_response_id=forgotten.id)
    assert e.value.code == "previous_response_not_found"


def test_store_keeps_the_most_recently_used_within_its_bytes() -> None:
    def made(k: int) -> dict:
        return {"id": f"resp_{k}", "output": [{"type": "message", "role": "assistant", "content": f"turn {k}"}]}

    size = len(json.dumps(made(0))) + len(json.dumps([]))
    store = ResponseStore(size * 5 // 2)  # room for two
    assert store.put(made(0), [], None) and store.put(made(1), [], "resp_0")
    store.get("resp_0")  # read: now the most recently used
    assert store.put(made(2), [], "resp_1")
    assert len(store) == 2 and store.size == 2 * size and store.get("resp_2") and store.get("resp_0")
    with pytest.raises(Exception, match="'resp_1', which the response 'resp_2' continues, is not stored"):
        store.conversation("resp_2")
    assert not store.put({**made(3), "pad": "x" * 3 * size}, [], None) and len(store) == 2  # alone too large
    store.put(made(4), [], "resp_0")  # resp_2 was the least recently used
    with pytest.raises(Exception, match="no stored response 'resp_2'"):
        store.get("resp_2")
    assert [x.content for x in store.conversation("resp_4")] == ["turn 0", "turn 4"]


def test_a_server_that_keeps_none_says_so(tok: Tokenizer) -> None:
    from fastapi.testclient import TestClient

    from pocketmoe.serve.__main__ import parse_args
    from pocketmoe.serve.api import ServerState, create_app
    from pocketmoe.testing.scripted import ScriptedEngine

    assert parse_args(["--responses-store-mib", "0"]).responses_store_mib == 0
    with pytest.raises(SystemExit):
        parse_args(["--responses-store-mib", "-1"])
    state = ServerState(model_name="m", max_model_len=4096, engine=ScriptedEngine(tok, "minimax-m2", "ok"),  # type: ignore[arg-type]
                        tokenizer=tok, responses=ResponseStore(0))
    http = TestClient(create_app(state), base_url="http://testserver")
    r = http.post("/v1/responses", json={"input": "x"}).json()
    assert r["store"] is False and http.get(f"/v1/responses/{r['id']}").status_code == 404


def test_truncation_auto_drops_the_oldest_turns_that_do_not_fit(tok: Tokenizer) -> None:
    """truncation "auto" cuts the conversation at the latest user message it must, no later: the prompt is the one
    the kept turns render (through /tokenize here), the earliest cut whose prompt leaves room for
    max_output_tokens; "disabled" (the default) and a last turn too long even alone are a 400."""
    from fastapi.testclient import TestClient

    from pocketmoe.serve.api import ServerState, create_app
    from pocketmoe.testing.scripted import ScriptedEngine

    max_len = 400
    eng = ScriptedEngine(tok, "minimax-m2", "ok")
    http = TestClient(create_app(ServerState(model_name="m", max_model_len=max_len, engine=eng,  # type: ignore[arg-type]
                                             tokenizer=tok)), base_url="http://testserver")
    turns = [{"role": role, "content": f"{role} turn {k}: " + "many words " * 6}
             for k in range(5) for role in ("user", "assistant")]
    turns.append({"role": "user", "content": "the last question"})

    def rendered(messages: list[dict]) -> list[int]:
        return http.post("/tokenize", json={"messages": messages}).json()["tokens"]

    assert len(rendered(turns)) + 16 > max_len  # too long whole
    cut = next(i for i in range(0, len(turns), 2) if len(rendered(turns[i:])) + 16 <= max_len)
    assert 0 < cut < len(turns) - 1
    r = http.post("/v1/responses", json={"input": turns, "truncation": "auto", "max_output_tokens": 16})
    assert r.status_code == 200, r.text
    assert eng.prompts[-1] == rendered(turns[cut:]) and r.json()["truncation"] == "auto"
    r = http.post("/v1/responses", json={"input": turns, "max_output_tokens": 16})
    assert (r.status_code, r.json()["error"]["code"]) == (400, "context_length_exceeded")
    r = http.post("/v1/responses", json={"input": [*turns[:-1], {"role": "user", "content": "word " * 500}],
                                         "truncation": "auto"})
    assert (r.status_code, r.json()["error"]["code"]) == (400, "context_length_exceeded")


def test_output_text_logprobs_are_its_own_tokens(tok: Tokenizer) -> None:
    """With include message.output_text.logprobs, the message's text carries the logprobs of the tokens that wrote
    it: not those of the reasoning block, its end tag or the tool call; the stream's text deltas carry the same."""
    script = THINK + MM_CALL
    c, eng = client_for(tok, script)
    ask = {"model": "m", "input": "weather in Paris?", "tools": RESPONSES_TOOLS, "include": [LOGPROBS],
           "top_logprobs": 2}
    r = c.responses.create(**ask)
    assert eng.params[-1][0].logprobs == 2 and r.top_logprobs == 2
    lps = next(it for it in r.output if it.type == "message").content[0].logprobs
    ks = [round(-x.logprob * 8) for x in lps]  # the scripted token k's logprob is -k / 8
    text_at = script.index("Let me check.")  # the message's text, between the reasoning block and the tool call
    text_end = text_at + len("Let me check.")
    assert ks == [k for k in range(-(-len(script) // 5)) if 5 * k < text_end and 5 * k + 5 > text_at]
    for k, x in zip(ks, lps, strict=True):
        assert [(t.logprob, t.token) for t in x.top_logprobs] == [
            (-k / 8 - j, tok.token_to_piece(k + 1 + j).decode("utf-8", "replace")) for j in range(2)]
        assert x.token == tok.token_to_piece(k + 1).decode("utf-8", "replace") and x.bytes == list(
            tok.token_to_piece(k + 1))
    with c.responses.stream(**ask) as s:
        deltas = [(x.token, x.logprob) for e in s if e.type == "response.output_text.delta" for x in e.logprobs]
        final = s.get_final_response()
    assert deltas == [(x.token, x.logprob) for x in lps]
    assert next(it for it in final.output if it.type == "message").content[0].logprobs == lps

    r = c.responses.create(model="m", input="x", top_logprobs=2)  # top_logprobs alone asks for none
    assert eng.params[-1][0].logprobs is None and r.output[-1].content[0].logprobs == []


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
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),  # never stored
    ({"input": "x", "conversation": "conv_1", "previous_response_id": "resp_1"}, "conversation"),
    ({"input": "x", "conversation": {"name": "conv_1"}}, "conversation.id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "x", "tools": [1.5, []]}, None),  # not objects (once a 500)
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input.0.content.0.type"),
    ({"input": "x", "include": [LOGPROBS], "top_logprobs": 21}, "top_logprobs"),
    ({"input": "x", "background": True, "store": False}, "background"),
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
    """On the real engine: greedy output_text and its logprobs are the chat route's content and logprobs for the same
    message, a reply cut at max_output_tokens is incomplete, and a turn continuing it by previous_response_id
    answers as the chat route does given the whole conversation."""
    from pocketmoe.testing.live_server import LiveServer

    model = write_fixture("deepseek2", "tiny", "Q4_K_M", tmp_path / "m.gguf", seed=11)[0]
    with LiveServer(["--model", str(model), "--served-model-name", "tiny", "--max-model-len", "256",
                     "--threads", "1"]) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        greedy = {"max_tokens": 8, "temperature": 0}
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello world"}],
                                              logprobs=True, top_logprobs=2, **greedy)
        r = client.responses.create(model="tiny", input="hello world", max_output_tokens=8, temperature=0,
                                    include=[LOGPROBS], top_logprobs=2)
        assert r.output_text == chat.choices[0].message.content
        assert [(x.token, x.logprob, [(t.token, t.logprob) for t in x.top_logprobs])
                for x in r.output[-1].content[0].logprobs] == [
            (x.token, x.logprob, [(t.token, t.logprob) for t in x.top_logprobs]) for x in chat.choices[0].logprobs.content]
        assert (r.status, r.incomplete_details and r.incomplete_details.reason) == (
            ("incomplete", "max_output_tokens") if chat.choices[0].finish_reason == "length" else ("completed", None))
        assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
        then = client.responses.create(model="tiny", input="and again", previous_response_id=r.id, max_output_tokens=8,
                                       temperature=0)
        whole = client.chat.completions.create(model="tiny", messages=[
            {"role": "user", "content": "hello world"}, {"role": "assistant", "content": r.output_text},
            {"role": "user", "content": "and again"}], **greedy)
        assert then.output_text == whole.choices[0].message.content
        assert then.usage.input_tokens == whole.usage.prompt_tokens
        assert httpx.get(srv.url + "/metrics").text.count('endpoint="/v1/responses"') > 0
