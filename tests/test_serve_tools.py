"""Tool calls: the parsers of both formats, the streamed hold-back, and the chat endpoint driven by the
official `openai` client over a scripted engine whose output is forced (what a model would write).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from pocketmoe.gguf import open_bundle
from pocketmoe.serve.api import ServerState, create_app
from pocketmoe.serve.tools import (
    DEEPSEEK,
    DEEPSEEK_V31,
    KIMI,
    MINIMAX,
    ToolStream,
    call_grammar,
    parse,
    tool_format,
)
from pocketmoe.testing.scripted import MM_CALL, TOOLS, client_for
from pocketmoe.testing.synth import write_fixture
from pocketmoe.testing.vocab import (
    DEEPSEEK_V31_SHAPED_TEMPLATE,
    KIMI_SHAPED_TEMPLATE,
    MINIMAX_SHAPED_TEMPLATE,
)
from pocketmoe.tokenizer import Tokenizer

DS_CALL = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
           '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
DS31_CALL = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 3}'
             "<｜tool▁call▁end｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
KIMI_CALL = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
             '{"city": "Paris", "days": 3}<|tool_call_end|><|tool_call_begin|>functions.now:1'
             "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>")


def test_minimax_calls_parse_with_schema_types() -> None:
    content, calls = parse(MINIMAX, MM_CALL, TOOLS)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 3}),
                                                                  ("now", {})]
    assert len({c.id for c in calls}) == 2


def test_deepseek_calls_parse() -> None:
    content, calls = parse(DEEPSEEK, "ok " + DS_CALL, TOOLS)
    assert content == "ok " and json.loads(calls[0].arguments) == {"city": "Paris", "days": 3}


@pytest.mark.parametrize("text", [
    MM_CALL.replace("</minimax:tool_call>", ""),                      # cut off
    MM_CALL.replace('"days">3', '"days">three'),                      # integer that is not JSON
    MM_CALL.replace("get_weather", "launch_rockets"),                 # no such tool
    MM_CALL + " and more text",                                       # text after the calls
])
def test_malformed_minimax_calls_stay_text(text: str) -> None:
    assert parse(MINIMAX, text, TOOLS) == (text, [])


def test_malformed_deepseek_calls_stay_text() -> None:
    bad = DS_CALL.replace('"days": 3}', '"days": 3')
    assert parse(DEEPSEEK, bad, TOOLS) == (bad, [])


def test_deepseek_v31_calls_parse() -> None:
    """DeepSeek-V3.1's calls (no fence), read under either DeepSeek format: what the model wrote is read."""
    for fmt in (DEEPSEEK_V31, DEEPSEEK):
        content, calls = parse(fmt, "ok " + DS31_CALL, TOOLS)
        assert content == "ok " and [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris", "days": 3}), ("now", {})]
    assert [c.name for c in parse(DEEPSEEK_V31, DS_CALL, TOOLS)[1]] == ["get_weather"]  # R1's, under V3.1's


@pytest.mark.parametrize("text", [
    DS31_CALL.replace('"days": 3}', '"days": 3'),                     # arguments that are not JSON
    DS31_CALL.replace("now<", "launch_rockets<"),                     # a call of no such tool
    DS31_CALL.replace("<｜tool▁calls▁end｜>", ""),                    # cut off
    DS31_CALL.replace("now<｜tool▁sep｜>{}", "now{}"),                # a call without its separator
    DS31_CALL.replace("{}", "[]"),                                    # arguments that are not an object
])
def test_malformed_deepseek_v31_calls_stay_text(text: str) -> None:
    assert parse(DEEPSEEK_V31, text, TOOLS) == (text, [])


def test_deepseek_format_by_template() -> None:
    """R1's template fences the arguments after the name, V3.1's writes them after the separator; a DeepSeek file
    whose template writes no calls gets R1's (the fenced one, which its models were tuned on)."""
    r1 = ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name']"
          " + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}")
    assert tool_format(r1, "deepseek2") is DEEPSEEK
    assert tool_format(DEEPSEEK_V31_SHAPED_TEMPLATE, "deepseek2") is DEEPSEEK_V31
    assert tool_format("{{ messages }}", "deepseek2") is DEEPSEEK and tool_format("{{ messages }}", "x") is None


def test_kimi_calls_parse_with_the_ids_the_model_gave() -> None:
    content, calls = parse(KIMI, "ok " + KIMI_CALL, TOOLS)
    assert content == "ok " and [(c.id, c.name, json.loads(c.arguments)) for c in calls] == [
        ("functions.get_weather:0", "get_weather", {"city": "Paris", "days": 3}), ("functions.now:1", "now", {})]


