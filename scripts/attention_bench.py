"""The native attention core alone: one decode query of H heads over N cache rows (K = V, d values each, as
DeepSeek-V4 and an absorbed MLA score their latent rows), the rows pushed out of the caches before each timed call
the way the other layers' weights push them out in a model. Prints one JSON object per (heads, keys):

    python scripts/attention_bench.py --heads 16 128 --keys 4096 32768 --dims 576 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from pocketmoe import native


def one(heads: int, keys: int, d: int, repeats: int, flush: np.ndarray) -> dict[str, float]:
    rng = np.random.default_rng(0)
    cache = rng.standard_normal((keys, d), dtype=np.float32)
    q = rng.standard_normal((1, heads, d), dtype=np.float32) * 0.05
    offsets = np.arange(keys, dtype=np.int64) * d
    starts = np.array([0, keys], dtype=np.int32)
    no_sinks = np.full(heads, -np.inf, dtype=np.float32)
    attend = native._lib().dsv4_attend
    attend(q, cache, offsets, starts, no_sinks, 0.05)
    times = []
    for _ in range(repeats):
        flush += 1.0
        t0 = time.perf_counter()
        attend(q, cache, offsets, starts, no_sinks, 0.05)
        times.append(time.perf_counter() - t0)
    s = float(np.median(times))
    flops = 2 * heads * keys * 2 * d  # scores and the weighted sum, a multiply-add being two
    return {"heads": heads, "keys": keys, "dims": d, "ms": round(s * 1e3, 3), "gflops": round(flops / s / 1e9, 1),
            "kv_gbps": round(keys * d * 4 / s / 1e9, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    p.add_argument("--keys", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--dims", type=int, default=576)
    p.add_argument("--threads", type=int, default=None, help="default: the native pool's")
    p.add_argument("--repeats", type=int, default=7, help="timed calls; the median is printed")
    p.add_argument("--flush-mib", type=int, default=96, help="buffer written before each call to evict the rows")
    args = p.parse_args()
    if not native.available():
        raise SystemExit(f"error: the native kernels are not built ({native.unavailable_reason()})")
    if args.threads is not None:
        native.set_num_threads(args.threads)
    flush = np.ones(args.flush_mib << 18, dtype=np.float32)
    for h in args.heads:
        for n in args.keys:
            print(json.dumps({**one(h, n, args.dims, args.repeats, flush), "threads": native.get_num_threads()}))


if __name__ == "__main__":
    main()
