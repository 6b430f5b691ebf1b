"""Background responses (serve/background.py): OpenAI's `background: true` on /v1/responses, polled, streamed again
from a sequence number, and cancelled, through the OpenAI SDK.

A live server on the tiny DeepSeek-V2 fixture: a greedy background response ends as the same response run in the
foreground ends, and its events as the foreground stream's. A scripted engine that never finishes a reply (until
the server aborts it) holds a response running, for what can only be seen while it runs: polls in progress, a
follower leaving, a cancel.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest

from pocketmoe.testing.live_server import LiveServer
from pocketmoe.testing.scripted import app_for, thinking_tokenizer
from pocketmoe.testing.synth import write_fixture

NAME = "tiny"


def strip(event: dict) -> dict:
    """An event without what differs between two runs of the same reply (ids, times, the prefix cache's share) and
    the background flag."""
    drop = {"id", "item_id", "created_at", "response_id", "background", "cached_tokens"}
    if isinstance(event, dict):
        return {k: strip(v) for k, v in event.items() if k not in drop}
    if isinstance(event, list):
        return [strip(v) for v in event]
    return event


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model = write_fixture("deepseek2", "tiny", "Q4_K_M", tmp_path_factory.mktemp("bg") / "m.gguf", seed=11)[0]
    with LiveServer(["--model", str(model), "--served-model-name", NAME, "--max-model-len", "256",
                     "--threads", "1"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def wait(client: openai.OpenAI, rid: str):  # noqa: ANN201
    r = client.responses.retrieve(rid)
    deadline = time.monotonic() + 60
    while r.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.02)
        r = client.responses.retrieve(rid)
    return r


def test_background_response_ends_as_the_foreground_one(client: openai.OpenAI) -> None:
    kw = {"model": NAME, "input": "tell me about the sea", "max_output_tokens": 24, "temperature": 0}
    fg = client.responses.create(**kw)
    bg = client.responses.create(**kw, background=True)
    assert bg.status == "queued" and bg.background and bg.output == []
    done = wait(client, bg.id)
    assert done.status == fg.status and done.background
    assert done.output_text == fg.output_text and done.usage.output_tokens == fg.usage.output_tokens
    # it is stored: a later turn continues it as it continues the foreground one
    nxt = {"model": NAME, "input": "and the mountains?", "max_output_tokens": 8, "temperature": 0}
    assert client.responses.create(**nxt, previous_response_id=done.id).output_text == \
        client.responses.create(**nxt, previous_response_id=fg.id).output_text


def test_background_stream_and_its_replay_are_the_foreground_stream(client: openai.OpenAI) -> None:
    kw = {"model": NAME, "input": "count to ten", "max_output_tokens": 16, "temperature": 0}
    fg = [e.model_dump() for e in client.responses.create(**kw, stream=True)]
    live = [e.model_dump() for e in client.responses.create(**kw, stream=True, background=True)]
    rid = live[0]["response"]["id"]
    assert [e["sequence_number"] for e in live] == list(range(len(live)))
    assert strip(live[1:]) == strip(fg[1:])  # the first: created, queued here
    wait(client, rid)
    replay = [e.model_dump() for e in client.responses.retrieve(rid, stream=True)]
    assert replay == live
    tail = [e.model_dump() for e in client.responses.retrieve(rid, stream=True, starting_after=4)]
    assert tail == live[5:]


def test_background_requests_that_cannot_work_are_400s(server: LiveServer, client: openai.OpenAI) -> None:
    r = httpx.post(server.url + "/v1/responses", json={"input": "x", "background": True, "store": False})
    assert r.status_code == 400 and "leave store true" in r.json()["error"]["message"]
    fg = client.responses.create(model=NAME, input="x", max_output_tokens=2)
    for call in (lambda: httpx.post(f"{server.url}/v1/responses/{fg.id}/cancel"),
                 lambda: httpx.get(f"{server.url}/v1/responses/{fg.id}", params={"stream": "true"})):
        r = call()
        assert r.status_code == 400 and "is not a background response this server holds" in r.json()["error"]["message"]
    assert httpx.post(f"{server.url}/v1/responses/resp_nope/cancel").status_code == 400


def test_a_held_reply_polls_in_progress_survives_its_follower_and_cancels(tmp_path: Path) -> None:
    http, eng = app_for(thinking_tokenizer(tmp_path), "one two three four five six")
    eng.hold = True
    with http:  # one event loop for the whole test: the run's task lives in it
        c = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        r = c.responses.create(model="m", input="hi", background=True)
        assert r.status == "queued"
        assert c.responses.retrieve(r.id).status == "in_progress"
        with c.responses.retrieve(r.id, stream=True) as stream:  # a follower that leaves after two events
            assert [next(stream).type for _ in range(2)] == ["response.created", "response.in_progress"]
        assert c.responses.retrieve(r.id).status == "in_progress" and eng.aborted == []
        # a turn after a running response cannot see its output yet
        after = http.post("/v1/responses", json={"input": "more", "previous_response_id": r.id})
        assert after.status_code == 400 and "still running" in after.json()["error"]["message"]
        cancelled = c.responses.cancel(r.id)
        assert cancelled.status == "cancelled" and len(eng.aborted) == 1  # the engine dropped its sequence
        assert c.responses.cancel(r.id).status == "cancelled" and len(eng.aborted) == 1
        assert c.responses.retrieve(r.id).status == "cancelled"
        assert [e.type for e in c.responses.retrieve(r.id, stream=True)][-1] != "response.completed"
        # a running one deleted: stopped, and gone
        r2 = c.responses.create(model="m", input="again", background=True)
        assert http.delete(f"/v1/responses/{r2.id}").json()["deleted"] is True
        assert len(eng.aborted) == 2
        assert http.get(f"/v1/responses/{r2.id}").status_code == 404


def test_finished_runs_are_forgotten_oldest_first() -> None:
    """Past KEEP_FINISHED runs or KEEP_EVENTS events, the oldest finished runs' events go; running ones stay."""
    import asyncio

    from pocketmoe.serve import background as bg

    async def events(n: int, rid: str):  # noqa: ANN202
        yield {"type": "response.created", "response": {"id": rid, "status": "in_progress"}}
        for i in range(n):
            yield {"type": "response.output_text.delta", "sequence_number": i + 1}

    async def main() -> tuple[list[str], int, int]:
        runs = bg.BackgroundRuns()
        for i in range(bg.KEEP_FINISHED + 3):
            await runs.start(events(2, f"r{i}"), lambda r: None)
        await asyncio.sleep(0)
        for r in list(runs._runs.values()):
            await r.task
        after_many = len(runs._runs)
        await runs.start(events(bg.KEEP_EVENTS - 10, "big"), lambda r: None)
        await runs.get("big").task
        return list(runs._runs), after_many, sum(len(runs.get(k).events) for k in runs._runs)

    kept, after_many, events_kept = asyncio.run(main())
    assert after_many == bg.KEEP_FINISHED
    assert kept[-1] == "big" and events_kept <= bg.KEEP_EVENTS and len(kept) < bg.KEEP_FINISHED
