"""`python -m pocketmoe.chat`: turns read from stdin, each reply held to LLM.chat over the same conversation
(an LLM that computes every prompt whole), the previous turn's rows reused, /reset, dropping old turns, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pocketmoe import LLM, SamplingParams
from pocketmoe.testing.synth import write_fixture

ROOT = Path(__file__).resolve().parents[1]
N_CTX = 256


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("chat") / "tiny.gguf"
    write_fixture("deepseek2", "tiny", "Q8_0", path, seed=5)
    return path


@pytest.fixture(scope="module")
def ref(model) -> LLM:
    return LLM(model, n_ctx=N_CTX, threads=1, max_num_seqs=1, enable_prefix_caching=False)


def chat(model: Path, stdin: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pocketmoe.chat", "--model", str(model), "--threads", "1",
                           "--json", *flags], input=stdin, capture_output=True, text=True, cwd=ROOT, timeout=600)


def turns(r: subprocess.CompletedProcess) -> list[dict]:
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def test_turns_follow_the_conversation(model, ref):
    flags = ("--n-ctx", str(N_CTX), "--max-tokens", "12", "--temperature", "0.8", "--seed", "3",
             "--system", "Be brief.")
    msgs = ["Hello there", "Tell me more\\", "about that", "/reset", "Hello there"]
    got = turns(chat(model, "\n".join(msgs) + "\n", *flags))
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=12)
    system = [{"role": "system", "content": "Be brief."}]
    history: list[dict] = []
    users = ["Hello there", "Tell me more\nabout that", "Hello there"]
    assert len(got) == len(users)
    for i, (turn, user) in enumerate(zip(got, users, strict=True)):
        if i == 2:  # after /reset
            history = []
        history.append({"role": "user", "content": user})
        want = ref.chat(system + history, params)
        assert (turn["reply"], turn["finish_reason"]) == (want.text.strip(), want.finish_reason)
        assert turn["prompt_tokens"] == len(ref.encode_chat(system + history))
        assert turn["completion_tokens"] == len(want.token_ids) and turn["dropped_turns"] == 0
        history.append({"role": "assistant", "content": turn["reply"]})
    # the second turn continued from the first's rows: its prompt at least
    assert got[0]["cached_tokens"] == 0 and got[1]["cached_tokens"] >= got[0]["prompt_tokens"]
    assert got[2]["reply"] == got[0]["reply"]  # /reset: the same first turn, the same seed


def test_old_turns_are_dropped_to_fit_the_context(model, ref):
    n_ctx, max_tokens = 96, 16
    users = [f"message number {i} with some words in it" for i in range(6)]
    got = turns(chat(model, "\n".join(users) + "\n", "--n-ctx", str(n_ctx), "--max-tokens", str(max_tokens),
                     "--temperature", "0"))
    assert len(got) == len(users)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    history: list[dict] = []
    dropped_any = False
    for turn, user in zip(got, users, strict=True):
        msgs, dropped = [*history, {"role": "user", "content": user}], 0
        while len(ref.encode_chat(msgs)) + max_tokens > n_ctx and len(msgs) > 1:
            msgs, dropped = msgs[2:], dropped + 1
        assert turn["dropped_turns"] == dropped
        dropped_any |= dropped > 0
        want = ref.chat(msgs, params)
        assert turn["completion_tokens"] == len(want.token_ids) and turn["finish_reason"] == want.finish_reason
        history = [*msgs, {"role": "assistant", "content": turn["reply"]}]
    assert dropped_any


def test_a_message_too_long_is_one_error_and_the_chat_goes_on(model):
    long = " ".join(["word"] * 400)
    r = chat(model, f"{long}\nshort one\n", "--n-ctx", "128", "--max-tokens", "4", "--temperature", "0")
    got = turns(r)
    assert len(got) == 1 and got[0]["completion_tokens"] <= 4
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "the context holds 128" in errors[0] and "--n-ctx" in errors[0]


def test_streamed_text_and_stats(model, ref):
    r = subprocess.run([sys.executable, "-m", "pocketmoe.chat", "--model", str(model), "--threads", "1", "--n-ctx",
                        str(N_CTX), "--max-tokens", "8", "--temperature", "0", "--stats"], input="Hi\n",
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    want = ref.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=8))
    assert r.stdout == want.text + "\n"
    assert "prompt " in r.stderr and "tok/s" in r.stderr


@pytest.mark.parametrize("flags, needle", [
    (("--temperature", "-1"), "temperature"),
    (("--model", "/nonexistent/model.gguf"), "/nonexistent/model.gguf"),
    (("--reasoning-budget", "-2"), "--reasoning-budget"),
])
def test_bad_flags_are_one_line(model, flags, needle):
    r = chat(model, "Hi\n", *flags)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0]


def test_an_interrupted_reply_stays_in_the_conversation(model, ref):
    from pocketmoe.chat import ChatSession

    llm = LLM(model, n_ctx=N_CTX, threads=1, max_num_seqs=1)
    session = ChatSession(llm, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    pieces: list[str] = []

    def stop_after_three(text: str) -> None:
        pieces.append(text)
        if len(pieces) == 3:
            raise KeyboardInterrupt

    turn = session.ask("Hello there", on_text=stop_after_three)
    assert turn.finish_reason == "interrupted" and turn.reply == "".join(pieces).strip()
    full = ref.chat([{"role": "user", "content": "Hello there"}],
                    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert full.text.startswith(turn.reply) and len(turn.reply) < len(full.text)
    assert session.history[-1] == {"role": "assistant", "content": turn.reply}
    # the next turn runs on: the conversation holds the cut reply
    nxt = session.ask("go on")
    want = ref.chat([*session.history[:2], {"role": "user", "content": "go on"}],
                    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert nxt.reply == want.text.strip()
    llm.close()


THINK_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                  "{% if add_generation_prompt %}<assistant><think>\n{% endif %}")


class Scripted:
    """An LLM stand-in whose every reply is `script`, streamed a few characters at a time."""

    def __init__(self, tokenizer, script: str) -> None:
        self.tokenizer, self.n_ctx, self.script, self.prompts = tokenizer, 4096, script, []

    def stream(self, ids, params, out):
        from pocketmoe.engine.llm import StreamChunk

        self.prompts.append(list(ids))
        out.prompt_token_ids = list(ids)
        for i in range(0, len(self.script), 3):
            piece = self.script[i:i + 3]
            out.text += piece
            out.token_ids.append(0)
            yield StreamChunk(0, piece)
        out.finish_reason = "stop"
        yield StreamChunk(None, "", "stop")


def test_reasoning_kept_where_the_template_keeps_it(model, ref):
    """With a template that renders history's reasoning (MiniMax-M2's way), the next turn's prompt holds this turn's
    prompt and the reply exactly as the model wrote them, so the engine continues from all of their rows."""
    from pocketmoe.chat import ChatSession
    from pocketmoe.testing.vocab import MINIMAX_SHAPED_TEMPLATE
    from pocketmoe.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(ref.bundle.metadata)
    tok.chat_template = MINIMAX_SHAPED_TEMPLATE
    script = "Let me think.\n</think>\n\nParis."
    llm = Scripted(tok, script)
    session = ChatSession(llm, SamplingParams(max_tokens=50), system="Be brief.")
    session.ask("Capital of France?")
    first = tok.decode(llm.prompts[-1])
    session.ask("And of Spain?")
    assert tok.decode(llm.prompts[-1]).startswith(first + script + "[e~[\n]~b]user\nAnd of Spain?")


@pytest.mark.parametrize("think", [True, False])
def test_reasoning_shows_and_stays_out_where_the_template_drops_it(model, ref, think):
    from pocketmoe.chat import ChatSession
    from pocketmoe.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(ref.bundle.metadata)
    tok.chat_template = THINK_TEMPLATE  # the template opens the block (MiniMax-M2's way)
    script = "\nLet me think.\n</think>\n\nParis." if think else "Paris."
    llm = Scripted(tok, script)
    session = ChatSession(llm, SamplingParams(max_tokens=50), think=think)
    shown: list[str] = []
    turn = session.ask("Capital of France?", on_text=shown.append)
    prompt = tok.decode(llm.prompts[-1])
    if think:
        assert prompt.endswith("<assistant><think>\n") and "".join(shown) == "<think>" + script
        assert turn.reasoning == "Let me think."
    else:  # --no-think: the block is closed empty in the prompt, the output is all answer
        assert prompt.endswith("<think>\n</think>\n\n") and "".join(shown) == script and turn.reasoning is None
    assert turn.reply == "Paris."
    session.ask("And of Spain?")
    assert "<user>Capital of France?<assistant>Paris.<user>And of Spain?" in tok.decode(llm.prompts[-1])


@pytest.mark.parametrize("think", [True, False])
def test_a_template_that_reasons_when_asked_is_asked(model, ref, think):
    """DeepSeek-V3.1's template opens the block only where `thinking` is true: chat asks it to unless --no-think."""
    from pocketmoe.chat import ChatSession
    from pocketmoe.testing.vocab import DEEPSEEK_V31_SHAPED_TEMPLATE
    from pocketmoe.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(ref.bundle.metadata)
    tok.chat_template = DEEPSEEK_V31_SHAPED_TEMPLATE
    llm = Scripted(tok, "Let me think.</think>Paris." if think else "Paris.")
    turn = ChatSession(llm, SamplingParams(max_tokens=50), think=think).ask("Capital of France?")
    assert tok.decode(llm.prompts[-1]).endswith("<｜Assistant｜><think>" if think else "<｜Assistant｜></think>")
    assert (turn.reasoning, turn.reply) == (("Let me think." if think else None), "Paris.")


