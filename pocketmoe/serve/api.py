"""The OpenAI-compatible HTTP API over the engine: models, completions, chat completions, health, metrics.

Every client error is OpenAI's body `{"error": {"message", "type", "param", "code"}}` with its 4xx; an
unexpected failure inside a handler is a 500 with a one-line message and never a traceback or a
stopped engine. The body cap and the API key are checked by one ASGI middleware before routing.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from pocketmoe import __version__
from pocketmoe.defaults import DEFAULT_POOLING, DEFAULT_RESPONSES_STORE_MIB
from pocketmoe.engine.budget import ReasoningBudget
from pocketmoe.engine.prefix_store import SlotFileError, read_slot_file, write_slot_file
from pocketmoe.engine.sampler import (
    LLAMA_CHAIN,
    SamplingParams,
    SamplingParamsError,
    TokenLogprob,
    dry_breakers_of,
    logprob_entry,
)
from pocketmoe.engine.structured import Grammar, GrammarError, check_grammar
from pocketmoe.serve.background import BackgroundRuns, Detached
from pocketmoe.serve.conversations import ConversationStore
from pocketmoe.serve.conversations import add_routes as add_conversation_routes
from pocketmoe.serve.embeddings import (
    EmbeddingRequest,
    LlamaEmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    check_dimensions,
    check_lengths,
    llama_body,
    openai_body,
    rerank_body,
    score_body,
)
from pocketmoe.serve.engine import Delta, Engine, QueueFullError, SlotBusyError
from pocketmoe.serve.llama_api import DEFAULTS as LLAMA_DEFAULTS
from pocketmoe.serve.llama_api import (
    InfillRequest,
    LlamaCompletionRequest,
    SlotFileRequest,
    fim_layout,
    pick_fields,
    probabilities,
    slot_view,
    stop_fields,
)
from pocketmoe.serve.llama_api import timings as llama_timings
from pocketmoe.serve.messages import MessagesRequest, message_body, message_events
from pocketmoe.serve.messages import error_body as anthropic_error
from pocketmoe.serve.metrics import Metrics
from pocketmoe.serve.protocol import (
    EXTRA_DEFAULTS,
    ApplyTemplateRequest,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    RequestError,
    SamplingFields,
    TokenizeRequest,
    _Body,
    pydantic_error,
    template_messages,
    template_variables,
    truncate_prompt,
)
from pocketmoe.serve.reasoning import ReasoningSplitter, thinking_prompt
from pocketmoe.serve.reasoning import split as split_reasoning
from pocketmoe.serve.responses import (
    ResponsesRequest,
    ResponseStore,
    input_item,
    item_page,
    response_events,
    turn_starts,
)
from pocketmoe.serve.responses import Usage as ResponseUsage
from pocketmoe.serve.tools import ToolFormat, ToolStream, call_grammar, tool_format
from pocketmoe.serve.tools import parse as parse_tool_calls
from pocketmoe.tokenizer import ChatTemplateError, Tokenizer

log = logging.getLogger("pocketmoe.serve")
Body = TypeVar("Body", bound=_Body)  # a request body type
T = TypeVar("T")
ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/responses/input_tokens",
             "/v1/messages", "/v1/messages/count_tokens", "/completion", "/completions", "/infill", "/tokenize",
             "/detokenize", "/apply-template", "/props", "/health", "/metrics", "/chat/completions", "/models",
             "/v1/health", "/v1/embeddings", "/embedding", "/embeddings", "/score", "/v1/score", "/rerank",
             "/v1/rerank", "/v2/rerank", "/slots")
ANTHROPIC_ROUTES = "/v1/messages"
# the routes --api-key guards (/completions too), but llama-server's /v1/health
GATED = ("/v1", "/completion", "/infill", "/tokenize", "/detokenize", "/apply-template", "/props", "/chat/completions",
         "/models", "/embedding", "/score", "/rerank", "/v2", "/slots")
PUBLIC = ("/v1/health",)
MAX_COMPLETION_CHOICES = 64  # prompts x n of one /v1/completions request
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: the rest of the context)
KEEPALIVE_S = 10.0  # a stream with no event this long gets an SSE comment line (nginx's default idle timeout is 60 s)
# a chat request made ready to run: prompt ids, its choices' params, its tool-call format, whether its output starts
# inside a reasoning block (create_app's chat_prepared)
Prepared = tuple[list[int], list[SamplingParams], ToolFormat | None, bool | None]


@dataclass
class ServerState:
    """What the handlers read; `engine` is None while the model loads (every route but /metrics: 503)."""

    model_name: str
    max_model_len: int
    api_key: str | None = None
    max_body_bytes: int = 16 << 20
    metrics: Metrics = field(default_factory=Metrics)
    engine: Engine | None = None
    tokenizer: Tokenizer | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    load_error: str | None = None
    lost_rank: BaseException | None = None  # a tensor-parallel rank died (the server exits 1)
    reasoning_format: str = "auto"  # "auto": <think> blocks come back as reasoning_content; "none": as content
    reasoning_budget: int = -1  # tokens of thought before the block is closed for the model (-1: no bound)
    reasoning_budget_message: str = ""  # written before the closing tag when the budget is spent
    spm_infill: bool = False  # fill-in-the-middle prompts in suffix-prefix-middle order (--spm-infill)
    allowed_origins: tuple[str, ...] = ()  # browser origins answered with CORS headers (--allowed-origins)
    pooling: str = DEFAULT_POOLING  # what /v1/embeddings and /embedding pool (--pooling, engine/pooling.py)
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(DEFAULT_RESPONSES_STORE_MIB << 20))
    background: BackgroundRuns = field(default_factory=BackgroundRuns)  # background: true responses
    conversations: ConversationStore = field(
        default_factory=lambda: ConversationStore(DEFAULT_RESPONSES_STORE_MIB << 20))
    slots_endpoint: bool = True  # GET /slots answers (--no-slots: 501)
    slots_debug: bool = False  # /slots shows each slot's prompt and text too (--slots-debug)
    slot_save_path: Path | None = None  # POST /slots/{id}?action=save|restore's files (--slot-save-path)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # every chat's, unless it sets its own
    # request fields' defaults on every route, where a request leaves them out (llama-server's --temp, --top-k, ...)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, path: str = "") -> JSONResponse:
    """OpenAI's error body; on Anthropic's routes (path /v1/messages...), Anthropic's."""
    if path.startswith(ANTHROPIC_ROUTES):
        return JSONResponse(anthropic_error(status, message), status)
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status)


def _endpoint(path: str) -> str:
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    if path.startswith("/v1/responses/") and path not in ENDPOINTS:
        return "/v1/responses/{id}"
    if path.startswith("/v1/conversations"):
        return "/v1/conversations"
    if path.startswith("/slots/"):
        return "/slots/{id}"
    return path if path in ENDPOINTS else "other"


