"""OpenAI's Conversations API, `/v1/conversations`, the stateful layer of the Responses API.

A conversation holds items (messages, function calls and their outputs, reasoning: what a Responses request's `input`
takes); `POST /v1/responses` with `conversation` (its id, or `{"id": ...}`) puts them before the request's input and,
when the reply is done, adds the input items and the reply's output items to it, so an agent sends only what is new
each turn (OpenAI's alternative to `previous_response_id`). Routes, in OpenAI's shapes: create (up to 20 items, and
metadata), retrieve, update (metadata), delete; and a conversation's items: add (up to 20), list (`limit`, `order`,
`after`), retrieve, delete.

Conversations are kept in memory, at most the server's `--responses-store-mib` of their JSON (apart from the
responses' own store); the least recently used goes first to make room, and one that is gone is a 404 that says so.
With `--responses-store-dir` they are files there too, read back when the server starts again.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, StrictStr

from pocketmoe.serve.persist import JsonDir
from pocketmoe.serve.protocol import RequestError, _Body
from pocketmoe.serve.responses import _ITEMS, InputItem, ResponsesRequest, _id, input_item, item_page

MAX_ITEMS_PER_CALL = 20  # OpenAI's: items one create or add call may carry
Metadata = Annotated[dict[StrictStr, Annotated[StrictStr, Field(max_length=512)]], Field(max_length=16)]


class ConversationCreate(_Body):
    items: Annotated[list[InputItem], Field(max_length=MAX_ITEMS_PER_CALL)] | None = None
    metadata: Metadata | None = None


class ConversationUpdate(_Body):
    metadata: Metadata


class ItemsCreate(_Body):
    items: Annotated[list[InputItem], Field(min_length=1, max_length=MAX_ITEMS_PER_CALL)]


@dataclass
class Conversation:
    id: str
    created_at: int
    metadata: dict[str, str]
    items: list[dict[str, Any]]
    size: int = 0

    def body(self) -> dict[str, Any]:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}


def _readable(items: list[Any], field: str) -> list[dict[str, Any]]:
    """The items as stored (ids given where missing); a 400 naming `field` for one a chat cannot render."""
    try:
        ResponsesRequest(input=items).messages()
    except RequestError as e:  # its words and field name the Responses request's input
        raise RequestError(e.message.replace("input", field), (e.param or "input").replace("input", field)) from None
    return [input_item(x) for x in items]


class ConversationStore:
    """Conversations by id, in memory, at most `capacity` bytes of their JSON; the least recently used goes first.
    With a `directory` each is also a file there (serve/persist.py), read back when the server starts again."""

    def __init__(self, capacity: int, directory: str | Path | None = None) -> None:
        self.capacity, self.size = capacity, 0
        self._kept: OrderedDict[str, Conversation] = OrderedDict()
        self._disk = JsonDir(directory if capacity else None, "conversations")  # keeping none: the files are left be
        for key, v in self._disk.load():
            try:
                conv = Conversation(key, int(v["created_at"]), dict(v["metadata"]), list(v["items"]))
            except (KeyError, TypeError, ValueError):
                continue
            self._kept[key] = conv
            try:
                self._resize(conv, save=False)
            except RequestError:  # larger than the store now holds: dropped (its file too)
                pass

    def __len__(self) -> int:
        return len(self._kept)

    def create(self, items: list[dict[str, Any]], metadata: dict[str, str]) -> Conversation:
        if not self.capacity:
            raise RequestError("this server keeps no conversations (--responses-store-mib 0); send the conversation "
                               "in input instead.")
        conv = Conversation(_id("conv"), int(time.time()), metadata, [])
        self._kept[conv.id] = conv
        self.add(conv.id, items)
        return conv

    def get(self, conversation_id: str) -> Conversation:
        conv = self._kept.get(conversation_id)
        if conv is None:
            raise RequestError(f"there is no conversation {conversation_id!r}: it was deleted, never made here, or "
                               "dropped when the conversations passed the server's --responses-store-mib.",
                               status=404, code="not_found")
        self._kept.move_to_end(conversation_id)
        self._disk.touch(conversation_id)
        return conv

    def delete(self, conversation_id: str) -> None:
        self.size -= self.get(conversation_id).size
        del self._kept[conversation_id]
        self._disk.remove(conversation_id)

    def add(self, conversation_id: str, items: list[dict[str, Any]]) -> None:
        """Append items, then make room (others first); a conversation larger than the whole store is a 400."""
        conv = self.get(conversation_id)
        conv.items.extend(items)
        self._resize(conv)

    def set_metadata(self, conversation_id: str, metadata: dict[str, str]) -> Conversation:
        conv = self.get(conversation_id)
        conv.metadata = metadata
        self._resize(conv)
        return conv

    def remove_item(self, conversation_id: str, item_id: str) -> Conversation:
        gone = self.item(conversation_id, item_id)
        conv = self.get(conversation_id)
        conv.items = [x for x in conv.items if x is not gone]
        self._resize(conv)
        return conv

    def item(self, conversation_id: str, item_id: str) -> dict[str, Any]:
        found = next((x for x in self.get(conversation_id).items if x["id"] == item_id), None)
        if found is None:
            raise RequestError(f"conversation {conversation_id!r} has no item {item_id!r}.", status=404,
                               code="not_found")
        return found

    def history(self, conversation_id: str) -> list[Any]:
        """The conversation's items as a Responses request's input items (what goes before its own)."""
        return _ITEMS.validate_python(self.get(conversation_id).items)

    def _resize(self, conv: Conversation, save: bool = True) -> None:
        """Count a changed conversation's bytes (and write it out), then make room: the others first."""
        size = len(json.dumps(conv.items)) + len(json.dumps(conv.metadata))
        if size > self.capacity:
            self.delete(conv.id)
            raise RequestError(f"conversation {conv.id!r} would take {size} bytes, more than the server keeps "
                               f"({self.capacity}, --responses-store-mib); it was dropped: send the conversation in "
                               "input instead.", "items")
        self.size += size - conv.size
        conv.size = size
        if save:
            self._disk.save(conv.id, {"created_at": conv.created_at, "metadata": conv.metadata, "items": conv.items})
        while self.size > self.capacity:
            oldest = next(iter(self._kept))
            self.size -= self._kept.pop(oldest).size
            self._disk.remove(oldest)


