"""Time to first token of a long prompt computed, then read back from --prefix-cache-dir by a restarted server.

    python scripts/prefix_store_bench.py --model FILE.gguf [--prompt-tokens 8000] [--threads N] [--dir DIR]

Starts `python -m pocketmoe.serve --prefix-cache-dir DIR` on the model, sends one /v1/completions request of about
--prompt-tokens pseudo-random token ids (max_tokens 1, greedy), stops the server, starts a fresh one over the same
directory and sends the same request. Prints JSON: each run's seconds, prompt and cached tokens and token, the bytes
the pages take on disk, the speedup, and the read rate the second run's prompt needed.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time

import httpx

from pocketmoe.testing.live_server import LiveServer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-tokens", type=int, default=8000)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dir", default=None, help="the prefix cache directory (default: a new temporary one)")
    args = p.parse_args()
    store = args.dir or tempfile.mkdtemp(prefix="pocketmoe-prefix-")
    prompt = [random.Random(0).randrange(10, 200) for _ in range(args.prompt_tokens)]
    serve = ["--model", args.model, "--max-model-len", str(args.prompt_tokens + 16), "--max-num-seqs", "1",
             "--prefix-cache-dir", store, *(["--threads", str(args.threads)] if args.threads else [])]
    runs = {}
    try:
        for name in ("computed", "from_disk"):
            with LiveServer(serve, timeout=1800) as srv:
                t = time.perf_counter()
                r = httpx.post(srv.url + "/v1/completions", json={
                    "prompt": prompt, "max_tokens": 1, "temperature": 0, "return_token_ids": True}, timeout=None)
                seconds = time.perf_counter() - t
                r.raise_for_status()
                body = r.json()
                metrics = httpx.get(srv.url + "/metrics").text
                disk = next(float(line.split()[1]) for line in metrics.splitlines()
                            if line.startswith("pocketmoe_prefix_cache_disk_bytes "))
                runs[name] = {"seconds": round(seconds, 3), "prompt_tokens": body["usage"]["prompt_tokens"],
                              "cached_tokens": body["usage"]["prompt_tokens_details"]["cached_tokens"],
                              "token": body["choices"][0]["token_ids"], "disk_bytes": int(disk)}
    finally:
        if args.dir is None:
            shutil.rmtree(store, ignore_errors=True)
    a, b = runs["computed"], runs["from_disk"]
    print(json.dumps({"model": args.model, **runs, "same_token": a["token"] == b["token"],
                      "speedup": round(a["seconds"] / b["seconds"], 1),
                      "prefill_tok_s": round(a["prompt_tokens"] / a["seconds"], 1),
                      "read_gb_s": round(b["disk_bytes"] / b["seconds"] / 1e9, 2)}))


if __name__ == "__main__":
    main()
