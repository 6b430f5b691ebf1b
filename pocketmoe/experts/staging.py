"""Device slot pools and the copy engine that stages experts' raw blocks into them.

A copy runs on the copy engine (a CUDA copy stream with events, from pinned host staging buffers; on the CPU
device, one copy thread whose futures are the events), so the next expert's copy overlaps the current expert's compute. A slot is never
overwritten while a copy into it or a kernel reading it is in flight: `stage` refuses a slot whose
copy is not waited for or that has readers (`SlotInUseError`, a bug, never a user error), and the
dispatcher only stages into slots it has released.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from pocketmoe.experts.kernels import ExpertStore
from pocketmoe.layers.experts import ExpertWeights

CopyDelay = Callable[[int, int], None]  # (slot, expert): called on the copy engine before each copy (tests)


class SlotInUseError(RuntimeError):
    """A slot was about to be overwritten while a copy into it or a kernel reading it was in flight."""


class TorchCuda:
    """The CUDA calls the copy engine makes (tests hand it a fake that logs them on the CPU)."""

    def stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def use(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def event(self) -> Any:
        return torch.cuda.Event()

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class CopyEngine:
    """Copies run in submission order off the compute thread; `done` events say when each one landed.

    CUDA: an expert's blocks are gathered on the host into one of `buffers` pinned staging buffers (the
    mapped file is pageable: a copy from it would not be asynchronous), then copied into the slot on the copy
    stream, after the compute-stream event `after` (the last kernel that read the slot); a buffer is refilled
    only once the copy out of it has landed (its event synchronized). Two buffers: the host fills one while the
    other's copy runs (double-buffered), and both overlap the kernels on the compute stream.
    """

    def __init__(self, device: torch.device, delay: CopyDelay | None = None, api: Any = None,
                 buffers: int = 2) -> None:
        """api: the CUDA calls (None: torch.cuda on a CUDA device; on the CPU device, a copy thread)."""
        self.device, self.delay = device, delay
        self.cuda = device.type == "cuda" or api is not None
        self.copied_bytes = 0
        if self.cuda:
            self.api = api if api is not None else TorchCuda()
            self.stream = self.api.stream(device)
            self._staging: list[tuple[torch.Tensor | None, Any]] = [(None, None)] * max(1, buffers)
            self._next = 0
        else:
            # one worker: copies land in submission order; concurrent.futures drains and joins it at exit
            # (a daemon thread still copying when the interpreter stops aborts the process)
            self._copier: ThreadPoolExecutor | None = None

    def _buffer(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """The next staging buffer in turn, free (the copy out of it landed) and at least nbytes long."""
        i = self._next
        self._next = (i + 1) % len(self._staging)
        buf, ev = self._staging[i]
        if ev is not None:
            ev.synchronize()
        if buf is None or buf.numel() < nbytes:
            buf = self.api.pinned(nbytes)
        self._staging[i] = (buf, None)
        return i, buf

    def submit(self, dst: tuple[torch.Tensor, ...], src: tuple[torch.Tensor, ...], slot: int, expert: int,
               after: object = None) -> object:
        """Copy src[i] into dst[i] (CUDA: once the compute-stream event `after` passed); returns the event
        to wait on."""
        nbytes = sum(s.numel() * s.element_size() for s in src)
        self.copied_bytes += nbytes
        if self.cuda:
            i, buf = self._buffer(nbytes)
            views, off = [], 0
            for s in src:  # host side: the pageable blocks into the pinned buffer
                n = s.numel() * s.element_size()
                views.append(buf[off:off + n])
                views[-1].copy_(_bytes(s))
                off += n
            if after is not None:
                self.stream.wait_event(after)
            ev = self.api.event()
            with self.api.use(self.stream):
                if self.delay is not None:
                    self.delay(slot, expert)
                for d, v in zip(dst, views, strict=True):
                    _bytes(d).copy_(v, non_blocking=True)
                ev.record(self.stream)
            self._staging[i] = (buf, ev)
            return ev
        if self._copier is None:
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="pocketmoe-copy")
        return self._copier.submit(self._copy, dst, src, slot, expert)

    def _copy(self, dst: tuple[torch.Tensor, ...], src: tuple[torch.Tensor, ...], slot: int, expert: int) -> None:
        if self.delay is not None:
            self.delay(slot, expert)
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)

    def wait(self, event: object) -> None:
        """Make the compute side wait for the copy (CUDA: the current stream waits on the event)."""
        if self.cuda:
            self.api.current_stream(self.device).wait_event(event)
        else:
            event.result()  # a Future of the copy thread; raises what the copy raised

    def read_done(self) -> object:
        """CUDA: an event recorded on the compute stream now (after the kernels that read a slot)."""
        ev = self.api.event()
        ev.record(self.api.current_stream(self.device))
        return ev


class SlotPool:
    """S device slots of one layer's expert layout: gate, up, down of one expert each."""

    def __init__(self, host: ExpertStore, n_slots: int, device: torch.device, engine: CopyEngine) -> None:
        self.host, self.n_slots, self.engine = host, n_slots, engine

        def pool(w: ExpertWeights) -> ExpertWeights:
            t = torch.empty((n_slots, *w.raw.shape[1:]), dtype=w.raw.dtype, device=device)
            return ExpertWeights(t, w.ggml_type, (n_slots, *w.shape[1:]))

        self.store = ExpertStore(pool(host.gate), pool(host.up), pool(host.down), host.swiglu_limit)
        self._pending: dict[int, object] = {}   # slot -> copy event not yet waited for
        self._readers = [0] * n_slots
        self._read_done: dict[int, object] = {}  # CUDA: slot -> event after the last kernel that read it

    def stage(self, slot: int, expert: int) -> None:
        """Start copying host expert `expert` into `slot`."""
        if slot in self._pending or self._readers[slot]:
            raise SlotInUseError(f"slot {slot} would be overwritten with expert {expert} while a "
                                 f"{'copy into it' if slot in self._pending else 'kernel reading it'} is in flight")
        s, h = self.store, self.host
        dst = (s.gate.raw[slot], s.up.raw[slot], s.down.raw[slot])
        src = (h.gate.raw[expert], h.up.raw[expert], h.down.raw[expert])
        self._pending[slot] = self.engine.submit(dst, src, slot, expert, self._read_done.pop(slot, None))

    def acquire(self, slot: int) -> None:
        """Before a kernel reads `slot`: its copy (if any) has landed, and it counts as read."""
        ev = self._pending.pop(slot, None)
        if ev is not None:
            self.engine.wait(ev)
        self._readers[slot] += 1

    def release(self, slot: int) -> None:
        """After the kernel that read `slot` finished (on CUDA the stream orders the next copy after it)."""
        if self._readers[slot] <= 0:
            raise SlotInUseError(f"slot {slot} released more often than acquired")
        self._readers[slot] -= 1
        if self.engine.cuda:
            self._read_done[slot] = self.engine.read_done()

    def busy(self, slot: int) -> bool:
        return slot in self._pending or self._readers[slot] > 0
