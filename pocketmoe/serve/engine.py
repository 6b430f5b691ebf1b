"""Continuous batching: many sequences share one ModelRunner and its KV pool, one forward per step.

A background thread runs the loop: take new requests and aborts, admit waiting sequences while the
KV pool and `max_num_seqs` allow (FIFO), build one `Step` of every running sequence's next token plus
prefill chunks up to `chunk_size` tokens, run it, sample, and hand each request its deltas on its
asyncio queue. Prefill chunks of a sequence end at multiples of `chunk_size` from position 0, so a
sequence is cut into the same chunks alone as in any batch; with row-independent ops (native and
reference alike across sequences) its logits are bitwise its solo logits. When a decode token finds
no free page, the newest running sequence is preempted: its pages go back to the pool and it is
recomputed from its prompt and the tokens it already produced when pages free up (its stream just
pauses). An abort (client gone) frees the sequence's pages before the next step.

Prefix caching (EngineConfig.prefix_caching): after each step a sequence's full pages of computed rows
are indexed by their tokens (PagedKVCache.commit); an admitted sequence attaches the indexed pages that
match the start of its tokens and computes only the rest (at least its last token, whose logits it
samples from). A multi-turn chat then prefills only the new turn, a repeated system prompt is computed
once, the n choices of a request compute their prompt once (the others wait for its pages), and a
preempted sequence gets its pages back while they are not evicted. A row depends only on
the tokens up to it; where the ops' results also do not depend on how a prompt is chunked (the native
kernels: `ops.chunk_invariant`) a cached row is bitwise the row a prefill would write and the tokens
are the same with the cache as without, so that is where it is on by default. Sequences that want
prompt logprobs compute their whole prompt.

Slots (llama-server's): a running sequence holds one of `max_num_seqs` slots, the lowest free one or the one
its request named (id_slot: it then waits for that slot, FIFO); /slots shows each slot's sequence, or the one it
ran last. The prefix cache is shared, so which slot runs a prompt changes nothing in what it reuses.

Legend: V vocab.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from pocketmoe.defaults import DEFAULT_CHUNK_SIZE
from pocketmoe.engine.kv_cache import KVPoolFullError
from pocketmoe.engine.pooling import Pooler, chunk_rows, reuses_prefix
from pocketmoe.engine.runner import ModelRunner
from pocketmoe.engine.sampler import Sampler, SamplingParams, StopChecker, TokenLogprob, token_logprob
from pocketmoe.engine.step import SeqChunk, Step
from pocketmoe.engine.structured import GrammarError
from pocketmoe.errors import PocketMoEError
from pocketmoe.parallel import RankLost
from pocketmoe.serve.metrics import Metrics
from pocketmoe.tokenizer import Tokenizer
from pocketmoe.tokenizer.stream import StreamDecoder

log = logging.getLogger("pocketmoe.serve")
T = TypeVar("T")


class QueueFullError(Exception):
    """The waiting queue holds `max_queue` requests already (the server answers 503)."""


class SlotBusyError(Exception):
    """A slot action asked of a slot a sequence runs in (the server answers 409)."""


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 16      # sequences decoding at once
    max_queue: int = 256        # requests waiting for admission before new ones get a 503
    chunk_size: int = DEFAULT_CHUNK_SIZE  # prefill tokens per step, over all sequences
    max_model_len: int = 4096   # prompt + generated tokens of one sequence
    # reuse the KV pages of a prompt's start that earlier sequences computed; None: where the ops are chunk-invariant
    prefix_caching: bool | None = None


@dataclass
class Delta:
    """What one step added to one choice: text (possibly empty while a stop string or UTF-8 character is
    pending), the tokens, their logprobs, and on the last delta the finish reason."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # echo: one per prompt token (the first None)
    error: str | None = None
    cached_tokens: int | None = None  # on the last delta: prompt tokens whose KV rows the prefix cache gave
    stop_reason: str | int | None = None  # on a "stop" delta: the stop string, or the end token id (vLLM's field)
    # llama.cpp's return_progress: a delta of its own (no text or tokens) as the prompt is computed, {"total",
    # "cache", "processed" (cached ones included), "time_ms" (since its prefill began)}
    progress: dict[str, int] | None = None
    embedding: torch.Tensor | None = None  # an embedding's: its prompt's pooled hidden state [D] ([T, D] unpooled)
    slot: int = -1  # the slot its choice ran in (llama-server's id_slot; -1: none yet)