def add_routes(app: FastAPI, store: ConversationStore, parse: Any) -> None:
    """The /v1/conversations routes over `store`; parse(model, body) validates a body as the other routes do."""

    @app.post("/v1/conversations")
    async def create(request: Request) -> Response:
        req = parse(ConversationCreate, await request.body())
        items = _readable(req.items or [], "items")
        return JSONResponse(store.create(items, req.metadata or {}).body())

    @app.get("/v1/conversations/{conversation_id}")
    async def retrieve(conversation_id: str) -> Response:
        return JSONResponse(store.get(conversation_id).body())

    @app.post("/v1/conversations/{conversation_id}")
    async def update(conversation_id: str, request: Request) -> Response:
        req = parse(ConversationUpdate, await request.body())
        return JSONResponse(store.set_metadata(conversation_id, req.metadata).body())

    @app.delete("/v1/conversations/{conversation_id}")
    async def delete(conversation_id: str) -> Response:
        store.delete(conversation_id)
        return JSONResponse({"id": conversation_id, "object": "conversation.deleted", "deleted": True})

    @app.post("/v1/conversations/{conversation_id}/items")
    async def add_items(conversation_id: str, request: Request) -> Response:
        store.get(conversation_id)
        items = _readable(parse(ItemsCreate, await request.body()).items, "items")
        store.add(conversation_id, items)
        return JSONResponse(item_page(items, len(items), "asc", None, conversation_id))

    @app.get("/v1/conversations/{conversation_id}/items")
    async def list_items(conversation_id: str, limit: int = 20, order: str = "desc", after: str | None = None
                         ) -> Response:
        return JSONResponse(item_page(store.get(conversation_id).items, limit, order, after, conversation_id))

    @app.get("/v1/conversations/{conversation_id}/items/{item_id}")
    async def retrieve_item(conversation_id: str, item_id: str) -> Response:
        return JSONResponse(store.item(conversation_id, item_id))

    @app.delete("/v1/conversations/{conversation_id}/items/{item_id}")
    async def delete_item(conversation_id: str, item_id: str) -> Response:
        return JSONResponse(store.remove_item(conversation_id, item_id).body())

