"""Offline throughput of LLM.generate: the same prompts one after another, then as one batch (one JSON line).

    python scripts/batch_generate_bench.py --model M [--prompts 16] [--max-num-seqs 16] [--gen-tokens 64]

Prompts are random token ids of 32-128 tokens (seeded), greedy with ignore_eos, so both runs do the same work;
`same_tokens` says whether every batched output equals its one-at-a-time run (it must). `bound` is bench's: the
weight bytes one decode token reads over the measured read bandwidth, the limit of one sequence's decode (its
fraction is the one-at-a-time rate's, prefill included); a batch reads each weight once for all its sequences,
so its output rate may pass it. `next_turn_*`: one prompt and its reply, then the next turn (the two and 16 new
tokens) on the single sequence, its time to first token with the rows of the first run reused and without.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from pocketmoe import LLM, SamplingParams
from pocketmoe.benchmark.bounds import decode_bound, decode_bytes_per_token
from pocketmoe.hostinfo import measure_read_bandwidth
from pocketmoe.memstat import MemoryWatch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    mem = MemoryWatch()
    rng = np.random.default_rng(args.seed)
    llm = LLM(args.model, threads=args.threads, n_ctx=128 + 2 * args.gen_tokens + 32, max_num_seqs=args.max_num_seqs)
    vocab = llm.runner.vocab_size
    prompts = [rng.integers(10, vocab - 10, size=int(rng.integers(32, 129))).tolist() for _ in range(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.gen_tokens, ignore_eos=True)
    llm.generate([rng.integers(10, vocab - 10, size=64).tolist()], params)  # warm-up (shares no prompt start)
    t = time.perf_counter()
    solo = [llm.generate([q], params)[0] for q in prompts]
    solo_s = time.perf_counter() - t
    t = time.perf_counter()
    batch = llm.generate(prompts, params, use_tqdm=False)
    batch_s = time.perf_counter() - t
    mem.sample()
    peak_rss = mem.peak_rss_mib  # before a second LLM maps the file again

    # a chat's next turn on the single sequence: the previous prompt and reply, then 16 new tokens
    turn = prompts[0] + solo[0].token_ids + rng.integers(10, vocab - 10, size=16).tolist()
    ttft = {}
    for reuse in (True, False):
        one = llm if reuse else LLM(args.model, threads=args.threads, n_ctx=llm.n_ctx, max_num_seqs=1,
                                    enable_prefix_caching=False)
        one.generate([prompts[0]], params)
        ttft[reuse] = one.generate([turn], SamplingParams(temperature=0, max_tokens=1))[0]

    bw = measure_read_bandwidth(args.threads)
    out = sum(len(o.token_ids) for o in batch)
    print(json.dumps({
        "model": args.model, "prompts": args.prompts, "max_num_seqs": args.max_num_seqs,
        "prompt_tokens": sum(len(q) for q in prompts), "output_tokens": out,
        "one_at_a_time_s": round(solo_s, 3), "batch_s": round(batch_s, 3),
        "one_at_a_time_out_tok_s": round(out / solo_s, 1), "batch_out_tok_s": round(out / batch_s, 1),
        "speedup": round(solo_s / batch_s, 2),
        "same_tokens": all(a.token_ids == b.token_ids for a, b in zip(solo, batch, strict=True)),
        "next_turn_prompt_tokens": len(turn), "next_turn_cached_tokens": ttft[True].cached_tokens,
        "next_turn_ttft_s": round(ttft[True].ttft_s, 3), "next_turn_ttft_s_without_reuse": round(ttft[False].ttft_s, 3),
        "bound": decode_bound(decode_bytes_per_token(llm.bundle), bw.gbps, bw.method, out / solo_s),
        "peak_rss_mib": round(peak_rss, 1), "backend": llm.backend_detail,
    }))


if __name__ == "__main__":
    main()