def test_reasoning_budget_closes_the_block_for_the_model(model, ref):
    """--reasoning-budget: the reply's thought is the unbounded one's first tokens and the message, and the answer is
    what the model writes after the closing tag (the engine given that text, with no budget)."""
    from pocketmoe.chat import ChatSession

    template, ref.tokenizer.chat_template = ref.tokenizer.chat_template, THINK_TEMPLATE  # it opens the block
    try:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        free = ChatSession(ref, params).ask("Hi")
        turn = ChatSession(ref, params, budget=5, budget_message=" Done.").ask("Hi")
        tok = ref.tokenizer
        ids, inside = ChatSession(ref, params)._render([{"role": "user", "content": "Hi"}])
        assert inside
        thought = ref.generate([ids], SamplingParams(temperature=0, max_tokens=5))[0].token_ids
        # whole characters (on a cut inside one the count waits for it to end: test_reasoning_budget)
        assert free.reasoning.startswith(tok.decode(thought).strip()) and "\ufffd" not in tok.decode(thought)
        assert turn.reasoning == (tok.decode(thought) + " Done.").strip()
        forced = ids + thought + tok.encode(" Done.</think>", add_bos=False, space_prefix=False)
        after = ref.generate([forced], SamplingParams(temperature=0, max_tokens=24 - len(forced) + len(ids),
                                                      ignore_eos=True))[0]
        assert turn.reply == after.text.strip() and turn.completion_tokens == 24
    finally:
        ref.tokenizer.chat_template = template
