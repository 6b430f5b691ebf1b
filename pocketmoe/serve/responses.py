"""OpenAI's Responses API, `POST /v1/responses`, over the chat route.

A request's `instructions` and `input` items (messages, function calls and their outputs, reasoning) become the
chat messages the model's template renders; `tools` (function tools), `tool_choice`, `text.format` and
`reasoning.effort` become the chat request's tools, tool_choice, response_format and reasoning_effort; the
chat route runs it as it runs any chat request, and its reply (or its stream of chunks) is given back as a
response object with output items: `reasoning` (the `<think>` block), `message` (`output_text`) and
`function_call`, or as the Responses stream of events (response.created ... response.completed).

A reply that is not asked to be forgotten (`store`, true by default as on OpenAI's API) is kept in a
ResponseStore, in memory and bounded, for `previous_response_id` (the kept conversation goes before the new
input) and for `GET` / `DELETE /v1/responses/{id}` and its `input_items`; `conversation` (OpenAI's Conversations
API, serve/conversations.py) puts a kept conversation's items before the input and adds the turn to it.

The whole reply is the stream's last event's response: both come from one function, so they cannot differ.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import ConfigDict, Discriminator, Field, StrictStr, Tag, TypeAdapter

from pocketmoe.serve.persist import JsonDir
from pocketmoe.serve.protocol import (
    MAX_TOP_LOGPROBS,
    ChatCompletionRequest,
    ChatStreamReader,
    RequestError,
    _Body,
    chat_request,
)

TextKind = Literal["input_text", "output_text", "text", "reasoning_text", "summary_text"]


class TextPart(_Body):
    type: TextKind
    text: StrictStr


class RefusalPart(_Body):
    type: Literal["refusal"]
    refusal: StrictStr


class OtherPart(_Body):
    model_config = ConfigDict(strict=True, extra="allow")
    type: StrictStr


def _part_tag(v: Any) -> str:
    t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return t if t == "refusal" else ("text" if t in get_args(TextKind) else "other")


Part = Annotated[Annotated[TextPart, Tag("text")] | Annotated[RefusalPart, Tag("refusal")]
                 | Annotated[OtherPart, Tag("other")], Discriminator(_part_tag)]


def _text(content: str | list[Any], item: int, field: str = "content") -> str:
    """The text of input item `item`'s content (or output) parts."""
    if isinstance(content, str):
        return content
    out = []
    for j, p in enumerate(content):
        if isinstance(p, OtherPart):
            raise RequestError(f"input[{item}].{field}[{j}] is of type {p.type!r}; this model reads text parts only.",
                               f"input.{item}.{field}.{j}.type")
        out.append(p.text if isinstance(p, TextPart) else p.refusal)
    return "".join(out)


class MessageItem(_Body):
    type: Literal["message"] = "message"
    id: StrictStr | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: StrictStr | list[Part]


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    id: StrictStr | None = None
    call_id: Annotated[StrictStr, Field(min_length=1)]
    name: Annotated[StrictStr, Field(min_length=1)]
    arguments: StrictStr


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    id: StrictStr | None = None
    call_id: Annotated[StrictStr, Field(min_length=1)]
    output: StrictStr | list[Part]


class ReasoningItem(_Body):
    type: Literal["reasoning"]
    id: StrictStr | None = None
    summary: list[Part] = Field(default_factory=list)
    content: list[Part] | None = None


class OtherItem(_Body):
    model_config = ConfigDict(strict=True, extra="allow")
    type: StrictStr


ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
LOGPROBS = "message.output_text.logprobs"  # the `include` value that asks for the output text's logprobs


def _item_tag(v: Any) -> str:
    t = v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", None)
    return t if t in ITEM_TYPES else "other"


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")] | Annotated[OtherItem, Tag("other")],
                      Discriminator(_item_tag)]


class FunctionTool(_Body):
    type: Literal["function"]
    name: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class OtherTool(_Body):
    model_config = ConfigDict(strict=True, extra="allow")
    type: StrictStr


def _tool_tag(v: Any) -> str:  # a tool that is not an object is "other", whose validation then says so
    return "function" if (v.get("type") if isinstance(v, dict) else getattr(v, "type", None)) == "function" \
        else "other"


