"""Tool calls in model output, as the chat templates of these models write them, turned into OpenAI's.

Two formats:

- MiniMax-M2: `<minimax:tool_call>` blocks of `<invoke name="f"><parameter name="p">value</parameter>
  </invoke>`; a value is JSON when the tool's schema says the parameter is not a string (else text).
- DeepSeek: `<｜tool▁calls▁begin｜>` then per call `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`
  and its JSON arguments in a ```json fence, `<｜tool▁call▁end｜>`, then `<｜tool▁calls▁end｜>`.

A call that does not parse (or names no tool the request gave) leaves the text as it is: content, never
an error.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pocketmoe.engine.sampler import partial_prefix


@dataclass(frozen=True)
class ToolFormat:
    name: str
    start: str  # the text that opens the calls; everything from it on is held until the end


MINIMAX = ToolFormat("minimax", "<minimax:tool_call>")
DEEPSEEK = ToolFormat("deepseek", "<｜tool▁calls▁begin｜>")

_INVOKE = re.compile(r'<invoke name="([^"]+)">(.*?)</invoke>', re.S)
_PARAM = re.compile(r'<parameter name="([^"]+)">(.*?)</parameter>', re.S)
_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>function<｜tool▁sep｜>([^\n]+)\n```(?:json)?\n(.*?)\n```<｜tool▁call▁end｜>",
                      re.S)


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
    if DEEPSEEK.start in chat_template or architecture in ("deepseek2", "deepseek4"):
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
    calls: list[ToolCall] = []
    if fmt is MINIMAX:
        end = body.find("</minimax:tool_call>")
        if end < 0 or body[end + len("</minimax:tool_call>"):].strip():
            return text, []
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
        end = body.find("<｜tool▁calls▁end｜>")
        if end < 0 or body[end + len("<｜tool▁calls▁end｜>"):].strip():
            return text, []
        for name, raw in _DS_CALL.findall(body[:end]):
            try:
                args = json.loads(raw)
            except json.JSONDecodeError:
                return text, []
            if name.strip() not in types or not isinstance(args, dict):
                return text, []
            calls.append(ToolCall(name.strip(), json.dumps(args, ensure_ascii=False), _new_id()))
    return (text[:i], calls) if calls else (text, [])


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
