"""A reasoning budget: at most so many tokens of thought, then the block is closed for the model.

A thinking model writes `<think> ... </think>` and then its answer, and nothing in the model bounds the block.
llama.cpp's `--reasoning-budget` (and `thinking_budget_tokens`), vLLM's `thinking_token_budget` and Anthropic's
`thinking.budget_tokens` bound it: once the output has spent the budget inside blocks, the sampler writes a message
(empty unless asked for) and the closing tag itself, token by token, and the model goes on from there to its
answer. The budget is the whole output's, as Anthropic counts it: a block the model opens after it is spent is
closed at once. The count stops until a token completes the UTF-8 character it began, so the thought never ends in
half a character. A block ended by the model before the budget is spent leaves the output as it would have been.

Legend: the tags are token sequences (one token each in the models that think; text of several tokens also matches,
where the model writes it with those same tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pocketmoe.errors import PocketMoEError

if TYPE_CHECKING:
    from pocketmoe.tokenizer import Tokenizer

OPEN_TAG, CLOSE_TAG = "<think>", "</think>"


class ReasoningBudgetError(PocketMoEError, ValueError):
    """A reasoning budget that cannot work: negative, or tags with no tokens."""


@dataclass(frozen=True)
class ReasoningBudget:
    """tokens: the thought's length in tokens (0: a block is closed as soon as it opens). start, end: the token ids
    of the opening and closing tags; forced: what the sampler writes when the budget is spent (a message, then the
    closing tag); inside: the prompt ends inside an open block (a template that opens it), so the output starts in
    one."""

    tokens: int
    start: tuple[int, ...]
    end: tuple[int, ...]
    forced: tuple[int, ...]
    inside: bool = False

    def __post_init__(self) -> None:
        if self.tokens < 0:
            raise ReasoningBudgetError(f"a reasoning budget of {self.tokens} tokens must be >= 0 (leave it out for "
                                       "no bound).")
        if not self.start or not self.end or not self.forced:
            raise ReasoningBudgetError("a reasoning budget needs the token ids of the opening and closing tags and "
                                       "of what it writes when spent.")

    @classmethod
    def for_tokenizer(cls, tok: Tokenizer, tokens: int, message: str = "", inside: bool = False) -> ReasoningBudget:
        """The budget for a model that writes `<think> ... </think>`, its tags as `tok` reads them (one special
        token each where the vocabulary has them); when spent it writes `message` and `</think>`, as llama.cpp
        does."""
        def ids(text: str) -> tuple[int, ...]:
            return tuple(tok.encode(text, add_bos=False, parse_special=True, space_prefix=False))

        return cls(tokens, ids(OPEN_TAG), ids(CLOSE_TAG), ids(message + CLOSE_TAG), inside)


class _Matcher:
    """Finds a token sequence in a stream of tokens, one token at a time."""

    def __init__(self, seq: tuple[int, ...]) -> None:
        self.seq, self.at = seq, 0

    def push(self, token: int) -> bool:
        """Whether `token` completes the sequence."""
        if token == self.seq[self.at]:
            self.at += 1
        else:  # the tags have no repeated prefix: a mismatch can only restart the match at this token
            self.at = 1 if token == self.seq[0] else 0
        if self.at == len(self.seq):
            self.at = 0
            return True
        return False


def _utf8_owed(owed: int, piece: bytes) -> int:
    """The continuation bytes a UTF-8 text still owes after `piece`, `owed` before it."""
    for b in piece:
        if owed and 0x80 <= b < 0xC0:
            owed -= 1
        else:
            owed = 3 if b >= 0xF0 else 2 if b >= 0xE0 else 1 if b >= 0xC0 else 0
    return owed


class BudgetTracker:
    """One sequence's place under its reasoning budget: `forced()` gives the token the sampler must write next
    (None: draw as usual), `accept(token)` moves on past each token of the output."""

    def __init__(self, budget: ReasoningBudget, tok: Tokenizer | None = None) -> None:
        self.budget = budget
        self.left = budget.tokens
        self.inside = budget.inside  # in a block the model opened (or the prompt did)
        self.spent = False          # the budget ran out; forcing the closing tag (after the character ends)
        self._forcing = -1          # index of the next forced token (-1: not forcing)
        self._owed = 0              # UTF-8 continuation bytes the output still owes
        self._tok = tok
        self._start, self._end = _Matcher(budget.start), _Matcher(budget.end)
        if self.inside and self.left == 0:
            self._spend()

    def forced(self) -> int | None:
        return self.budget.forced[self._forcing] if self._forcing >= 0 else None

    def _spend(self) -> None:
        self.spent = True
        if not self._owed:
            self._forcing = 0

    def accept(self, token: int) -> None:
        if self._forcing >= 0:
            if token != self.budget.forced[self._forcing]:
                raise ReasoningBudgetError(f"token {token} was drawn where the reasoning budget writes "
                                           f"{self.budget.forced[self._forcing]}.")
            self._forcing += 1
            if self._forcing == len(self.budget.forced):
                self._forcing, self.inside, self.spent = -1, False, False
                self._start.at = self._end.at = 0
            return
        if self._tok is not None:
            self._owed = _utf8_owed(self._owed, self._tok.token_to_piece(token))
        if not self.inside:
            if self._start.push(token):
                self.inside = True
                if self.left == 0:
                    self._spend()
            return
        if self._end.push(token):
            self.inside, self.spent = False, False
            return
        if self.spent:  # waiting for the character to end
            if not self._owed:
                self._forcing = 0
            return
        self.left -= 1
        if self.left == 0:
            self._spend()