@pytest.mark.parametrize("text", [
    KIMI_CALL.replace('"days": 3}', '"days": 3'),                          # arguments that are not JSON
    KIMI_CALL.replace("functions.now", "functions.launch_rockets"),        # a call of no such tool
    KIMI_CALL.replace("<|tool_calls_section_end|>", ""),                   # cut off
    KIMI_CALL.replace(":1<|tool_call_argument_begin|>", ":1"),             # a call without its argument marker
])
def test_malformed_kimi_calls_stay_text(text: str) -> None:
    assert parse(KIMI, text, TOOLS) == (text, [])


@pytest.mark.parametrize("template, script, fmt", [(DEEPSEEK_V31_SHAPED_TEMPLATE, DS31_CALL, DEEPSEEK_V31),
                                                   (KIMI_SHAPED_TEMPLATE, KIMI_CALL, KIMI)])
def test_calls_round_trip_through_their_template(model: Path, template: str, script: str, fmt) -> None:  # noqa: ANN001
    """DeepSeek-V3.1's and Kimi-K2's calls come back as tool_calls (Kimi's with the ids the model gave), and what
    their templates write back into the history reads as the same calls."""
    tok2 = Tokenizer.from_metadata(open_bundle(model).metadata)
    tok2.chat_template = template
    assert tool_format(template, "deepseek2") is fmt
    c, eng = client_for(tok2, "ok " + script, arch="deepseek2")
    r = c.chat.completions.create(model="m", messages=MSGS, tools=TOOLS, max_tokens=80)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "ok "
    got = [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls]
    assert got == [("get_weather", {"city": "Paris", "days": 3}), ("now", {})]
    ids = [t.id for t in msg.tool_calls]
    assert (ids == ["functions.get_weather:0", "functions.now:1"]) == (fmt is KIMI)
    history = MSGS + [{"role": "assistant", "content": msg.content, "tool_calls": [t.model_dump() for t in
                                                                                 msg.tool_calls]},
                      {"role": "tool", "tool_call_id": ids[0], "content": "sunny"}]
    c.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=5)
    rendered = tok2.decode(eng.prompts[-1])
    start, end = rendered.index(fmt.start), rendered.index(fmt.end) + len(fmt.end)
    content, again = parse(fmt, rendered[start:end], TOOLS)
    assert content == "" and [(t.name, json.loads(t.arguments)) for t in again] == got
    if fmt is KIMI:
        assert [t.id for t in again] == ids


@pytest.mark.parametrize("fmt,text", [(MINIMAX, MM_CALL), (DEEPSEEK, "ok " + DS_CALL),
                                      (DEEPSEEK_V31, "ok " + DS31_CALL), (KIMI, "ok " + KIMI_CALL),
                                      (MINIMAX, "no calls, but <minimax:tool a near miss")])
def test_stream_holds_back_the_calls_at_any_split(fmt, text: str) -> None:  # noqa: ANN001
    want_content, want_calls = parse(fmt, text, TOOLS)
    for step in (1, 3, 7):
        ts = ToolStream(fmt, TOOLS)
        sent = "".join(ts.push(text[i:i + step]) for i in range(0, len(text), step))
        rest, calls = ts.finish()
        assert sent + rest == want_content
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want_calls]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_fixture("minimax-m2", "tiny", "Q4_K_M", tmp_path_factory.mktemp("tools") / "m.gguf")[0]


@pytest.fixture(scope="module")
def tok(model: Path) -> Tokenizer:
    return Tokenizer.from_metadata(open_bundle(model).metadata)


MSGS = [{"role": "user", "content": "weather in Paris?"}]


def test_chat_returns_tool_calls(tok: Tokenizer) -> None:
    c, _ = client_for(tok, MM_CALL)
    r = c.chat.completions.create(model="m", messages=MSGS, tools=TOOLS, max_tokens=50)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Let me check."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in ch.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 3}), ("now", {})]


def test_chat_stream_returns_tool_calls(tok: Tokenizer) -> None:
    c, _ = client_for(tok, MM_CALL)
    content, calls, finish = "", {}, None
    for chunk in c.chat.completions.create(model="m", messages=MSGS, tools=TOOLS, max_tokens=50, stream=True):
        d = chunk.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            calls.setdefault(t.index, ["", ""])
            calls[t.index][0] += t.function.name or ""
            calls[t.index][1] += t.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me check." and finish == "tool_calls"
    assert [(n, json.loads(a)) for n, a in calls.values()] == [("get_weather", {"city": "Paris", "days": 3}),
                                                              ("now", {})]


