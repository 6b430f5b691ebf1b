"""One check the architecture tests share: a step that batches several sequences gives each its solo logits."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pocketmoe.engine import ModelRunner, SeqChunk, Step


def assert_batched_step_is_solo(make_runner: Callable[[], ModelRunner], prompts: dict[str, list[int]]) -> None:
    """Each sequence's prefill and one decode token alone (then freed), against all of them in one prefill step
    and one decode step on a fresh runner: bitwise the same logits."""
    r = make_runner()
    solo = {}
    for s, p in prompts.items():
        solo[s] = (r.forward(Step([SeqChunk(s, p, 0, "all")])), r.forward(Step([SeqChunk(s, [11], len(p), "all")])))
        r.free(s)
    r = make_runner()
    first = r.forward(Step([SeqChunk(s, p, 0, "all") for s, p in prompts.items()]))
    second = r.forward(Step([SeqChunk(s, [11], len(p), "all") for s, p in prompts.items()]))
    i = 0
    for j, (s, p) in enumerate(prompts.items()):
        assert torch.equal(first[i:i + len(p)], solo[s][0]), s
        assert torch.equal(second[j:j + 1], solo[s][1]), s
        i += len(p)
