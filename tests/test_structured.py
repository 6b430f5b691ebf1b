"""Structured output (engine/structured.py): the grammar mask against an independent reading of the vocabulary,
and generated output against an independent validator (jsonschema, re).

The mask check needs no model: for a choice grammar the tokens allowed after some text are exactly those whose
bytes (taken from the tokenizer, not from llguidance) extend the text toward one of the choices, plus the
end-of-generation tokens once the text is a whole choice. That is checked over random walks on both kinds of
vocabulary (byte-level GPT-2 and SentencePiece with byte tokens), multi-byte characters included.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from pocketmoe.engine.llm import LLM
from pocketmoe.engine.sampler import Sampler, SamplingParams
from pocketmoe.engine.structured import Constraint, Grammar, GrammarError, check_grammar
from pocketmoe.testing.synth import write_fixture
from pocketmoe.testing.vocab import tokenizer_metadata
from pocketmoe.tokenizer import Tokenizer

CHOICES = ["no", "no way", "yes", "maybe so", "日本語", "naïve"]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def tok(request) -> Tokenizer:  # noqa: ANN001
    return Tokenizer.from_metadata(tokenizer_metadata(2048, model=request.param))


def reference_allowed(tok: Tokenizer, text: bytes) -> set[int]:
    """Tokens that keep `text` a prefix of a choice, from the tokenizer's own pieces; the end ids once it is one."""
    targets = [c.encode() for c in CHOICES]
    out = {t for t in range(tok.vocab_size) if not tok.is_special(t) and tok.token_to_piece(t)
           and any(c.startswith(text + tok.token_to_piece(t)) for c in targets)}
    return out | set(tok.eot_ids) if text in targets else out


def forced(text: bytes) -> bool:
    """Whether the next bytes are forced: every choice `text` can still become goes on with the same byte."""
    rest = {c.encode()[len(text):] for c in CHOICES if c.encode().startswith(text)}
    return "" not in rest and len({r[:1] for r in rest}) == 1


def test_choice_mask_is_exactly_the_tokens_that_extend_a_choice(tok: Tokenizer) -> None:
    """Where the choices still differ in their next byte the mask is every token that extends one; where the next
    bytes are forced, llguidance allows the forced text's own tokenization (a subset; never none)."""
    rng = random.Random(0)
    checked_equal = 0
    for walk in range(12):
        c = Constraint(Grammar.choice(CHOICES), tok)
        text = b""
        for _ in range(40):
            allowed = set(torch.nonzero(c.allowed()).flatten().tolist())
            if forced(text):
                assert allowed and allowed <= reference_allowed(tok, text), (walk, text)
            else:
                assert allowed == reference_allowed(tok, text), (walk, text)
                checked_equal += 1
            token = rng.choice(sorted(allowed))
            if token in tok.eot_ids:
                break
            c.accept(token)
            text += tok.token_to_piece(token)
        assert text.decode() in CHOICES
    assert checked_equal >= 12 + 2  # every walk's start, and the ends of "no" (go on to "no way", or end)
    with pytest.raises(GrammarError, match="does not continue"):
        Constraint(Grammar.choice(CHOICES), tok).accept(tok.encode("q", add_bos=False)[0])


def test_sampler_draws_only_allowed_tokens_and_greedy_is_the_allowed_argmax(tok: Tokenizer) -> None:
    gen = torch.Generator().manual_seed(1)
    for seed in range(6):
        logits = torch.randn(tok.vocab_size, generator=gen) * 4
        greedy = Sampler(SamplingParams(temperature=0, grammar=Grammar.choice(CHOICES)), tok)
        allowed = reference_allowed(tok, b"")
        want = max(allowed, key=lambda t: logits[t].item())
        assert greedy(logits) == want
        hot = Sampler(SamplingParams(temperature=1.5, top_k=3, seed=seed, grammar=Grammar.choice(CHOICES)), tok)
        assert hot(logits) in allowed  # top-k runs after the mask: three allowed tokens, never a -inf one


def test_a_grammar_without_a_tokenizer_or_that_does_not_parse_is_a_clear_error(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        Sampler(SamplingParams(grammar=Grammar.json_object()))
    for bad in (Grammar.regex("(unclosed"), Grammar("gbnf", "root ::= ("), Grammar.json_schema({"type": "frob"})):
        with pytest.raises(GrammarError, match=bad.kind):
            check_grammar(bad, tok)
    with pytest.raises(GrammarError, match="at least one"):
        Grammar.choice([])


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
     "required": ["name", "age", "tags"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4},
    {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"ok": {"const": True}}, "required": ["ok"],
                                  "additionalProperties": False}]},
]


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    path: Path = write_fixture("deepseek2", "tiny", "Q4_K_M", tmp_path_factory.mktemp("st") / "m.gguf", seed=5)[0]
    return LLM(path, n_ctx=256, threads=1, enable_prefix_caching=False)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["object", "array", "anyOf"])
def test_json_schema_output_validates(llm: LLM, schema: dict) -> None:
    for i, params in enumerate([dict(temperature=0), dict(temperature=1.0, seed=3), dict(temperature=0.7, seed=9)]):
        out = llm.generate([f"prompt {i}: the answer"], SamplingParams(max_tokens=120, grammar=Grammar.json_schema(
            schema), **params))[0]
        assert out.finish_reason == "stop", out.text
        value = json.loads(out.text)
        jsonschema.validate(value, schema)
        if schema.get("additionalProperties") is False:  # properties come out in the schema's order, as OpenAI's do
            assert list(value) == list(schema["properties"])


def test_json_object_regex_and_gbnf_outputs(llm: LLM) -> None:
    for seed in range(3):
        p = dict(temperature=1.0, seed=seed, max_tokens=150)
        obj = llm.generate(["{"], SamplingParams(grammar=Grammar.json_object(), **p))[0]
        if obj.finish_reason == "stop":  # a free-form object may be longer than max_tokens; when it ends, it parses
            assert isinstance(json.loads(obj.text), dict)
        else:
            assert obj.text.startswith("{")
        pattern = r"[0-9]{3}-[a-z]{2,5}( [A-Z][a-z]{0,6})?"  # bounded: a random model need not stop by itself
        rx = llm.generate(["code:"], SamplingParams(grammar=Grammar.regex(pattern), **p))[0]
        assert re.fullmatch(pattern, rx.text) and rx.finish_reason == "stop", rx.text
        gbnf = 'root ::= ("yes" | "no") ", " [0-9] [0-9]'
        g = llm.generate(["answer:"], SamplingParams(grammar=Grammar("gbnf", gbnf), **p))[0]
        assert re.fullmatch(r"(yes|no), [0-9]{2}", g.text) and g.finish_reason == "stop", g.text


def test_the_output_ends_where_the_grammar_does_even_with_ignore_eos(llm: LLM) -> None:
    out = llm.generate(["pick:"], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                                                 grammar=Grammar.choice(["alpha", "beta"])))[0]
    assert out.text in ("alpha", "beta") and out.finish_reason == "stop"
