"""Chat templates rendered with jinja2 the way HF transformers does (sandboxed, trim/lstrip blocks)."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pocketmoe.errors import PocketMoEError

# DeepSeek-V2-Chat / V2-Lite-Chat tokenizer_config.json
DEEPSEEK_V2_CHAT_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ 'User: ' + message['content'] + '\\n\\n' }}{% elif message['role'] == 'assistant' %}"
    "{{ 'Assistant: ' + message['content'] + eos_token }}{% elif message['role'] == 'system' %}"
    "{{ message['content'] + '\\n\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


class ChatTemplateError(PocketMoEError):
    """The chat template failed to compile or render (it may call raise_exception itself)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from e


def render_chat(source: str, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                **variables: Any) -> str:
    """Render `source` with `messages`, `add_generation_prompt` and extra variables (bos_token, ...)."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ChatTemplateError(f"chat message {i} must be a dict with a 'role' key, got {m!r}.")
    try:
        return compile_template(source).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed to render: {e}") from e
