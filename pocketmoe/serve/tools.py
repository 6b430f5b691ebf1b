"""Tool calls in model output, as the chat templates of these models write them, turned into OpenAI's.

Four formats:

- MiniMax-M2: `<minimax:tool_call>` blocks of `<invoke name="f"><parameter name="p">value</parameter>
  </invoke>`; a value is JSON when the tool's schema says the parameter is not a string (else text).
- DeepSeek (V2.5, R1): `<｜tool▁calls▁begin｜>` then per call `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`
  and its JSON arguments in a ```json fence, `<｜tool▁call▁end｜>`, then `<｜tool▁calls▁end｜>`.
- DeepSeek-V3.1: the same markers, a call `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>` and its JSON arguments as they
  are, then `<｜tool▁call▁end｜>` (a template that writes DeepSeek's markers with no ```json fence).
- Kimi-K2: `<|tool_calls_section_begin|>` then per call `<|tool_call_begin|>functions.NAME:INDEX
  <|tool_call_argument_begin|>` and its JSON arguments, `<|tool_call_end|>`, then `<|tool_calls_section_end|>`; the
  call's id is `functions.NAME:INDEX` as the model wrote it (its template writes the id back as the call's head).

A call that does not parse (or names no tool the request gave) leaves the text as it is: content, never
an error. With tool_choice "required" or a named function, `call_grammar` holds the output to calls in the
model's format (llguidance; engine/structured.py), each call's arguments to its tool's parameter schema.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pocketmoe.engine.sampler import partial_prefix
from pocketmoe.engine.structured import JSON_WHITESPACE, Grammar
from pocketmoe.tokenizer import Tokenizer


@dataclass(frozen=True)
class ToolFormat:
    name: str
    start: str  # the text that opens the calls; everything from it on is held until the end
    end: str  # the text that closes them; nothing may follow it


MINIMAX = ToolFormat("minimax", "<minimax:tool_call>", "</minimax:tool_call>")
DEEPSEEK = ToolFormat("deepseek", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
DEEPSEEK_V31 = ToolFormat("deepseek-v3.1", DEEPSEEK.start, DEEPSEEK.end)
KIMI = ToolFormat("kimi-k2", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")

_INVOKE = re.compile(r'<invoke name="([^"]+)">(.*?)</invoke>', re.S)
_PARAM = re.compile(r'<parameter name="([^"]+)">(.*?)</parameter>', re.S)
# one call each, its name, its JSON arguments and (Kimi's) the id the model gave it
_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>function<｜tool▁sep｜>(?P<name>[^\n]+)\n```(?:json)?\n(?P<args>.*?)\n```"
                      r"<｜tool▁call▁end｜>", re.S)
_DS31_CALL = re.compile(r"<｜tool▁call▁begin｜>(?P<name>[^\n<]+?)<｜tool▁sep｜>(?P<args>.*?)<｜tool▁call▁end｜>", re.S)
_KIMI_CALL = re.compile(r"<\|tool_call_begin\|>\s*(?P<id>(?:functions\.)?(?P<name>[^\s:<]+)(?::\d+)?)\s*"
                        r"<\|tool_call_argument_begin\|>(?P<args>.*?)<\|tool_call_end\|>", re.S)
# a format whose arguments are JSON: the text that opens each call, and the forms its calls are read in, the first
# that reads them all (a DeepSeek model's calls in either DeepSeek form: what it wrote is read, whichever form its
# template showed)
_JSON_CALLS = {DEEPSEEK: ("<｜tool▁call▁begin｜>", (_DS_CALL, _DS31_CALL)),
               DEEPSEEK_V31: ("<｜tool▁call▁begin｜>", (_DS31_CALL, _DS_CALL)),
               KIMI: ("<|tool_call_begin|>", (_KIMI_CALL,))}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str

    def to_json(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def tool_format(chat_template: str, architecture: str) -> ToolFormat | None:
    """The format the template writes tool calls in (by its text, else by the architecture)."""
    if MINIMAX.start in chat_template or architecture == "minimax-m2":
        return MINIMAX
    if KIMI.start in chat_template:
        return KIMI
    if DEEPSEEK.start in chat_template:  # the fence, if any, follows the function's name after the separator
        sep = chat_template.find("<｜tool▁sep｜>")
        return DEEPSEEK if sep < 0 or "```json" in chat_template[sep:sep + 120] else DEEPSEEK_V31
    if architecture in ("deepseek2", "deepseek4"):
        return DEEPSEEK
    return None


def _param_types(tools: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    out = {}
    for t in tools:
        fn = t.get("function") or {}
        props = ((fn.get("parameters") or {}).get("properties") or {})
        out[fn.get("name", "")] = {k: (v or {}).get("type", "string") if isinstance(v, dict) else "string"
                                   for k, v in props.items()}
    return out


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse(fmt: ToolFormat, text: str, tools: list[dict[str, Any]]) -> tuple[str, list[ToolCall]]:
    """(content before the calls, calls); (text, []) when there are none or they do not parse."""
    i = text.find(fmt.start)
    if i < 0:
        return text, []
    types = _param_types(tools)
    body = text[i + len(fmt.start):]
    end = body.find(fmt.end)
    if end < 0 or body[end + len(fmt.end):].strip():
        return text, []
    calls: list[ToolCall] = []
    if fmt is MINIMAX:
        for name, inner in _INVOKE.findall(body[:end]):
            if name not in types:
                return text, []
            args: dict[str, Any] = {}
            for pname, raw in _PARAM.findall(inner):
                value = raw.strip("\n")
                if types[name].get(pname, "string") != "string":
                    try:
                        value = json.loads(value)
                    except json.JSONDecodeError:
                        return text, []
                args[pname] = value
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False), _new_id()))
    else:
        begin, forms = _JSON_CALLS[fmt]
        calls = next((c for c in (_json_calls(rx, begin, body[:end], types) for rx in forms) if c), [])
    return (text[:i], calls) if calls else (text, [])


def _json_calls(rx: re.Pattern[str], begin: str, text: str, types: dict[str, dict[str, str]]) -> list[ToolCall]:
    """The calls of `text` (between the outer markers of a format whose arguments are JSON, each opened by `begin`)
    in the form `rx` reads; [] unless every call reads, names a tool and has an object of arguments."""
    found = list(rx.finditer(text))
    if len(found) != text.count(begin):
        return []
    calls = []
    for m in found:
        try:
            args = json.loads(m["args"])
        except json.JSONDecodeError:
            return []
        name = m["name"].strip()
        if name not in types or not isinstance(args, dict):
            return []
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False), m.groupdict().get("id") or _new_id()))
    return calls


class ToolStream:
    """Streamed content with tool calls held back: `push(text)` gives the text safe to send now (a possible
    start of the calls is held); `finish()` gives (text still to send, calls) at the end of the stream."""

    def __init__(self, fmt: ToolFormat, tools: list[dict[str, Any]]) -> None:
        self.fmt, self.tools = fmt, tools
        self._held = ""
        self._capturing = False

    def push(self, text: str) -> str:
        if self._capturing:
            self._held += text
            return ""
        buf = self._held + text
        i = buf.find(self.fmt.start)
        if i >= 0:
            self._capturing, self._held = True, buf[i:]
            return buf[:i]
        keep = partial_prefix(buf, self.fmt.start)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def finish(self) -> tuple[str, list[ToolCall]]:
        held, self._held = self._held, ""
        if not self._capturing:
            return held, []
        _, calls = parse(self.fmt, held, self.tools)
        return ("", calls) if calls else (held, [])


def _text_value(schema: dict[str, Any]) -> str:
    """A Lark expression for a MiniMax text parameter: its enum or const, its pattern, else text up to the next
    tag (at most maxLength characters)."""
    options = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(options, list) and options and all(isinstance(x, str) for x in options):
        return "(" + " | ".join(json.dumps(x, ensure_ascii=False) for x in options) + ")"
    if isinstance(schema.get("pattern"), str):  # the whole value matches it (anchors dropped)
        pattern = schema["pattern"].removeprefix("^")
        pattern = pattern[:-1] if pattern.endswith("$") and not pattern.endswith("\\$") else pattern
        return "/" + pattern.replace("/", "\\/") + "/"
    limit = schema.get("maxLength")
    return f"/[^<]{{0,{limit}}}/" if isinstance(limit, int) and limit >= 0 else "/[^<]*/"


def call_grammar(fmt: ToolFormat, tools: list[dict[str, Any]], tok: Tokenizer, only: str | None = None,
                 parallel: bool = True) -> Grammar:
    """The output is tool calls and nothing else, as the model's template writes them: one call of `only`, or
    one or more (one without `parallel`) of any of the tools. A marker that is one token of the vocabulary
    (DeepSeek's tool tokens, MiniMax's tags) must be that token."""
    fns = [t["function"] for t in tools if only is None or t["function"]["name"] == only]
    many = parallel and only is None
    types = _param_types(tools)  # a MiniMax value is written as parse reads it: as it is where "string", else JSON

    def mark(text: str) -> str:  # the token itself where the vocabulary has it whole, else its text
        ids = tok.encode(text, add_bos=False, space_prefix=False)
        return f"<[{ids[0]}]>" if len(ids) == 1 and tok.tokens[ids[0]] == text else json.dumps(text)

    def schema_rule(schema: dict[str, Any]) -> str:
        options = {"whitespace_pattern": JSON_WHITESPACE, "lenient": True}  # tools' schemas vary; enforce what is known
        return "%json " + json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)

    rules = []
    if fmt is MINIMAX:
        rules.append(f"start: {mark(fmt.start)} \"\\n\" invoke{'+' if many else ''} {mark(fmt.end)}")
        rules.append("invoke: " + " | ".join(f"f{i}" for i in range(len(fns))))
        for i, fn in enumerate(fns):
            params = fn.get("parameters") or {}
            props = params.get("properties") or {}
            required = set(params.get("required") or [])
            defs = {k: params[k] for k in ("$defs", "definitions") if k in params}  # for a property's $ref
            parts = []
            for j, (pname, pschema) in enumerate(props.items()):
                pschema = pschema if isinstance(pschema, dict) else {}
                text = types[fn["name"]][pname] == "string"
                value = f" {_text_value(pschema)} " if text else f" f{i}v{j} "
                rules.append(f"f{i}p{j}: " + json.dumps(f'<parameter name="{pname}">', ensure_ascii=False) + value
                             + json.dumps("</parameter>\n"))
                if not text:
                    rules.append(f"f{i}v{j}: {schema_rule({**defs, **pschema})}")
                parts.append(f"f{i}p{j}" if pname in required else f"f{i}p{j}?")
            rules.append(f"f{i}: " + json.dumps(f'<invoke name="{fn["name"]}">\n', ensure_ascii=False) + " "
                         + " ".join(parts) + ' "</invoke>\\n"')
    else:  # arguments as JSON: the format's frame of a call, and the text before and after each tool's arguments
        if fmt is KIMI:
            frame = f"{mark('<|tool_call_begin|>')} \"functions.\" fn"

            def around(name: str) -> tuple[str, str]:
                return (json.dumps(name + ":", ensure_ascii=False) + " /[0-9]{1,4}/ "
                        + mark("<|tool_call_argument_begin|>"), mark("<|tool_call_end|>"))
        else:
            kind = "\"function\" " + mark("<｜tool▁sep｜>") + " " if fmt is DEEPSEEK else ""
            frame = f"{mark('<｜tool▁call▁begin｜>')} {kind}fn {mark('<｜tool▁call▁end｜>')}"

            def around(name: str) -> tuple[str, str]:
                if fmt is DEEPSEEK:
                    return json.dumps(f"{name}\n```json\n", ensure_ascii=False), json.dumps("\n```")
                return json.dumps(name, ensure_ascii=False) + " " + mark("<｜tool▁sep｜>"), ""
        rules.append(f"start: {mark(fmt.start)} call{'+' if many else ''} {mark(fmt.end)}")
        rules.append(f"call: {frame}")
        rules.append("fn: " + " | ".join(f"f{i}" for i in range(len(fns))))
        for i, fn in enumerate(fns):
            before, after = around(fn["name"])
            rules.append(f"f{i}: {before} f{i}a {after}".rstrip())
            rules.append(f"f{i}a: {schema_rule(fn.get('parameters') or {'type': 'object'})}")
    return Grammar("lark", "\n".join(rules) + "\n")