Tool = Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[OtherTool, Tag("other")],
                 Discriminator(_tool_tag)]


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    description: StrictStr | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ReasoningConfig(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: StrictStr | None = None


class ResponsesRequest(_Body):
    model: StrictStr | None = None
    input: StrictStr | list[InputItem]
    instructions: StrictStr | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stream: bool = False
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    include: list[StrictStr] | None = None
    store: bool | None = None
    metadata: Annotated[dict[StrictStr, StrictStr], Field(max_length=16)] | None = None
    previous_response_id: StrictStr | None = None
    conversation: Any = None
    background: bool | None = None
    user: StrictStr | None = None

    def check(self) -> None:
        if not self.input:
            raise RequestError("input is empty; give a string or at least one item.", "input")
        if self.conversation is not None and self.previous_response_id is not None:
            raise RequestError("conversation and previous_response_id both name what this input continues; give one "
                               "of them.", "conversation")
        if not isinstance(self.conversation, (str, dict, type(None))):
            raise RequestError("conversation is a conversation's id, or {\"id\": ...}.", "conversation")
        if self.background and self.store is False:
            raise RequestError("a background response is kept so that it can be polled; leave store true.",
                               "background")
        for i, t in enumerate(self.tools or []):
            if isinstance(t, OtherTool):
                raise RequestError(f"tools[{i}] is of type {t.type!r}; this server runs function tools only.",
                                   f"tools.{i}.type")
        self.messages()  # the input's items and parts, each one this server reads

    @property
    def conversation_id(self) -> str | None:
        """`conversation` (an id, or {"id": ...}) as its id."""
        c = self.conversation
        if isinstance(c, dict):
            if not isinstance(c.get("id"), str):
                raise RequestError("conversation is a conversation's id, or {\"id\": ...}.", "conversation.id")
            return c["id"]
        return c

    @property
    def logprobs(self) -> bool:
        """Whether the output text's tokens come with their logprobs (top_logprobs alone asks for none, as on
        OpenAI's API)."""
        return LOGPROBS in (self.include or [])

    def items(self) -> list[Any]:
        """The input as items (a string is one user message)."""
        return [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else list(self.input)

    def messages(self, items: Sequence[Any] | None = None) -> list[dict[str, Any]]:
        """The chat messages of instructions + items (the input's, or a conversation's the route puts together:
        a stored one's before the input, maybe cut by truncation): function calls join the assistant turn before
        them (or make one), their outputs are tool messages, and a reasoning item's text is the next assistant
        turn's reasoning_content (as the chat route gives it back). An item or part this server cannot read is a
        RequestError naming input[i] (check runs this on the input, so the route's later calls never raise)."""
        out: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        thought: str | None = None

        def assistant() -> dict[str, Any]:
            nonlocal thought
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant" or thought is not None:
                last = {"role": "assistant", "content": ""}
                out.append(last)
            if thought is not None:
                last["reasoning_content"], thought = thought, None
            return last

        for i, item in enumerate(self.items() if items is None else items):
            if isinstance(item, OtherItem):
                raise RequestError(f"input[{i}] is of type {item.type!r}; this server reads message, function_call, "
                                   "function_call_output and reasoning items.", f"input.{i}.type")
            if isinstance(item, ReasoningItem):
                thought = _text(item.content, i) if item.content else _text(item.summary, i, "summary")
            elif isinstance(item, MessageItem) and item.role == "assistant":
                msg = assistant()
                msg["content"] += _text(item.content, i)
            elif isinstance(item, MessageItem):
                out.append({"role": item.role, "content": _text(item.content, i)})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                assistant().setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output, i, "output")})
        return out

    def chat_request(self, items: Sequence[Any] | None = None) -> ChatCompletionRequest:
        """The chat request that runs this one over `items` (default: the input), validated as the chat route
        validates its own, and always streamed: the reply, whole or streamed, is made from its chunks."""
        body: dict[str, Any] = {"model": self.model, "messages": self.messages(items), "stream": True,
                                "stream_options": {"include_usage": True},
                                "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
                                "top_p": self.top_p, "parallel_tool_calls": self.parallel_tool_calls,
                                "user": self.user}
        if self.logprobs:
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                             for t in self.tools]
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
            choice = {"type": "function", "function": {"name": choice["name"]}}
        body["tool_choice"] = choice
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "response", "schema": fmt.json_schema, "strict": fmt.strict,
                "description": fmt.description}}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        if self.reasoning is not None:
            body["reasoning_effort"] = self.reasoning.effort
        return chat_request(body)

    def echo(self, model: str, stored: bool) -> dict[str, Any]:
        """The request's settings as a response object carries them (stored: whether the reply is kept)."""
        fmt = self.text.format.model_dump(exclude_none=True, by_alias=True) if self.text and self.text.format \
            else {"type": "text"}
        return {"model": model, "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p,
                "tools": [t.model_dump(exclude_none=True) for t in self.tools or []],
                "tool_choice": self.tool_choice or "auto", "parallel_tool_calls": self.parallel_tool_calls,
                "text": {"format": fmt}, "reasoning": {"effort": self.reasoning.effort if self.reasoning else None,
                                                       "summary": None},
                "top_logprobs": self.top_logprobs or 0, "previous_response_id": self.previous_response_id,
                "conversation": {"id": self.conversation_id} if self.conversation_id else None,
                "store": stored, "background": bool(self.background), "truncation": self.truncation,
                "metadata": self.metadata or {}, "user": self.user, "error": None, "incomplete_details": None}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def item_page(items: list[dict[str, Any]], limit: int, order: str, after: str | None, owner: str) -> dict[str, Any]:
    """A page of items in OpenAI's list shape (`limit` 1..100, `order` asc or desc, `after` an item id of `owner`)."""
    if not 1 <= limit <= 100:
        raise RequestError(f"limit is {limit}; give 1 to 100.", "limit")
    if order not in ("asc", "desc"):
        raise RequestError(f"order is {order!r}; give 'asc' or 'desc'.", "order")
    items = items if order == "asc" else items[::-1]
    if after is not None:
        at = next((k for k, x in enumerate(items) if x["id"] == after), None)
        if at is None:
            raise RequestError(f"after is {after!r}, which is not an item of {owner!r}.", "after")
        items = items[at + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def turn_starts(items: Sequence[Any]) -> list[int]:
    """Where truncation "auto" may cut a conversation's items: its start and each later user message, so that what
    is left starts a turn (no tool output without its call, no reply without its question)."""
    return [0, *(i for i, x in enumerate(items) if i and isinstance(x, MessageItem) and x.role == "user")]


ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_item(item: Any) -> dict[str, Any]:
    """An input item as `input_items` lists it: with an id (the client's, or a new one) and text content as parts."""
    out = item.model_dump(exclude_none=True, by_alias=True)
    out.setdefault("id", _id(ITEM_ID_PREFIX[item.type]))
    if isinstance(item, MessageItem):
        out.setdefault("status", "completed")
        if isinstance(item.content, str):
            out["content"] = [output_text(item.content) if item.role == "assistant"
                              else {"type": "input_text", "text": item.content}]
    return out


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []}


