"""`torchrun --nproc-per-node 2 -m pocketmoe.serve` on the CPU with gloo, driven by the official openai client:
the same outputs as the 1-process server; SIGTERM to rank 0 or to torchrun stops every process; a killed
worker makes rank 0 answer 503 and exit non-zero within 30 s."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from pocketmoe.engine.kv_cache import PagedKVCache
from pocketmoe.gguf import open_bundle
from pocketmoe.testing.live_server import LiveServer
from pocketmoe.testing.synth import write_fixture
from pocketmoe.tokenizer import Tokenizer

HERE = Path(__file__).parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE.parent),
                                                                *filter(None, [os.environ.get("PYTHONPATH")])])}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_fixture("deepseek2", "tiny", "F32", tmp_path_factory.mktemp("tps") / "ds2.gguf")[0])


def server(model: str, ranks: int, *extra: str, env: dict[str, str] | None = None) -> LiveServer:
    args = ["--model", model, "--served-model-name", "m", "--threads", "1", "--max-model-len", "1024", *extra]
    return LiveServer(args, env={**ENV, **(env or {})}, launcher=TORCHRUN if ranks == 2 else (), timeout=180)


def children(pid: int) -> list[int]:
    """Every live descendant of pid (from /proc)."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def rank_pids(srv: LiveServer) -> dict[int, int]:
    """{rank: pid} of the torchrun workers."""
    assert srv.proc is not None
    ranks = {}
    for pid in children(srv.proc.pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for kv in env:
            if kv.startswith(b"RANK="):
                ranks[int(kv[5:])] = pid
    return ranks


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def requests(url: str) -> dict[str, object]:
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    chat = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hello there"}], max_tokens=12,
                                     temperature=0, extra_body={"ignore_eos": True})
    stream = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=12, temperature=0,
        stream=True, extra_body={"ignore_eos": True}) if ch.choices)
    comp = c.completions.create(model="m", prompt=["one two three", "the quick brown"], max_tokens=10, temperature=0,
                                extra_body={"ignore_eos": True})
    emb = c.embeddings.create(model="m", input=["one two three", "the quick brown fox"])
    return {"chat": chat.choices[0].message.content, "stream": stream,
            "completions": [ch.text for ch in sorted(comp.choices, key=lambda ch: ch.index)],
            "usage": (chat.usage.prompt_tokens, chat.usage.completion_tokens),
            "embeddings": np.array([d.embedding for d in emb.data])}


def test_two_rank_server_matches_one_process_and_sigterm_to_rank0_exits_0(model: str) -> None:
    with server(model, 1) as one:
        want = requests(one.url)
    srv = server(model, 2)
    with srv:
        got = requests(srv.url)
        ranks = rank_pids(srv)
        assert sorted(ranks) == [0, 1]
        os.kill(ranks[0], signal.SIGTERM)
        t0 = time.monotonic()
        rc = srv.wait(30)
        took = time.monotonic() - t0
    # the embeddings' unit vectors within the float noise of the ranks' partial sums, the rest the same
    assert np.abs(got.pop("embeddings") - want.pop("embeddings")).max() <= 1e-5
    assert got == want
    assert rc == 0, "".join(srv.stderr[-40:])
    assert took < 30
    assert not any(alive(p) for p in ranks.values())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_torchrun_stops_every_rank(model: str, sig: int) -> None:
    srv = server(model, 2)
    with srv:
        ranks = rank_pids(srv)
        srv.signal(sig)  # torchrun's own exit status for a signal is its business (non-zero)
        t0 = time.monotonic()
        srv.wait(40)
        took = time.monotonic() - t0
    assert took < 30
    assert not any(alive(p) for p in ranks.values())
    err = "".join(srv.stderr)
    assert "error:" not in err and "RankLost" not in err, err[-3000:]


