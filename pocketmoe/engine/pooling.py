"""Embeddings: a prompt's final hidden states (the output norm's, what the head reads) pooled into one vector.

What llama.cpp's `--pooling` and vLLM's pooling runner compute for a decoder model: `last` (the last token's state:
vLLM's default for these models, and ours), `mean` (the mean over the prompt's tokens), `cls` (the first token's),
or `none` (every token's state, unpooled: llama-server's `/embedding` only). A GGUF's `{arch}.pooling_type` (0 none,
1 mean, 2 cls, 3 last) is the model's own choice where it has one. `normalize` is llama.cpp's `embd_normalize`.

Legend: T prompt tokens, D hidden.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from pocketmoe.defaults import DEFAULT_POOLING, POOLINGS
from pocketmoe.errors import PocketMoEError

GGUF_POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last"}  # llama.cpp's enum llama_pooling_type (4, rank, is not ours)


def model_pooling(architecture: str, metadata: Mapping[str, Any]) -> str:
    """The pooling a GGUF names (`{arch}.pooling_type`), else DEFAULT_POOLING."""
    value = metadata.get(f"{architecture}.pooling_type")
    if value is None:
        return DEFAULT_POOLING
    if int(value) not in GGUF_POOLING:
        raise PocketMoEError(f"{architecture}.pooling_type is {value}, which is not one this engine pools by "
                             f"({', '.join(f'{k} {v}' for k, v in GGUF_POOLING.items())}); give --pooling.")
    return GGUF_POOLING[int(value)]


def check_pooling(pooling: str) -> str:
    if pooling not in POOLINGS:
        raise PocketMoEError(f"pooling {pooling!r} is not one of {', '.join(POOLINGS)}.")
    return pooling


def chunk_rows(pooling: str, start: int, end: int, n: int) -> str:
    """Which rows of a prompt chunk [start, end) of n tokens the pooling reads (SeqChunk.hidden)."""
    if pooling == "last":
        return "last" if end == n else "none"
    if pooling == "cls":
        return "first" if start == 0 else "none"
    return "all"


def reuses_prefix(pooling: str) -> bool:
    """Whether cached KV rows may stand in for the prompt's start: only the last token's state is read."""
    return pooling == "last"


class Pooler:
    """One prompt's pooled state as its chunks' hidden rows come in (chunk_rows), in order from position 0."""

    def __init__(self, pooling: str) -> None:
        self.pooling = check_pooling(pooling)
        self.parts: list[torch.Tensor] = []
        self.sum: torch.Tensor | None = None
        self.count = 0

    def add(self, rows: torch.Tensor) -> None:
        """rows [k, D]: the hidden states chunk_rows named for the next chunk."""
        if len(rows) == 0:
            return
        if self.pooling == "mean":  # in float64, so the mean of a long prompt does not depend on how it is chunked
            part = rows.double().sum(0)
            self.sum = part if self.sum is None else self.sum + part
            self.count += len(rows)
        else:
            self.parts.append(rows.float())

    def result(self) -> torch.Tensor:
        """[D] float32 ([T, D] for none)."""
        if self.pooling == "mean":
            assert self.sum is not None, "a mean of no rows"
            return (self.sum / self.count).float()
        rows = torch.cat(self.parts)
        return rows if self.pooling == "none" else rows[-1]


def check_normalize(p: int) -> int:
    if p < -1:
        raise PocketMoEError(f"embd_normalize {p} is not one of -1 (none), 0 (max absolute), 1 (taxicab), 2 "
                             "(Euclidean) or a p-norm above 2.")
    return p


def embd_normalize(v: torch.Tensor, p: int) -> torch.Tensor:
    """llama.cpp's embd_normalize of each row of v: -1 none, 0 max absolute (to int16's range, 32760), 1 taxicab,
    2 Euclidean (the default), > 2 the p-norm. An all-zero row stays zero."""
    if check_normalize(p) == -1:
        return v
    x = v.double()
    if p == 0:
        scale = x.abs().amax(-1, keepdim=True) / 32760.0
    else:
        scale = x.abs().pow(p).sum(-1, keepdim=True).pow(1.0 / p)
    return torch.where(scale > 0, x / torch.where(scale > 0, scale, 1.0), 0.0).to(v.dtype)
