"""Benchmark an OpenAI-compatible server: throughput and TTFT / TPOT / ITL latency under load.

    python -m pocketmoe.bench_serve --url URL [--concurrency C] [--requests N] [--prompt-tokens P]
        [--gen-tokens G] [--model NAME] [--api-key KEY] [--seed S] [--timeout SECONDS] [--json]
        [--temperature T] [--top-p P] [--top-k K]

Sends N streamed /v1/completions requests, at most C in flight, each a prompt of P pseudo-random token
ids (in [10, 200), seeded by seed + request index) with max_tokens G and ignore_eos, so every request
yields G tokens; greedy unless --temperature (then request i is seeded seed + i, with --top-p / --top-k). The metrics are the ones vLLM's benchmark_serving.py reports: TTFT = first
streamed token - request start; ITL = gaps between successive streamed chunks (all requests pooled);
TPOT = (latency - TTFT) / (tokens - 1) per request; output_throughput = completion tokens / wall time.
The model id comes from GET /v1/models unless --model is given. Proxy settings are ignored.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from pocketmoe.cli_util import run_cli, table
from pocketmoe.errors import PocketMoEError

TOKEN_LOW, TOKEN_HIGH = 10, 200  # prompt ids: ordinary tokens below any vocabulary we bench


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # seconds, request start to the end of the stream
    itl: list[float] = field(default_factory=list)  # seconds between successive output events
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the server's prefix cache gave (usage.prompt_tokens_details)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pocketmoe.bench_serve", description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    p.add_argument("--concurrency", type=int, default=1, help="most requests in flight at once")
    p.add_argument("--requests", type=int, default=16, help="requests to send in all")
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length of every request")
    p.add_argument("--gen-tokens", type=int, default=128, help="max_tokens of every request (ignore_eos is set)")
    p.add_argument("--model", default=None, help="model id to send (default: the first one /v1/models lists)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--seed", type=int, default=0, help="request i's prompt comes from random.Random(seed + i)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a connect or read may wait")
    p.add_argument("--warmup", type=int, default=1,
                   help="requests of the same shape sent first and not counted (page-in, first-call costs)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: off)")
    args = p.parse_args(argv)
    if args.warmup < 0:
        raise PocketMoEError(f"--warmup must be 0 or more, got {args.warmup}.")
    for flag, value in (("--concurrency", args.concurrency), ("--requests", args.requests),
                        ("--prompt-tokens", args.prompt_tokens), ("--gen-tokens", args.gen_tokens)):
        if value < 1:
            raise PocketMoEError(f"{flag} must be at least 1, got {value}.")
    if not args.timeout > 0:
        raise PocketMoEError(f"--timeout must be a positive number of seconds, got {args.timeout}.")
    return args


def base_url(url: str) -> str:
    """`http://host:port` from the URL given, with or without a trailing `/` or `/v1`."""
    base = url.strip().rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    try:
        parsed = httpx.URL(base) if "://" in base else None
    except httpx.InvalidURL:
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise PocketMoEError(f"--url {url!r} is not an http(s) URL; give the server base, e.g. http://127.0.0.1:8000.")
    return base


def prompt_ids(seed: int, index: int, n: int) -> list[int]:
    rng = random.Random(seed + index)
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n)]


async def fetch_model(client: httpx.AsyncClient, base: str) -> str:
    try:
        r = await client.get(f"{base}/v1/models")
    except httpx.HTTPError as e:
        raise PocketMoEError(f"cannot reach {base}/v1/models ({type(e).__name__}: {e}); start the server "
                             "(python -m pocketmoe.serve) or fix --url.") from None
    if r.status_code != 200:
        raise PocketMoEError(f"GET {base}/v1/models answered HTTP {r.status_code} ({r.text[:200]!r}); check --url "
                             "and --api-key, or give --model.")
    try:
        return str(r.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise PocketMoEError(f"GET {base}/v1/models lists no model ({r.text[:200]!r}); give --model.") from None


def is_output_event(chunk: dict[str, Any]) -> bool:
    """A chunk that carries generated text or a token: text, logprobs tokens, or any chunk before the last
    (PocketMoE sends one chunk per token, its text empty while a UTF-8 character or a stop string is pending)."""
    choices = chunk.get("choices") or []
    if not choices:
        return False
    c = choices[0]
    return bool(c.get("text")) or bool((c.get("logprobs") or {}).get("tokens")) or c.get("finish_reason") is None


async def one_request(client: httpx.AsyncClient, base: str, body: dict[str, Any]) -> RequestResult:
    res = RequestResult()
    usage_tokens: int | None = None
    events, done = 0, False
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                res.error = f"HTTP {r.status_code}: {text}"[:200]
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    res.error = f"stream error: {json.dumps(chunk['error'])}"[:200]
                    return res
                now = time.perf_counter()
                if is_output_event(chunk):
                    if events == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    events, last = events + 1, now
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                    res.cached_tokens = int((chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                                            or 0)
    except (httpx.HTTPError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
        return res
    res.latency = time.perf_counter() - start
    if not done:
        res.error = "the stream ended before 'data: [DONE]'"
    elif events == 0:
        res.error = "the stream carried no output tokens"
    else:
        res.ok, res.output_tokens = True, usage_tokens if usage_tokens is not None else events
    return res


async def run_all(args: argparse.Namespace, base: str) -> tuple[str, list[RequestResult], float]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(args.timeout),
                                 trust_env=False) as client:
        model = args.model or await fetch_model(client, base)
        gate = asyncio.Semaphore(args.concurrency)

        def body(i: int) -> dict[str, Any]:
            out = {"model": model, "prompt": prompt_ids(args.seed, i, args.prompt_tokens),
                   "max_tokens": args.gen_tokens, "temperature": args.temperature, "stream": True, "ignore_eos": True,
                   "stream_options": {"include_usage": True}}
            if args.temperature > 0:  # the server checks the ranges (a 400 names the field)
                out.update(seed=(args.seed + i) % 2**63, top_p=args.top_p, top_k=args.top_k)
            return out

        async def bounded(i: int) -> RequestResult:
            async with gate:
                return await one_request(client, base, body(i))

        for k in range(args.warmup):
            await one_request(client, base, body(-1 - k))
        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(i) for i in range(args.requests)))
        return model, list(results), time.perf_counter() - start


def stats_ms(seconds: Sequence[float]) -> dict[str, float]:
    if not seconds:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    return {"mean": round(float(ms.mean()), 3), "p50": round(float(np.percentile(ms, 50)), 3),
            "p99": round(float(np.percentile(ms, 99)), 3)}


def summarize(args: argparse.Namespace, base: str, model: str, results: list[RequestResult],
              duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "url": base, "model": model, "concurrency": args.concurrency, "requests": args.requests,
        "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
        "sampling": {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k},
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": round(duration, 4),
        "request_throughput": round(len(ok) / duration, 4), "output_throughput": round(out_tokens / duration, 3),
        "total_input_tokens": args.prompt_tokens * len(ok), "total_output_tokens": out_tokens,
        "cached_input_tokens": sum(r.cached_tokens for r in ok),  # a prefix cache hit makes a TTFT shorter
        "ttft_ms": stats_ms([r.ttft for r in ok]),
        "tpot_ms": stats_ms([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
        "itl_ms": stats_ms([gap for r in ok for gap in r.itl]),
        "e2e_latency_ms": stats_ms([r.latency for r in ok]),
        "errors": list(dict.fromkeys(r.error for r in results if not r.ok))[:5],  # distinct, in order
    }


def render(rep: dict[str, Any]) -> str:
    lines = [f"serving benchmark: {rep['url']}  model {rep['model']}",
             f"  concurrency {rep['concurrency']}, {rep['requests']} requests of {rep['prompt_tokens']} prompt + "
             f"{rep['gen_tokens']} generated tokens",
             f"  completed {rep['completed']}, failed {rep['failed']}, duration {rep['duration_s']:.2f} s",
             f"  request throughput {rep['request_throughput']:.3f} req/s, "
             f"output throughput {rep['output_throughput']:.1f} tok/s (aggregate)",
             f"  input tokens {rep['total_input_tokens']} ({rep['cached_input_tokens']} from the server's prefix "
             f"cache), output tokens {rep['total_output_tokens']}", ""]
    rows = [[name, *(f"{rep[key][s]:.2f}" for s in ("mean", "p50", "p99"))]
            for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"),
                              ("E2E latency", "e2e_latency_ms"))]
    lines.append(table(["latency (ms)", "mean", "p50", "p99"], rows))
    lines += [f"  failed: {e}" for e in rep["errors"]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    base = base_url(args.url)
    model, results, duration = asyncio.run(run_all(args, base))
    rep = summarize(args, base, model, results, duration)
    if rep["completed"] == 0:
        raise PocketMoEError(f"all {args.requests} requests to {base}/v1/completions failed (first: "
                             f"{rep['errors'][0]}); check the server log, --model and --api-key.")
    print(json.dumps(rep) if args.json else render(rep))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