def test_malformed_call_and_tool_choice_none_come_back_as_text(tok: Tokenizer) -> None:
    bad = MM_CALL.replace("</minimax:tool_call>", "")
    c, _ = client_for(tok, bad)
    r = c.chat.completions.create(model="m", messages=MSGS, tools=TOOLS, max_tokens=50)
    assert r.choices[0].message.content == bad and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    c, _ = client_for(tok, MM_CALL)
    r = c.chat.completions.create(model="m", messages=MSGS, tools=TOOLS, tool_choice="none", max_tokens=50)
    assert r.choices[0].message.content == MM_CALL and not r.choices[0].message.tool_calls
    for kw, needle in [(dict(tool_choice="required"), "no tools"),
                       (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}}), "'fly'"),
                       (dict(tools=TOOLS, tool_choice="sometimes"), "not one of"),
                       (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "one of")]:
        with pytest.raises(openai.BadRequestError, match=needle):
            c.chat.completions.create(model="m", messages=MSGS, max_tokens=50, **kw)
    c, eng = client_for(tok, MM_CALL)
    r = c.chat.completions.create(model="m", messages=MSGS, tools=TOOLS, tool_choice="required", max_tokens=50)
    assert r.choices[0].finish_reason == "tool_calls" and eng.params[-1][0].grammar.kind == "lark"


def test_deepseek_format_by_architecture(tok: Tokenizer) -> None:
    c, _ = client_for(tok, DS_CALL, arch="deepseek2")
    r = c.chat.completions.create(model="m", messages=MSGS, tools=TOOLS, max_tokens=50)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls[0].function.name == \
        "get_weather"


def test_template_sees_the_tools(model: Path) -> None:
    """The chat template's `tools` variable is the request's tools (and the history's tool messages pass through)."""
    tok2 = Tokenizer.from_metadata(open_bundle(model).metadata)
    tok2.chat_template = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
                          "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if m.tool_call_id is defined %}"
                          "#{{ m.tool_call_id }}{% endif %}{% endfor %}")
    c, eng = client_for(tok2, "fine")
    history = MSGS + [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                      "function": {"name": "now", "arguments": "{}"}}]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    c.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=5)
    text = tok2.decode(eng.prompts[-1])
    assert "[tool get_weather][tool now]" in text and "<tool>12:00#call_1" in text


FORCED_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                         "units": {"enum": ["C", "F"]}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                    "additionalProperties": False}}},
]


@pytest.fixture(scope="module", params=["deepseek2", "minimax-m2", "deepseek2 v3.1", "deepseek2 kimi"])
def arch_llm(request, tmp_path_factory):  # noqa: ANN001, ANN201
    from pocketmoe.engine.llm import LLM

    arch = request.param.split()[0]
    path = write_fixture(arch, "tiny", "Q8_0", tmp_path_factory.mktemp("tc") / "m.gguf", seed=3)[0]
    llm = LLM(path, n_ctx=512, threads=1, enable_prefix_caching=False)
    if request.param.endswith("v3.1"):
        llm.tokenizer.chat_template = DEEPSEEK_V31_SHAPED_TEMPLATE
    elif request.param.endswith("kimi"):
        llm.tokenizer.chat_template = KIMI_SHAPED_TEMPLATE
    return arch, llm


@pytest.mark.parametrize("only,parallel", [(None, True), (None, False), ("get_weather", True)])
def test_forced_tool_calls_parse_and_follow_their_schemas(arch_llm, only: str | None, parallel: bool) -> None:  # noqa: ANN001
    """tool_choice 'required' / named: whatever a (random) model draws under call_grammar, the format's own
    parser reads calls of the allowed tools, their arguments valid for the tool's schema (jsonschema)."""
    import jsonschema

    from pocketmoe.engine.sampler import SamplingParams

    arch, llm = arch_llm
    fmt = tool_format(llm.tokenizer.chat_template, arch)
    grammar = call_grammar(fmt, FORCED_TOOLS, llm.tokenizer, only, parallel)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in FORCED_TOOLS}
    for seed in range(4):
        out = llm.generate(["call a tool:"], SamplingParams(temperature=1.0, seed=seed, max_tokens=400,
                                                            grammar=grammar))[0]
        text = out.text
        if out.finish_reason == "length":  # only where calls may go on (a random model need not stop calling):
            assert parallel and only is None, text  # the calls made so far, closed, must stand
            end = {MINIMAX: "</invoke>\n", KIMI: "<|tool_call_end|>"}.get(fmt, "<｜tool▁call▁end｜>")
            text = text[:text.rindex(end) + len(end)] + fmt.end
        content, calls = parse(fmt, text, FORCED_TOOLS)
        assert content == "" and calls, out.text
        assert len(calls) == 1 or (parallel and only is None)
        for c in calls:
            assert c.name == only or (only is None and c.name in schemas)
            jsonschema.validate(json.loads(c.arguments), schemas[c.name])