class GateMiddleware:
    """Before routing: the body cap (413), the API key on the API routes (GATED but PUBLIC: 401), and the request
    counter."""

    def __init__(self, app: Callable[..., Awaitable[None]], state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Awaitable[dict[str, Any]]],
                       send: Callable[..., Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def counted_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self._gate(scope, receive, counted_send)
        finally:
            self.state.metrics.requests.labels(_endpoint(scope["path"]), str(status["code"])).inc()

    async def _gate(self, scope: dict[str, Any], receive: Callable[..., Awaitable[dict[str, Any]]],
                    send: Callable[..., Awaitable[None]]) -> None:
        st = self.state
        headers = dict(scope["headers"])
        path = scope["path"]
        if st.api_key is not None and path.startswith(GATED) and path not in PUBLIC:
            auth = headers.get(b"authorization", b"").decode("latin-1")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            token = token or headers.get(b"x-api-key", b"").decode("latin-1").strip()  # Anthropic's clients
            if not hmac.compare_digest(token.encode(), st.api_key.encode()):
                what = "no API key was given" if not token else "the API key is wrong"
                await error_response(401, f"{what}; send 'Authorization: Bearer <key>' (or 'x-api-key: <key>') with "
                                          "the server's --api-key.", code="invalid_api_key",
                                     path=path)(scope, receive, send)
                return
        limit = st.max_body_bytes
        declared = headers.get(b"content-length")
        too_big = error_response(413, f"the request body is over the server's limit of {limit} bytes "
                                      "(--max-body-mib); send a smaller request.", code="body_too_large", path=path)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await too_big(scope, receive, send)
            return
        chunks, size = [], 0
        while True:  # read the whole body now, so a chunked upload is capped too
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before the body was complete
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                await too_big(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _parse(model: type[Body], body: bytes) -> Body:
    try:
        req = model.model_validate_json(body or b"null")
    except ValidationError as e:
        raise pydantic_error(e.errors()) from None
    req.check()
    return req


async def _engine_call(eng: Engine, fn: Callable[[], T]) -> T:
    """fn's result, run in the engine's thread between steps (a busy slot: 409)."""
    try:
        return await asyncio.wrap_future(eng.call(fn))
    except SlotBusyError as e:
        raise RequestError(str(e), status=409, type_="invalid_request_error", code="slot_busy") from None


def _sampling(req: SamplingFields, grammar: Grammar | None, max_tokens: int, vocab: int, n_prompt: int,
              max_model_len: int, logprobs: int | None = None, prompt_logprobs: int | None = None,
              reasoning_budget: ReasoningBudget | None = None) -> list[SamplingParams]:
    if n_prompt + max_tokens > max_model_len:
        raise RequestError(f"the prompt has {n_prompt} tokens and max_tokens is {max_tokens}, {n_prompt + max_tokens} "
                           f"in all, but this server's context holds {max_model_len} (--max-model-len); shorten "
                           "the prompt or lower max_tokens.", "max_tokens", code="context_length_exceeded")
    bias = []
    for k, v in (req.logit_bias or {}).items():
        if not k.lstrip("-").isdigit() or not 0 <= int(k) < vocab:
            raise RequestError(f"logit_bias key {k!r} is not a token id of this model (0..{vocab - 1}).", "logit_bias")
        bias.append((int(k), v))
    stop_ids = req.stop_token_ids or []
    _check_vocab(stop_ids, vocab, "stop_token_ids", "stop token id")
    rep = req.repetition_penalty if req.repetition_penalty is not None else req.repeat_penalty
    base = dict(
        temperature=1.0 if req.temperature is None else req.temperature, top_p=req.top_p or 1.0,
        top_k=max(req.top_k or 0, 0), min_p=req.min_p or 0.0, repetition_penalty=rep or 1.0,
        frequency_penalty=req.frequency_penalty or 0.0, presence_penalty=req.presence_penalty or 0.0,
        max_tokens=max_tokens, stop=req.stop_list(), ignore_eos=req.ignore_eos, logit_bias=tuple(bias), grammar=grammar,
        stop_token_ids=tuple(stop_ids), min_tokens=min(req.min_tokens, max_tokens),
        include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
        logprobs=logprobs, prompt_logprobs=prompt_logprobs, reasoning_budget=reasoning_budget, min_keep=req.min_keep)
    chain = req.llama_chain()
    if chain is not None:  # llama.cpp's other samplers: its order, as llama-server samples these routes
        base.update(req.extras(), chain=chain)
    return SamplingParams(**base, n=req.n, seed=None if req.seed is None else req.seed % 2**64).choices()


class _Choice:
    """One choice's output gathered from its deltas."""

    def __init__(self) -> None:
        self.text, self.token_ids, self.logprobs = "", [], []
        self.prompt_logprobs: list[TokenLogprob | None] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.cached_tokens = 0
        self.stop_reason: str | int | None = None
        self.slot = -1

    def add(self, d: Delta) -> None:
        self.slot = d.slot if d.slot >= 0 else self.slot
        self.text += d.text
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs
        self.prompt_logprobs += d.prompt_logprobs or []
        self.finish_reason = d.finish_reason or self.finish_reason
        self.error = d.error or self.error
        self.cached_tokens = d.cached_tokens if d.cached_tokens is not None else self.cached_tokens
        self.stop_reason = d.stop_reason if d.stop_reason is not None else self.stop_reason


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="PocketMoE", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.pm = state
    state.metrics.responses_stored.set_function(lambda: len(state.responses))
    state.metrics.responses_store_bytes.set_function(lambda: state.responses.size)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, e: RequestError) -> JSONResponse:
        return error_response(e.status, e.message, e.type, e.param, e.code, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _query_error(request: Request, e: RequestValidationError) -> JSONResponse:
        """A path or query parameter FastAPI could not read (bodies are parsed by _parse): OpenAI's 400."""
        err = pydantic_error([{**x, "loc": tuple(x.get("loc", ()))[1:]} for x in e.errors()])  # drop "query"
        return error_response(400, err.message, param=err.param, path=request.url.path)

    @app.exception_handler(SamplingParamsError)
    async def _sampling_error(request: Request, e: SamplingParamsError) -> JSONResponse:
        return error_response(400, str(e), param=e.param, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 404:
            return error_response(404, f"there is no route {request.method} {request.url.path}; the API is under /v1 "
                                       "(models, completions, chat/completions, responses, messages), with "
                                       "llama.cpp's /completion, /infill, /tokenize and /detokenize.",
                                  code="not_found", path=request.url.path)
        if e.status_code == 405:
            return error_response(405, f"{request.method} is not allowed on {request.url.path}.",
                                  code="method_not_allowed", path=request.url.path)
        return error_response(e.status_code, str(e.detail), path=request.url.path)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("request failed")
        return error_response(500, f"internal error ({type(e).__name__}); see the server log.", "server_error",
                              path=request.url.path)

    def engine() -> Engine:
        if state.engine is None or not state.engine.alive:
            raise RequestError("the model is still loading; retry in a moment." if state.engine is None and not
                               state.load_error else "the engine is down; restart the server.", status=503,
                               type_="server_error", code="unavailable")
        return state.engine

    def check_model(name: str | None) -> None:
        if name is not None and name != state.model_name:
            raise RequestError(f"the model {name!r} does not exist; this server serves {state.model_name!r}.",
                               "model", status=404, code="model_not_found")

    def model_card() -> dict[str, Any]:
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "pocketmoe",
                "max_model_len": state.max_model_len}

    @app.get("/health")
    @app.get("/v1/health")  # llama-server's other name
    async def health() -> Response:
        if state.engine is not None and state.engine.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "loading" if state.engine is None and not state.load_error else "down"}, 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    @app.get("/models")  # llama-server's, for clients whose base URL leaves out /v1
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return model_card()

    async def encode_prompt(tok: Tokenizer, p: str | list[int], truncate: int | None = None, room: int = 1
                            ) -> list[int]:
        """A prompt's ids, checked (and cut to its last `truncate`, truncate_prompt_tokens, leaving `room` to
        generate)."""
        ids = await asyncio.to_thread(tok.encode, p) if isinstance(p, str) else p  # off the event loop
        if not ids:
            raise RequestError("the prompt is empty; give at least one token.", "prompt")
        ids = truncate_prompt(ids, truncate, state.max_model_len, room)
        _check_vocab(ids, engine().runner.vocab_size, "prompt", "prompt token id")
        if len(ids) >= state.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens but this server's context holds "
                               f"{state.max_model_len} (--max-model-len), and at least one must be left to generate; "
                               "shorten the prompt.", "prompt", code="context_length_exceeded")
        return ids

    def run(prompts: list[list[int]], params: list[list[SamplingParams]], progress: bool = False, slot: int = -1
            ) -> tuple[asyncio.Queue, list]:
        """Submit one engine request per prompt; their deltas (global choice index) share one queue (with progress,
        each prompt's progress deltas too; `slot` >= 0: each runs in that slot, in turn)."""
        eng = engine()
        q: asyncio.Queue[Delta | None] = asyncio.Queue()
        reqs = []
        try:
            for i, (ids, ps) in enumerate(zip(prompts, params, strict=True)):
                reqs.append(eng.submit(ids, ps, out=q, index_base=i * len(ps), progress=progress, slot=slot))
        except QueueFullError as e:
            for r in reqs:
                eng.abort(r)
            raise RequestError(str(e), status=503, type_="server_error", code="queue_full") from None
        return q, reqs

    async def deltas(request: Request, q: asyncio.Queue, reqs: list) -> AsyncIterator[Delta]:
        """The deltas until every request ends; a client that disconnects aborts them (KV freed next step)."""
        eng = engine()
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        left = len(reqs)
        try:
            while left:
                getter = asyncio.ensure_future(q.get())
                done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    return  # the client went away
                d = getter.result()
                if d is None:
                    left -= 1
                    continue
                yield d
        finally:
            watcher.cancel()
            if left:
                for r in reqs:
                    eng.abort(r)

    async def accept(request: Request, model: type[SamplingFields]) -> tuple[Any, Engine, Tokenizer, Grammar | None]:
        """The validated body of a request for the served model, the engine to run it, and the grammar its output
        keeps to (compiled for the model's vocabulary here, so a bad one is a 400)."""
        req = _parse(model, await request.body())
        return (req, *await checked(req))

    async def checked(req: SamplingFields) -> tuple[Engine, Tokenizer, Grammar | None]:
        """accept's checks of a parsed request: the served model, the engine, the output's grammar; the server's
        sampling defaults fill the fields it left out."""
        check_model(req.model)
        eng = engine()
        given = req.model_fields_set | ({"repeat_penalty"} if "repetition_penalty" in req.model_fields_set else set())
        for name, value in state.sampling_defaults.items():
            if name not in given:
                setattr(req, name, value)
        if (req.dry_multiplier or 0) > 0:  # DRY's breaker tokens: a pass over the vocabulary, once, off the loop
            await asyncio.to_thread(dry_breakers_of, eng.tok, req.extras()["dry_sequence_breakers"])
        grammar, field_name = req.output_grammar()
        if grammar is not None:
            try:
                await asyncio.to_thread(check_grammar, grammar, eng.tok)
            except GrammarError as e:
                raise RequestError(str(e), field_name) from None
        return eng, eng.tok, grammar

    async def chat_prompt(tok: Tokenizer, req: ChatCompletionRequest | TokenizeRequest | EmbeddingRequest,
                          messages: list[ChatMessage],
                          tools: list[dict[str, Any]], grammar: Grammar | None) -> tuple[list[int], bool]:
        """The token ids of a chat as the template renders it (the chat route and /tokenize alike), and whether the
        output starts inside a reasoning block (chat_text)."""
        text, thinking = await chat_text(tok, req, messages, tools, grammar)
        return await asyncio.to_thread(tok.encode_rendered_chat, text), thinking

    async def chat_text(tok: Tokenizer, req: ChatCompletionRequest | TokenizeRequest | EmbeddingRequest,
                        messages: list[ChatMessage],
                        tools: list[dict[str, Any]], grammar: Grammar | None) -> tuple[str, bool]:
        """A chat as the template renders it, with a block the template opened closed empty where no reasoning is
        wanted (enable_thinking false, or a grammar deciding the output from its first token), and whether the
        output starts inside a block."""
        variables = template_variables(req, state.chat_template_kwargs)
        try:
            text = await asyncio.to_thread(tok.apply_chat_template, template_messages(messages),
                                           req.add_generation_prompt, req.continue_final_message, tools=tools or None,
                                           **variables)
        except ChatTemplateError as e:
            raise RequestError(f"the chat template could not render these messages: {e}", "messages") from None
        return thinking_prompt(text, grammar is None and variables.get("enable_thinking") is not False)

    async def tool_call_grammar(fmt: ToolFormat | None, tools: list[dict[str, Any]], tok: Tokenizer, only: str | None,
                                parallel: bool, asked: Grammar | None) -> Grammar:
        """tool_choice 'required' or a named function: the output is held to tool calls in the model's format."""
        if asked is not None:
            raise RequestError("tool_choice asks for tool calls and the request also constrains the output "
                               "(response_format or a grammar); give one of them.", "tool_choice")
        if fmt is None:
            raise RequestError("this model's chat template writes no tool calls, so tool_choice cannot require "
                               "one; use 'auto' or 'none'.", "tool_choice")
        grammar = call_grammar(fmt, tools, tok, only, parallel)
        try:
            await asyncio.to_thread(check_grammar, grammar, tok)
        except GrammarError as e:
            raise RequestError(f"the tools' parameter schemas do not compile into a grammar: {e}", "tools") from None
        return grammar

    async def collect(request: Request, q: asyncio.Queue, reqs: list, n: int,
                      seen: Callable[[Delta], None] | None = None) -> list[_Choice]:
        """Each choice's output, whole (seen: called with every delta as it comes)."""
        choices = [_Choice() for _ in range(n)]
        async for d in deltas(request, q, reqs):
            if d.progress is not None:
                continue
            choices[d.index].add(d)
            if seen is not None:
                seen(d)
        for c in choices:
            if c.error:
                raise engine_failed(c.error)
        return choices

    def engine_failed(message: str) -> Exception:
        """What a whole reply raises when the engine failed its request: a 503 when the engine is down (e.g. a
        tensor-parallel rank died), else a 500."""
        if state.engine is not None and not state.engine.alive:
            return RequestError(message, status=503, type_="server_error", code="unavailable")
        return RuntimeError(message)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req, eng, tok, grammar = await accept(request, CompletionRequest)
        if len(req.prompts()) * req.n > MAX_COMPLETION_CHOICES:
            raise RequestError(f"{len(req.prompts())} prompts x n={req.n} is over {MAX_COMPLETION_CHOICES} choices in "
                               "one request; send fewer prompts or a smaller n.", "n")
        max_tokens = req.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        if req.suffix:  # insertion: each prompt the text before, laid out with the suffix as the model fills in
            if req.truncate_prompt_tokens is not None:
                raise RequestError("truncate_prompt_tokens would cut the insertion layout of a prompt with a suffix; "
                                   "shorten the prompt instead.", "truncate_prompt_tokens")
            after = await asyncio.to_thread(tok.encode, req.suffix, False, False)
            prompts = [await encode_prompt(tok, fim_layout(
                tok, await asyncio.to_thread(tok.encode, p, False, False) if isinstance(p, str) else p, after, "suffix",
                state.spm_infill))
                for p in req.prompts()]
        else:
            prompts = [await encode_prompt(tok, p, req.truncate_prompt_tokens, max_tokens) for p in req.prompts()]
        # the prompt's logprobs for echo (OpenAI's legacy object) and for vLLM's prompt_logprobs, the larger top
        prompt_k = max((k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None),
                       default=None)
        params = [_sampling(req, grammar, max_tokens, eng.runner.vocab_size, len(p), state.max_model_len,
                            req.logprobs, prompt_k) for p in prompts]
        q, reqs = run(prompts, params, req.stream and req.return_progress)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        n_choices = len(prompts) * req.n
        prompt_text = [tok.decode(p) for p in prompts]
        usage = _usage(sum(len(p) for p in prompts))
        if req.stream:
            return _sse(_completion_stream(tok, req, deltas(request, q, reqs), rid, created, state.model_name,
                                           prompts, prompt_text, usage))
        out, cached = [], {}
        for i, c in enumerate(await collect(request, q, reqs, n_choices)):
            echo = prompt_text[i // req.n] if req.echo else ""
            lp = None
            if req.logprobs is not None:
                lp = _completion_logprobs(tok, (c.prompt_logprobs if req.echo else []) + c.logprobs,
                                          prompts[i // req.n] if req.echo else [], 0, req.logprobs)
            out.append({"index": i, "text": echo + c.text, "logprobs": lp, "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason})
            if req.return_token_ids:
                out[-1].update(prompt_token_ids=prompts[i // req.n], token_ids=c.token_ids)
            if req.prompt_logprobs is not None:
                out[-1]["prompt_logprobs"] = _prompt_logprobs(tok, c.prompt_logprobs, req.prompt_logprobs)
            usage["completion_tokens"] += len(c.token_ids)
            _count_cached(usage, cached, i // req.n, c.cached_tokens)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                             "choices": out, "usage": usage, "system_fingerprint": None})

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")  # llama-server's, as /models
    async def chat(request: Request) -> Response:
        req, eng, tok, grammar = await accept(request, ChatCompletionRequest)
        _, out = await chat_reply(request, req, eng, tok, grammar)
        return _sse(out) if req.stream else JSONResponse(out)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API over the chat route (serve/responses.py): the whole reply is the last event's."""
        asked = _parse(ResponsesRequest, await request.body())
        store = state.responses
        items = conversation(asked)
        req = asked.chat_request(items)
        eng, tok, grammar = await checked(req)
        prepared = None
        if asked.truncation == "auto":
            req, prepared = await truncated(asked, items, eng, tok, grammar)
        stored = asked.store is not False and store.capacity > 0
        if asked.background and not stored:
            raise RequestError("a background response is kept so that it can be polled, and this server keeps none "
                               "(--responses-store-mib 0).", "background")
        _, chunks = await chat_reply(Detached() if asked.background else request, req, eng, tok, grammar, prepared)
        conv = asked.conversation_id
        sent = [input_item(x) for x in asked.items()] if stored or conv else []  # as input_items will list them

        def keep(r: dict[str, Any]) -> None:
            if stored:
                store.put(r, sent, asked.previous_response_id)
            if conv:  # the turn joins the conversation (unless it was deleted or dropped meanwhile)
                with contextlib.suppress(RequestError):
                    state.conversations.add(conv, copy.deepcopy([*sent, *r["output"]]))

        events = response_events(chunks, asked.echo(state.model_name, stored),
                                 ResponseUsage(lambda text: len(tok.encode(text, add_bos=False))),
                                 keep if stored or conv else None)
        if asked.background:
            queued = await state.background.start(events, lambda r: store.put(r, sent, asked.previous_response_id))
            run = state.background.get(queued["id"])
            return _sse(run.follow(), done=False, named=True) if asked.stream and run else JSONResponse(queued)
        if asked.stream:
            return _sse(events, done=False, named=True)
        last: dict[str, Any] = {}
        async for e in events:
            last = e
        if last["type"] == "response.failed":
            raise engine_failed(last["response"]["error"]["message"])
        return JSONResponse(last["response"])

    def conversation(asked: ResponsesRequest) -> list[Any]:
        """A Responses request's items: the kept conversation it continues (previous_response_id, or a Conversations
        API conversation), then its input."""
        previous, conv = asked.previous_response_id, asked.conversation_id
        before = state.responses.conversation(previous) if previous else \
            state.conversations.history(conv) if conv else []
        return [*before, *asked.items()]

    @app.post("/v1/responses/input_tokens")
    async def response_input_tokens(request: Request) -> Response:
        """The input tokens a /v1/responses request would take: its conversation (a stored one before its input)
        rendered as that route renders it, whole (before any truncation)."""
        asked = _parse(ResponsesRequest, await request.body())
        req = asked.chat_request(conversation(asked))
        eng, tok, grammar = await checked(req)
        ids, *_ = await chat_ids(req, eng, tok, grammar)
        return JSONResponse({"object": "response.input_tokens", "input_tokens": len(ids)})

    async def truncated(asked: ResponsesRequest, items: list[Any], eng: Engine, tok: Tokenizer,
                        grammar: Grammar | None) -> tuple[ChatCompletionRequest, Prepared]:
        """truncation "auto": the chat request of the conversation without the fewest leading turns whose prompt
        leaves room for max_output_tokens (one token without it), and chat_prepared's answer for it; where even
        the last turn alone does not fit, its error."""
        starts = turn_starts(items)
        lo, hi, best, error = 0, len(starts) - 1, None, None
        while lo <= hi:  # the prompt shrinks as the cut moves later: the first cut that fits
            mid = (lo + hi) // 2
            req = asked.chat_request(items[starts[mid]:])
            try:
                best, hi = (req, await chat_prepared(req, eng, tok, grammar)), mid - 1
            except RequestError as e:
                if e.code != "context_length_exceeded":
                    raise
                error, lo = e, mid + 1
        if best is None:
            raise error  # type: ignore[misc]
        return best

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, stream: bool = False, starting_after: int | None = None) -> Response:
        """A stored response; a background one as it runs (with stream, its events after starting_after)."""
        run = state.background.get(response_id)
        if stream:
            if run is None:
                raise RequestError(f"{response_id!r} is not a background response this server holds the events of; "
                                   "only those can be streamed again.", "stream")
            return _sse(run.follow(starting_after), done=False, named=True)
        if run is not None:
            return JSONResponse(run.latest)
        return JSONResponse(state.responses.get(response_id).response)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> Response:
        """Stop a background response (OpenAI's cancel); a finished one is answered as it is."""
        await state.background.cancel(response_id)
        run = state.background.get(response_id)
        return JSONResponse(run.latest if run is not None else state.responses.get(response_id).response)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        """Delete a stored response; a background one is stopped first, and its events go."""
        if state.background.get(response_id) is not None:
            await state.background.cancel(response_id)
            state.background.forget(response_id)
        state.responses.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str, limit: int = 20, order: str = "desc", after: str | None = None
                          ) -> Response:
        """The items a stored response's request gave as input, a page at a time (OpenAI's list shape)."""
        return JSONResponse(item_page(state.responses.get(response_id).items, limit, order, after, response_id))

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        """Anthropic's Messages API over the chat route (serve/messages.py)."""
        req = _parse(MessagesRequest, await request.body()).chat_request()
        eng, tok, grammar = await checked(req)
        n_prompt, out = await chat_reply(request, req, eng, tok, grammar)
        if req.stream:
            return _sse(message_events(out, state.model_name, n_prompt), done=False, named=True)
        return JSONResponse(message_body(out, state.model_name))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        """The prompt tokens a /v1/messages request would take (its messages, system and tools rendered as that
        route renders them, a reasoning block closed where a schema or a forced tool decides the output)."""
        req = _parse(MessagesRequest, await request.body()).chat_request(count_only=True)
        eng, tok, grammar = await checked(req)
        ids, *_ = await chat_ids(req, eng, tok, grammar)
        return JSONResponse({"input_tokens": len(ids)})

    async def chat_ids(req: ChatCompletionRequest, eng: Engine, tok: Tokenizer, grammar: Grammar | None
                       ) -> tuple[list[int], Grammar | None, ToolFormat | None, bool]:
        """A chat request's prompt ids as the template renders them (not yet checked against the context), the
        grammar its output keeps to (tool_choice's, where it forces calls), its tool-call format, and whether the
        output starts inside a reasoning block."""
        tools = req.tool_dicts
        fmt = tool_format(tok.chat_template, eng.runner.bundle.architecture) if tools and req.tool_choice != "none" \
            else None
        forced, only = req.forced_tool()
        if forced:
            grammar = await tool_call_grammar(fmt, tools, tok, only, req.parallel_tool_calls, grammar)
        ids, thinking = await chat_prompt(tok, req, req.messages, tools, grammar)
        return ids, grammar, fmt, thinking

    async def chat_prepared(req: ChatCompletionRequest, eng: Engine, tok: Tokenizer, grammar: Grammar | None
                            ) -> Prepared:
        """A chat request made ready to run: its prompt ids, its choices' params, the tool-call format its output
        is read with and whether it starts inside a reasoning block; a RequestError (context_length_exceeded
        where it does not fit the context) before anything runs."""
        ids, grammar, fmt, thinking = await chat_ids(req, eng, tok, grammar)
        ids = await encode_prompt(tok, ids, req.truncate_prompt_tokens, req.max_completion_tokens or req.max_tokens or 1)
        max_tokens = req.max_completion_tokens or req.max_tokens or (state.max_model_len - len(ids))
        budget = req.thinking_budget(state.reasoning_budget)
        message = state.reasoning_budget_message if req.thinking_budget_message is None else req.thinking_budget_message
        bound = ReasoningBudget.for_tokenizer(tok, budget, message, inside=thinking) \
            if budget >= 0 and grammar is None else None  # a grammar closes the block before the output starts
        params = _sampling(req, grammar, max_tokens, eng.runner.vocab_size, len(ids), state.max_model_len,
                           (req.top_logprobs or 0) if req.logprobs else None, req.prompt_logprobs, bound)
        return ids, params, fmt, thinking if state.reasoning_format == "auto" else None

    async def chat_reply(request: Request, req: ChatCompletionRequest, eng: Engine, tok: Tokenizer,
                         grammar: Grammar | None, prepared: Prepared | None = None) -> tuple[int, Any]:
        """Run a chat request (prepared: chat_prepared's answer for it, where the caller has it): (its prompt tokens,
        its completion object or, with stream, the iterator of its chunks)."""
        ids, params, fmt, thinking = prepared or await chat_prepared(req, eng, tok, grammar)
        tools = req.tool_dicts
        t0 = time.perf_counter()
        q, reqs = run([ids], [params], req.stream and req.return_progress)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        usage = _usage(len(ids))
        if req.stream:
            return len(ids), _chat_stream(tok, req, deltas(request, q, reqs), rid, created, state.model_name, usage,
                                          fmt, tools, thinking, ids, t0)
        out, cached = [], {}
        clock = _Clock(t0)
        choices = await collect(request, q, reqs, req.n, seen=clock.see)
        for i, c in enumerate(choices):
            lp = {"content": [_chat_logprob(tok, x) for x in c.logprobs]} if req.logprobs else None
            thought, answer = split_reasoning(c.text, thinking) if thinking is not None else (None, c.text)
            content, calls = parse_tool_calls(fmt, answer, tools) if fmt else (answer, [])
            message: dict[str, Any] = {"role": "assistant", "content": (content or None) if calls else content}
            if thought is not None:
                message["reasoning_content"] = message["reasoning"] = thought
            if calls:
                message["tool_calls"] = [x.to_json() for x in calls]
            out.append({"index": i, "message": message, "logprobs": lp,
                        "finish_reason": "tool_calls" if calls else c.finish_reason, "stop_reason": c.stop_reason})
            if req.return_token_ids:
                out[-1]["token_ids"] = c.token_ids
            usage["completion_tokens"] += len(c.token_ids)
            _count_cached(usage, cached, 0, c.cached_tokens)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        body = {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
                "choices": out, "usage": usage, "system_fingerprint": None, "timings": clock.timings(usage)}
        if req.prompt_logprobs is not None:  # vLLM's: the prompt's, once for all choices
            body["prompt_logprobs"] = _prompt_logprobs(tok, choices[0].prompt_logprobs, req.prompt_logprobs)
        if req.return_token_ids:
            body["prompt_token_ids"] = ids
        return len(ids), body

    async def encode_pieces(tok: Tokenizer, pieces: list[str | int], truncate: int | None = None, room: int = 1
                            ) -> list[int]:
        """A llama.cpp prompt of strings and token ids: the first string with the file's BOS policy, later ones
        without a BOS, ids as they are; then the checks every prompt gets."""
        ids: list[int] = []
        for j, p in enumerate(pieces):
            if isinstance(p, str):
                ids += await asyncio.to_thread(tok.encode, p, None if j == 0 else False)
            else:
                ids.append(p)
        return await encode_prompt(tok, ids, truncate, room)

    @app.post("/completion")
    @app.post("/completions")
    async def llama_completion(request: Request) -> Response:
        """llama.cpp's native completion route (serve/llama_api.py)."""
        return await llama_reply(request, LlamaCompletionRequest)

    @app.post("/infill")
    async def infill(request: Request) -> Response:
        """llama.cpp's fill-in-the-middle route: /completion's, its prompt laid out from the text around the
        cursor (llama_api.InfillRequest)."""
        return await llama_reply(request, InfillRequest)

    async def llama_reply(request: Request, model: type[LlamaCompletionRequest]) -> Response:
        t0 = time.perf_counter()
        req, eng, tok, grammar = await accept(request, model)
        if req.id_slot >= eng.cfg.max_num_seqs:
            raise RequestError(f"id_slot {req.id_slot} names no slot: this server has {eng.cfg.max_num_seqs} "
                               f"(--parallel), 0..{eng.cfg.max_num_seqs - 1}; give one of those, or -1 for any.",
                               "id_slot")
        if isinstance(req, InfillRequest):
            if req.truncate_prompt_tokens is not None:
                raise RequestError("truncate_prompt_tokens would cut the infill layout; shorten input_prefix or "
                                   "input_extra instead.", "truncate_prompt_tokens")
            prompts = [await encode_prompt(tok, await asyncio.to_thread(req.infill_ids, tok, state.max_model_len,
                                                                        state.spm_infill))]
        else:
            pieces = req.prompts()
            if len(pieces) > MAX_COMPLETION_CHOICES:  # refused before any is tokenized
                raise RequestError(f"{len(pieces)} prompts are over {MAX_COMPLETION_CHOICES} in one request; send "
                                   "fewer.", "prompt")
            asked = req.n_predict if req.n_predict is not None else req.max_tokens or -1  # as max_new_tokens reads it
            room = max(asked, 1)  # -1 (as many as the context leaves) and 0 (warm the cache): room for one
            prompts = [await encode_pieces(tok, p, req.truncate_prompt_tokens, room) for p in pieces]
        wanted = [req.max_new_tokens(len(p), state.max_model_len) for p in prompts]
        params = [req.sampling(grammar, max(n, 1), eng.runner.vocab_size) for n in wanted]
        live = [i for i, n in enumerate(wanted) if n > 0]
        # n_predict 0: nothing to generate, but with cache_prompt the prompt is still computed (one token drawn and
        # dropped) so that the prefix cache keeps it for the next request, as llama-server computes it (llama.vim
        # warms the cache so)
        warm = {i for i, n in enumerate(wanted) if n == 0 and req.cache_prompt and eng.prefix_caching}
        ran = live + sorted(warm)
        choices = {i: _Choice() for i in range(len(prompts))}
        for i in set(choices) - set(live):
            choices[i].finish_reason = "length"
        first: dict[int, float] = {}
        end = {i: t0 for i in choices}

        def piece(t: int) -> tuple[str, list[int]]:
            return _piece(tok, t)

        def result(i: int, content: str) -> dict[str, Any]:
            c, ids = choices[i], prompts[i]
            out = {"index": i, "content": content, "tokens": c.token_ids if req.return_tokens else [],
                   "id_slot": c.slot, "stop": True, "model": state.model_name, "tokens_predicted": len(c.token_ids),
                   "tokens_evaluated": len(ids), "tokens_cached": c.cached_tokens,
                   "generation_settings": {**req.settings(params[i], state.max_model_len, state.model_name),
                                           "n_predict": wanted[i]},
                   "prompt": tok.decode(ids), "has_new_line": "\n" in c.text,
                   "truncated": c.finish_reason == "length" and len(ids) + len(c.token_ids) >= state.max_model_len,
                   **stop_fields(c.finish_reason, c.stop_reason),
                   "timings": llama_timings(len(ids), c.cached_tokens, len(c.token_ids), t0, first.get(i), end[i])}
            if req.n_probs:
                out["completion_probabilities"] = probabilities(piece, c.logprobs, req.post_sampling_probs)
            return pick_fields(req.response_fields, out) if req.response_fields else out

        def seen(d: Delta, now: float) -> int:
            i = ran[d.index]
            if d.token_ids and i not in first and i not in warm:
                first[i] = now
            end[i] = now
            return i

        q, reqs = run([prompts[i] for i in ran], [[params[i]] for i in ran], req.stream and req.return_progress,
                      req.id_slot) if ran else (asyncio.Queue(), [])
        if req.stream:
            async def events() -> AsyncIterator[dict[str, Any]]:
                for i in set(choices) - set(ran):
                    yield result(i, "")
                async for d in deltas(request, q, reqs):
                    if d.error:
                        yield _error_event(d.error)
                        return
                    if d.progress is not None:  # llama-server's progress chunk
                        yield {"index": ran[d.index], "content": "", "tokens": [], "stop": False, "id_slot": d.slot,
                               "prompt_progress": d.progress}
                        continue
                    i = seen(d, time.perf_counter())
                    c = choices[i]
                    if i in warm:  # only the prompt was wanted
                        c.cached_tokens = d.cached_tokens if d.cached_tokens is not None else c.cached_tokens
                        if d.finish_reason is not None:
                            yield result(i, "")
                        continue
                    c.add(d)
                    if d.text or d.token_ids:
                        chunk = {"index": i, "content": d.text, "tokens": d.token_ids, "stop": False, "id_slot": d.slot,
                                 "tokens_predicted": len(c.token_ids), "tokens_evaluated": len(prompts[i])}
                        if req.n_probs:
                            chunk["completion_probabilities"] = probabilities(piece, d.logprobs, req.post_sampling_probs)
                        yield chunk
                    if d.finish_reason is not None:
                        yield result(i, "")

            return _sse(events(), done=False)
        for i, c in zip(ran, await collect(request, q, reqs, len(ran), seen=lambda d: seen(d, time.perf_counter())),
                        strict=True):
            if i in warm:
                choices[i].cached_tokens = c.cached_tokens
            else:
                choices[i] = c
        results = [result(i, choices[i].text) for i in range(len(prompts))]
        return JSONResponse(results if req.several() else results[0])

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        req = pooled(_parse(EmbeddingRequest, await request.body()))
        eng = engine()
        check_dimensions(req, int(eng.runner.bundle.metadata.get(f"{eng.runner.bundle.architecture}.embedding_length",
                                                                   0)))
        ids, vectors = await embed(request, req, req.truncate_prompt_tokens)
        return JSONResponse(openai_body(req, vectors, state.model_name, sum(len(p) for p in ids)))

    @app.post("/embedding")
    @app.post("/embeddings")  # llama-server's names, its own reply shape
    async def llama_embeddings(request: Request) -> Response:
        req = _parse(LlamaEmbeddingRequest, await request.body())
        _, vectors = await embed(request, req, None)
        return JSONResponse(llama_body(req, vectors, state.pooling))

    @app.post("/score")
    @app.post("/v1/score")
    async def score(request: Request) -> Response:
        return await similarities(request, ScoreRequest, score_body)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(request: Request) -> Response:
        return await similarities(request, RerankRequest, rerank_body)

    async def similarities(request: Request, model: type[ScoreRequest] | type[RerankRequest],
                           answer: Callable[..., dict[str, Any]]) -> Response:
        """/score's and /rerank's: the request's texts embedded, then compared as `answer` says."""
        req = _parse(model, await request.body())
        ids, vectors = await embed(request, pooled(req), req.truncate_prompt_tokens)
        return JSONResponse(answer(req, vectors, state.model_name, sum(len(p) for p in ids)))

    def pooled(req: Body) -> Body:
        """req, where the server pools one vector an input (a 400 under --pooling none)."""
        if state.pooling == "none":
            raise RequestError("this server pools no embeddings (--pooling none), so it has no one vector an input: "
                               "/embedding gives each token's; or start it with --pooling last, mean or cls.", "input")
        return req

    async def embed(request: Request, req: EmbeddingRequest | LlamaEmbeddingRequest | ScoreRequest | RerankRequest,
                    truncate: int | None) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Each input's ids (as checked) and its pooled hidden state, computed by the engine among the other
        requests."""
        check_model(req.model)
        eng = engine()
        tok = eng.tok
        if isinstance(req, EmbeddingRequest) and req.messages is not None:
            ids = [(await chat_prompt(tok, req, req.messages, [], None))[0]]
        else:
            inputs = req.inputs()
            ids = await asyncio.to_thread(lambda: [tok.encode(p, None if req.add_special_tokens else False)
                                                   if isinstance(p, str) else p for p in inputs])
        for p in ids:
            _check_vocab(p, eng.runner.vocab_size, "input", "input token id")
        ids = check_lengths(ids, state.max_model_len, truncate)
        q: asyncio.Queue[Delta | None] = asyncio.Queue()
        try:
            reqs = [eng.submit_embed(ids, state.pooling, out=q)]
        except QueueFullError as e:
            raise RequestError(str(e), status=503, type_="server_error", code="queue_full") from None
        vectors: list[torch.Tensor | None] = [None] * len(ids)
        async for d in deltas(request, q, reqs):
            if d.error:
                raise engine_failed(d.error)
            vectors[d.index] = d.embedding
        if any(v is None for v in vectors):
            raise RequestError("the client went away", status=499)  # never sent: the connection is gone
        return ids, [v for v in vectors if v is not None]

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        """vLLM's /tokenize: the token ids of a prompt (add_special_tokens) or of chat messages (the template, as
        /v1/chat/completions renders them without tools)."""
        req = _parse(TokenizeRequest, await request.body())
        check_model(req.model)
        tok = engine().tok
        if req.messages is not None:
            ids, _ = await chat_prompt(tok, req, req.messages, [], None)
        else:
            ids = await asyncio.to_thread(tok.encode, req.text, None if req.add_bos else False, req.parse_special)
        tokens: list[Any] = ids
        if req.with_pieces:  # llama-server's: each piece as text, or as its bytes where it is not whole UTF-8
            tokens = [{"id": t, "piece": _piece_or_bytes(tok.token_to_piece(t))} for t in ids]
        return JSONResponse({"count": len(ids), "max_model_len": state.max_model_len, "tokens": tokens})

    @app.post("/apply-template")
    async def apply_template(request: Request) -> Response:
        """llama.cpp's /apply-template: the prompt text a chat request's messages render to."""
        req = _parse(ApplyTemplateRequest, await request.body())
        check_model(req.model)
        text, _ = await chat_text(engine().tok, req, req.messages, [], None)
        return JSONResponse({"prompt": text})

    @app.get("/props")
    async def props() -> Response:
        """llama.cpp's /props: what clients read at start (context, default sampling, chat template, slots)."""
        eng = engine()
        tok = eng.tok
        token = (lambda t: tok.tokens[t] if t is not None else "")  # noqa: E731
        return JSONResponse({
            "default_generation_settings": {"n_ctx": state.max_model_len, "model": state.model_name,
                                            "params": {**LLAMA_DEFAULTS, **EXTRA_DEFAULTS, "repeat_last_n": 64,
                                                       "n_predict": -1, "seed": -1, "n_probs": 0, "min_keep": 0,
                                                       "mirostat": 0, "samplers": list(LLAMA_CHAIN),
                                                       **state.sampling_defaults}},
            "total_slots": eng.cfg.max_num_seqs, "model_alias": state.model_name,
            "endpoint_slots": state.slots_endpoint, "endpoint_props": False, "endpoint_metrics": True,
            "model_path": eng.runner.bundle.paths[0].name, "chat_template": tok.chat_template or "",
            "bos_token": token(tok.bos_id), "eos_token": token(tok.eos_id),
            "modalities": {"vision": False, "audio": False}, "build_info": f"pocketmoe {__version__}"})

    @app.get("/slots")
    async def slots(fail_on_no_slot: str = "") -> Response:
        """llama-server's /slots: each of the --parallel slots, busy or idle, with the sequence it runs or ran last
        (fail_on_no_slot: a 503 while every slot is busy, for a load balancer)."""
        if not state.slots_endpoint:
            raise RequestError("this server does not serve /slots (it was started with --no-slots); restart it "
                               "without that flag.", status=501, type_="not_supported_error")
        eng = engine()
        busy, last = list(eng.slots), list(eng.slot_last)  # the engine thread writes them
        if fail_on_no_slot not in ("", "0", "false") and None not in busy:
            raise RequestError(f"no slot available: all {len(busy)} slots are busy (--parallel {len(busy)}); retry "
                               "later.", status=503, type_="unavailable_error")
        views = await asyncio.to_thread(lambda: [
            slot_view(i, b or s, b is not None, state.max_model_len, eng.tok.decode, state.slots_debug)
            for i, (b, s) in enumerate(zip(busy, last, strict=True))])
        return JSONResponse(views)

    @app.post("/slots/{id_slot}")
    async def slot_action(request: Request, id_slot: str, action: str = "") -> Response:
        """llama-server's slot actions on the prefix cache: save (the full KV pages of what the slot ran last, to
        a file in --slot-save-path), restore (a saved file's pages back into the cache, where any slot's prompt
        that starts with its tokens attaches them) and erase (drop the slot's pages from the cache)."""
        eng = engine()
        if not (id_slot.isdecimal() and int(id_slot) < eng.cfg.max_num_seqs):
            raise RequestError(f"{id_slot[:40]!r} names no slot: this server has {eng.cfg.max_num_seqs} "
                               f"(--parallel), 0..{eng.cfg.max_num_seqs - 1}.", "id_slot", status=404)
        slot = int(id_slot)
        if action not in ("save", "restore", "erase"):
            raise RequestError(f"action {action[:40]!r} is not one of save, restore, erase; add ?action=save (or "
                               "restore, erase) to the URL.", "action")
        if not eng.prefix_caching:
            raise RequestError("slot actions work on the prefix cache, which is off here (--no-enable-prefix-caching, "
                               "or kernels whose rows depend on the chunking); turn it on with "
                               "--enable-prefix-caching.", status=501, type_="not_supported_error")
        if eng.cache.mirror is not None:
            raise RequestError("slot actions are not served under tensor parallelism (each rank holds a share of "
                               "the KV rows); use --prefix-cache-dir to keep prompts across restarts instead.",
                               status=501, type_="not_supported_error")
        if action == "erase":
            n = await _engine_call(eng, lambda: eng.slot_erase(slot))
            return JSONResponse({"id_slot": slot, "n_erased": n})
        if state.slot_save_path is None:
            raise RequestError("slot save and restore need a directory for their files; start the server with "
                               "--slot-save-path DIR.", status=501, type_="not_supported_error")
        name = _parse(SlotFileRequest, await request.body()).filename
        path = state.slot_save_path / name
        t0 = time.perf_counter()
        key = await asyncio.to_thread(lambda: eng.runner.kv_key)  # made once: a pass over every tensor's ends
        if action == "save":
            tokens, rows = await _engine_call(eng, lambda: eng.slot_rows(slot))
            try:
                written = await asyncio.to_thread(write_slot_file, path, key, tokens, rows)
            except OSError as e:
                raise RequestError(f"{name} could not be written in {state.slot_save_path} ({e.strerror}); free "
                                   "some space or give a --slot-save-path this user can write.", status=500,
                                   type_="server_error") from None
            return JSONResponse({"id_slot": slot, "filename": name, "n_saved": len(tokens), "n_written": written,
                                 "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}})
        shape, dtype = eng.runner.kv_page_shape
        try:
            tokens, rows, read = await asyncio.to_thread(read_slot_file, path, key, shape, dtype)
        except FileNotFoundError:
            raise RequestError(f"there is no file {name} in {state.slot_save_path} (--slot-save-path); save the "
                               "slot under that name first.", "filename", status=404) from None
        except SlotFileError as e:
            raise RequestError(str(e), "filename") from None
        except OSError as e:
            raise RequestError(f"{name} could not be read ({e.strerror}).", "filename", status=500,
                               type_="server_error") from None
        n = await _engine_call(eng, lambda: eng.slot_restore(slot, tokens, rows))
        return JSONResponse({"id_slot": slot, "filename": name, "n_restored": n, "n_read": read,
                             "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        """vLLM's /detokenize: the text of token ids."""
        req = _parse(DetokenizeRequest, await request.body())
        check_model(req.model)
        tok = engine().tok
        _check_vocab(req.tokens, len(tok.tokens), "tokens", "token id")
        text = await asyncio.to_thread(tok.decode, req.tokens)
        return JSONResponse({"prompt": text, "content": text})  # vLLM's key and llama-server's

    add_conversation_routes(app, state.conversations, _parse)
    gated = GateMiddleware(app, state)
    if not state.allowed_origins:
        return gated  # type: ignore[return-value]
    # outside the gate: a browser's preflight carries no API key, and the gate's 401 / 413 carry the CORS headers
    cors = CORSMiddleware(gated, allow_origins=list(state.allowed_origins), allow_methods=["*"], allow_headers=["*"])
    return cors  # type: ignore[return-value]


def _check_vocab(ids: list[int], vocab: int, field: str, what: str) -> None:
    bad = next((t for t in ids if t >= vocab), None)
    if bad is not None:
        raise RequestError(f"{what} {bad} is outside the vocabulary of {vocab} tokens.", field)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Clock:
    """When a request's tokens came, for llama-server's timings (the prompt from submission to the first token, the
    rest as generation)."""

    def __init__(self, t0: float) -> None:
        self.t0, self.first = t0, None

    def see(self, d: Delta) -> None:
        if d.token_ids and self.first is None:
            self.first = time.perf_counter()

    def timings(self, usage: dict[str, Any]) -> dict[str, float | int]:
        return llama_timings(usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                             usage["completion_tokens"], self.t0, self.first, time.perf_counter())


def _piece_or_bytes(piece: bytes) -> str | list[int]:
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


def _usage(n_prompt: int) -> dict[str, Any]:
    return {"prompt_tokens": n_prompt, "completion_tokens": 0, "total_tokens": n_prompt,
            "prompt_tokens_details": {"cached_tokens": 0}}


def _count_cached(usage: dict[str, Any], per_prompt: dict[int, int], prompt: int, cached: int | None) -> None:
    """usage.prompt_tokens_details.cached_tokens: per prompt (per_prompt keeps them), the most any of its choices
    took from the prefix cache, as each prompt counts once in prompt_tokens whatever n is."""
    if cached is None:
        return
    per_prompt[prompt] = max(per_prompt.get(prompt, 0), cached)
    usage["prompt_tokens_details"]["cached_tokens"] = sum(per_prompt.values())


def _piece(tok: Tokenizer, t: int) -> tuple[str, list[int]]:
    b = tok.token_to_piece(t)
    return b.decode("utf-8", "replace"), list(b)


def _chat_logprob(tok: Tokenizer, x: TokenLogprob) -> dict[str, Any]:
    text, b = _piece(tok, x.token_id)
    top = [{"token": (p := _piece(tok, t))[0], "logprob": lp, "bytes": p[1]} for t, lp in x.top]
    return {"token": text, "logprob": x.logprob, "bytes": b, "top_logprobs": top}


def _completion_logprobs(tok: Tokenizer, lps: list[TokenLogprob | None], prompt: list[int], offset: int, k: int
                         ) -> dict[str, list[Any]]:
    """OpenAI's legacy logprobs object, k most likely tokens each; with echo the prompt tokens come first (the very
    first has no logprob)."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    ids = list(prompt) + [x.token_id for x in lps[len(prompt):] if x is not None]
    for t, x in zip(ids, lps, strict=True):
        text = _piece(tok, t)[0]
        out["tokens"].append(text)
        out["token_logprobs"].append(None if x is None else x.logprob)
        out["top_logprobs"].append(None if x is None else {_piece(tok, i)[0]: lp for i, lp in x.top[:k]})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _prompt_logprobs(tok: Tokenizer, lps: list[TokenLogprob | None], k: int) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: per prompt token (the first None) {token id: {logprob, rank, decoded_token}} for
    it and the k most likely tokens."""
    return [None if x is None else {str(t): asdict(v) for t, v in logprob_entry(x, tok, k).items()} for x in lps]


def _sse(events: AsyncIterator[dict[str, Any]], done: bool = True, named: bool = False) -> StreamingResponse:
    """Server-sent events, one JSON object each; OpenAI's streams end with `data: [DONE]` (done), llama.cpp's and
    the Responses API's not; named: each event also has an `event:` line, its type (the Responses API's). While no
    event comes for KEEPALIVE_S (a long prompt prefilling on a CPU), an SSE comment line keeps proxies and clients
    with idle timeouts from dropping the stream; every SSE reader skips it."""
    async def body() -> AsyncIterator[bytes]:
        it = events.__aiter__()
        pending: asyncio.Future[dict[str, Any]] | None = None
        try:
            while True:
                pending = pending or asyncio.ensure_future(it.__anext__())
                finished, _ = await asyncio.wait({pending}, timeout=KEEPALIVE_S)
                if not finished:
                    yield b": keep-alive\n\n"
                    continue
                try:
                    e = pending.result()
                except StopAsyncIteration:
                    break
                finally:
                    pending = None
                name = f"event: {e.get('type', 'error')}\n".encode() if named else b""
                yield name + b"data: " + json.dumps(e, ensure_ascii=False).encode() + b"\n\n"
        finally:
            if pending is not None:  # the client went away mid-wait: the events' own cleanup (an abort) runs
                pending.cancel()
        if done:
            yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _error_event(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": None}}


async def _completion_stream(tok: Tokenizer, req: CompletionRequest, deltas: AsyncIterator[Delta], rid: str,
                             created: int, model: str, prompts: list[list[int]], prompt_text: list[str],
                             usage: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(index: int, text: str, lp: Any, finish: str | None, stop_reason: str | int | None = None,
              token_ids: list[int] | None = None) -> dict[str, Any]:
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish, "stop_reason": stop_reason}
        if req.return_token_ids:  # each chunk its tokens; a choice's first chunk its prompt's too
            choice["token_ids"] = token_ids or []
            if index not in begun:
                choice["prompt_token_ids"] = prompts[index // req.n]
        begun.add(index)
        c = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
        if include_usage:
            c["usage"] = None
        return c

    begun: set[int] = set()  # choices that have had a chunk

    offsets: dict[int, int] = {}  # characters sent per choice (text_offset)
    cached: dict[int, int] = {}  # prefix-cached tokens per prompt
    prompt_lps: dict[int, list[TokenLogprob | None]] = {}
    async for d in deltas:
        if d.error:
            yield _error_event(d.error)
            return
        if d.progress is not None:
            yield {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
                   "prompt_progress": d.progress}
            continue
        i, p = d.index, d.index // req.n
        if d.prompt_logprobs is not None:  # echo with logprobs: the prompt goes out whole, as the first chunk
            got = prompt_lps.setdefault(i, [])
            got += d.prompt_logprobs
            if len(got) == len(prompts[p]):
                yield chunk(i, prompt_text[p], _completion_logprobs(tok, got, prompts[p], 0, req.logprobs or 0), None)
                offsets[i] = len(prompt_text[p])
            continue
        text = d.text
        if i not in offsets:
            offsets[i] = 0
            if req.echo:
                text = prompt_text[p] + text
        lp = None
        if req.logprobs is not None:
            lp = _completion_logprobs(tok, list(d.logprobs), [], offsets[i] + len(text) - len(d.text), req.logprobs)
        offsets[i] += len(text)
        usage["completion_tokens"] += len(d.token_ids)
        _count_cached(usage, cached, p, d.cached_tokens)
        if text or d.finish_reason or d.token_ids:  # one chunk per token, as OpenAI streams
            yield chunk(i, text, lp, d.finish_reason, d.stop_reason, d.token_ids)
    if include_usage:
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        yield {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
               "usage": usage}


async def _chat_stream(tok: Tokenizer, req: ChatCompletionRequest, deltas: AsyncIterator[Delta], rid: str,
                       created: int, model: str, usage: dict[str, Any], fmt: ToolFormat | None,
                       tools: list[dict[str, Any]], thinking: bool | None, prompt_ids: list[int], t0: float
                       ) -> AsyncIterator[dict[str, Any]]:
    """Chat chunks; a <think> block (thinking not None) as reasoning deltas; with tools, text from the start of a
    tool call on is held and sent as tool_calls at the end (or as content, when it does not parse); with
    return_token_ids, the prompt's ids on the first chunk (vLLM's); llama-server's timings on the last choice's
    finishing chunk (t0: when the request was submitted)."""
    clock, open_choices = _Clock(t0), req.n
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    held = [ToolStream(fmt, tools) for _ in range(req.n)] if fmt else None
    minds = [ReasoningSplitter(thinking) for _ in range(req.n)] if thinking is not None else None
    cached: dict[int, int] = {}

    def chunk(index: int, delta: dict[str, Any], lp: Any, finish: str | None, stop_reason: str | int | None = None,
              token_ids: list[int] | None = None) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish, "stop_reason": stop_reason}
        if req.return_token_ids:  # a delta's tokens on the one chunk that carries its logprobs
            choice["token_ids"] = token_ids or []
        c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "system_fingerprint": None, "choices": [choice]}
        if include_usage:
            c["usage"] = None
        if req.timings_per_token and clock.first is not None:  # llama-server's: the speed so far, on every chunk
            c["timings"] = clock.timings(usage)
        return c

    for i in range(req.n):
        first = chunk(i, {"role": "assistant", "content": ""}, None, None)
        if req.return_token_ids and i == 0:
            first["prompt_token_ids"] = prompt_ids
        yield first
    async for d in deltas:
        if d.error:
            yield _error_event(d.error)
            return
        if d.progress is not None:
            yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "system_fingerprint": None, "choices": [], "prompt_progress": d.progress}
            continue
        clock.see(d)
        usage["completion_tokens"] += len(d.token_ids)
        _count_cached(usage, cached, 0, d.cached_tokens)
        lp = {"content": [_chat_logprob(tok, x) for x in d.logprobs]} if req.logprobs and d.logprobs else None
        thought, text = minds[d.index].push(d.text) if minds else ("", d.text)
        if d.finish_reason and minds:
            more, tail = minds[d.index].finish()
            thought, text = thought + more, text + tail
        if thought:
            yield chunk(d.index, {"reasoning_content": thought, "reasoning": thought}, lp, None, token_ids=d.token_ids)
        text = held[d.index].push(text) if held else text
        if text or (d.token_ids and not thought):  # one chunk per token, as OpenAI streams
            yield chunk(d.index, {"content": text}, None if thought else lp, None,
                        token_ids=None if thought else d.token_ids)
        if d.finish_reason:
            finish = d.finish_reason
            if held:
                rest, calls = held[d.index].finish()
                if rest:
                    yield chunk(d.index, {"content": rest}, None, None)
                if calls:
                    yield chunk(d.index, {"tool_calls": [c.to_json(k) for k, c in enumerate(calls)]}, None, None)
                    finish = "tool_calls"
            last = chunk(d.index, {}, None, finish, d.stop_reason)
            open_choices -= 1
            if not open_choices:
                last["timings"] = clock.timings(usage)
            yield last
    if include_usage:
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
               "usage": usage}