@dataclass
class Seq:
    """One choice of a request: its tokens (prompt, then generated) and how far the KV cache holds them."""

    key: tuple[int, int]
    request: Request
    index: int
    prompt_len: int
    tokens: list[int]
    params: SamplingParams
    sampler: Sampler
    stop: StopChecker
    decoder: StreamDecoder
    computed: int = 0
    generated: int = 0
    want_prompt_logprobs: bool = False
    prompt_lp_sent: int = 0  # prompt logprob entries sent (a preempted sequence does not send them twice)
    last_token_at: float = 0.0
    first_token_at: float = 0.0
    finished: bool = False
    admitted: bool = False
    cached: int = 0  # prompt positions the prefix cache gave at its first admission
    want_progress: bool = False  # send progress deltas while the prompt is computed (Delta.progress)
    admitted_at: float = 0.0
    pooler: Pooler | None = None  # an embedding's: its prompt is computed and pooled, nothing is generated
    slot: int = -1  # the slot it runs in while running, else the one it last ran in (-1: none yet)
    want_slot: int = -1  # the slot it must run in (llama-server's id_slot; -1: any free one)

    @property
    def decoding(self) -> bool:
        """Past its prompt with one token (the last sampled) to feed: a decode token this step."""
        return self.computed >= self.prompt_len and len(self.tokens) - self.computed == 1


