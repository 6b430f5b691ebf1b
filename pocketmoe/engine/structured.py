"""Structured output: a grammar every generated token must keep the output inside.

A request may ask for JSON (any object, or one that follows a JSON schema), text matching a regular
expression, one of a list of strings, or a context-free grammar (Lark or llama.cpp's GBNF). llguidance
compiles it against the model's vocabulary and, before each draw, gives the tokens that keep the output
a prefix of some sentence of the grammar; the sampler sets every other logit to -inf after the penalties and
the logit bias, ahead of temperature and the filters. Once the grammar is complete only the end-of-generation
tokens are allowed, so the engine ends a constrained sequence there with finish reason "stop" (or "length"
when max_tokens cuts it first).

Legend: V vocab.
"""

from __future__ import annotations

import functools
import json
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from pocketmoe.errors import PocketMoEError

if TYPE_CHECKING:
    import llguidance

    from pocketmoe.tokenizer import Tokenizer

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "lark", "gbnf"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "lark", "gbnf")
_SPECIAL_PREFIX = b"\xff"  # llguidance's mark of a special token: no grammar text can contain it
# Whitespace between JSON tokens, as llama.cpp's JSON-schema grammars allow it: one space, or one or two newlines
# and an indent of at most 20. Any run of whitespace would let a model that likes blanks fill max_tokens with them
# (small models do) instead of going on with the document.
JSON_WHITESPACE = r"(?: |\n{1,2}[ \t]{0,20})"


class GrammarError(PocketMoEError, ValueError):
    """A grammar that does not compile, or structured output asked of an install without llguidance."""


@dataclass(frozen=True)
class Grammar:
    """What the output must match. source: the schema as JSON text (json_schema), the regex, the choices as a
    JSON list, or the grammar text; strict=False lets a JSON schema carry keywords the compiler does not know
    (they are then not enforced)."""

    kind: GrammarKind
    source: str = ""
    strict: bool = True

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool, strict: bool = True) -> Grammar:
        return cls("json_schema", json.dumps(schema), strict)  # key order kept: properties come out in it

    @classmethod
    def json_object(cls) -> Grammar:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: list[str]) -> Grammar:
        return cls("choice", json.dumps(list(options)))

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"grammar kind {self.kind!r} is not one of {', '.join(KINDS)}.")
        if self.kind == "choice" and not json.loads(self.source or "[]"):
            raise GrammarError("a choice grammar needs at least one string to choose from.")

    @functools.cached_property
    def compiled(self) -> str:
        """The llguidance grammar (GrammarError where the source does not parse); built once, however many
        sequences (the n choices of a request) and checks use it."""
        llg = _llguidance()
        try:
            if self.kind in ("json_object", "json_schema"):
                schema = self.source if self.kind == "json_schema" else {"type": "object"}
                options = {"lenient": not self.strict, "whitespace_pattern": JSON_WHITESPACE}
                return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
            return llg.grammar_from(self.kind, self.source)  # regex, choice (a JSON list), lark, gbnf
        except ValueError as e:
            raise GrammarError(f"the {self.kind} grammar does not parse ({_one_line(str(e))}); fix it.") from None


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise GrammarError("structured output needs the llguidance package, which is not installed; "
                           "pip install llguidance.") from None
    return llguidance


class _VocabView:
    """Our tokenizer as llguidance's TokenizerWrapper reads one: every id's bytes (special tokens marked)."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self.eos_token_id = tok.eot_ids[0] if tok.eot_ids else tok.eos_id
        self.bos_token_id = tok.bos_id
        self.special_token_ids = [i for i in range(tok.vocab_size) if tok.is_special(i)]
        special = set(self.special_token_ids)
        self.tokens = [_SPECIAL_PREFIX + tok.token_to_piece(i) if i in special else tok.token_to_piece(i)
                       for i in range(tok.vocab_size)]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tok.encode(text, add_bos=False, parse_special=False, space_prefix=False)


_LL_TOKENIZERS: weakref.WeakKeyDictionary[Tokenizer, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()


def ll_tokenizer(tok: Tokenizer) -> llguidance.LLTokenizer:
    """The llguidance view of `tok` (built once per tokenizer): its end-of-generation ids end a grammar."""
    if tok not in _LL_TOKENIZERS:
        llg = _llguidance()
        eos = list(tok.eot_ids) or ([tok.eos_id] if tok.eos_id is not None else [])
        if not eos:
            raise GrammarError("this model's tokenizer has no end-of-generation token, so a constrained output "
                               "could never end; structured output is not available for it.")
        _LL_TOKENIZERS[tok] = llg.LLTokenizer(llg.TokenizerWrapper(_VocabView(tok)), eos_token=eos)
    return _LL_TOKENIZERS[tok]


def check_grammar(grammar: Grammar, tok: Tokenizer) -> None:
    """GrammarError, saying why, where the grammar does not compile for this model."""
    err = _llguidance().LLMatcher.validate_grammar(grammar.compiled, ll_tokenizer(tok))
    if err:
        raise GrammarError(f"the {grammar.kind} grammar does not compile ({_one_line(err)}); fix it.")


def _one_line(message: str, limit: int = 300) -> str:
    text = " ".join(message.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


class Constraint:
    """One sequence's place in its grammar: the tokens allowed next, advanced by each token drawn."""

    def __init__(self, grammar: Grammar, tok: Tokenizer) -> None:
        llg = _llguidance()
        self.grammar = grammar
        self.n_vocab = tok.vocab_size
        self._matcher = llg.LLMatcher(ll_tokenizer(tok), grammar.compiled, log_level=0)
        self._raise_if_error()

    def _raise_if_error(self) -> None:
        if self._matcher.is_error():
            raise GrammarError(f"the {self.grammar.kind} grammar failed ({_one_line(self._matcher.get_error())}).")

    def allowed(self) -> torch.Tensor:
        """bool [V]: the tokens that keep the output inside the grammar."""
        self._raise_if_error()
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), np.uint8), bitorder="little")
        return torch.from_numpy(bits[:self.n_vocab].astype(bool))

    def mask_(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] (model-sized: ids past the tokenizer's vocabulary are never allowed) with every token the
        grammar does not allow set to -inf, in place."""
        allowed = self.allowed()
        logits[:self.n_vocab].masked_fill_(~allowed, -torch.inf)
        logits[self.n_vocab:] = -torch.inf
        return logits

    def accept(self, token: int) -> None:
        """Advance past the drawn token (GrammarError if the grammar did not allow it)."""
        if not self._matcher.consume_token(int(token)):
            raise GrammarError(f"token {token} does not continue the {self.grammar.kind} grammar "
                               f"({_one_line(self._matcher.get_error())}).")

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and takes nothing more but an end-of-generation token."""
        return self._matcher.is_stopped()