def message_item(item_id: str, text: str, status: str = "completed",
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [output_text(text, logprobs)] if status != "in_progress" else []}


def output_text(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An output_text part; logprobs: the chat route's entries of its tokens (token, logprob, bytes, top_logprobs)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _delta_logprobs(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat route's logprob entries as a text delta event carries them (no bytes)."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
            for e in entries]


def call_item(item_id: str, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if status != "in_progress" else "", "status": status}


_ITEMS: TypeAdapter[list[Any]] = TypeAdapter(list[InputItem])


@dataclass
class Stored:
    """A kept response: the response object as it was given, the request's input items (with ids) and the
    response it continued; size: the bytes of its JSON, what the store counts."""

    response: dict[str, Any]
    items: list[dict[str, Any]]
    previous: str | None
    size: int


class ResponseStore:
    """The responses kept for previous_response_id and GET / DELETE /v1/responses/{id}: in memory, at most
    `capacity` bytes of their JSON; the least recently used (made, read or continued) goes first to make room.
    With a `directory` each is also a file there (serve/persist.py), read back when the server starts again; a
    background response that was still running then is failed."""

    def __init__(self, capacity: int, directory: str | Path | None = None) -> None:
        self.capacity, self.size = capacity, 0
        self._kept: OrderedDict[str, Stored] = OrderedDict()
        self._disk = JsonDir(directory if capacity else None, "responses")  # keeping none: the files are left be
        for key, v in self._disk.load():
            response = v.get("response")
            if not isinstance(response, dict) or response.get("id") != key:
                continue
            if response.get("status") in ("queued", "in_progress"):
                response = {**response, "status": "failed", "error": {
                    "code": "server_error", "message": "the server stopped before this background response finished."}}
            if not self.put(response, v.get("items") or [], v.get("previous"), save=response is not v["response"]):
                self._disk.remove(key)

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, response: dict[str, Any], items: list[dict[str, Any]], previous: str | None,
            save: bool = True) -> bool:
        """Keep a response (False: it alone is larger than the store)."""
        size = len(json.dumps(response)) + len(json.dumps(items))
        old = self._kept.pop(response["id"], None)  # a background response kept again as it runs
        if old is not None:
            self.size -= old.size
        if size > self.capacity:
            self._disk.remove(response["id"])
            return False
        while self.size + size > self.capacity:
            gone, kept = self._kept.popitem(last=False)
            self.size -= kept.size
            self._disk.remove(gone)
        self._kept[response["id"]] = Stored(response, items, previous, size)
        self.size += size
        if save:
            self._disk.save(response["id"], {"response": response, "items": items, "previous": previous})
        return True

    def get(self, response_id: str) -> Stored:
        """A kept response, or a 404 that says why there may be none."""
        kept = self._kept.get(response_id)
        if kept is None:
            raise RequestError(f"there is no stored response {response_id!r}: it was made with store false, deleted, "
                               "or dropped when the store passed its --responses-store-mib.", status=404,
                               code="not_found")
        self._used(response_id)
        return kept

    def delete(self, response_id: str) -> None:
        self.size -= self.get(response_id).size
        del self._kept[response_id]
        self._disk.remove(response_id)

    def _used(self, response_id: str) -> None:
        self._kept.move_to_end(response_id)
        self._disk.touch(response_id)

    def conversation(self, response_id: str) -> list[Any]:
        """The input items that continue response `response_id`: from the first response of its chain on, each
        one's input items and then its output items."""
        chain, at = [], response_id
        while at is not None:
            kept = self._kept.get(at)
            if kept is None:
                via = "" if at == response_id else f", which the response {response_id!r} continues,"
                raise RequestError(f"the previous response {at!r}{via} is not stored here (made with store false, "
                                   "deleted, or dropped when the store passed its --responses-store-mib); send the "
                                   "whole conversation in input instead.", "previous_response_id",
                                   code="previous_response_not_found")
            if kept.response.get("status") in ("queued", "in_progress"):
                raise RequestError(f"the previous response {at!r} is still running in the background; wait until "
                                   "GET /v1/responses/{id} says it is completed, then continue it.",
                                   "previous_response_id", code="previous_response_not_found")
            chain.append((at, kept))
            at = kept.previous
        for at, _ in reversed(chain):
            self._used(at)
        return _ITEMS.validate_python([x for _, kept in reversed(chain) for x in (*kept.items,
                                                                                  *kept.response["output"])])

