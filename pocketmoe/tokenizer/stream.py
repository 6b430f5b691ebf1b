"""Incremental detokenization: text comes out only once its UTF-8 bytes are complete."""

from __future__ import annotations

import codecs
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pocketmoe.tokenizer.tokenizer import Tokenizer


class StreamDecoder:
    """Feed generated token ids one at a time; each `push` returns the newly completed text.

    A token may end in the middle of a multi-byte character (byte-level BPE, <0xXX> byte tokens);
    those bytes are held until the character completes. Bytes that can never form a character come
    out as U+FFFD. `flush` returns whatever is held at the end of the stream.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tok.token_to_piece(token_id, special=not self._skip_special))

    def push_many(self, token_ids: list[int]) -> str:
        return "".join(self.push(t) for t in token_ids)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