class Request:
    """A submitted request: its choices run as sequences; deltas arrive on `queue` (None ends it), or go to
    `sink` where the engine runs in the caller's thread (Engine.run_until_done)."""

    def __init__(self, rid: int, n_prompt: int, loop: asyncio.AbstractEventLoop | None,
                 out: asyncio.Queue[Delta | None] | None = None,
                 sink: Callable[[Delta | None], None] | None = None) -> None:
        self.id = rid
        self.n_prompt = n_prompt
        self.loop = loop
        self.sink = sink
        self.queue: asyncio.Queue[Delta | None] | None = out if out is not None or sink is not None \
            else asyncio.Queue()
        self.seqs: list[Seq] = []
        self.arrival = time.perf_counter()
        self.open = 0  # choices not finished yet
        self.queued = True  # counts against max_queue until its first choice is admitted or it ends

    def put(self, item: Delta | None) -> None:
        if self.sink is not None:
            self.sink(item)
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop has closed (server stopped)
            pass

    async def deltas(self) -> AsyncIterator[Delta]:
        assert self.queue is not None, "a request with a sink has no queue"
        while (d := await self.queue.get()) is not None:
            yield d


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, cfg: EngineConfig, metrics: Metrics) -> None:
        self.runner, self.tok, self.cfg, self.metrics = runner, tokenizer, cfg, metrics
        self.cache = runner.cache
        self.prefix_caching = runner.reuses_rows(cfg.prefix_caching)
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        # llama-server's slots: each running sequence holds one of max_num_seqs; `slot_last` keeps the sequence a
        # slot ran last (what /slots shows of an idle slot). Written by the engine thread alone.
        self.slots: list[Seq | None] = [None] * cfg.max_num_seqs
        self.slot_last: list[Seq | None] = [None] * cfg.max_num_seqs
        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards the count of queued requests
        self._queued = 0
        self._thread = threading.Thread(target=self._loop, name="pocketmoe-engine", daemon=True)
        self.alive = False
        self.steps = 0
        # called once when a tensor-parallel rank is lost (the server then exits non-zero)
        self.on_fatal: Callable[[BaseException], None] | None = None
        self._lost_error = ""

    # -- the asyncio side ------------------------------------------------------------------------------
    def start(self) -> None:
        self.alive = True
        self._thread.start()

    def request_stop(self) -> None:
        """Ask the loop to finish every request (finish_reason "length" on what is cut short) and end."""
        self._inbox.put(("stop", None))

    def stop(self, timeout: float = 5.0) -> None:
        """request_stop, then wait for the loop to end."""
        if self._thread.is_alive():
            self.request_stop()
            self._thread.join(timeout)
        self.alive = False

    def lose(self, e: BaseException) -> None:
        """A tensor-parallel rank is gone (seen while idle): new requests get 503, the running ones end with
        an error, the loop ends."""
        self.alive = False
        self._lost_error = f"a tensor-parallel rank was lost: {e}"
        self._inbox.put(("lost", None))
        if self.on_fatal is not None:
            self.on_fatal(e)

    def submit(self, prompt: Sequence[int], params: Sequence[SamplingParams], *,
               loop: asyncio.AbstractEventLoop | None = None,
               out: asyncio.Queue[Delta | None] | None = None, index_base: int = 0,
               sink: Callable[[Delta | None], None] | None = None, samplers: Sequence[Sampler] | None = None,
               progress: bool = False, slot: int = -1) -> Request:
        """Queue one request of len(params) choices over `prompt` (QueueFullError past max_queue). Its deltas
        (choice indices from index_base) go to `sink` (called in the engine's thread), else to `out` (default:
        its own queue), then one None; with `progress`, the first choice's progress deltas too. A grammar in the
        params that does not compile raises GrammarError here (`samplers`: the choices' samplers, built by the
        caller). `slot` >= 0: the first choice runs in that slot, waiting (and the queue behind it) while it is
        taken."""
        if not -1 <= slot < self.cfg.max_num_seqs:
            raise ValueError(f"slot {slot} is not -1 nor in [0, {self.cfg.max_num_seqs})")
        if samplers is None:
            samplers = [Sampler(p, self.tok) for p in params]
        req = self._request(len(prompt), loop, out, sink)
        for i, (p, sampler) in enumerate(zip(params, samplers, strict=True)):
            req.seqs.append(Seq(
                key=(req.id, i), request=req, index=index_base + i, prompt_len=len(prompt), tokens=list(prompt), params=p,
                sampler=sampler, stop=StopChecker(p.stop, p.include_stop_str_in_output, p.n_indent),
                decoder=self.tok.stream_decoder(p.skip_special_tokens),
                want_prompt_logprobs=p.prompt_logprobs is not None, want_progress=progress and i == 0,
                want_slot=slot if i == 0 else -1))
        req.open = len(req.seqs)
        self._inbox.put(("add", req))
        return req

    def submit_embed(self, prompts: Sequence[Sequence[int]], pooling: str, *,
                     loop: asyncio.AbstractEventLoop | None = None, out: asyncio.Queue[Delta | None] | None = None,
                     sink: Callable[[Delta | None], None] | None = None) -> Request:
        """Queue one request that embeds each prompt (QueueFullError past max_queue): one delta per prompt (index i)
        with its pooled hidden state in `embedding` and finish_reason "stop", then one None; delivered as submit's."""
        req = self._request(sum(len(p) for p in prompts), loop, out, sink)
        params = SamplingParams(max_tokens=1)
        for i, prompt in enumerate(prompts):
            req.seqs.append(Seq(
                key=(req.id, i), request=req, index=i, prompt_len=len(prompt), tokens=list(prompt), params=params,
                sampler=Sampler(params), stop=StopChecker(()), decoder=self.tok.stream_decoder(True),
                pooler=Pooler(pooling)))
        req.open = len(req.seqs)
        self._inbox.put(("add", req))
        return req

    def _request(self, n_prompt: int, loop: asyncio.AbstractEventLoop | None, out: asyncio.Queue[Delta | None] | None,
                 sink: Callable[[Delta | None], None] | None) -> Request:
        """A new request, counted against max_queue (QueueFullError past it)."""
        with self._lock:
            if self._queued >= self.cfg.max_queue:
                raise QueueFullError(f"the server has {self._queued} requests waiting (--max-queue "
                                     f"{self.cfg.max_queue}); retry later.")
            self._queued += 1
        if sink is None and loop is None:
            loop = asyncio.get_running_loop()
        return Request(next(self._ids), n_prompt, loop, out, sink)

    def abort(self, req: Request) -> None:
        """Drop the request's sequences and their KV pages before the next step (a client went away)."""
        self._inbox.put(("abort", req))

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run fn in the engine thread between two steps, where it may touch the KV cache and the slots; its result
        or exception comes back on the future (an exception too where the engine stops first)."""
        fut: Future[T] = Future()
        if not self.alive:
            fut.set_exception(PocketMoEError("the engine is not running; retry once the server is up."))
        else:
            self._inbox.put(("call", (fn, fut)))
        return fut

    # -- slot actions (llama-server's POST /slots/{id}; in the engine thread, through call) -------------------------
    def slot_rows(self, slot: int) -> tuple[list[int], list[torch.Tensor]]:
        """The tokens and KV rows [L, page, W] of the full pages of what `slot` ran last that the prefix cache
        still holds (from the start; none for a slot that ran nothing)."""
        s = self._idle(slot)
        if s is None:
            return [], []
        rows = self.cache.prefix_rows(s.tokens[:s.computed])
        return s.tokens[:len(rows) * self.cache.page], rows

    def slot_restore(self, slot: int, tokens: list[int], rows: list[torch.Tensor]) -> int:
        """Put a saved prompt's pages back in the prefix cache (slot_rows' answer, read back): a later prompt that
        starts with those tokens attaches them, in any slot. Returns the positions the cache then holds."""
        self._idle(slot)
        return self.cache.index_rows(tokens, rows)

    def slot_erase(self, slot: int) -> int:
        """Drop the prefix cache's pages of what `slot` ran last (those no running sequence shares) and forget it;
        returns the positions dropped."""
        s = self._idle(slot)
        self.slot_last[slot] = None
        return self.cache.forget_prefix(s.tokens[:s.computed]) if s is not None else 0

    def _idle(self, slot: int) -> Seq | None:
        """What `slot` ran last (SlotBusyError while a sequence runs in it)."""
        if self.slots[slot] is not None:
            raise SlotBusyError(f"slot {slot} is running a task; retry once GET /slots shows it idle.")
        return self.slot_last[slot]

    def run_until_done(self) -> None:
        """Run the loop in the caller's thread until every submitted request has finished (LLM.generate's
        batch: requests submitted with a sink, the engine thread never started)."""
        if self._thread.is_alive():
            raise RuntimeError("run_until_done drives an engine whose thread is not running")
        try:
            self._drain(block=False)
            while self.running or self.waiting:
                if not self._step() and not self.running:
                    s = self.waiting[0]
                    raise PocketMoEError(f"a sequence of {len(s.tokens)} tokens does not fit in the KV pool of "
                                         f"{self.cache.n_pages * self.cache.page} positions; give the pool more "
                                         "memory.")
                self._drain(block=False)
        except BaseException:  # an interrupt or a bug: nothing is left half-run for the next call
            self._drain(block=False)
            self._finish_all(error="the batch was interrupted")
            raise

    def _step(self) -> bool:
        """Admit, schedule and run one step; False where nothing could run."""
        self._admit()
        planned = self._schedule()
        if planned:
            self._run(planned)
        self._gauges()
        return bool(planned)

    # -- the engine thread -----------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                idle = not self.running and not self.waiting
                if not self._drain(block=idle):
                    break
                self._step()
        except RankLost as e:  # no step can run any more: report the engine down before ending the requests
            self.alive = False
            log.error("%s", e)
            self._finish_all(error=f"a tensor-parallel rank was lost: {e}")
            if self.on_fatal is not None:
                self.on_fatal(e)
        except Exception:  # a bug, not a request: log it and report the engine down
            log.exception("the engine loop failed")
            self._finish_all(error="the engine stopped after an internal error; see the server log.")
        finally:
            self.alive = False
            self._fail_calls()

    def _fail_calls(self) -> None:
        """Answer the calls still queued once the loop has ended (their callers would wait forever)."""
        while True:
            try:
                what, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if what == "call":
                payload[1].set_exception(PocketMoEError("the engine stopped before it could run this."))

    def _drain(self, block: bool) -> bool:
        """Take what the asyncio side sent; False once asked to stop."""
        while True:
            try:
                what, req = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return True
            block = False
            if what == "stop":
                self._finish_all()
                return False
            if what == "lost":
                self._finish_all(error=self._lost_error)
                return False
            if what == "call":
                fn, fut = req
                try:
                    fut.set_result(fn())
                except Exception as e:  # the caller's to report
                    fut.set_exception(e)
                continue
            assert req is not None
            if what == "add":
                self.waiting.extend(req.seqs)
                self.metrics.prompt_tokens.inc(req.n_prompt)
            elif what == "abort":
                for s in req.seqs:
                    self._drop(s)

    def _dequeue(self, req: Request) -> None:
        if req.queued:
            req.queued = False
            with self._lock:
                self._queued -= 1

    def _drop(self, s: Seq) -> None:
        if s.finished:
            return
        s.finished = True
        self._dequeue(s.request)
        if s in self.running:
            self.running.remove(s)
            self._vacate(s)
        elif s in self.waiting:
            self.waiting.remove(s)
        self.cache.free(s.key)

    def _finish_all(self, error: str | None = None) -> None:
        for s in [*self.running, *self.waiting]:
            self._finish(s, "length", error=error)

    def _admit(self) -> None:
        """FIFO: the oldest waiting sequence first; none jumps the queue. One page per running sequence
        stays free for its next decode token."""
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            s = self.waiting[0]
            if self._sibling_prefilling(s) or (s.want_slot >= 0 and self.slots[s.want_slot] is not None):
                return
            reused = self._attach_prefix(s)
            pages = self.cache.pages_for(len(s.tokens)) - self.cache.pages_for(reused)
            if self.running and self.cache.free_pages - pages < len(self.running):
                self.cache.free(s.key)
                return
            try:
                self.cache.reserve(s.key, len(s.tokens))
            except KVPoolFullError:
                self.cache.free(s.key)
                return
            s.computed = reused
            self.running.append(self.waiting.popleft())
            self._occupy(s)
            if not s.admitted:
                s.admitted, s.cached, s.admitted_at = True, reused, time.perf_counter()
                self._progress(s)  # 0 computed yet (but what the prefix cache gave)
                if self.prefix_caching:
                    self.metrics.prefix_cache_queries.inc(len(s.tokens))
                    self.metrics.prefix_cache_hits.inc(reused)
            self._dequeue(s.request)

    def _occupy(self, s: Seq) -> None:
        """Give an admitted sequence its slot: the one it asked for, else the lowest free one."""
        s.slot = s.want_slot if s.want_slot >= 0 else self.slots.index(None)
        self.slots[s.slot] = self.slot_last[s.slot] = s

    def _vacate(self, s: Seq) -> None:
        if self.slots[s.slot] is s:
            self.slots[s.slot] = None

    def _sibling_prefilling(self, s: Seq) -> bool:
        """Whether another choice of s's request is computing the same prompt now: with prefix caching s then
        waits for its pages (the queue behind it too, FIFO) instead of computing the prompt again, until the
        sibling has computed every full page s could attach (those of its prompt less the last token)."""
        if not self.prefix_caching or s.admitted or s.want_prompt_logprobs or s.pooler is not None:
            return False
        shareable = (s.prompt_len - 1) // self.cache.page * self.cache.page
        return any(o is not s and o.computed < shareable and o in self.running for o in s.request.seqs)

    def _attach_prefix(self, s: Seq) -> int:
        """Positions of s's tokens the prefix cache gives it (its pages attached); its last token is always
        computed, since its logits are sampled."""
        if not self.prefix_caching or s.want_prompt_logprobs or (s.pooler and not reuses_prefix(s.pooler.pooling)):
            return 0
        store = self.cache.store
        loaded = store.loaded if store is not None else 0
        reused = self.cache.attach(s.key, s.tokens[:-1])
        if store is not None and not s.admitted:
            self.metrics.prefix_cache_disk_hits.inc((store.loaded - loaded) * self.cache.page)
        return reused

    def _preempt(self) -> Seq:
        """Give the newest running sequence's pages back; it waits at the head of the queue to be recomputed."""
        victim = self.running.pop()
        self._vacate(victim)
        self.cache.free(victim.key)
        victim.computed = 0
        if victim.pooler is not None:
            victim.pooler = Pooler(victim.pooler.pooling)  # its prompt is pooled afresh
        self.waiting.appendleft(victim)
        self.metrics.preemptions.inc()
        return victim

    def _schedule(self) -> list[tuple[Seq, SeqChunk]]:
        """The step: every decoding sequence's next token, then prefill chunks in admission order."""
        planned: list[tuple[Seq, SeqChunk]] = []
        budget = self.cfg.chunk_size
        cs = self.cfg.chunk_size
        i = 0
        while i < len(self.running):
            s = self.running[i]
            if s.decoding:  # its page may be new
                try:
                    self.cache.reserve(s.key, len(s.tokens))
                except KVPoolFullError:
                    if self._preempt() is not s:
                        continue  # retry this sequence with the freed pages
                    break
                planned.append((s, SeqChunk(s.key, s.tokens[s.computed:], s.computed, "last")))
            i += 1
        for s in self.running:
            if s.decoding:
                continue
            start, n_all = s.computed, len(s.tokens)
            end = min(n_all, (start // cs + 1) * cs)
            if end - start > budget:
                break
            budget -= end - start
            if s.pooler is not None:
                planned.append((s, SeqChunk(s.key, s.tokens[start:end], start, "none",
                                            chunk_rows(s.pooler.pooling, start, end, n_all))))
                continue
            mode = "all" if s.want_prompt_logprobs else ("last" if end == n_all else "none")
            planned.append((s, SeqChunk(s.key, s.tokens[start:end], start, mode)))
        return planned

    def _run(self, planned: list[tuple[Seq, SeqChunk]]) -> None:
        try:
            logits, hidden = self.runner.run_step(Step(tuple(c for _, c in planned)))
        except RankLost:
            raise
        except Exception as e:  # one bad step fails its sequences, never the engine
            log.exception("a step failed")
            for s, _ in planned:
                self._finish(s, "length", error=f"the step failed: {e}")
            return
        self.steps += 1
        self.metrics.llama.step(len(self.running), max(len(s.tokens) for s, _ in planned))
        row = h_row = 0
        now = time.perf_counter()
        for s, c in planned:
            n = len(c.rows(c.logits, 0))
            rows = logits[row:row + n]
            row += n
            h = len(c.rows(c.hidden, 0))
            if s.pooler is not None and hidden is not None:
                s.pooler.add(hidden[h_row:h_row + h])
            h_row += h
            s.computed += len(c.tokens)
            if self.prefix_caching:
                self.cache.commit(s.key, s.tokens, s.computed)
            if c.logits == "all":
                self._prompt_logprobs(s, c, rows)
            if c.start < s.prompt_len:
                self._progress(s)
            if s.computed == len(s.tokens) and s.pooler is not None:
                self._finish(s, "stop", Delta(s.index, embedding=s.pooler.result()))
            elif s.computed == len(s.tokens) and not s.finished:
                try:
                    self._sample(s, rows[-1], now)
                except GrammarError as e:  # a grammar at a dead end fails its sequence alone
                    self._finish(s, "length", error=str(e))

    def _progress(self, s: Seq) -> None:
        if s.want_progress:
            s.request.put(Delta(s.index, slot=s.slot, progress={
                "total": s.prompt_len, "cache": s.cached, "processed": min(s.computed, s.prompt_len),
                "time_ms": int((time.perf_counter() - s.admitted_at) * 1e3)}))

    def _prompt_logprobs(self, s: Seq, c: SeqChunk, rows: torch.Tensor) -> None:
        """Echo with logprobs: entry p is the logprob of prompt token p given the ones before it (from the
        logits of position p - 1; entry 0 has none). A chunk [a, b) gives entries a+1..b (0..b from 0);
        those sent before a preemption are not sent again."""
        k = s.params.prompt_logprobs or 0
        first = c.start if c.start == 0 else c.start + 1
        last = min(c.start + len(c.tokens), s.prompt_len - 1)
        out = [None if p == 0 else token_logprob(rows[p - 1 - c.start], s.tokens[p], k)
               for p in range(max(first, s.prompt_lp_sent), last + 1)]
        s.prompt_lp_sent = max(s.prompt_lp_sent, last + 1)
        if s.prompt_lp_sent >= s.prompt_len:
            s.want_prompt_logprobs = False
        if out:
            s.request.put(Delta(s.index, prompt_logprobs=out))

    def _sample(self, s: Seq, logits: torch.Tensor, now: float) -> None:
        token = s.sampler(logits, s.tokens)
        if s.generated == 0:
            self.metrics.ttft.observe(now - s.request.arrival)
            self.metrics.llama.prompt_tokens.inc(max(s.prompt_len - s.cached, 0))
            self.metrics.llama.prompt_seconds.inc(now - s.admitted_at)
            s.first_token_at = now
        else:
            self.metrics.itl.observe(now - s.last_token_at)
        s.last_token_at = now
        if token in s.sampler.end_ids:
            self._finish(s, "stop", Delta(s.index, stop_reason=token))
            return
        s.tokens.append(token)
        s.generated += 1
        self.metrics.generation_tokens.inc()
        text, stopped = s.stop.push(s.decoder.push(token))
        lp = s.sampler.logprob(logits, token)
        lps = [lp] if lp is not None else []
        delta = Delta(s.index, text, [token], lps, slot=s.slot)
        if stopped or s.sampler.complete:
            delta.stop_reason = s.stop.matched
            self._finish(s, "stop", delta)
        elif s.generated >= s.params.max_tokens or len(s.tokens) >= self.cfg.max_model_len or \
                s.params.out_of_time(text, now - s.first_token_at):
            self._finish(s, "length", delta)
        else:
            s.request.put(delta)

    def _finish(self, s: Seq, reason: str, delta: Delta | None = None, error: str | None = None) -> None:
        if s.finished:
            return
        self._drop(s)
        if s.generated:
            self.metrics.llama.tokens_predicted.inc(s.generated)
            self.metrics.llama.predicted_seconds.inc(max(s.last_token_at - s.first_token_at, 0.0))
        d = delta or Delta(s.index)
        d.text += s.stop.end(s.decoder.flush())
        if s.stop.limited:  # a line under n_indent (a limit, as llama.cpp counts it), not a stop string or token
            reason, d.stop_reason = "length", None
        d.finish_reason, d.error, d.cached_tokens, d.slot = reason, error, s.cached, s.slot
        req = s.request
        req.put(d)
        req.open -= 1
        if req.open == 0:
            req.put(None)

    def _gauges(self) -> None:
        m = self.metrics
        m.running.set(len(self.running))
        m.waiting.set(len(self.waiting))
        m.kv_used.set(self.cache.used_pages / self.cache.n_pages)
        m.kv_cached_pages.set(self.cache.cached_pages)
        if self.cache.store is not None:
            m.prefix_cache_disk_bytes.set(self.cache.store.bytes)
