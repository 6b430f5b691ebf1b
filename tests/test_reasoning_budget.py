"""The reasoning budget against what it promises, with a scripted model: an output under its budget is the output
without one; a spent budget keeps the model's first tokens, writes the message and the closing tag, and the rest is
what the model writes after them with no budget; the count waits for a character to end and spans blocks."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from pocketmoe.engine.budget import ReasoningBudget, ReasoningBudgetError, _Matcher
from pocketmoe.engine.sampler import Sampler, SamplingParams, SamplingParamsError, token_logprob
from pocketmoe.engine.structured import Grammar
from pocketmoe.testing.scripted import thinking_tokenizer
from pocketmoe.tokenizer import Tokenizer

Model = Callable[[Sequence[int]], torch.Tensor]
PROMPT = [300, 301, 302]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:  # noqa: ANN001
    return thinking_tokenizer(tmp_path_factory.mktemp("budget"))


def scripted(tok: Tokenizer, script: Sequence[int]) -> Model:
    """A model that writes `script` after PROMPT while the output follows it; elsewhere (after the output left it)
    tokens that hang on the last three, never '<' (so no tag) and never an end of generation."""
    lt = tok.encode("<", add_bos=False, space_prefix=False)[0]
    banned = [lt, *tok.eot_ids]

    def model(history: Sequence[int]) -> torch.Tensor:
        out = list(history[len(PROMPT):])
        if len(out) < len(script) and out == list(script[:len(out)]):
            logits = torch.zeros(tok.vocab_size)
            logits[script[len(out)]] = 50.0
            return logits
        g = torch.Generator().manual_seed(hash(tuple(history[-3:])) % 2**31)
        logits = torch.randn(tok.vocab_size, generator=g)
        logits[banned] = -50.0
        return logits

    return model


def generate(model: Model, params: SamplingParams, tok: Tokenizer, n: int, prompt: Sequence[int] = PROMPT
             ) -> list[int]:
    s, history, out = Sampler(params, tok), list(prompt), []
    for _ in range(n):
        t = s(model(history), history)
        if t in s.end_ids:
            break
        history.append(t)
        out.append(t)
    return out


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_bos=False, parse_special=True, space_prefix=False)


def words(tok: Tokenizer, n: int, seed: int) -> list[int]:
    """n tokens of plain text, each whole characters (no '<')."""
    g = torch.Generator().manual_seed(seed)
    pool = [i for i in range(tok.vocab_size) if b"<" not in tok.token_to_piece(i) and i not in tok.eot_ids
            and tok.token_to_piece(i) and _whole(tok.token_to_piece(i))]
    return [pool[int(i)] for i in torch.randint(len(pool), (n,), generator=g)]


def _whole(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def greedy(budget: ReasoningBudget | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=400, reasoning_budget=budget)


@pytest.mark.parametrize("inside", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_an_output_under_its_budget_is_the_output_without_one(tok: Tokenizer, inside: bool, seed: int) -> None:
    thought = words(tok, 5 + 7 * seed, seed)
    script = ([] if inside else ids(tok, "<think>")) + thought + ids(tok, "</think>") + words(tok, 9, 100 + seed)
    model = scripted(tok, script)
    plain = generate(model, greedy(), tok, 80)
    assert plain[:len(script)] == script
    # the block's tokens: the thought and the closing tag's (its last ends the block); here the tag has 7
    spent = len(thought) + len(ids(tok, "</think>")) - 1
    for b in (spent + 1, spent + 2, 1000):
        budget = ReasoningBudget.for_tokenizer(tok, b, "Enough.", inside=inside)
        assert generate(model, greedy(budget), tok, 80) == plain, b
    budget = ReasoningBudget.for_tokenizer(tok, spent, "Enough.", inside=inside)
    assert generate(model, greedy(budget), tok, 80) != plain  # one short: the message is written


@pytest.mark.parametrize("message", ["", " Time to answer."])
@pytest.mark.parametrize("inside", [True, False])
@pytest.mark.parametrize("b", [0, 1, 7, 30])
def test_a_spent_budget_writes_the_closing_tag_and_the_model_goes_on(tok: Tokenizer, message: str, inside: bool,
                                                                     b: int) -> None:
    opened = [] if inside else ids(tok, "<think>")
    script = opened + words(tok, 60, b)  # a thought that never ends
    model = scripted(tok, script)
    budget = ReasoningBudget.for_tokenizer(tok, b, message, inside=inside)
    out = generate(model, greedy(budget), tok, 120)
    cut = len(opened) + b
    forced = ids(tok, message + "</think>")
    assert list(budget.forced) == forced
    assert out[:cut] == script[:cut]
    assert out[cut:cut + len(forced)] == forced
    rest = generate(model, greedy(), tok, 120 - cut - len(forced), PROMPT + out[:cut + len(forced)])
    assert out[cut + len(forced):] == rest and rest


def test_the_budget_counts_every_block_of_the_output(tok: Tokenizer) -> None:
    first, second = words(tok, 6, 1), words(tok, 40, 2)
    script = ids(tok, "<think>") + first + ids(tok, "</think>") + words(tok, 4, 3) + ids(tok, "<think>") + second
    model = scripted(tok, script)
    out = generate(model, greedy(ReasoningBudget.for_tokenizer(tok, 20)), tok, 100)
    cut = len(script) - len(second) + 8  # 12 of the 20 went to the first block (its 6 and 6 of its closing tag's)
    assert out[:cut] == script[:cut]
    assert out[cut:cut + 7] == ids(tok, "</think>")
    # spent: a block opened later is closed at once
    third = ids(tok, "<think>")
    again = out[:cut + 7] + words(tok, 3, 4) + third
    model = scripted(tok, again + words(tok, 20, 5))
    out = generate(model, greedy(ReasoningBudget.for_tokenizer(tok, 20)), tok, 100)
    assert out[:len(again)] == again and out[len(again):len(again) + 7] == ids(tok, "</think>")


@pytest.mark.parametrize("b", [3, 4, 5])
def test_the_count_waits_for_a_character_to_end(tok: Tokenizer, b: int) -> None:
    han = ids(tok, "中中")  # [b'\xe4\xb8', b'\xad'] twice: a character split over two tokens
    assert len(han) == 4 and tok.token_to_piece(han[0]) == b"\xe4\xb8"
    script = words(tok, 3, 7) + han + words(tok, 30, 8)
    model = scripted(tok, script)
    out = generate(model, greedy(ReasoningBudget.for_tokenizer(tok, b, inside=True)), tok, 60)
    cut = b + (b % 2 == 0)  # b tokens, or one more where the b-th begins a character
    assert out[:cut] == script[:cut]
    assert out[cut:cut + 7] == ids(tok, "</think>")
    b"".join(tok.token_to_piece(t) for t in out[:cut]).decode("utf-8")  # whole characters


def test_forced_tokens_have_the_models_logprobs_or_probability_one(tok: Tokenizer) -> None:
    model = scripted(tok, words(tok, 30, 9))
    budget = ReasoningBudget.for_tokenizer(tok, 2, inside=True)
    for mode in ("raw_logprobs", "processed_logprobs"):
        s = Sampler(SamplingParams(temperature=0.7, seed=3, logprobs=2, logprobs_mode=mode,
                                   reasoning_budget=budget), tok)
        history = list(PROMPT)
        for i in range(5):
            logits = model(history)
            t = s(logits, history)
            lp = s.logprob(logits, t)
            if i >= 2:  # forced
                assert t == budget.forced[i - 2]
                want = token_logprob(logits, t, 2) if mode == "raw_logprobs" else None
                assert lp == want or (want is None and lp.logprob == 0.0 and lp.rank == 1)
            history.append(t)


def test_sampled_tokens_before_the_cut_are_the_unbounded_ones(tok: Tokenizer) -> None:
    model = scripted(tok, [])  # all drawn: a thought of random text
    params = SamplingParams(temperature=0.9, top_k=40, seed=11, max_tokens=50)
    free = generate(model, params, tok, 50)
    budget = ReasoningBudget.for_tokenizer(tok, 12, inside=True)
    held = generate(model, SamplingParams(**{**params.__dict__, "reasoning_budget": budget}), tok, 50)
    assert held[:12] == free[:12] and held[12:19] == ids(tok, "</think>")


def test_bad_budgets_are_refused(tok: Tokenizer) -> None:
    with pytest.raises(ReasoningBudgetError, match=">= 0"):
        ReasoningBudget.for_tokenizer(tok, -1)
    with pytest.raises(ReasoningBudgetError, match="token ids"):
        ReasoningBudget(5, (), (1,), (1,))
    with pytest.raises(SamplingParamsError, match="reasoning_budget"):
        SamplingParams(grammar=Grammar.json_object(), reasoning_budget=ReasoningBudget.for_tokenizer(tok, 5))


def test_matcher_finds_a_tag_after_a_false_start() -> None:
    m = _Matcher((1, 2, 3))
    assert [m.push(t) for t in (1, 1, 2, 3, 2, 1, 2, 4, 1, 2, 3)] == [False] * 3 + [True] + [False] * 6 + [True]


def test_live_server_bounds_the_thought(tmp_path) -> None:  # noqa: ANN001
    """On the real engine, a template that opens the block: the server's --reasoning-budget and a request's own
    budget (llama.cpp's, vLLM's and Anthropic's field) keep the unbounded output's first tokens (to a whole
    character), then the message and the closing tag; what follows is what /v1/completions continues that text with,
    and it comes back as the content."""
    import anthropic
    import openai

    from pocketmoe.gguf import open_bundle
    from pocketmoe.testing.live_server import LiveServer
    from pocketmoe.testing.synth import write_fixture
    from pocketmoe.testing.vocab import MINIMAX_SHAPED_TEMPLATE

    model = write_fixture("minimax-m2", "tiny", "Q4_K_M", tmp_path / "m.gguf", seed=5)[0]
    tok = Tokenizer.from_metadata(open_bundle(model).metadata)
    (tmp_path / "t.jinja").write_text(MINIMAX_SHAPED_TEMPLATE)
    args = ["--model", str(model), "--served-model-name", "tiny", "--max-model-len", "256", "--threads", "1",
            "--chat-template", str(tmp_path / "t.jinja"), "--reasoning-budget", "6",
            "--reasoning-budget-message", " Enough."]
    msgs = [{"role": "user", "content": "hello world"}]
    with LiveServer(args) as srv:
        o = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)

        def chat(**extra) -> tuple[list[int], list[int], openai.types.chat.ChatCompletionMessage]:  # noqa: ANN003
            r = o.chat.completions.create(model="tiny", messages=msgs, max_tokens=30, temperature=0,
                                          extra_body={"return_token_ids": True, **extra})
            return r.prompt_token_ids, r.choices[0].token_ids, r.choices[0].message

        prompt, free, m = chat(thinking_budget_tokens=-1)
        assert tok.decode(prompt).endswith("<think>\n") and len(free) == 30
        assert m.content == "" and m.model_extra["reasoning_content"]  # all thought: it never closed the block
        for extra, b, message in [({}, 6, " Enough."), ({"thinking_token_budget": 2}, 2, " Enough."),
                                  ({"thinking_budget_tokens": 0, "thinking_budget_message": ""}, 0, "")]:
            _, out, m = chat(**extra)
            cut = b
            while not _whole(b"".join(tok.token_to_piece(t) for t in free[:cut])):
                cut += 1  # a character split over tokens is finished first
            forced = ids(tok, message + "</think>")
            assert out[:cut] == free[:cut] and out[cut:cut + len(forced)] == forced, extra
            then = o.completions.create(model="tiny", prompt=prompt + out[:cut + len(forced)], temperature=0,
                                        max_tokens=30 - cut - len(forced), extra_body={"return_token_ids": True})
            assert out[cut + len(forced):] == then.choices[0].token_ids
            assert m.model_extra["reasoning_content"] == (tok.decode(free[:cut]) + message).strip()
            assert m.content == then.choices[0].text.lstrip()
        a = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
        r = a.messages.create(model="tiny", messages=msgs, max_tokens=30, thinking={"type": "enabled",
                              "budget_tokens": 2}, extra_body={"temperature": 0})
        same = chat(thinking_token_budget=2)[2]
        assert r.content[0].type == "thinking" and r.content[0].thinking == same.model_extra["reasoning_content"]
        assert r.content[1].type == "text" and r.content[1].text == same.content
        with pytest.raises(openai.BadRequestError, match="differ"):
            chat(thinking_token_budget=2, thinking_budget_tokens=3)


def test_server_fields_and_flags(tok: Tokenizer) -> None:
    """Which budget a request runs with: its own (either name), else the server's; none under a grammar (the block
    is closed before the output starts); bad values are a 400 or a usage error."""
    from fastapi.testclient import TestClient

    from pocketmoe.serve.__main__ import parse_args
    from pocketmoe.serve.api import ServerState, create_app
    from pocketmoe.testing.scripted import ScriptedEngine

    assert parse_args(["--reasoning-budget", "0"]).reasoning_budget == 0
    with pytest.raises(SystemExit):
        parse_args(["--reasoning-budget", "-2"])
    eng = ScriptedEngine(tok, "minimax-m2", "ok")
    http = TestClient(create_app(ServerState(model_name="m", max_model_len=4096, engine=eng,  # type: ignore[arg-type]
                                             tokenizer=tok, reasoning_budget=9, reasoning_budget_message="Hm.")))
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}

    def budget(body: dict, path: str = "/v1/chat/completions") -> ReasoningBudget | None:
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text
        return eng.params[-1][0].reasoning_budget

    b = budget(chat)
    assert (b.tokens, b.inside, list(b.forced)) == (9, True, ids(tok, "Hm.</think>"))
    assert budget({**chat, "thinking_token_budget": 3, "thinking_budget_message": ""}).forced == b.end
    assert budget({**chat, "thinking_budget_tokens": -1}) is None
    assert budget({**chat, "response_format": {"type": "json_object"}}) is None
    assert budget({**chat, "reasoning_effort": "none"}).inside is False  # the block closed: a later one is bounded
    assert budget({**chat, "thinking": {"type": "enabled", "budget_tokens": 4}}, "/v1/messages").tokens == 4
    assert budget({**chat, "thinking": {"type": "adaptive"}}, "/v1/messages").tokens == 9
    for bad, field in [({"thinking_budget_tokens": -2}, "thinking_budget_tokens"),
                       ({"thinking_budget_message": "x" * 1025}, "thinking_budget_message"),
                       ({"thinking_budget_tokens": 1, "thinking_token_budget": 2}, "thinking_token_budget")]:
        r = http.post("/v1/chat/completions", json={**chat, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
