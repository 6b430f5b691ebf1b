"""The all-reduce cost of tensor parallelism, measured on this machine's group and projected to N GPUs.

    torchrun --nproc-per-node 1 -m pocketmoe.parallel.commbench --hidden 2048 --layers 27 --json

Times `all_reduce` (NCCL on CUDA, gloo on the CPU) on the messages a step sends: one [T, hidden] float32
sum per sublayer (attention, then FFN or MoE) and one for the embedding. Even at world size 1 the collective
runs (the model itself skips it there), so one GPU gives the per-call latency floor. The projection to N
GPUs on PCIe is on paper: per call, that latency plus a ring all-reduce's 2 (N - 1) / N x bytes over the
link bandwidth, times the calls per token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from pocketmoe.cli_util import EXIT_OK, int_list, run_cli, table
from pocketmoe.errors import PocketMoEError
from pocketmoe.parallel.group import init_parallel, shutdown_parallel


def time_all_reduce(t: torch.Tensor, iters: int) -> float:
    """Median seconds of one all_reduce of t on the default group (after a warm-up)."""
    for _ in range(3):
        dist.all_reduce(t)
    times = []
    for _ in range(iters):
        if t.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        if t.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(hidden: int, layers: int, tokens: list[int], iters: int, pcie_gbps: float,
            ranks: list[int]) -> dict:
    tp = init_parallel()
    device = torch.device("cuda", tp.local_rank) if tp.backend == "nccl" else torch.device("cpu")
    calls = 2 * layers + 1  # one reduce per sublayer, plus the vocab-parallel embedding's
    out: dict = {"rank": tp.rank, "backend": tp.backend, "world_size": tp.world, "device": str(device), "hidden": hidden,
                 "layers": layers, "calls_per_step": calls, "pcie_gbps": pcie_gbps, "steps": []}
    for n in tokens:
        t = torch.ones(n, hidden, dtype=torch.float32, device=device)
        sec = time_all_reduce(t, iters)
        nbytes = t.numel() * 4
        step = {"tokens": n, "bytes_per_call": nbytes, "measured_us_per_call": round(sec * 1e6, 2),
                "measured_ms_per_step": round(sec * calls * 1e3, 4), "estimate_ms_per_step": {}}
        for r in ranks:  # on paper: the measured floor plus a ring's bytes over PCIe
            ring = 2 * (r - 1) / r * nbytes / (pcie_gbps * 1e9)
            step["estimate_ms_per_step"][str(r)] = round((sec + ring) * calls * 1e3, 4)
        out["steps"].append(step)
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pocketmoe.parallel.commbench", description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048, help="the model's hidden size (V2-Lite: 2048)")
    p.add_argument("--layers", type=int, default=27, help="decoder layers (V2-Lite: 27)")
    p.add_argument("--tokens", default="1,512", help="tokens per step to time, comma-separated (decode, prefill)")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--pcie-gbps", type=float, default=12.6, help="GPU-to-GPU bandwidth for the projection")
    p.add_argument("--ranks", default="2,4", help="tensor-parallel sizes to project to")
    p.add_argument("--json", action="store_true", help="one JSON object (else a table)")
    return p


def _positive(text: str, flag: str) -> list[int]:
    values = int_list(text, flag)
    if min(values) < 1:
        raise PocketMoEError(f"{flag} takes positive integers, got {text!r}.")
    return values


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    tokens, ranks = _positive(args.tokens, "--tokens"), _positive(args.ranks, "--ranks")
    try:
        res = measure(args.hidden, args.layers, tokens, max(1, args.iters), args.pcie_gbps, ranks)
    finally:
        shutdown_parallel()
    if res["rank"] != 0:  # rank 0 reports for the group
        return EXIT_OK
    if args.json:
        print(json.dumps(res))
        return EXIT_OK
    print(f"all_reduce on {res['backend']} ({res['device']}), world size {res['world_size']}, "
          f"{res['calls_per_step']} calls per step")
    headers = ["tokens", "bytes/call", "us/call", "ms/step", *(f"TP={r} ms/step (paper)" for r in ranks)]
    print(table(headers, [[s["tokens"], s["bytes_per_call"], s["measured_us_per_call"], s["measured_ms_per_step"],
                           *s["estimate_ms_per_step"].values()] for s in res["steps"]]))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