def test_call_grammar_uses_a_marker_token_where_the_vocabulary_has_it() -> None:

    tok = Tokenizer.from_metadata(open_bundle(write_fixture("minimax-m2", "tiny", "Q8_0", Path(
        __import__("tempfile").mkdtemp()) / "m.gguf", seed=1)[0]).metadata)
    whole = [t for t in ("<minimax:tool_call>", "</minimax:tool_call>") if t in tok.tokens]
    source = call_grammar(MINIMAX, FORCED_TOOLS, tok).source
    for t in whole:
        assert f"<[{tok.tokens.index(t)}]>" in source
    for t in {"<minimax:tool_call>", "</minimax:tool_call>"} - set(whole):
        assert json.dumps(t) in source


def reference_split(text: str, forced_open: bool) -> tuple[str | None, str]:
    """The <think> block of an output, read whole: from the start (or, not forced, from a leading <think>) to the
    first </think>, without the blanks around it; the content after it, less the blanks that follow the tag
    (llama.cpp's string_strip and consume_spaces)."""
    if not forced_open:
        if not text.lstrip().startswith("<think>"):
            return None, text
        text = text.lstrip()[len("<think>"):]
    end = text.find("</think>")
    return (text.strip(), "") if end < 0 else (text[:end].strip(), text[end + len("</think>"):].lstrip())


def test_reasoning_splits_alike_streamed_at_any_cut() -> None:
    from pocketmoe.serve.reasoning import ReasoningSplitter, split

    rng = __import__("random").Random(0)
    words = ["<think>", "</think>", "<thi", "nk>", "</", "think", ">", "\n", " ", "\t", "a", "b c", "<", "/"]
    for _ in range(600):
        text = "".join(rng.choice(words) for _ in range(rng.randint(0, 12)))
        forced = rng.random() < 0.5
        want = reference_split(text, forced)
        assert split(text, forced) == want, (text, forced)
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        s = ReasoningSplitter(forced)
        parts = [s.push(text[i:j]) for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)] + [s.finish()]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == (want[0] or "", want[1]), (text, cuts)


THINK_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                  "{% if add_generation_prompt %}<assistant><think>\n{% endif %}")


@pytest.mark.parametrize("script", ["I should greet.\n</think>\n\nHello there.",
                                    "\n\n  Two lines\nof thought.  \n\n</think>\n\n\nHello there."])
def test_reasoning_sent_back_renders_the_text_the_model_wrote(model: Path, script: str) -> None:
    """A client that sends the reply back as it came (content and reasoning_content) gets, from a template that keeps
    history's reasoning, the prompt the model's own text continues: the next turn's prompt starts with this turn's
    prompt and the reply as written, so the prefix cache and the model see one conversation."""
    tok2 = Tokenizer.from_metadata(open_bundle(model).metadata)
    tok2.chat_template = MINIMAX_SHAPED_TEMPLATE
    c, eng = client_for(tok2, script)
    m = c.chat.completions.create(model="m", messages=MSGS, max_tokens=60).choices[0].message
    first = tok2.decode(eng.prompts[-1])
    reply = {"role": "assistant", "content": m.content, "reasoning_content": m.model_extra["reasoning_content"]}
    c.chat.completions.create(model="m", messages=[*MSGS, reply, {"role": "user", "content": "and Rome?"}],
                              max_tokens=60)
    canonical = "I should greet." if script.startswith("I") else "Two lines\nof thought."
    assert tok2.decode(eng.prompts[-1]).startswith(first + canonical + "\n</think>\n\nHello there.[e~[\n")
    if script.startswith("I"):  # written the template's way: the text itself, byte for byte
        assert tok2.decode(eng.prompts[-1]).startswith(first + script)


