"""Rank 0 broadcasts each step's inputs; the other ranks run the same step on their shards.

Messages go over the control group as a header (kind, payload bytes) then the pickled payload: STEP (the
StepContext arrays rank 0 built: tokens, positions, cache rows, page table, logit rows), IDLE (a heartbeat
when no step ran for `HEARTBEAT_S`, answered by a one-value all-reduce so rank 0 learns a rank is gone even
while idle; it also keeps the workers' receive inside the collective timeout), PAGES (prefix-store pages each rank
saves or reads, its shard of their rows, as rank 0's store does: `StoreMirror`), STOP (exit cleanly). The KV cache
allocator runs on rank 0 only: the others write where the step says.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pocketmoe.parallel.group import Parallel, RankLost

if TYPE_CHECKING:
    from pocketmoe.engine.step import StepContext

STEP, IDLE, STOP, HELLO, PAGES = 1, 2, 3, 4, 5
HEARTBEAT_S = 1.0
STEP_FIELDS = ("tokens", "positions", "seq", "write_rows", "keys", "page_table", "logit_rows", "seq_spans",
               "contiguous")


def step_inputs(ctx: StepContext) -> dict[str, Any]:
    return {k: getattr(ctx, k) for k in STEP_FIELDS}


def received_inputs(payload: dict[str, Any]) -> dict[str, Any]:
    """Unpickled arrays with the canonical dtype objects the native ops check for (pickle makes new ones)."""
    return {k: v.astype(np.dtype(v.dtype.name)) if isinstance(v, np.ndarray) else v for k, v in payload.items()}


class StepChannel:
    def __init__(self, tp: Parallel) -> None:
        self.tp = tp
        self.lock = threading.RLock()  # one message (and the step it starts) at a time, in the same order everywhere
        self.last = time.monotonic()
        self.closed = False
        self.lost: RankLost | None = None
        self._beat: threading.Thread | None = None

    # -- rank 0 ------------------------------------------------------------------------------------------
    def _send(self, kind: int, payload: object = None) -> None:
        if self.lost is not None:
            raise self.lost
        data = b"" if payload is None else pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.tp.broadcast(torch.tensor([kind, len(data)], dtype=torch.int64))
            if data:
                self.tp.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        except RankLost as e:
            self.lost = e
            raise
        self.last = time.monotonic()

    def run_step(self, ctx: StepContext, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Broadcast the step, then run this rank's share of it (the workers run theirs)."""
        with self.lock:
            self._send(STEP, step_inputs(ctx))
            try:
                return run()
            except RankLost as e:
                self.lost = e
                raise

    def pages(self, ops: list[tuple[str, bytes, int]]) -> bool:
        """Have the workers save ("save", digest, page) or read ("load", digest, page) their shard of prefix-store
        pages, in order; with a read among them, whether every rank read its share (True without one)."""
        with self.lock:
            self._send(PAGES, ops)
            if not has_load(ops):
                return True
            try:
                return self.tp.agree(True)
            except RankLost as e:
                self.lost = e
                raise

    def hello(self, layout: dict[str, Any]) -> None:
        """Rank 0's cache layout; every worker checks its own is the same."""
        with self.lock:
            self._send(HELLO, layout)
            self.tp.ack()

    def heartbeat(self) -> None:
        with self.lock:
            if self.closed or time.monotonic() - self.last < HEARTBEAT_S:
                return
            self._send(IDLE)
            try:
                self.tp.ack()
            except RankLost as e:
                self.lost = e
                raise

    def start_heartbeat(self, on_lost: Callable[[RankLost], None]) -> None:
        """A daemon thread sending IDLE when no step ran for HEARTBEAT_S; on_lost(e) once a rank is gone."""

        def beat() -> None:
            while not self.closed:
                time.sleep(HEARTBEAT_S / 4)
                try:
                    self.heartbeat()
                except RankLost as e:
                    on_lost(e)
                    return

        self._beat = threading.Thread(target=beat, name="pocketmoe-tp-heartbeat", daemon=True)
        self._beat.start()

    def stop(self) -> None:
        """Tell every worker to exit (once; nothing is sent after a rank was lost)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if self.lost is None:
                try:
                    self._send(STOP)
                    self.tp.ack()  # every worker got it: the group can go
                except RankLost:
                    pass

    # -- the other ranks ---------------------------------------------------------------------------------
    def receive(self) -> tuple[int, Any]:
        header = self.tp.broadcast(torch.zeros(2, dtype=torch.int64))
        kind, n = (int(v) for v in header.tolist())
        payload = None
        if n:
            buf = self.tp.broadcast(torch.empty(n, dtype=torch.uint8))
            payload = pickle.loads(buf.numpy().tobytes())
        return kind, payload

    def serve(self, run: Callable[[dict[str, Any]], object],
              pages: Callable[[list[tuple[str, bytes, int]]], bool] | None = None) -> None:
        """A worker: run(inputs) for each STEP, pages(ops) for each PAGES (answering whether its reads worked),
        answer each IDLE, return at STOP."""
        while True:
            kind, payload = self.receive()
            if kind == STOP:
                self.tp.ack()
                return
            if kind == IDLE:
                self.tp.ack()
            elif kind == STEP:
                run(received_inputs(payload))
            elif kind == PAGES:
                ok = pages(payload) if pages is not None else False
                if has_load(payload):
                    self.tp.agree(ok)


def has_load(ops: list[tuple[str, bytes, int]]) -> bool:
    return any(op == "load" for op, _, _ in ops)


class StoreMirror:
    """Rank 0's prefix-store pages kept on the other ranks too, each its shard of the rows (PagedKVCache.mirror):
    saves go with the next message, a read waits for every rank's answer, so a page is only attached where each
    rank read its share."""

    def __init__(self, channel: StepChannel) -> None:
        self.channel = channel
        self.pending: list[tuple[str, bytes, int]] = []

    def saved(self, digest: bytes, page: int) -> None:
        """Rank 0 kept page `page` under `digest`: the workers keep theirs before the next step can change it."""
        self.pending.append(("save", digest, page))

    def loaded(self, digest: bytes, page: int) -> bool:
        """Rank 0 read `digest` into page `page`: whether every worker read its share there too."""
        ops, self.pending = [*self.pending, ("load", digest, page)], []
        return self.channel.pages(ops)

    def flush(self) -> None:
        if self.pending and not self.channel.closed:
            ops, self.pending = self.pending, []
            self.channel.pages(ops)
