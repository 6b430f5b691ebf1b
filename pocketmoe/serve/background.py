"""Background responses (OpenAI's `background: true` on /v1/responses): the reply runs on the server whether or not
the client stays, for replies that take longer than a connection lives (a long reasoning on a CPU).

The POST answers at once with the response `queued`; the response's events are produced by a task of the server's
event loop and kept in a `BackgroundRun`, and each one that carries the response keeps the stored copy current, so
`GET /v1/responses/{id}` polls it (`in_progress`, then `completed`, `incomplete` or `failed`).
`GET ...?stream=true&starting_after=N` (and a POST with `stream`) follows its events from after sequence number N,
those already made first; leaving one never stops the run. `POST /v1/responses/{id}/cancel` stops it (the engine
drops its sequence): status `cancelled`, and again the same answer. Finished runs' events stay for the last
`KEEP_FINISHED` of them, within `KEEP_EVENTS` events in all (the response itself stays in the store).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

from pocketmoe.serve.protocol import RequestError

log = logging.getLogger("pocketmoe.serve")
KEEP_FINISHED = 64  # finished runs whose events a stream may still replay
KEEP_EVENTS = 50_000  # events of finished runs kept in all (a text delta is a few hundred bytes)


class Detached:
    """A request whose client never goes away: what a background run's reply is tied to (serve/api.py's deltas
    watch their request for a disconnect)."""

    async def receive(self) -> dict[str, Any]:
        await asyncio.Event().wait()  # until cancelled
        raise AssertionError("unreachable")


class BackgroundRun:
    def __init__(self, response_id: str) -> None:
        self.id = response_id
        self.events: list[dict[str, Any]] = []  # event i has sequence_number i
        self.done = False
        self.cancelled = False
        self.latest: dict[str, Any] = {}  # the response as the last event that carried it (polls read it)
        self.task: asyncio.Task[None] | None = None
        self._changed = asyncio.Condition()

    async def add(self, event: dict[str, Any]) -> None:
        async with self._changed:
            self.events.append(event)
            self._changed.notify_all()

    async def finish(self) -> None:
        async with self._changed:
            self.done = True
            self._changed.notify_all()

    async def follow(self, after: int | None = None) -> AsyncIterator[dict[str, Any]]:
        """The run's events from sequence number after + 1 (all without it), those made so far and then each as it
        comes, until the run ends."""
        i = 0 if after is None else after + 1
        while True:
            async with self._changed:
                while i >= len(self.events) and not self.done:
                    await self._changed.wait()
                new, finished = self.events[i:], self.done
            for e in new:
                yield e
            i += len(new)
            if finished and i >= len(self.events):
                return


class BackgroundRuns:
    """The background runs of this server, by response id: the running ones, and the last KEEP_FINISHED finished."""

    def __init__(self) -> None:
        self._runs: OrderedDict[str, BackgroundRun] = OrderedDict()

    def get(self, response_id: str) -> BackgroundRun | None:
        return self._runs.get(response_id)

    async def start(self, events: AsyncIterator[dict[str, Any]], snapshot: Callable[[dict[str, Any]], object]
                    ) -> dict[str, Any]:
        """Run a response's events (response_events') in a task; snapshot(response) is called with the response
        each event carries and once more if it is cancelled. Returns the response as queued."""
        first = await events.__anext__()  # response.created: made before any output, it names the response
        run = BackgroundRun(first["response"]["id"])
        queued = {**copy.deepcopy(first["response"]), "status": "queued"}
        run.latest = queued
        snapshot(queued)
        await run.add(first)
        self._runs[run.id] = run
        run.task = asyncio.create_task(self._drive(run, events, snapshot, queued))
        return queued

    async def _drive(self, run: BackgroundRun, events: AsyncIterator[dict[str, Any]],
                     snapshot: Callable[[dict[str, Any]], object], last: dict[str, Any]) -> None:
        try:
            async for e in events:
                await run.add(e)
                if "response" in e:
                    last = run.latest = e["response"]
                    snapshot(last)
        except asyncio.CancelledError:
            run.cancelled = True
            run.latest = {**last, "status": "cancelled"}
            snapshot(run.latest)
        except Exception as e:  # a bug, not the engine (whose errors are a response.failed event): polls say failed
            log.exception("a background response failed")
            run.latest = {**last, "status": "failed", "error": {"code": "server_error", "message": str(e)}}
            snapshot(run.latest)
        finally:
            await run.finish()
            self._trim()

    def _trim(self) -> None:
        """Forget the oldest finished runs past KEEP_FINISHED of them or KEEP_EVENTS events."""
        finished = [k for k, r in self._runs.items() if r.done]
        events = sum(len(self._runs[k].events) for k in finished)
        for k in finished:
            if len(finished) <= KEEP_FINISHED and events <= KEEP_EVENTS:
                break
            events -= len(self._runs.pop(k).events)
            finished = finished[1:]

    def forget(self, response_id: str) -> None:
        self._runs.pop(response_id, None)

    async def cancel(self, response_id: str) -> None:
        """Stop a running background response (RequestError where the id names none)."""
        run = self._runs.get(response_id)
        if run is None:
            raise RequestError(f"{response_id!r} is not a background response this server holds; only a response made "
                               "with background true can be cancelled.", status=400)
        if run.task is not None and not run.done:
            run.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run.task