def test_reasoning_asked_for_reaches_a_template_that_thinks_only_when_asked(model: Path) -> None:
    """DeepSeek-V3.1's template reads `thinking` (default off): a reasoning_effort, enable_thinking, or the Messages
    API's thinking turns it on, as llama.cpp passes enable_thinking to it; "none" or disabled leave it off."""
    tok2 = Tokenizer.from_metadata(open_bundle(model).metadata)
    tok2.chat_template = DEEPSEEK_V31_SHAPED_TEMPLATE
    c, eng = client_for(tok2, "Paris.", arch="deepseek2")
    http = TestClient(create_app(ServerState(model_name="m", max_model_len=4096, engine=eng,  # type: ignore[arg-type]
                                             tokenizer=tok2)))

    def opened(**extra: Any) -> bool:
        c.chat.completions.create(model="m", messages=MSGS, max_tokens=5, extra_body=extra)
        return tok2.decode(eng.prompts[-1]).endswith("<think>")

    assert not opened() and not opened(reasoning_effort="none")
    assert opened(reasoning_effort="low") and opened(chat_template_kwargs={"enable_thinking": True})
    assert opened(chat_template_kwargs={"thinking": True})
    assert not opened(reasoning_effort="high", chat_template_kwargs={"thinking": False})
    for thinking, want in ((None, False), ({"type": "enabled", "budget_tokens": 2048}, True),
                           ({"type": "disabled"}, False)):
        body = {"model": "m", "max_tokens": 5, "messages": MSGS} | ({"thinking": thinking} if thinking else {})
        assert http.post("/v1/messages", json=body).status_code == 200
        assert tok2.decode(eng.prompts[-1]).endswith("<think>") == want, thinking


@pytest.mark.parametrize("forced", [False, True])
def test_chat_sends_the_think_block_as_reasoning(model: Path, forced: bool) -> None:
    """A thinking model's block comes back as reasoning_content / reasoning, whole and streamed; tool calls are read
    in what follows; --reasoning-format none leaves it all content; enable_thinking false (or reasoning_effort
    "none") closes the block."""
    tok2 = Tokenizer.from_metadata(open_bundle(model).metadata)
    if forced:  # the template opens the block (MiniMax-M2's way): the output starts inside it
        tok2.chat_template = THINK_TEMPLATE
    script = ("" if forced else "<think>") + "\nCheck the weather first.\n</think>\n\n" + MM_CALL
    c, eng = client_for(tok2, script)
    r = c.chat.completions.create(model="m", messages=MSGS, tools=TOOLS, max_tokens=50).choices[0]
    thought = "Check the weather first."  # without the blanks around it, as llama.cpp reads a block
    assert r.message.model_extra["reasoning_content"] == r.message.model_extra["reasoning"] == thought
    assert r.message.content == "Let me check." and r.finish_reason == "tool_calls"
    assert [t.function.name for t in r.message.tool_calls] == ["get_weather", "now"]
    chunks = list(c.chat.completions.create(model="m", messages=MSGS, tools=TOOLS, max_tokens=50, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == "Let me check."
    c, _ = client_for(tok2, script, reasoning_format="none")
    r = c.chat.completions.create(model="m", messages=MSGS, max_tokens=50).choices[0]
    assert r.message.content == script and "reasoning_content" not in (r.message.model_extra or {})
    if forced:
        c, eng = client_for(tok2, "Paris.")
        r = c.chat.completions.create(model="m", messages=MSGS, max_tokens=5,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0]
        assert tok2.decode(eng.prompts[-1]).endswith("<think>\n</think>\n\n") and r.message.content == "Paris."
        c.chat.completions.create(model="m", messages=MSGS, max_tokens=5, extra_body={"reasoning_effort": "none"})
        assert eng.prompts[-1] == eng.prompts[-2]  # OpenAI's reasoning_effort "none": the same closed block
        with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
            c.chat.completions.create(model="m", messages=MSGS, max_tokens=5, extra_body={
                "reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}})
        http = TestClient(create_app(ServerState(model_name="m", max_model_len=4096, engine=eng,  # type: ignore[arg-type]
                                                 tokenizer=tok2)))
        body = {"messages": MSGS, "chat_template_kwargs": {"enable_thinking": False}}
        assert http.post("/tokenize", json=body).json()["tokens"] == eng.prompts[-1]  # the count the chat route uses
        c, eng = client_for(tok2, '{"a": 1}')  # a grammar decides the output: no block is left open for it
        c.chat.completions.create(model="m", messages=MSGS, max_tokens=5, response_format={"type": "json_object"})
        assert tok2.decode(eng.prompts[-1]).endswith("</think>\n\n")
