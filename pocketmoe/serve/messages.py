"""Anthropic's Messages API, `POST /v1/messages` (and `/v1/messages/count_tokens`), over the chat route: what
Claude Code and the Anthropic SDKs speak (ANTHROPIC_BASE_URL pointed at this server).

`system` and `messages` (text, `tool_use`, `tool_result` and `thinking` blocks) become the chat messages the model's
template renders; `tools` (client tools: name, description, input_schema), `tool_choice`, `stop_sequences`,
`thinking` (disabled closes the reasoning block; `budget_tokens` bounds it, engine/budget.py), `output_config.format`
(a JSON schema the text follows), `max_tokens` and (older clients') `temperature`, `top_p`, `top_k` become the chat request's; the chat route runs it, and its reply comes back as a message of `thinking`, `text` and `tool_use` content
blocks with Anthropic's stop_reason and usage, whole or as Anthropic's stream of events (message_start,
content_block_start / _delta / _stop, message_delta, message_stop). Errors are Anthropic's body
(`{"type": "error", "error": {"type", "message"}}`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, StrictStr, Tag

from pocketmoe.serve.protocol import (
    MAX_STOP,
    ChatCompletionRequest,
    ChatStreamReader,
    RequestError,
    _Body,
    chat_request,
)

# Anthropic's error types by HTTP status (anything else is api_error)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class TextBlock(_Body):
    type: Literal["text"]
    text: StrictStr


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: StrictStr


class RedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: Annotated[StrictStr, Field(min_length=1)]
    name: Annotated[StrictStr, Field(min_length=1)]
    input: dict[str, Any]


class OtherBlock(_Body):
    model_config = ConfigDict(strict=True, extra="allow")
    type: StrictStr


BLOCK_TYPES = ("text", "thinking", "redacted_thinking", "tool_use", "tool_result")


def _block_tag(v: Any, known: set[str] | tuple[str, ...] = BLOCK_TYPES) -> str:
    t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return t if t in known else "other"


ResultPart = Annotated[Annotated[TextBlock, Tag("text")] | Annotated[OtherBlock, Tag("other")],
                      Discriminator(lambda v: _block_tag(v, ("text",)))]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: Annotated[StrictStr, Field(min_length=1)]
    content: StrictStr | list[ResultPart] = ""
    is_error: bool = False


Block = Annotated[Annotated[TextBlock, Tag("text")] | Annotated[ThinkingBlock, Tag("thinking")]
                  | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")] | Annotated[ToolUseBlock, Tag("tool_use")]
                  | Annotated[ToolResultBlock, Tag("tool_result")] | Annotated[OtherBlock, Tag("other")],
                  Discriminator(_block_tag)]


class Message(_Body):
    role: Literal["user", "assistant"]
    content: StrictStr | list[Block]


class ToolDef(_Body):
    model_config = ConfigDict(strict=True, extra="allow")
    name: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    type: StrictStr | None = None  # "custom" (or absent): a client tool; anything else is a server tool
    description: StrictStr | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: bool = False


class Thinking(_Body):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Annotated[int, Field(ge=0)] | None = None


class OutputFormat(_Body):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    effort: StrictStr | None = None
    format: OutputFormat | None = None


class MessagesRequest(_Body):
    model: StrictStr | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    system: StrictStr | list[TextBlock] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    stop_sequences: Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None

    def check(self) -> None:
        for i, t in enumerate(self.tools or []):
            if t.type not in (None, "custom"):
                raise RequestError(f"tools[{i}] ({t.name!r}) is a server tool of type {t.type!r}; this server runs "
                                   "client tools only (name, description, input_schema).", f"tools.{i}.type")
        if self.tool_choice is not None and self.tool_choice.type == "tool" and not self.tool_choice.name:
            raise RequestError("tool_choice of type 'tool' needs the tool's name.", "tool_choice.name")

    def chat_messages(self) -> list[dict[str, Any]]:
        """The chat messages: system first; a user turn's tool_result blocks as tool messages (before its text); an
        assistant turn's thinking as reasoning_content, its tool_use blocks as tool_calls."""
        system = self.system if isinstance(self.system, str) or self.system is None \
            else "".join(b.text for b in self.system)
        out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        for i, m in enumerate(self.messages):
            blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
            text, thought, calls = [], [], []
            for j, b in enumerate(blocks):
                if isinstance(b, OtherBlock):
                    raise RequestError(f"messages[{i}].content[{j}] is of type {b.type!r}; this model reads text, "
                                       "tool_use, tool_result and thinking blocks.", f"messages.{i}.content.{j}.type")
                if isinstance(b, TextBlock):
                    text.append(b.text)
                elif isinstance(b, ThinkingBlock) and m.role == "assistant":
                    thought.append(b.thinking)
                elif isinstance(b, ToolUseBlock) and m.role == "assistant":
                    calls.append({"id": b.id, "type": "function",
                                  "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
                elif isinstance(b, ToolResultBlock) and m.role == "user":
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_text(b, i, j)})
                elif not isinstance(b, RedactedThinkingBlock):
                    raise RequestError(f"messages[{i}].content[{j}] ({b.type}) cannot be in a {m.role} turn.",
                                       f"messages.{i}.content.{j}.type")
            if m.role == "user" and (text or not out or out[-1]["role"] != "tool"):
                out.append({"role": "user", "content": "".join(text)})
            elif m.role == "assistant":
                msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
                if thought:
                    msg["reasoning_content"] = "".join(thought)
                if calls:
                    msg["tool_calls"] = calls
                out.append(msg)
        return out

    def chat_request(self, count_only: bool = False) -> ChatCompletionRequest:
        """The chat request that runs this one (validated as the chat route validates its own); count_only: for
        count_tokens, where max_tokens is not given."""
        if self.max_tokens is None and not count_only:
            raise RequestError("max_tokens is required.", "max_tokens")
        body: dict[str, Any] = {"model": self.model, "messages": self.chat_messages(), "stream": self.stream,
                                "max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                                "top_k": self.top_k, "stop": self.stop_sequences}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.input_schema}} for t in self.tools]
        c = self.tool_choice
        if c is not None:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(c.type) or \
                {"type": "function", "function": {"name": c.name}}
            body["parallel_tool_calls"] = not c.disable_parallel_tool_use
        fmt = self.output_config.format if self.output_config else None
        if fmt is not None:  # structured output: the reply's text follows the schema
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                              "schema": fmt.json_schema}}
        if self.thinking is not None and self.thinking.type == "disabled":
            body["reasoning_effort"] = "none"
        elif self.thinking is not None:  # the template's reasoning switched on (a model that thinks only when asked)
            body["chat_template_kwargs"] = {"enable_thinking": True}
            if self.thinking.budget_tokens is not None:
                body["thinking_budget_tokens"] = self.thinking.budget_tokens
        return chat_request(body)


