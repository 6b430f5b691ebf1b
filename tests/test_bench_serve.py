"""python -m pocketmoe.bench_serve against a fake in-process OpenAI-style server: counts, latencies, errors."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pocketmoe import bench_serve
from pocketmoe.cli_util import run_cli

SLEEP_S = 0.005  # the fake's gap between streamed tokens


class Fake:
    """What the fake server saw, and which requests it should fail."""

    def __init__(self) -> None:
        self.reset()

    def reset(self, fail_every: int = 0) -> None:
        self.fail_every = fail_every  # answer HTTP 500 to every k-th request received (0: never)
        self.received = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict[str, Any]] = []


def fake_app(fake: Fake) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        fake.bodies.append(body)
        fake.received += 1
        if fake.fail_every and fake.received % fake.fail_every == 0:
            return JSONResponse({"error": {"message": "fake failure", "type": "server_error"}}, status_code=500)
        fake.in_flight += 1
        fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)

        async def stream() -> AsyncIterator[bytes]:
            try:
                for _ in range(body["max_tokens"]):
                    await asyncio.sleep(SLEEP_S)
                    chunk = {"object": "text_completion", "usage": None,
                             "choices": [{"index": 0, "text": "t", "logprobs": None, "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"],
                         "total_tokens": len(body["prompt"]) + body["max_tokens"],
                         "prompt_tokens_details": {"cached_tokens": len(body["prompt"]) // 4 * 2}}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
                yield b"data: [DONE]\n\n"
            finally:
                fake.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Fake]]:
    fake = Fake()
    srv = uvicorn.Server(uvicorn.Config(fake_app(fake), host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    port = srv.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", fake
    srv.should_exit = True
    thread.join(timeout=5)


def bench(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert bench_serve.main([*args, "--json"] + ([] if "--warmup" in args else ["--warmup", "0"])) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    return json.loads(out[0])


def test_warmup_requests_are_sent_first_and_not_counted(server: tuple[str, Fake],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    url, fake = server
    fake.reset()
    rep = bench(capsys, "--url", url, "--requests", "3", "--gen-tokens", "2", "--warmup", "2")
    assert len(fake.bodies) == 5 and rep["completed"] == 3 and rep["total_output_tokens"] == 6


def test_counts_latencies_and_concurrency(server: tuple[str, Fake], capsys: pytest.CaptureFixture[str]) -> None:
    url, fake = server
    fake.reset()
    n, c, p, g = 8, 3, 12, 6
    rep = bench(capsys, "--url", url, "--concurrency", str(c), "--requests", str(n), "--prompt-tokens", str(p),
                "--gen-tokens", str(g))
    assert rep["model"] == "fake" and rep["url"] == url
    assert (rep["concurrency"], rep["requests"], rep["prompt_tokens"], rep["gen_tokens"]) == (c, n, p, g)
    assert rep["completed"] == n and rep["failed"] == 0 and rep["errors"] == []
    assert rep["total_output_tokens"] == n * g and rep["total_input_tokens"] == n * p
    assert rep["cached_input_tokens"] == n * (p // 4 * 2)
    assert rep["duration_s"] > 0
    assert rep["request_throughput"] == pytest.approx(n / rep["duration_s"], rel=1e-2)
    assert rep["output_throughput"] == pytest.approx(n * g / rep["duration_s"], rel=1e-2)
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_latency_ms"):
        s = rep[key]
        assert set(s) == {"mean", "p50", "p99"}
        assert 0 < s["p50"] <= s["p99"], (key, s)
        assert s["mean"] > 0
    assert rep["itl_ms"]["p50"] >= 0.8 * SLEEP_S * 1000
    assert rep["ttft_ms"]["p50"] < rep["e2e_latency_ms"]["p50"]
    assert rep["e2e_latency_ms"]["mean"] >= g * SLEEP_S * 1000 * 0.8
    assert fake.max_in_flight == c
    assert len(fake.bodies) == n
    for body in fake.bodies:
        assert body["model"] == "fake" and body["max_tokens"] == g and body["stream"] is True
        assert body["ignore_eos"] is True and body["temperature"] == 0
        assert body["stream_options"] == {"include_usage": True}
        assert len(body["prompt"]) == p and all(10 <= t < 200 for t in body["prompt"])
    prompts = sorted(tuple(b["prompt"]) for b in fake.bodies)
    assert prompts == sorted(tuple(bench_serve.prompt_ids(0, i, p)) for i in range(n))


def test_sampling_flags_reach_every_request_with_its_own_seed(server: tuple[str, Fake],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    url, fake = server
    fake.reset()
    rep = bench(capsys, "--url", url, "--requests", "3", "--gen-tokens", "2", "--temperature", "0.8", "--top-p",
                "0.95", "--top-k", "40", "--seed", "5")
    assert rep["sampling"] == {"temperature": 0.8, "top_p": 0.95, "top_k": 40}
    assert sorted(b["seed"] for b in fake.bodies) == [5, 6, 7]
    assert all((b["temperature"], b["top_p"], b["top_k"]) == (0.8, 0.95, 40) for b in fake.bodies)


def test_concurrency_above_requests_and_v1_suffix(server: tuple[str, Fake],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    url, fake = server
    fake.reset()
    rep = bench(capsys, "--url", f"{url}/v1/", "--concurrency", "4", "--requests", "2", "--prompt-tokens", "3",
                "--gen-tokens", "1", "--model", "named")
    assert rep["model"] == "named" and rep["url"] == url
    assert rep["completed"] == 2 and rep["total_output_tokens"] == 2
    assert fake.max_in_flight <= 2
    assert rep["itl_ms"] == {"mean": 0.0, "p50": 0.0, "p99": 0.0}  # one token each: no gaps


def test_http_500_counts_as_failed(server: tuple[str, Fake], capsys: pytest.CaptureFixture[str]) -> None:
    url, fake = server
    fake.reset(fail_every=3)
    rep = bench(capsys, "--url", url, "--concurrency", "2", "--requests", "6", "--prompt-tokens", "4",
                "--gen-tokens", "3")
    assert rep["completed"] == 4 and rep["failed"] == 2
    assert rep["total_output_tokens"] == 4 * 3
    assert len(rep["errors"]) == 1 and rep["errors"][0].startswith("HTTP 500")
    assert "fake failure" in rep["errors"][0]


def test_every_request_failing_is_an_error(server: tuple[str, Fake], capsys: pytest.CaptureFixture[str]) -> None:
    url, fake = server
    fake.reset(fail_every=1)
    code = run_cli(bench_serve.main, ["--url", url, "--requests", "2", "--gen-tokens", "2", "--json"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err.startswith("error: all 2 requests") and "HTTP 500" in captured.err


def test_table_output(server: tuple[str, Fake], capsys: pytest.CaptureFixture[str]) -> None:
    url, fake = server
    fake.reset()
    assert bench_serve.main(["--url", url, "--requests", "2", "--prompt-tokens", "4", "--gen-tokens", "3"]) == 0
    out = capsys.readouterr().out
    for word in ("completed 2, failed 0", "output throughput", "TTFT", "TPOT", "ITL", "E2E latency", "p99"):
        assert word in out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_url(capsys: pytest.CaptureFixture[str]) -> None:
    code = run_cli(bench_serve.main, ["--url", f"http://127.0.0.1:{free_port()}", "--requests", "1", "--json"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot reach") and "--url" in lines[0]


@pytest.mark.parametrize("args, needle", [
    (["--url", "http://127.0.0.1:1", "--concurrency", "0"], "--concurrency must be at least 1, got 0"),
    (["--url", "http://127.0.0.1:1", "--requests", "0"], "--requests must be at least 1"),
    (["--url", "http://127.0.0.1:1", "--prompt-tokens", "-1"], "--prompt-tokens must be at least 1"),
    (["--url", "http://127.0.0.1:1", "--gen-tokens", "0"], "--gen-tokens must be at least 1"),
    (["--url", "http://127.0.0.1:1", "--timeout", "0"], "--timeout must be a positive"),
    (["--url", "127.0.0.1:8000"], "is not an http(s) URL"),
    (["--url", "ftp://host"], "is not an http(s) URL"),
])
def test_bad_args(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(bench_serve.main, args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1
