"""Split text into BPE words exactly the way llama.cpp does for each `tokenizer.ggml.pre` type.

llama.cpp applies a list of regexes in turn; each one splits every piece left by the previous one,
keeping both the matches and the text between them. Regexes that name a unicode category (\\p{L},
\\p{N}, ...) run on a "collapsed" copy of the text where every non-ASCII code point is replaced by one
stand-in character for its category (whitespace first), and the category is rewritten to that
stand-in plus its ASCII members. The other regexes run on the text with non-ASCII whitespace replaced
by \\v. `\\s` only ever sees ASCII whitespace. We do the same with Python's `re`, so the quirks of that
scheme (e.g. U+3000 not matching a literal class that contains it) are reproduced too.
"""

from __future__ import annotations

import re
import unicodedata
import warnings
from collections.abc import Callable
from functools import cache

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTION = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"  # (?i:'s|'t|'re|'ve|'m|'ll|'d)

# written as escapes: several of these code points (U+1F7D, U+2126, U+212A, ...) do not survive NFC
_DEEPSEEK_LLM_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd"
    "\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d"
    "\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
    "\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec"
    "\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b"
    "\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787"
    "\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)

# pre type -> llama.cpp's regex list (src/llama-vocab.cpp, llm_tokenizer_bpe)
PRE_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"),
    "gpt-2": (_GPT2,),
    "deepseek-llm": (
        "[\r\n]",
        r"\s?[" + _DEEPSEEK_LLM_LETTERS + "]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        r"\s+$",
        "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
        r"\p{N}+",
    ),
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}"),
    "deepseek-v3": (
        r"\p{N}{1,3}",
        "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    # GPT-4o's o200k split, which MiniMax-M2's tokenizer uses: a word's letters are upper-case ones then lower-case
    # ones (or the reverse) with an English contraction after them (llama.cpp spells tokenizer.json's
    # \p{Lu}/\p{Ll} classes with lookaheads over \p{L}, so a non-ASCII letter counts as both cases)
    "gpt-4o": (
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTION +
        r"?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTION +
        r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
}
PRE_ALIASES = {"gpt2": "gpt-2", "deepseek3-llm": "deepseek-v3", "minimax-m2": "gpt-4o"}

# category stand-ins and the ASCII members llama.cpp adds for each \p{X} (unicode.cpp)
_CATEGORY_CHAR = {"N": "\xd1", "L": "\xd2", "P": "\xd3", "M": "\xd4", "S": "\xd5"}
_CATEGORY_ASCII = {
    "N": "0-9",
    "L": "A-Za-z",
    "P": r"!-#%-*,-/:-;?-@\[-\]_\{\}",
    "M": "",
    "S": r"\$\+<->\^`\|~",
}
_CATEGORY_RE = re.compile(r"\\p\{(N|L|P|M|S|Lu|Ll|Lt|Lm|Lo)\}")
_WHITESPACE = frozenset(
    [0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029,
     0x202F, 0x205F, 0x3000]
)


def resolve_pre(pre: str | None) -> str:
    """The pre type we split with: llama.cpp's name, an alias of it, or gpt2 (with a warning)."""
    if not pre:
        return "default"
    pre = PRE_ALIASES.get(pre, pre)
    if pre not in PRE_REGEXES and pre not in PRE_SPLITTERS:
        warnings.warn(f"unknown tokenizer.ggml.pre {pre!r}; splitting words with the gpt-2 regex",
                      stacklevel=2)
        return "gpt-2"
    return pre


class _CollapseTable(dict):
    """str.translate table: non-ASCII code point -> its category stand-in (computed on first use)."""

    def __missing__(self, cp: int) -> str:
        if cp in _WHITESPACE:
            out = "\x0b"
        else:
            out = _CATEGORY_CHAR.get(unicodedata.category(chr(cp))[0], "\xd0")
        self[cp] = out
        return out


_COLLAPSE = _CollapseTable({cp: chr(cp) for cp in range(128)})
_WIDE = {cp: "\x0b" for cp in _WHITESPACE if cp >= 128}


def _collapse_text(text: str) -> str:
    return text.translate(_COLLAPSE)


def _wide_text(text: str) -> str:
    return text.translate(_WIDE)


def _collapse_regex(expr: str) -> str:
    out: list[str] = []
    inside = False
    i = 0
    while i < len(expr):
        c = expr[i]
        if c == "[" and (i == 0 or expr[i - 1] != "\\"):
            inside = True
        elif c == "]" and inside and expr[i - 1] != "\\":
            inside = False
        m = _CATEGORY_RE.match(expr, i)
        if m:
            cat = m.group(1)[0]
            body = _CATEGORY_CHAR[cat] + _CATEGORY_ASCII[cat]
            out.append(body if inside else f"[{body}]")
            i = m.end()
            continue
        out.append(c)
        i += 1
    return "".join(out)


@cache
def _compile(expr: str) -> tuple[re.Pattern[str], bool]:
    """(pattern, uses_collapsed_text); ECMAScript `$` is end of input, so it becomes `\\Z`."""
    if expr == _GPT2:
        expr = _GPT2 + r"|\s+"  # llama.cpp's hand-written gpt2 splitter also takes lone whitespace
    collapsed = _CATEGORY_RE.search(expr) is not None
    if collapsed:
        expr = _collapse_regex(expr)
    if expr.endswith("$") and not expr.endswith("\\$"):
        expr = expr[:-1] + r"\Z"
    return re.compile(expr, re.ASCII), collapsed


def _split_pieces(view: str, lengths: list[int], pattern: re.Pattern[str]) -> list[int]:
    out: list[int] = []
    start = 0
    for n in lengths:
        end = start + n
        pos = start
        for m in pattern.finditer(view, start, end):  # endpos: lookaheads and \Z stop at the piece end
            if m.start() > pos:
                out.append(m.start() - pos)
            out.append(m.end() - m.start())
            pos = m.end()
        if pos < end:
            out.append(end - pos)
        start = end
    return out


def _is_han(cp: int) -> bool:
    """llama.cpp's Han ranges: CJK unified ideographs, extensions A to F, compatibility ideographs."""
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2EBEF or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def _kimi_k2_lengths(text: str) -> list[int]:
    """Kimi-K2's split as llama.cpp's scanner makes it (not quite its tokenizer.json regex: a word's letters are
    taken whatever their case). In turn: a run of Han characters; an optional leading character that is not a
    newline, letter or digit, then non-Han letters and an English contraction; up to three digits; an optional
    space, then characters that are not whitespace, letters or digits, then newlines; whitespace up to its last
    newline; whitespace but its last character where more text follows; whitespace; any one character."""
    n = len(text)
    cps = [ord(c) for c in text]
    cats = [unicodedata.category(c)[0] for c in text]

    def letter(i: int) -> bool:  # a non-Han letter
        return i < n and cats[i] == "L" and not _is_han(cps[i])

    def plain(i: int) -> bool:  # in the text, and not whitespace, a letter or a digit
        return i < n and cps[i] not in _WHITESPACE and cats[i] not in "LN"

    out: list[int] = []
    pos = 0
    while pos < n:
        start, cp = pos, cps[pos]
        if _is_han(cp):
            while pos < n and _is_han(cps[pos]):
                pos += 1
        elif letter(pos) or (cp not in (10, 13) and cats[pos] not in "LN" and letter(pos + 1)):
            pos += 1
            while letter(pos):
                pos += 1
            if pos + 1 < n and cps[pos] == 39:  # an apostrophe: 's 't 'm 'd, or 're 've 'll, either case
                one, two = text[pos + 1].lower(), text[pos + 2].lower() if pos + 2 < n else ""
                pos += 2 if one in ("s", "t", "m", "d") else 3 if one + two in ("re", "ve", "ll") else 0
        elif cats[pos] == "N":
            pos += 1
            while pos < n and cats[pos] == "N" and pos - start < 3:
                pos += 1
        elif plain(pos + 1 if cp == 32 else pos):
            pos += 1
            while plain(pos):
                pos += 1
            while pos < n and cps[pos] in (10, 13):
                pos += 1
        else:
            end = pos
            while end < n and cps[end] in _WHITESPACE:
                end += 1
            newline = max((i + 1 for i in range(pos, end) if cps[i] in (10, 13)), default=0)
            pos = newline if newline else end - 1 if end - pos > 1 and end < n else max(end, pos + 1)
        out.append(pos - start)
    return out


# pre types llama.cpp splits with a hand-written scanner rather than its regexes: the words' lengths
PRE_SPLITTERS: dict[str, Callable[[str], list[int]]] = {"kimi-k2": _kimi_k2_lengths}


def split_words(text: str, pre: str) -> list[str]:
    """Words of `text` (code points, not bytes) for pre type `pre` (already resolved)."""
    if not text:
        return []
    views: dict[bool, str] = {}
    view_of: dict[bool, Callable[[str], str]] = {True: _collapse_text, False: _wide_text}
    lengths = PRE_SPLITTERS[pre](text) if pre in PRE_SPLITTERS else [len(text)]
    for expr in PRE_REGEXES.get(pre, ()):
        pattern, collapsed = _compile(expr)
        if collapsed not in views:
            views[collapsed] = view_of[collapsed](text)
        lengths = _split_pieces(views[collapsed], lengths, pattern)
    words: list[str] = []
    start = 0
    for n in lengths:
        words.append(text[start:start + n])
        start += n
    return words
