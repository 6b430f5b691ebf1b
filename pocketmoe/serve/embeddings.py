"""Embeddings over HTTP: OpenAI's `POST /v1/embeddings` and llama-server's `POST /embedding` (and `/embeddings`).

Each input (a string, or token ids) runs as a prompt whose final hidden states the server's `--pooling` pools
(engine/pooling.py); nothing is generated. `/v1/embeddings` answers OpenAI's shape (the vectors as lists of floats,
or with `encoding_format: "base64"`, as the OpenAI SDKs ask by default, little-endian float32 bytes in base64), unit
length unless asked otherwise (llama.cpp's `embd_normalize`, vLLM's `normalize`); vLLM's `add_special_tokens` and
`truncate_prompt_tokens` are read too, and its chat form (`messages`, rendered by the chat template). `/embedding`
answers llama-server's: a list of `{"index", "embedding"}` whose embedding is a list of rows, one pooled row
(normalized as `embd_normalize` says), or with `--pooling none` every token's (as computed).

vLLM's score and rerank routes over the same vectors, as vLLM runs them for an embedding model: `POST /score` (and
`/v1/score`: `text_1`, `text_2`, each a string or a list, paired 1:1, 1:N or N:N) gives each pair's cosine
similarity; `POST /rerank` (and `/v1/rerank`, `/v2/rerank`: Jina's and Cohere's shape, `query`, `documents`,
`top_n`) gives the documents ordered by their cosine similarity to the query.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Annotated, Any, Literal

import numpy as np
import torch
from pydantic import Field, StrictBool, StrictInt, StrictStr

from pocketmoe.engine.pooling import check_normalize, embd_normalize
from pocketmoe.errors import PocketMoEError
from pocketmoe.serve.protocol import (
    ChatMessage,
    NonNegInt,
    RequestError,
    _Body,
    check_template_options,
    truncate_prompt,
)

MAX_EMBEDDING_INPUTS = 2048      # inputs in one request (OpenAI's limit)
MAX_EMBEDDING_TOKENS = 300_000   # tokens over a request's inputs (OpenAI's limit)

TokenIds = Annotated[list[NonNegInt], Field(min_length=1)]
Inputs = (StrictStr | Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)] | TokenIds
          | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)])


class _EmbeddingFields(_Body):
    model: StrictStr | None = None
    embd_normalize: StrictInt = 2  # llama.cpp's: -1 none, 0 max absolute, 1 taxicab, 2 Euclidean, > 2 p-norm
    add_special_tokens: StrictBool = True  # vLLM's: the file's BOS policy for text inputs (False: none added)

    def inputs(self) -> list[str | list[int]]:
        raise NotImplementedError

    def check(self) -> None:
        try:
            check_normalize(self.embd_normalize)
        except PocketMoEError as e:
            raise RequestError(str(e), "embd_normalize") from None
        for i, p in enumerate(self.inputs()):
            if p == "":
                raise RequestError(f"input {i} is an empty string; give text to embed.", "input")

    def norm(self) -> int:
        return self.embd_normalize


class EmbeddingRequest(_EmbeddingFields):
    """POST /v1/embeddings (OpenAI), with vLLM's and llama.cpp's extensions; vLLM's chat form embeds `messages` as
    the chat template renders them (no generation prompt unless asked) instead of `input`."""

    input: Inputs | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: StrictBool = False
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[StrictInt, Field(ge=1)] | None = None
    user: StrictStr | None = None
    normalize: StrictBool | None = None  # vLLM's: True is embd_normalize 2, False -1
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=-1)] | None = None  # vLLM's: keep the last k (-1: context)

    def inputs(self) -> list[str | list[int]]:
        return [] if self.input is None else as_inputs(self.input)

    def check(self) -> None:
        if (self.input is None) == (self.messages is None):
            raise RequestError("give input (texts or token ids) or messages (a chat), one of them.", "input")
        check_template_options(self)
        super().check()
        if self.normalize is not None and "embd_normalize" in self.model_fields_set:
            raise RequestError("give normalize (vLLM's) or embd_normalize (llama.cpp's), not both.", "normalize")
        if self.truncate_prompt_tokens == 0:
            raise RequestError("truncate_prompt_tokens 0 would leave no token to embed; give at least 1, or -1 for "
                               "the context's length.", "truncate_prompt_tokens")

    def norm(self) -> int:
        return self.embd_normalize if self.normalize is None else (2 if self.normalize else -1)


class LlamaEmbeddingRequest(_EmbeddingFields):
    """POST /embedding (llama-server): `content`, or `input` as OpenAI's."""

    content: Inputs | None = None
    input: Inputs | None = None

    def inputs(self) -> list[str | list[int]]:
        given = self.input if self.input is not None else self.content
        if given is None:
            raise RequestError("give the text to embed in content (or input).", "content")
        return as_inputs(given)


Texts = StrictStr | Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]


