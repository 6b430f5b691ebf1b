"""What tests/test_parallel.py compares: greedy tokens and logits of a model, here on one process or, run as
a script under torchrun, on every rank of the group (rank 0 writes them).

    torchrun --standalone --nproc-per-node 2 tests/parallel_run.py OUT.pt BACKEND MODEL.gguf [MODEL.gguf ...]
"""

from __future__ import annotations

import sys

import torch

from pocketmoe.engine.runner import ModelRunner, RunnerConfig
from pocketmoe.engine.step import SeqChunk, Step
from pocketmoe.gguf import open_bundle

PROMPT = [(37 * i + 11) % 250 + 1 for i in range(40)]  # past DeepSeek-V4 tiny's 32-row window
GEN = 6


def runner_for(path: str, backend: str) -> ModelRunner:
    return ModelRunner(open_bundle(path), RunnerConfig(n_ctx=64, backend=backend, threads=1, max_seqs=3))


def outputs(r: ModelRunner) -> dict[str, object]:
    """Prompt logits (every position), a greedy continuation, and a two-sequence prefill + decode step."""
    prompt_logits = r.forward(PROMPT, 0)
    tokens = r.generate_greedy(PROMPT, GEN)
    a, b = PROMPT[:6], PROMPT[3:]
    prefill = r.forward(Step((SeqChunk("a", a, 0, "all"), SeqChunk("b", b, 0, "last"))))
    nxt = prefill[[len(a) - 1, len(a)]].argmax(-1).tolist()
    decode = r.forward(Step((SeqChunk("a", [nxt[0]], len(a)), SeqChunk("b", [nxt[1]], len(b)))))
    return {"prompt_logits": prompt_logits, "tokens": tokens, "prefill": prefill, "decode": decode}


def main(argv: list[str]) -> int:
    out, backend, paths = argv[0], argv[1], argv[2:]
    results = {}
    runners = [runner_for(p, backend) for p in paths]
    lead = runners[0].parallel.is_lead
    for p, r in zip(paths, runners, strict=True):
        last = r is runners[-1]
        if lead:
            results[p] = outputs(r)
            r.stop_workers(end_group=last)
        else:
            r.serve_steps(end_group=last)
    if lead:
        torch.save({"world": runners[0].parallel.world, "results": results}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
