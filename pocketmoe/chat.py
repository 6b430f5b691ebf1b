"""Chat with a GGUF model in the terminal, turn after turn (llama.cpp's `llama-cli -cnv`).

    python -m pocketmoe.chat [--model PATH] [--system TEXT] [--max-tokens N] [--temperature T] [--top-p P]
        [--top-k K] [--min-p P] [--seed S] [--threads N] [--n-ctx C] [--no-think] [--reasoning-budget N]
        [--reasoning-budget-message TEXT] [--prefix-cache-dir DIR] [--stats] [--json]
        [--device auto|cpu|cuda] [--mode ...] [--gpu-memory-gib G[,G...]] [...]

Each line read is a user turn (a line ending in a backslash goes on in the next); the reply streams as it is
generated. Every turn the whole conversation is rendered with the model's chat template, and the engine
continues from the KV rows the previous turn left, so a turn computes only what is new. Where the conversation
no longer leaves room for a reply of --max-tokens in --n-ctx, its oldest turns are dropped. A thinking model's
reasoning shows between <think> and </think>; the conversation keeps it as the reply's reasoning_content, which
templates that keep history's reasoning (MiniMax-M2's) render back as the model wrote it and the others leave out;
--no-think renders the template with enable_thinking (and DeepSeek-V3.1's thinking) false and closes a block it
still opens; --reasoning-budget N closes it for the model after N tokens of thought
(after --reasoning-budget-message, if given), as llama-cli does. Commands: /reset forgets the conversation, /exit
(or the end of the input) ends. Ctrl-C stops a reply (what it wrote so far stays in the conversation); at the prompt it ends.
--json prints one JSON object per turn instead of the streamed text; --stats a line of counts and speed per turn.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pocketmoe.cli_util import add_placement_args, error_line, placement_from_args, run_cli
from pocketmoe.errors import PocketMoEError
from pocketmoe.foreign_flags import parse_args_with_foreign_flags, print_notes
from pocketmoe.generate import add_runtime_args, add_sampling_args, sampling_params

COMMANDS = {"/exit": "end the chat", "/quit": "end the chat", "/reset": "forget the conversation",
            "/help": "list the commands"}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pocketmoe.chat", description=__doc__.split("\n")[0])
    p.add_argument("--model", "-m", default=None,
                   help="GGUF file, any shard of a bundle, or its directory (default: the built-in demo model)")
    p.add_argument("--system", default=None, help="a system message that opens the conversation")
    add_sampling_args(p, max_tokens=512, temperature=0.8)
    add_runtime_args(p)
    p.add_argument("--no-think", action="store_true", help="close a reasoning block the chat template opens")
    p.add_argument("--reasoning-budget", type=int, default=-1,
                   help="tokens of thought before the reasoning block is closed for the model (-1: no bound)")
    p.add_argument("--reasoning-budget-message", default="",
                   help="text written before the closing tag when the reasoning budget is spent")
    p.add_argument("--stats", action="store_true", help="a line of token counts and speed after each reply")
    p.add_argument("--json", action="store_true", help="one JSON object per turn instead of the streamed text")
    add_placement_args(p)
    args = parse_args_with_foreign_flags(p, argv, server=False)
    if args.reasoning_budget < -1:
        raise PocketMoEError(f"--reasoning-budget must be -1 (no bound) or >= 0, got {args.reasoning_budget}; "
                             "give the tokens of thought to allow.")
    return args


@dataclass
class Turn:
    """One answered turn: the reply as the conversation keeps it, and what it cost."""

    reply: str
    reasoning: str | None
    finish_reason: str  # stop | length | interrupted
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    dropped_turns: int
    ttft_s: float
    decode_tok_s: float


class ChatSession:
    """A conversation over an LLM's single sequence: the messages so far, rendered whole each turn."""

    def __init__(self, llm: Any, params: Any, system: str | None = None, think: bool = True, budget: int = -1,
                 budget_message: str = "") -> None:
        self.llm, self.params, self.think = llm, params, think
        self.budget, self.budget_message = budget, budget_message  # the reasoning budget (-1: none)
        self.system = [{"role": "system", "content": system}] if system else []
        self.history: list[dict[str, str]] = []  # user and assistant messages, in pairs

    def reset(self) -> None:
        self.history = []

    def _render(self, messages: list[dict[str, str]]) -> tuple[list[int], bool]:
        """The prompt's token ids, and whether the output starts inside a reasoning block."""
        from pocketmoe.serve.reasoning import thinking_prompt

        tok = self.llm.tokenizer
        # the template told whether to reason (enable_thinking; `thinking`, DeepSeek-V3.1's name), as llama-cli does
        rendered = tok.apply_chat_template(self.system + messages, True, enable_thinking=self.think,
                                           thinking=self.think)
        text, thinking = thinking_prompt(rendered, self.think)
        return tok.encode_rendered_chat(text), thinking

    def ask(self, text: str, on_text: Callable[[str], None] | None = None) -> Turn:
        """Answer one user message; on_text gets the reply's text as it streams (a forced-open reasoning block
        starts with its `<think>`)."""
        from pocketmoe.engine.budget import ReasoningBudget
        from pocketmoe.engine.kv_cache import ContextLengthError
        from pocketmoe.engine.llm import CompletionOutput
        from pocketmoe.serve.reasoning import OPEN, split

        user = {"role": "user", "content": text}
        n_ctx, dropped = self.llm.n_ctx, 0
        ids, thinking = self._render([*self.history, user])
        while len(ids) + self.params.max_tokens > n_ctx and self.history:
            self.history = self.history[2:]  # the oldest exchange
            dropped += 1
            ids, thinking = self._render([*self.history, user])
        if len(ids) >= n_ctx:
            raise ContextLengthError(f"this message makes a prompt of {len(ids)} tokens but the context holds "
                                     f"{n_ctx}; shorten it or raise --n-ctx.")
        out = CompletionOutput(prompt_token_ids=[])
        if thinking and on_text is not None:
            on_text(OPEN)
        params = self.params
        if self.budget >= 0:
            params = replace(params, reasoning_budget=ReasoningBudget.for_tokenizer(
                self.llm.tokenizer, self.budget, self.budget_message, inside=thinking))
        try:
            for chunk in self.llm.stream(ids, params, out):
                if on_text is not None and chunk.text:
                    on_text(chunk.text)
        except KeyboardInterrupt:
            out.finish_reason = "interrupted"
        reasoning, reply = split(out.text, thinking)
        # kept without its surrounding blanks, as chat templates expect ("Assistant: " + content): the rendered
        # reply then tokenizes as it was generated, and the next turn reuses its rows too
        reply = reply.strip()
        answer = {"role": "assistant", "content": reply}
        if reasoning:  # as a client of the server sends it back (split gives it without its surrounding blanks)
            answer["reasoning_content"] = reasoning
        self.history += [user, answer]
        return Turn(reply, reasoning, out.finish_reason, len(ids), out.cached_tokens, len(out.token_ids), dropped,
                    out.ttft_s, out.decode_tok_s)