def _result_text(b: ToolResultBlock, i: int, j: int) -> str:
    if isinstance(b.content, str):
        return b.content
    for k, part in enumerate(b.content):
        if isinstance(part, OtherBlock):
            raise RequestError(f"messages[{i}].content[{j}].content[{k}] is of type {part.type!r}; a tool result is "
                               "read as text only.", f"messages.{i}.content.{j}.content.{k}.type")
    return "".join(p.text for p in b.content)  # type: ignore[union-attr]


def _stop(finish: str | None, stop_reason: str | int | None, calls: bool) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) of a chat choice's finish."""
    if calls:
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's usage: input_tokens are those computed, the prefix cache's are cache_read_input_tokens."""
    cached = chat_usage["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": chat_usage["prompt_tokens"] - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": chat_usage["completion_tokens"]}


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"] or "{}")}


def message_body(chat: dict[str, Any], model: str) -> dict[str, Any]:
    """A chat completion (n=1) as an Anthropic message."""
    choice = chat["choices"][0]
    m = choice["message"]
    calls = m.get("tool_calls") or []
    content: list[dict[str, Any]] = []
    if m.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": m["reasoning_content"], "signature": ""})
    if m.get("content") or not calls:
        content.append({"type": "text", "text": m.get("content") or ""})
    content += [_tool_use(c) for c in calls]
    stop_reason, stop_sequence = _stop(choice["finish_reason"], choice.get("stop_reason"), bool(calls))
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": _usage(chat["usage"])}


async def message_events(chunks: AsyncIterator[dict[str, Any]], model: str, n_prompt: int
                         ) -> AsyncIterator[dict[str, Any]]:
    """The chat route's chunks (n=1, usage at the end) as Anthropic's stream: message_start, each content block
    (start, deltas, stop) as it forms, message_delta (stop_reason, usage), message_stop; an engine error is an
    `error` event."""
    start = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model, "content": [],
             "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": n_prompt, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                       "output_tokens": 0}}
    yield {"type": "message_start", "message": start}
    index, open_kind = -1, ""
    calls = False
    seen = ChatStreamReader()

    def open_block(kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        nonlocal index, open_kind
        out = close_block()
        index, open_kind = index + 1, kind
        return [*out, {"type": "content_block_start", "index": index, "content_block": block}]

    def close_block() -> list[dict[str, Any]]:
        nonlocal open_kind
        if not open_kind:
            return []
        open_kind = ""
        return [{"type": "content_block_stop", "index": index}]

    async for c in chunks:
        if "error" in c:
            for e in close_block():
                yield e
            yield {"type": "error", "error": {"type": "api_error", "message": c["error"]["message"]}}
            return
        delta = seen.read(c)
        if delta is None:
            continue
        if delta.get("reasoning_content"):
            if open_kind != "thinking":
                for e in open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                    yield e
            yield {"type": "content_block_delta", "index": index,
                   "delta": {"type": "thinking_delta", "thinking": delta["reasoning_content"]}}
        if delta.get("content"):
            if open_kind != "text":
                for e in open_block("text", {"type": "text", "text": ""}):
                    yield e
            yield {"type": "content_block_delta", "index": index,
                   "delta": {"type": "text_delta", "text": delta["content"]}}
        for call in delta.get("tool_calls") or []:
            calls = True
            block = _tool_use(call)
            for e in open_block("tool_use", {**block, "input": {}}):
                yield e
            yield {"type": "content_block_delta", "index": index,
                   "delta": {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}}
    if index < 0:  # nothing was written: an empty text block, as the whole reply gives
        for e in open_block("text", {"type": "text", "text": ""}):
            yield e
    for e in close_block():
        yield e
    reason, sequence = _stop(seen.finish, seen.stop_reason, calls)
    yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
           "usage": _usage(seen.usage) if seen.usage is not None else {"output_tokens": 0}}
    yield {"type": "message_stop"}