class ScoreRequest(_EmbeddingFields):
    """POST /score (vLLM's): text_1 against text_2, 1:1, 1:N or N:N."""

    text_1: Texts
    text_2: Texts
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=-1)] | None = None

    def sides(self) -> tuple[list[str], list[str]]:
        return as_list(self.text_1), as_list(self.text_2)

    def inputs(self) -> list[str | list[int]]:
        first, second = self.sides()
        return [*first, *second]

    def check(self) -> None:
        first, second = self.sides()
        if len(first) > 1 and len(first) != len(second):
            raise RequestError(f"text_1 has {len(first)} texts and text_2 {len(second)}: pair them 1:1, 1:N (one "
                               "text_1) or N:N (as many of each).", "text_1")
        super().check()

    def pairs(self) -> list[tuple[int, int]]:
        """(index into inputs() of the pair's text_1, of its text_2), in text_2's order."""
        first, second = self.sides()
        return [(0 if len(first) == 1 else i, len(first) + i) for i in range(len(second))]


class RerankRequest(_EmbeddingFields):
    """POST /rerank (vLLM's, in Jina's and Cohere's shape): documents ordered by relevance to the query."""

    query: StrictStr
    documents: Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS - 1)]
    top_n: Annotated[StrictInt, Field(ge=0)] = 0  # 0: every document
    return_documents: StrictBool = True
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=-1)] | None = None

    def inputs(self) -> list[str | list[int]]:
        return [self.query, *self.documents]


def as_list(texts: str | list[str]) -> list[str]:
    return [texts] if isinstance(texts, str) else list(texts)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """The cosine similarity of two vectors (0 where one is all zeros)."""
    a, b = a.double(), b.double()
    norms = float(a.norm() * b.norm())
    return float(a @ b) / norms if norms > 0 else 0.0


def score_body(req: ScoreRequest, vectors: list[torch.Tensor], model: str, n_prompt: int) -> dict[str, Any]:
    data = [{"index": i, "object": "score", "score": cosine(vectors[a], vectors[b])}
            for i, (a, b) in enumerate(req.pairs())]
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": data,
            "usage": {"prompt_tokens": n_prompt, "total_tokens": n_prompt, "completion_tokens": 0}}


def rerank_body(req: RerankRequest, vectors: list[torch.Tensor], model: str, n_prompt: int) -> dict[str, Any]:
    """The documents by relevance (highest first; ties in the order given), the first top_n (all for 0)."""
    scores = [cosine(vectors[0], v) for v in vectors[1:]]
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n or None]
    results = [{"index": i, "relevance_score": scores[i], **({"document": {"text": req.documents[i]}}
                                                              if req.return_documents else {})} for i in order]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model,
            "usage": {"prompt_tokens": n_prompt, "total_tokens": n_prompt}, "results": results}


def as_inputs(given: Any) -> list[str | list[int]]:
    """One input per prompt: a string, a list of strings, a list of token ids (one prompt), or lists of them."""
    if isinstance(given, str):
        return [given]
    if given and isinstance(given[0], int):
        return [list(given)]
    return list(given)


def check_lengths(ids: list[list[int]], max_len: int, truncate: int | None) -> list[list[int]]:
    """Each input's ids within the context (vLLM's truncate_prompt_tokens keeps the last k; -1: the context's
    length), and the request's inputs within MAX_EMBEDDING_TOKENS (RequestError)."""
    ids = [truncate_prompt(p, truncate, max_len) for p in ids]
    for i, p in enumerate(ids):
        if not p:
            raise RequestError(f"input {i} has no tokens; give text or token ids to embed.", "input")
        if len(p) > max_len:
            raise RequestError(f"input {i} has {len(p)} tokens but this server's context holds {max_len} "
                               "(--max-model-len); shorten it, or set truncate_prompt_tokens.", "input",
                               code="context_length_exceeded")
    total = sum(len(p) for p in ids)
    if total > MAX_EMBEDDING_TOKENS:
        raise RequestError(f"the inputs have {total} tokens in all, over the {MAX_EMBEDDING_TOKENS} one request may "
                           "embed; send them in several requests.", "input")
    return ids


def openai_body(req: EmbeddingRequest, vectors: list[torch.Tensor], model: str, n_prompt: int) -> dict[str, Any]:
    """The /v1/embeddings reply: each pooled vector normalized as the request says, as floats or base64."""
    data = []
    for i, v in enumerate(vectors):
        v = embd_normalize(v, req.norm())
        if req.encoding_format == "base64":
            out: Any = base64.b64encode(v.numpy().astype("<f4").tobytes()).decode("ascii")
        else:
            out = v.tolist()
        data.append({"object": "embedding", "embedding": out, "index": i})
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": n_prompt, "total_tokens": n_prompt}}


def llama_body(req: LlamaEmbeddingRequest, vectors: list[torch.Tensor], pooling: str) -> list[dict[str, Any]]:
    """The /embedding reply: a list of rows per input, one pooled row or (pooling none) each token's."""
    out = []
    for i, v in enumerate(vectors):
        rows = v if pooling == "none" else embd_normalize(v, req.norm())[None]
        out.append({"index": i, "embedding": np.asarray(rows, dtype=np.float32).tolist()})
    return out


def check_dimensions(req: EmbeddingRequest, width: int) -> None:
    if req.dimensions is not None and req.dimensions != width:
        raise RequestError(f"this model's embeddings have {width} dimensions and it was not trained to give fewer; "
                           f"leave dimensions out or give {width}.", "dimensions")
