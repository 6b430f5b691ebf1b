"""Reasoning in chat output: a thinking model's `<think> ... </think>` block comes back apart from the answer.

MiniMax-M2 (and DeepSeek-R1-style models) write their reasoning between `<think>` and `</think>`, then the
answer. Where the rendered prompt already ends with `<think>` (the template opens the block, as MiniMax-M2's
does), the output starts inside it. The server (with `--reasoning-format auto`, the default) sends the block as
`reasoning_content` (llama.cpp's and older vLLM's field) and `reasoning` (newer vLLM's), and the rest as
`content`; tool calls are looked for in the content only. A block cut short by max_tokens is all reasoning.
The reasoning comes without the blanks around it and the content without those that follow `</think>`
(llama.cpp's reading), which is what templates that keep history's reasoning put back around it.
"""

from __future__ import annotations

from pocketmoe.engine.sampler import partial_prefix

OPEN, CLOSE = "<think>", "</think>"


def opens_thinking(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves the model inside a `<think>` block."""
    return prompt_text.rstrip().endswith(OPEN)


def thinking_prompt(prompt_text: str, wanted: bool) -> tuple[str, bool]:
    """The rendered prompt, with the block the template opened closed empty where no reasoning is wanted (as
    llama.cpp does for enable_thinking false), and whether the output starts inside a block."""
    if not opens_thinking(prompt_text):
        return prompt_text, False
    return (prompt_text, True) if wanted else (prompt_text + CLOSE + "\n\n", False)


class ReasoningSplitter:
    """Streamed text split into (reasoning, content) pieces. `forced_open`: the prompt opened the block, so the
    output starts in it; otherwise a block counts only where the output starts with `<think>` (after blanks).
    As llama.cpp reads a block, the reasoning comes without the blanks around it and the content without those
    after `</think>`: a template that writes history's reasoning as `<think>\n{reasoning}\n</think>\n\n{content}`
    (MiniMax-M2's) then gives back exactly the text the model wrote."""

    def __init__(self, forced_open: bool) -> None:
        # start -> (opened -> thinking) -> after -> answer; opened: the blanks that begin a block are dropped
        self._state = "opened" if forced_open else "start"
        self._held = ""
        self.thought = forced_open  # the output had a block

    def push(self, text: str) -> tuple[str, str]:
        buf, self._held = self._held + text, ""
        reasoning = ""
        if self._state == "start":
            head = buf.lstrip()
            if head.startswith(OPEN):
                self._state, buf, self.thought = "opened", head[len(OPEN):], True
            elif OPEN.startswith(head):  # blanks, or a part of "<think>": wait for more
                self._held = buf
                return "", ""
            else:
                self._state = "answer"
        if self._state == "opened":
            buf = buf.lstrip()
            if not buf:
                return "", ""
            self._state = "thinking"
        if self._state == "thinking":
            end = buf.find(CLOSE)
            if end < 0:  # hold a part of "</think>" and the blanks before it: they may end the block
                tag = partial_prefix(buf, CLOSE)
                keep = len(buf) - len(buf[:len(buf) - tag].rstrip())
                self._held = buf[len(buf) - keep:]
                return buf[:len(buf) - keep], ""
            reasoning, buf = buf[:end].rstrip(), buf[end + len(CLOSE):].lstrip()
            self._state = "answer" if buf else "after"
            return reasoning, buf
        if self._state == "after":  # the blanks right after </think> belong to neither
            buf = buf.lstrip()
            if buf:
                self._state = "answer"
        return reasoning, buf

    def finish(self) -> tuple[str, str]:
        """What is still held when the output ends: a partial tag is text of the part it is in (a block cut short
        ends without its trailing blanks)."""
        held, self._held = self._held, ""
        return (held.rstrip(), "") if self._state in ("opened", "thinking") else ("", held)


def split(text: str, forced_open: bool) -> tuple[str | None, str]:
    """(reasoning, content) of a whole output; reasoning None where there was no block."""
    s = ReasoningSplitter(forced_open)
    r1, c1 = s.push(text)
    r2, c2 = s.finish()
    return (r1 + r2 if s.thought else None), c1 + c2