class Usage:
    """The chat route's usage as a response's: reasoning tokens are the reasoning text's tokens."""

    def __init__(self, count_tokens: Callable[[str], int]) -> None:
        self.count_tokens = count_tokens

    def __call__(self, chat_usage: dict[str, Any] | None, reasoning: str) -> dict[str, Any] | None:
        if chat_usage is None:
            return None
        out = chat_usage["completion_tokens"]
        return {"input_tokens": chat_usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": out,
                "output_tokens_details": {"reasoning_tokens": min(self.count_tokens(reasoning), out) if reasoning
                                          else 0},
                "total_tokens": chat_usage["prompt_tokens"] + out}


def _status(finish: str | None) -> tuple[str, dict[str, str] | None]:
    return ("incomplete", {"reason": "max_output_tokens"}) if finish == "length" else ("completed", None)


async def response_events(chunks: AsyncIterator[dict[str, Any]], settings: dict[str, Any], usage: Usage,
                          keep: Callable[[dict[str, Any]], object] | None = None) -> AsyncIterator[dict[str, Any]]:
    """The chat route's chunks (n=1, usage at the end) as the Responses stream: response.created and
    .in_progress, then each output item as it forms (added, its part, deltas, done), then response.completed (or
    .incomplete at max_output_tokens, .failed on an engine error). The output text's deltas carry the logprobs of
    their tokens where the chat request asked for them. keep: given the final response (not when the chunks end
    early, as when the client has gone)."""
    seq = 0
    response = {"id": _id("resp"), "object": "response", "created_at": int(time.time()), **settings,
                "status": "in_progress", "output": [], "usage": None}

    def event(kind: str, **fields: Any) -> dict[str, Any]:
        nonlocal seq
        seq += 1
        return {"type": kind, "sequence_number": seq - 1, **fields}

    output: list[dict[str, Any]] = []
    open_kind, item_id, text, thought = "", "", "", ""
    logprobs: list[dict[str, Any]] = []  # the open message's tokens'
    pending: list[dict[str, Any]] = []  # tokens whose text is held (a tool call, or text not yet sent)
    seen = ChatStreamReader()

    def open_item(kind: str, item: dict[str, Any], part: dict[str, Any] | None) -> list[dict[str, Any]]:
        nonlocal open_kind, item_id, text
        open_kind, item_id, text = kind, item["id"], ""
        logprobs.clear()
        out = [event("response.output_item.added", output_index=len(output), item=item)]
        if part is not None:
            out.append(event("response.content_part.added", item_id=item_id, output_index=len(output),
                             content_index=0, part=part))
        return out

    def close_item() -> list[dict[str, Any]]:
        nonlocal open_kind
        if not open_kind:
            return []
        at, kind, open_kind = len(output), open_kind, ""
        if kind == "reasoning":
            item = reasoning_item(item_id, text)
            part, done = item["content"][0], event("response.reasoning_text.done", item_id=item_id, output_index=at,
                                                   content_index=0, text=text)
        else:
            item = message_item(item_id, text, _status(seen.finish)[0], list(logprobs))
            part, done = item["content"][0], event("response.output_text.done", item_id=item_id, output_index=at,
                                                   content_index=0, text=text, logprobs=_delta_logprobs(logprobs))
        output.append(item)
        return [done, event("response.content_part.done", item_id=item_id, output_index=at, content_index=0,
                            part=part), event("response.output_item.done", output_index=at, item=item)]

    yield event("response.created", response=copy.deepcopy(response))
    yield event("response.in_progress", response=copy.deepcopy(response))
    async for c in chunks:
        if "error" in c:  # the engine failed this request
            for e in close_item():
                yield e
            failed = {**response, "status": "failed", "output": output,
                      "error": {"code": "server_error", "message": c["error"]["message"]}}
            if keep is not None:
                keep(failed)
            yield event("response.failed", response=failed)
            return
        delta = seen.read(c)
        if delta is None:
            continue
        if delta.get("reasoning_content"):
            if open_kind != "reasoning":
                for e in [*close_item(), *open_item("reasoning", reasoning_item(_id("rs"), "", "in_progress"),
                                                    {"type": "reasoning_text", "text": ""})]:
                    yield e
            text += delta["reasoning_content"]
            thought += delta["reasoning_content"]
            yield event("response.reasoning_text.delta", item_id=item_id, output_index=len(output), content_index=0,
                        delta=delta["reasoning_content"])
        elif "content" in delta and (delta["content"] or open_kind != "reasoning"):
            pending += seen.logprobs  # (a token that ends the block, its tag or the space after it, is neither's)
        if delta.get("content"):
            if open_kind != "message":
                for e in [*close_item(), *open_item("message", message_item(_id("msg"), "", "in_progress"),
                                                    output_text(""))]:
                    yield e
            text += delta["content"]
            logprobs.extend(pending)
            yield event("response.output_text.delta", item_id=item_id, output_index=len(output), content_index=0,
                        delta=delta["content"], logprobs=_delta_logprobs(pending))
            pending = []
        for call in delta.get("tool_calls") or []:
            pending = []  # the held text was this call
            for e in close_item():
                yield e
            item = call_item(_id("fc"), call, "in_progress")
            at, args = len(output), call["function"]["arguments"]
            yield event("response.output_item.added", output_index=at, item=item)
            yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=at, delta=args)
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=at, arguments=args,
                        name=item["name"])
            done = call_item(item["id"], call)
            output.append(done)
            yield event("response.output_item.done", output_index=at, item=done)
    if not output and not open_kind:  # nothing was written: an empty message
        for e in open_item("message", message_item(_id("msg"), "", "in_progress"), output_text("")):
            yield e
    for e in close_item():
        yield e
    status, incomplete = _status(seen.finish)
    final = {**response, "status": status, "incomplete_details": incomplete, "output": output,
             "usage": usage(seen.usage, thought)}
    if keep is not None and seen.finish is not None:
        keep(final)
    yield event("response.completed" if status == "completed" else "response.incomplete", response=final)
