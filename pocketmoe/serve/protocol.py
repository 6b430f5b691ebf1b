"""The request bodies the server accepts, as pydantic models with OpenAI's field names.

Validation is strict (a string where a number belongs is a 400, as OpenAI answers), unknown fields
are ignored, and every range OpenAI documents is checked here, so the engine only sees valid input.
llama.cpp's `top_k`, `min_p`, `repeat_penalty` and vLLM's `ignore_eos` are accepted as extensions, and
structured output three ways: OpenAI's `response_format` (json_object, json_schema), vLLM's
`structured_outputs` (json, regex, choice, grammar, json_object) and llama.cpp's `json_schema` and `grammar`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from pocketmoe.engine.sampler import (
    DRY_BREAKERS,
    LLAMA_CHAIN,
    LLAMA_EXTRA_DEFAULTS,
    MAX_DRY_BREAKER_CHARS,
    MAX_DRY_BREAKERS,
    MAX_LOGPROBS,
    MAX_MIN_KEEP,
    MIROSTAT_CHAIN,
    llama_extras_on,
)
from pocketmoe.engine.structured import Grammar

MAX_STOP = 16          # stop strings per request
MAX_STOP_CHARS = 512   # characters of one stop string (matching is quadratic in it, per token)
MAX_CHOICES = 16       # n (x prompts on /v1/completions)
# chat top_logprobs, prompt_logprobs, n_probs (OpenAI's limit); completions logprobs is capped at 5 as OpenAI does
MAX_TOP_LOGPROBS = MAX_LOGPROBS
MAX_GRAMMAR_CHARS = 65536  # a regex or grammar's text (a JSON schema is bounded by the body cap)
MAX_GRAMMAR_CHOICES = 1024  # structured_outputs.choice
MAX_STOP_TOKEN_IDS = 64
MAX_BUDGET_MESSAGE = 1024  # characters of thinking_budget_message
# set by the request's own fields, or names of the rendering call's parameters
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message",
                                         "self", "source"})

NonNegInt = Annotated[int, Field(ge=0)]
EXTRA_DEFAULTS = LLAMA_EXTRA_DEFAULTS  # llama.cpp's other samplers' knobs at its defaults (SamplingParams')


class RequestError(Exception):
    """An invalid request: becomes a 400 (or `status`) with OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """A field sent as null takes its default (OpenAI's schema makes most fields nullable)."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    def check(self) -> None:
        """The rules that span fields (RequestError); a request body overrides it where it has some."""


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    """response_format.json_schema (OpenAI): the schema the output follows, with its name."""

    name: Annotated[StrictStr, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: StrictStr | None = None
    json_schema: dict[str, Any] | StrictBool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: StrictStr
    json_schema: JsonSchemaFormat | None = None


GrammarText = Annotated[StrictStr, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)]


class StructuredOutputs(_Body):
    """vLLM's structured_outputs: exactly one of the constraints."""

    json_schema: dict[str, Any] | StrictBool | StrictStr | None = Field(default=None, alias="json")
    regex: GrammarText | None = None
    choice: Annotated[list[Annotated[StrictStr, Field(min_length=1)]],
                      Field(min_length=1, max_length=MAX_GRAMMAR_CHOICES)] | None = None
    grammar: GrammarText | None = None
    json_object: bool | None = None