def test_killed_worker_gives_503_then_exit_within_30s(model: str) -> None:
    srv = server(model, 2)
    with srv:
        ranks = rank_pids(srv)
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        box: dict[str, object] = {}

        def long_request() -> None:
            try:
                box["ok"] = c.completions.create(model="m", prompt="count", max_tokens=1000, temperature=0,
                                                 extra_body={"ignore_eos": True})
            except openai.APIStatusError as e:
                box["status"] = e.status_code
            except openai.APIConnectionError as e:  # noqa: F841
                box["status"] = "connection"

        t = threading.Thread(target=long_request)
        t.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # until tokens are being generated
            m = httpx.get(srv.url + "/metrics").text
            gen = [ln for ln in m.splitlines() if ln.startswith("pocketmoe_generation_tokens_total")]
            if gen and float(gen[0].split()[-1]) > 0:
                break
            time.sleep(0.05)
        os.kill(ranks[1], signal.SIGKILL)
        t0 = time.monotonic()
        t.join(30)
        rc = srv.wait(30)
        took = time.monotonic() - t0
    assert box.get("status") == 503, box
    assert rc != 0
    assert took < 30
    assert not any(alive(p) for p in ranks.values())


def test_hung_worker_gives_503_then_rank0_exits_within_the_timeout(model: str) -> None:
    """A worker that stops answering (SIGSTOP) without dying: the collective timeout (here 5 s) fails the step."""
    srv = server(model, 2, env={"POCKETMOE_TP_TIMEOUT_S": "5"})
    with srv:
        ranks = rank_pids(srv)
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        os.kill(ranks[1], signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            with pytest.raises(openai.APIStatusError) as e:
                c.completions.create(model="m", prompt="count", max_tokens=8, temperature=0)
            assert e.value.status_code == 503
            assert "tensor-parallel rank was lost" in e.value.message
            while alive(ranks[0]) and time.monotonic() - t0 < 30:
                time.sleep(0.1)
            took = time.monotonic() - t0
        finally:
            os.kill(ranks[1], signal.SIGKILL)  # torchrun would only after its own 30 s
        rc = srv.wait(30)
    assert took < 30
    assert rc != 0
    assert not any(alive(p) for p in ranks.values())


def test_two_rank_server_keeps_and_reads_prefix_pages_in_files(model: str, tmp_path: Path) -> None:
    """--prefix-cache-dir under tensor parallelism: each rank keeps its shard of the pages in a directory of its own;
    a restarted two-rank server answers a repeated prompt from them with the text and logprobs of the first run, and
    a page one worker lost is computed again, for every rank, with the same answer."""
    store = tmp_path / "store"
    prompt = "the quick brown fox jumps over the lazy dog " * 12
    body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 2}

    def ask(srv: LiveServer) -> tuple:
        r = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0).completions.create(**body)
        lp = r.choices[0].logprobs
        cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
        return (r.choices[0].text, lp.token_logprobs, lp.top_logprobs), cached, r.usage.prompt_tokens

    with server(model, 2, "--prefix-cache-dir", str(store)) as srv:
        first, cached, n_prompt = ask(srv)
    assert cached == 0
    n_full = (n_prompt - 1) // 16 * 16
    for rank in (0, 1):
        assert len(list((store / f"tp2-rank{rank}").glob("*/*.kv"))) == n_full // 16, rank
    with server(model, 2, "--prefix-cache-dir", str(store)) as srv:
        again, cached, _ = ask(srv)
    assert again == first and cached == n_full
    # a worker's third page gone: the first two pages still come from the files, the rest is computed on every rank
    ids = Tokenizer.from_metadata(open_bundle(model).metadata).encode(prompt)
    digests = [d for _, d in PagedKVCache(1, 1, 1, 16)._digests(ids[:n_full])]
    for d in digests[2:]:
        (path,) = (store / "tp2-rank1").glob(f"*/{d.hex()}.kv")
        path.unlink()
    with server(model, 2, "--prefix-cache-dir", str(store)) as srv:
        third, cached, _ = ask(srv)
    assert third == first and cached == 2 * 16
