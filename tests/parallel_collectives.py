"""Run under torchrun by tests/test_parallel.py: the collectives of parallel/group.py on uneven shares."""

from __future__ import annotations

import sys

import torch

from pocketmoe.parallel import init_parallel, shutdown_parallel, split_range


def main(out: str) -> int:
    tp = init_parallel()
    results = {}
    for total in (7, 8, 1 + tp.world):
        a, b = split_range(total, tp.world, tp.rank)
        mine = torch.arange(a, b, dtype=torch.float32)[None, :].repeat(3, 1) * (torch.arange(3)[:, None] + 1)
        results[total] = tp.all_gather_cols(mine, total)
    x = torch.full((4, 5), float(tp.rank + 1))
    results["sum"] = tp.all_reduce_async(x).wait()
    results["calls"] = tp.stats.calls
    if tp.is_lead:
        torch.save(results, out)
    shutdown_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