class SamplingFields(_Body):
    """Fields both endpoints share."""

    model: StrictStr | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: dict[StrictStr, Annotated[float, Field(ge=-100, le=100)]] | None = None
    user: StrictStr | None = None
    response_format: ResponseFormat | None = None
    # llama.cpp / vLLM extensions
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repeat_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    ignore_eos: bool = False
    # llama.cpp's other samplers (engine/llama_samplers.py), as llama-server reads them on every route: a request
    # that turns one on is sampled in llama.cpp's order (LLAMA_CHAIN; mirostat: MIROSTAT_CHAIN)
    typical_p: float | None = None
    top_n_sigma: float | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    dynatemp_range: float | None = None
    dynatemp_exponent: float | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: Annotated[int, Field(ge=-1)] | None = None
    dry_sequence_breakers: Annotated[list[Annotated[StrictStr, Field(min_length=1, max_length=MAX_DRY_BREAKER_CHARS)]],
                                     Field(min_length=1, max_length=MAX_DRY_BREAKERS)] | None = None
    mirostat: Annotated[int, Field(ge=0, le=2)] = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    min_keep: Annotated[int, Field(ge=0, le=MAX_MIN_KEEP)] = 0  # top-p, min-p, typical and XTC leave at least this many
    min_tokens: NonNegInt = 0
    stop_token_ids: Annotated[list[NonNegInt], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = False
    # vLLM's: each choice's generated token ids (token_ids) and its prompt's (prompt_token_ids), streamed too
    return_token_ids: bool = False
    # llama.cpp's: with stream, chunks of prompt_progress {total, cache, processed, time_ms} as the prompt is computed
    return_progress: bool = False
    # llama.cpp's: with stream, the timings so far on every chat chunk after the first token (else on the last)
    timings_per_token: bool = False
    structured_outputs: StructuredOutputs | None = None
    json_schema: dict[str, Any] | None = None  # llama.cpp
    grammar: GrammarText | None = None  # llama.cpp (GBNF; Lark also reads)
    # vLLM's: each prompt token's logprob (the first's None) with this many most likely tokens' (not with stream)
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # vLLM's: the prompt's last k tokens alone (-1: the most that leave room for max_tokens, or for one token)
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=-1)] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: str | list[str] | None) -> str | list[str] | None:
        for s in [] if v is None else ([v] if isinstance(v, str) else v):
            if not 0 < len(s) <= MAX_STOP_CHARS:
                raise ValueError(f"each stop string must have 1 to {MAX_STOP_CHARS} characters, not {len(s)}")
        return v

    def extras(self) -> dict[str, Any]:
        """llama.cpp's other samplers' settings (SamplingParams' fields): each as given, else llama.cpp's default; a
        dry_penalty_last_n of -1 is the whole history, as llama.cpp's context is."""
        out: dict[str, Any] = {name: getattr(self, name) if getattr(self, name) is not None else default
                               for name, default in EXTRA_DEFAULTS.items()}
        out["top_n_sigma"] = out["top_n_sigma"] if out["top_n_sigma"] > 0 else -1.0
        out["xtc_probability"] = max(out["xtc_probability"], 0.0)
        out["dry_sequence_breakers"] = tuple(self.dry_sequence_breakers or DRY_BREAKERS)
        out.update(mirostat=self.mirostat, mirostat_tau=self.mirostat_tau, mirostat_eta=self.mirostat_eta,
                   min_keep=self.min_keep)
        return out

    def llama_chain(self) -> tuple[str, ...] | None:
        """The chain a request that turns on one of llama.cpp's other samplers runs (None: it turns on none)."""
        on = llama_extras_on(self.extras())
        return MIROSTAT_CHAIN if "mirostat" in on else LLAMA_CHAIN if on else None

    def stop_list(self) -> tuple[str, ...]:
        return () if self.stop is None else ((self.stop,) if isinstance(self.stop, str) else tuple(self.stop))

    def output_grammar(self) -> tuple[Grammar | None, str]:
        """The structured output this request asks for (None: free text) and the field that asks."""
        asked: list[tuple[Grammar, str]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked.append((Grammar.json_object(), "response_format"))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise RequestError("response_format type 'json_schema' needs a json_schema object (name, schema).",
                                   "response_format.json_schema")
            js = fmt.json_schema
            grammar = Grammar.json_object() if js.json_schema is None else Grammar.json_schema(js.json_schema,
                                                                                                  bool(js.strict))
            asked.append((grammar, "response_format.json_schema"))
        elif fmt is not None and fmt.type != "text":
            raise RequestError(f"response_format type {fmt.type!r} is not one of text, json_object, json_schema.",
                               "response_format.type")
        so = self.structured_outputs
        if so is not None:
            schema = so.json_schema
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise RequestError(f"structured_outputs.json is a string that is not JSON: {e}.",
                                       "structured_outputs.json") from None
            given = [(Grammar.json_schema(schema), "structured_outputs.json")] if schema is not None else []
            given += [(Grammar.regex(so.regex), "structured_outputs.regex")] if so.regex is not None else []
            given += [(Grammar.choice(so.choice), "structured_outputs.choice")] if so.choice is not None else []
            given += [(Grammar("gbnf", so.grammar), "structured_outputs.grammar")] if so.grammar is not None else []
            given += [(Grammar.json_object(), "structured_outputs.json_object")] if so.json_object else []
            if len(given) != 1:
                raise RequestError("structured_outputs takes exactly one of json, regex, choice, grammar, json_object, "
                                   f"not {len(given)}.", "structured_outputs")
            asked += given
        if self.json_schema is not None:
            asked.append((Grammar.json_schema(self.json_schema), "json_schema"))
        if self.grammar is not None:
            asked.append((Grammar("gbnf", self.grammar), "grammar"))
        if len(asked) > 1:
            raise RequestError(f"{asked[0][1]} and {asked[1][1]} both constrain the output; give one of them.",
                               asked[1][1])
        return asked[0] if asked else (None, "")

    def check_common(self) -> None:
        self.output_grammar()
        if self.prompt_logprobs is not None and self.stream:
            raise RequestError("prompt_logprobs are not available when stream is true; leave one of them out.",
                               "prompt_logprobs")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestError(f"min_tokens ({self.min_tokens}) is more than max_tokens ({self.max_tokens}).",
                               "min_tokens")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed when stream is true.", "stream_options")
        if self.truncate_prompt_tokens == 0:
            raise RequestError("truncate_prompt_tokens 0 would leave no prompt; give at least 1, or -1 for as many as "
                               "the context holds.", "truncate_prompt_tokens")


class CompletionRequest(SamplingFields):
    prompt: StrictStr | list[StrictStr] | list[NonNegInt] | list[list[NonNegInt]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    suffix: StrictStr | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None

    def check(self) -> None:
        self.check_common()
        if self.suffix and self.echo:
            raise RequestError("echo gives the prompt back, which with a suffix is a fill-in-the-middle layout, not "
                               "what was sent; leave echo or suffix out.", "echo")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError(f"best_of ({self.best_of}) different from n ({self.n}) is not supported; leave "
                               "best_of out.", "best_of")
        if isinstance(self.prompt, list) and not self.prompt:
            raise RequestError("prompt is an empty list; give a string, a list of strings or token ids.", "prompt")

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class OtherPart(_Body):
    model_config = ConfigDict(strict=True, extra="allow")
    type: StrictStr


class ChatMessage(_Body):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart | OtherPart] | None = None
    name: StrictStr | None = None

    def text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        out = []
        for j, part in enumerate(self.content):
            if not isinstance(part, TextPart):
                raise RequestError(f"messages[{index}].content[{j}] is of type {part.type!r}; this model reads "
                                   "text parts only.", f"messages.{index}.content.{j}.type")
            out.append(part.text)
        return "".join(out)


class FunctionDef(_Body):
    model_config = ConfigDict(strict=True, extra="allow")
    name: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # OpenAI's; "none" renders the chat with enable_thinking false (a block the template opens is closed empty)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # tokens of thought before the block is closed for the model (-1: no bound; default: --reasoning-budget):
    # llama.cpp's name and vLLM's, and the text written before the closing tag then
    thinking_budget_tokens: Annotated[int, Field(ge=-1)] | None = None
    thinking_token_budget: Annotated[int, Field(ge=-1)] | None = None
    thinking_budget_message: Annotated[StrictStr, Field(max_length=MAX_BUDGET_MESSAGE)] | None = None
    # vLLM's chat extensions
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def check(self) -> None:
        self.check_common()
        check_template_options(self)
        if self.reasoning_effort == "none" and (self.chat_template_kwargs or {}).get("enable_thinking") is True:
            raise RequestError("reasoning_effort 'none' asks for no reasoning and chat_template_kwargs.enable_thinking "
                               "for it; give one of them.", "reasoning_effort")
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs set to true.", "top_logprobs")
        self.forced_tool()
        self.thinking_budget(-1)

    def thinking_budget(self, default: int) -> int:
        """The reasoning budget this request asks for (-1: no bound), else `default` (the server's)."""
        given = {v for v in (self.thinking_budget_tokens, self.thinking_token_budget) if v is not None}
        if len(given) > 1:
            raise RequestError(f"thinking_budget_tokens ({self.thinking_budget_tokens}) and thinking_token_budget "
                               f"({self.thinking_token_budget}) differ; give one of them.", "thinking_token_budget")
        return given.pop() if given else default

    def forced_tool(self) -> tuple[bool, str | None]:
        """Whether tool_choice makes the output tool calls ("required", or a named function), and the name."""
        choice = self.tool_choice
        if choice in (None, "none", "auto"):
            return False, None
        if choice != "required" and not isinstance(choice, dict):
            raise RequestError(f"tool_choice {choice!r} is not one of 'none', 'auto', 'required' or "
                               "{'type': 'function', 'function': {'name': ...}}.", "tool_choice")
        if not self.tools:
            raise RequestError("tool_choice asks for a tool call but the request has no tools; give tools or "
                               "leave tool_choice out.", "tool_choice")
        if choice == "required":
            return True, None
        fn = choice.get("function") if isinstance(choice, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise RequestError("a named tool_choice is {'type': 'function', 'function': {'name': ...}}.",
                               "tool_choice")
        if name not in [t.function.name for t in self.tools]:
            raise RequestError(f"tool_choice names the function {name!r}, which is not among the request's tools.",
                               "tool_choice")
        return True, name

    @property
    def tool_dicts(self) -> list[dict[str, Any]]:
        """The request's tools as the chat template and the parser read them ([] without tools)."""
        return [t.model_dump(exclude_none=True) for t in self.tools or []]


def chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    """A chat request built from another API's (the Responses and Messages adapters), validated and checked as the
    chat route's own body is."""
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise pydantic_error(e.errors()) from None
    req.check()
    return req


class ChatStreamReader:
    """What the chat route's chunk stream (n=1, usage at the end) has said so far, for the adapters that turn it
    into another API's events: read(chunk) gives the choice's delta (None for a chunk with none) and keeps its
    finish reason, stop reason (the stop string or end token id), the usage, and the chunk's logprob entries."""

    def __init__(self) -> None:
        self.logprobs: list[dict[str, Any]] = []
        self.finish: str | None = None
        self.stop_reason: str | int | None = None
        self.usage: dict[str, Any] | None = None

    def read(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        if not chunk.get("choices"):
            return None
        choice = chunk["choices"][0]
        self.logprobs = (choice.get("logprobs") or {}).get("content") or []
        self.finish = choice.get("finish_reason") or self.finish
        if choice.get("stop_reason") is not None:
            self.stop_reason = choice["stop_reason"]
        return choice["delta"]


def template_variables(req: ChatCompletionRequest | TokenizeRequest, defaults: Mapping[str, Any] | None = None
                       ) -> dict[str, Any]:
    """The extra variables the chat template renders with: the server's `defaults` (--chat-template-kwargs), then
    enable_thinking false where reasoning_effort is "none" and true where it is another effort, then the request's
    chat_template_kwargs; `thinking` (DeepSeek-V3.1's name for it, as llama.cpp passes it) follows enable_thinking
    unless the request gives it, or the defaults do and the request leaves enable_thinking alone."""
    effort = getattr(req, "reasoning_effort", None)
    chosen = {} if effort is None else {"enable_thinking": effort != "none"}
    chosen.update(req.chat_template_kwargs or {})
    out = {**(defaults or {}), **chosen}
    if "enable_thinking" in out and "thinking" not in chosen and ("enable_thinking" in chosen or
                                                                  "thinking" not in (defaults or {})):
        out["thinking"] = out["enable_thinking"]
    return out


def check_template_options(req: ChatCompletionRequest | TokenizeRequest) -> None:
    """vLLM's chat template options: extra variables that do not replace the ones the server sets, and
    continue_final_message (the last assistant message goes on) instead of a generation prompt."""
    clash = sorted(RESERVED_TEMPLATE_VARIABLES & set(req.chat_template_kwargs or {}))
    if clash:
        raise RequestError(f"chat_template_kwargs may not set {', '.join(clash)}; the request's own fields do.",
                           "chat_template_kwargs")
    if req.continue_final_message and req.add_generation_prompt:
        raise RequestError("continue_final_message continues the last assistant message, so it needs "
                           "add_generation_prompt set to false.", "continue_final_message")


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template reads them: role, text content (parts joined), and the rest
    of each message as sent (tool_calls, tool_call_id, name)."""
    out = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        d["content"] = m.text(i)
        out.append(d)
    return out


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's route, and llama-server's): a prompt's token ids, or those of chat messages the template
    renders. llama-server's fields: `content` (the text; BOS only with add_special, as it does), `parse_special`
    (special-token texts become their tokens; default true) and `with_pieces` (each id with its text)."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    content: StrictStr | None = None  # llama-server's prompt
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None  # BOS (and EOS) as the file asks (prompt: default true); false: none
    add_special: bool | None = None  # llama-server's name of it (content: default false)
    parse_special: bool = True
    with_pieces: bool = False
    add_generation_prompt: bool = True  # messages: end with the assistant's turn opening, as a chat request does
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        check_template_options(self)
        given = [name for name in ("prompt", "content", "messages") if getattr(self, name) is not None]
        if len(given) != 1:
            raise RequestError("give one of prompt or content (text) or messages (a chat), not "
                               f"{' and '.join(given) if given else 'none'}.", given[-1] if given else "messages")
        if self.add_special is not None and self.add_special_tokens is not None \
                and self.add_special != self.add_special_tokens:
            raise RequestError("add_special and add_special_tokens differ; give one of them.", "add_special")

    @property
    def text(self) -> str | None:
        return self.prompt if self.prompt is not None else self.content

    @property
    def add_bos(self) -> bool:
        """Whether the text gets the file's BOS (and EOS): vLLM's default for prompt, llama-server's for content."""
        asked = self.add_special_tokens if self.add_special_tokens is not None else self.add_special
        return asked if asked is not None else self.prompt is not None


class ApplyTemplateRequest(TokenizeRequest):
    """POST /apply-template (llama.cpp's route): the text of chat messages as the template renders them."""

    def check(self) -> None:
        check_template_options(self)
        if self.messages is None or self.text is not None:
            raise RequestError("/apply-template renders messages; give messages (and no prompt).", "messages")


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's route): the text of token ids."""

    model: StrictStr | None = None
    tokens: list[NonNegInt]

    def check(self) -> None:
        """Nothing past the field types: the ids are checked against the served tokenizer's vocabulary."""


def truncate_prompt(ids: list[int], truncate: int | None, max_len: int, room: int = 0) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last k of a prompt's ids (None: all of them; -1: the most that leave `room`
    tokens of a context of max_len free), or a RequestError where k is past the context or no room is left."""
    if truncate is None:
        return ids
    if truncate > max_len:
        raise RequestError(f"truncate_prompt_tokens is {truncate} but this server's context holds {max_len} "
                           "(--max-model-len); give at most that, or -1.", "truncate_prompt_tokens")
    keep = max_len - room if truncate == -1 else truncate  # 0 and below -1 are refused where the request is checked
    if keep < 1:
        raise RequestError(f"max_tokens {room} leaves no room for a prompt in this server's context of {max_len} "
                           "tokens (--max-model-len); ask for fewer tokens.", "max_tokens",
                           code="context_length_exceeded")
    return ids[-keep:]


def pydantic_error(errors: list[dict[str, Any]]) -> RequestError:
    """The first validation error as one sentence naming the field."""
    e = errors[0]
    loc = ".".join(str(x) for x in e.get("loc", ()) if not (isinstance(x, str) and x.endswith("]")))
    if e.get("type") == "json_invalid":
        return RequestError(f"the request body is not valid JSON: {e.get('msg', '')}.", None)
    if e.get("type") == "missing":
        return RequestError(f"the field {loc!r} is required.", loc or None)
    if e.get("type") == "model_type" and not loc:
        return RequestError("the request body must be a JSON object.", None)
    msg = str(e.get("msg", "invalid value")).rstrip(".")
    got = e.get("input")
    shown = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
    return RequestError(f"{loc or 'the body'}: {msg} (got {shown[:80]}).", loc or None)
