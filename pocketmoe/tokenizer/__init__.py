"""Tokenizer from GGUF metadata (byte-level BPE and SPM, as llama.cpp), chat templates, streaming."""

from pocketmoe.tokenizer.chat import DEEPSEEK_V2_CHAT_TEMPLATE, ChatTemplateError, render_chat
from pocketmoe.tokenizer.stream import StreamDecoder
from pocketmoe.tokenizer.tokenizer import Tokenizer, TokenizerError

__all__ = [
    "DEEPSEEK_V2_CHAT_TEMPLATE",
    "ChatTemplateError",
    "StreamDecoder",
    "Tokenizer",
    "TokenizerError",
    "render_chat",
]
