"""One forward pass over several sequences: which tokens, at which positions, in which cache rows.

A `Step` lists, per sequence, a run of consecutive tokens (a prefill chunk, or one decode token) and
whether its last token needs logits. `StepContext.build` turns it into the flat per-token arrays the
ops read; the model never learns how many sequences share the step.

Legend: T tokens of the step, S sequences, P pages per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pocketmoe.engine.kv_cache import ContextLengthError, PagedKVCache
from pocketmoe.errors import PocketMoEError

ROWS = ("last", "all", "none")
HIDDEN_ROWS = ("none", "first", "last", "all")


@dataclass(frozen=True)
class SeqChunk:
    """Tokens of sequence `seq` at positions start.., following the positions already in its cache."""

    seq: object
    tokens: Sequence[int]
    start: int
    logits: str = "last"  # "last" | "all" | "none": which of these tokens' logits the step returns
    # "none" | "first" | "last" | "all": which of these tokens' final hidden states (after the output norm, the
    # head's input: what embeddings pool) the step returns
    hidden: str = "none"

    def __post_init__(self) -> None:
        if len(self.tokens) == 0:
            raise PocketMoEError(f"sequence {self.seq!r} has no tokens in this step.")
        if self.start < 0:
            raise ContextLengthError(f"sequence {self.seq!r} starts at position {self.start}; positions are >= 0.")
        if self.logits not in ROWS:
            raise PocketMoEError(f"logits={self.logits!r} is not one of {', '.join(ROWS)}.")
        if self.hidden not in HIDDEN_ROWS:
            raise PocketMoEError(f"hidden={self.hidden!r} is not one of {', '.join(HIDDEN_ROWS)}.")

    def rows(self, which: str, first: int) -> np.ndarray:
        """The step rows of this chunk's tokens `which` names ("none", "first", "last", "all"), its first at row
        `first`."""
        n = len(self.tokens)
        return {"none": np.zeros(0, dtype=np.int64), "first": np.array([first]), "last": np.array([first + n - 1]),
                "all": np.arange(first, first + n)}[which]


@dataclass(frozen=True)
class Step:
    chunks: tuple[SeqChunk, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunks", tuple(self.chunks))
        if not self.chunks:
            raise PocketMoEError("a step needs at least one sequence.")
        seqs = [c.seq for c in self.chunks]
        if len(set(seqs)) != len(seqs):
            raise PocketMoEError("a sequence appears twice in one step; give its tokens as one chunk.")


@dataclass
class StepContext:
    """The per-token arrays of one step (numpy int32, what the native ops take) and the rope tables.

    tokens, positions, seq (index into the step's sequences), write_rows (cache row of each token's
    entry), keys (positions each token attends to: position + 1) are [T]; page_table is [S, P];
    logit_rows [L] are the tokens whose logits the step returns, in order; hidden_rows [H] those whose final
    hidden states the model leaves in `hidden` [H, D] (float32, on the host).
    """

    tokens: np.ndarray
    positions: np.ndarray
    seq: np.ndarray
    write_rows: np.ndarray
    keys: np.ndarray
    page_table: np.ndarray
    logit_rows: np.ndarray
    cache: PagedKVCache
    seq_spans: list[tuple[int, int]]  # per sequence: its tokens [a, b) in the step
    contiguous: tuple[int, int] | None = None  # (start, n) when one sequence covers the step
    cos2: torch.Tensor | None = None  # [T, R] rope tables of the positions, set by the model
    sin2: torch.Tensor | None = None
    hidden_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    hidden: torch.Tensor | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @staticmethod
    def decode_one(seq: object, token: int, pos: int, cache: PagedKVCache, vocab_size: int) -> StepContext:
        """The step of one decode token of one sequence (its logits wanted): what build gives for
        Step([SeqChunk(seq, [token], pos)]), made without the general path's lists (decode runs it every token)."""
        if not 0 <= token < vocab_size:
            raise PocketMoEError(f"token id {token} is outside the vocabulary of {vocab_size} tokens.")
        if pos > cache.length(seq):
            raise ContextLengthError(f"sequence {seq!r} continues at position {pos} but only {cache.length(seq)} "
                                     "positions are cached.")
        if pos + 1 > cache.max_seq_len:
            raise ContextLengthError(f"positions {pos}..{pos} do not fit in the context of {cache.max_seq_len} "
                                     "tokens; raise n_ctx or shorten the input.")
        cache.reserve(seq, pos + 1)
        positions = np.array([pos], dtype=np.int32)
        return StepContext(tokens=np.array([token], dtype=np.int32), positions=positions,
                           seq=np.zeros(1, dtype=np.int32), write_rows=cache.rows(seq, pos, 1), keys=positions + 1,
                           page_table=cache.page_table([seq]), logit_rows=np.zeros(1, dtype=np.int64), cache=cache,
                           seq_spans=[(0, 1)], contiguous=(pos, 1))

    @staticmethod
    def build(step: Step, cache: PagedKVCache, vocab_size: int) -> StepContext:
        """Reserve cache rows for every chunk and flatten the step (PocketMoEError on bad input)."""
        toks, pos, seq, rows, logit_rows, hidden_rows, spans = [], [], [], [], [], [], []
        n = 0
        for i, c in enumerate(step.chunks):
            t = np.asarray(c.tokens, dtype=np.int64).reshape(-1)
            bad = (t < 0) | (t >= vocab_size)
            if bad.any():
                raise PocketMoEError(f"token id {int(t[bad][0])} is outside the vocabulary of {vocab_size} tokens.")
            if c.start > cache.length(c.seq):
                raise ContextLengthError(f"sequence {c.seq!r} continues at position {c.start} but only "
                                         f"{cache.length(c.seq)} positions are cached.")
            end = c.start + len(t)
            if end > cache.max_seq_len:
                raise ContextLengthError(
                    f"positions {c.start}..{end - 1} do not fit in the context of {cache.max_seq_len} tokens; "
                    "raise n_ctx or shorten the input.")
            cache.reserve(c.seq, end)
            toks.append(t)
            pos.append(np.arange(c.start, end))
            seq.append(np.full(len(t), i))
            rows.append(cache.rows(c.seq, c.start, len(t)))
            logit_rows.append(c.rows(c.logits, n))
            hidden_rows.append(c.rows(c.hidden, n))
            spans.append((n, n + len(t)))
            n += len(t)
        positions = np.concatenate(pos).astype(np.int32)
        one = step.chunks[0]
        return StepContext(
            tokens=np.concatenate(toks).astype(np.int32), positions=positions,
            seq=np.concatenate(seq).astype(np.int32), write_rows=np.concatenate(rows),
            keys=positions + 1, page_table=cache.page_table([c.seq for c in step.chunks]),
            logit_rows=np.concatenate(logit_rows).astype(np.int64), cache=cache, seq_spans=spans,
            hidden_rows=np.concatenate(hidden_rows).astype(np.int64),
            contiguous=(one.start, len(one.tokens)) if len(step.chunks) == 1 else None)