def read_turn(tty: bool) -> str | None:
    """The next user message (lines ending in a backslash joined with the next); None at the end of the input."""
    lines: list[str] = []
    while True:
        if tty:
            try:
                line = input("> " if not lines else ". ")
            except EOFError:
                return None
        else:
            line = sys.stdin.readline()
            if not line:
                return "\n".join(lines) if lines else None
            line = line.rstrip("\n")
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    print_notes(args)
    params = sampling_params(args)
    from pocketmoe.engine.llm import LLM

    if args.model is None:
        from pocketmoe.demo_model import demo_model_path

        args.model = str(demo_model_path())
    llm = LLM(args.model, n_ctx=args.n_ctx, threads=args.threads, chunk_size=args.chunk_size,
              backend=args.backend, kv_dtype=args.kv_dtype, placement=placement_from_args(args), max_num_seqs=1,
              prefix_cache_dir=args.prefix_cache_dir)
    if not llm.runner.parallel.is_lead:  # torchrun: rank 0 chats, the other ranks run its steps
        llm.runner.serve_steps()
        return 0
    tty = sys.stdin.isatty()
    if tty:
        import readline  # noqa: F401  (line editing and history for input())

        print(f"[pocketmoe] chatting with {llm.bundle.paths[0].name} ({llm.bundle.architecture}); "
              "/help lists the commands, Ctrl-D ends.", file=sys.stderr)
    session = ChatSession(llm, params, args.system, think=not args.no_think, budget=args.reasoning_budget,
                          budget_message=args.reasoning_budget_message)

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        while True:
            try:
                text = read_turn(tty)
            except KeyboardInterrupt:  # Ctrl-C at the prompt: the end
                print(file=sys.stderr)
                break
            command = text.strip() if text is not None else "/exit"
            if command in ("/exit", "/quit"):
                break
            if not command:
                continue
            if command == "/reset":
                session.reset()
                print("[pocketmoe] the conversation is forgotten.", file=sys.stderr)
                continue
            if command == "/help" or (command.startswith("/") and " " not in command and "\n" not in command):
                if command != "/help":
                    print(f"[pocketmoe] {command} is not a command.", file=sys.stderr)
                print("\n".join(f"  {c:7s} {what}" for c, what in COMMANDS.items()), file=sys.stderr)
                continue
            try:
                turn = session.ask(text, on_text=None if args.json else show)
            except PocketMoEError as e:  # this turn cannot run (too long); the chat goes on
                print(error_line(e), file=sys.stderr)
                continue
            if args.json:
                print(json.dumps(vars(turn), ensure_ascii=False), flush=True)
            else:
                show("\n")
            if turn.dropped_turns:
                print(f"[pocketmoe] dropped the oldest {turn.dropped_turns} exchange(s) to fit --n-ctx {llm.n_ctx}.",
                      file=sys.stderr)
            if args.stats:
                print(f"[pocketmoe] prompt {turn.prompt_tokens} tokens ({turn.cached_tokens} reused), reply "
                      f"{turn.completion_tokens} tokens ({turn.finish_reason}); first token after {turn.ttft_s:.2f} s, "
                      f"{turn.decode_tok_s:.1f} tok/s", file=sys.stderr)
    finally:
        llm.runner.stop_workers()  # tensor parallel: the other ranks are done
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
