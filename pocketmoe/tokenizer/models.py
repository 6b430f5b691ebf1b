"""The two word models llama.cpp has for LLM vocabularies: byte-level BPE ("gpt2") and SPM ("llama")."""

from __future__ import annotations

import heapq
import warnings
from functools import lru_cache

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from pocketmoe.tokenizer.pretokenize import split_words


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable code points."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_unicode().items()}


@lru_cache(maxsize=1)
def _latin1_to_symbol() -> dict[int, str]:
    return dict(byte_to_unicode())


def bytes_to_symbols(data: bytes) -> str:
    return data.decode("latin-1").translate(_latin1_to_symbol())


def symbols_to_bytes(text: str) -> bytes:
    table = unicode_to_byte()
    return b"".join(bytes([table[c]]) if c in table else c.encode("utf-8") for c in text)


class ByteLevelBPE:
    """GPT-2 style BPE: llama.cpp's word splitting, byte-level symbols, merges by rank (HF tokenizers)."""

    def __init__(self, tokens: list[str], merges: list[str], pre: str) -> None:
        vocab = {text: i for i, text in enumerate(tokens)}
        pairs: list[tuple[str, str]] = []
        dropped = 0
        for m in merges:
            pos = m.find(" ", 1)  # llama.cpp splits at the first space after the first character
            a, b = (m[:pos], m[pos + 1:]) if pos >= 0 else ("", "")
            if a in vocab and b in vocab and a + b in vocab:
                pairs.append((a, b))
            else:
                dropped += 1
        if dropped:
            warnings.warn(f"{dropped} BPE merges name tokens missing from the vocabulary and were ignored",
                          stacklevel=2)
        self.pre = pre
        self._tk = HFTokenizer(BPE(vocab=vocab, merges=pairs))

    def encode(self, text: str) -> list[int]:
        words = [bytes_to_symbols(w.encode("utf-8")) for w in split_words(text, self.pre)]
        if not words:
            return []
        return self._tk.encode(words, is_pretokenized=True, add_special_tokens=False).ids


class SentencePieceBPE:
    """llama.cpp's SPM tokenizer: merge the adjacent pair whose join is the highest-scoring token
    (ties: leftmost), over the whole fragment; symbols that are not tokens fall back to <0xXX> bytes."""

    def __init__(self, tokens: list[str], scores: list[float]) -> None:
        self._ids = {text: i for i, text in enumerate(tokens)}
        self._scores = scores
        self._byte_ids: list[int | None] = []
        for b in range(256):
            tid = self._ids.get(f"<0x{b:02X}>")
            if tid is None and b < 128:
                tid = self._ids.get(chr(b))
            self._byte_ids.append(tid)

    def encode(self, text: str) -> list[int]:
        syms = list(text)
        n = len(syms)
        prev = list(range(-1, n - 1))
        nxt = [i + 1 if i + 1 < n else -1 for i in range(n)]
        heap: list[tuple[float, int, int, str]] = []

        def push(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            joined = syms[left] + syms[right]
            tid = self._ids.get(joined)
            if tid is not None:
                heapq.heappush(heap, (-self._scores[tid], left, right, joined))

        for i in range(1, n):
            push(i - 1, i)
        while heap:
            _, left, right, joined = heapq.heappop(heap)
            if not syms[left] or not syms[right] or syms[left] + syms[right] != joined:
                continue
            syms[left], syms[right] = joined, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])
        out: list[int] = []
        i = 0 if n else -1
        while i != -1:
            tid = self._ids.get(syms[i])
            if tid is not None:
                out.append(tid)
            else:
                out.extend(t for b in syms[i].encode("utf-8") if (t := self._byte_ids[b]) is not None)
            i = nxt[i]
        return out
