"""Device slot pools and the copy engine that stages experts' raw blocks into them.

A copy runs on the copy engine (a CUDA copy stream with events; on the CPU device, one copy thread with
threading events), so the next expert's copy overlaps the current expert's compute. A slot is never
overwritten while a copy into it or a kernel reading it is in flight: `stage` refuses a slot whose
copy is not waited for or that has readers (`SlotInUseError`, a bug, never a user error), and the
dispatcher only stages into slots it has released.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from pocketmoe.experts.kernels import ExpertStore
from pocketmoe.layers.experts import ExpertWeights

CopyDelay = Callable[[int, int], None]  # (slot, expert): called on the copy engine before each copy (tests)


class SlotInUseError(RuntimeError):
    """A slot was about to be overwritten while a copy into it or a kernel reading it was in flight."""


class CopyEngine:
    """Copies run in submission order off the compute thread; `done` events say when each one landed."""

    def __init__(self, device: torch.device, delay: CopyDelay | None = None) -> None:
        self.device, self.delay = device, delay
        self.cuda = device.type == "cuda"
        self.copied_bytes = 0
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
        else:
            self._jobs: queue.Queue = queue.Queue()
            self._thread: threading.Thread | None = None

    def submit(self, dst: tuple[torch.Tensor, ...], src: tuple[torch.Tensor, ...], slot: int, expert: int,
               after: object = None) -> object:
        """Copy src[i] into dst[i] (CUDA: once the compute-stream event `after` passed); returns the event
        to wait on."""
        self.copied_bytes += sum(s.numel() * s.element_size() for s in src)
        if self.cuda:
            ev = torch.cuda.Event()
            if after is not None:
                self.stream.wait_event(after)
            with torch.cuda.stream(self.stream):
                if self.delay is not None:
                    self.delay(slot, expert)
                for d, s in zip(dst, src, strict=True):
                    d.copy_(s, non_blocking=True)
                ev.record(self.stream)
            return ev
        done = threading.Event()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pocketmoe-copy", daemon=True)
            self._thread.start()
        self._jobs.put((dst, src, slot, expert, done))
        return done

    def _run(self) -> None:
        while True:
            dst, src, slot, expert, done = self._jobs.get()
            if self.delay is not None:
                self.delay(slot, expert)
            for d, s in zip(dst, src, strict=True):
                d.copy_(s)
            done.set()

    def wait(self, event: object) -> None:
        """Make the compute side wait for the copy (CUDA: the current stream waits on the event)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(event)
        else:
            event.wait()


class SlotPool:
    """S device slots of one layer's expert layout: gate, up, down of one expert each."""

    def __init__(self, host: ExpertStore, n_slots: int, device: torch.device, engine: CopyEngine) -> None:
        self.host, self.n_slots, self.engine = host, n_slots, engine

        def pool(w: ExpertWeights) -> ExpertWeights:
            t = torch.empty((n_slots, *w.raw.shape[1:]), dtype=w.raw.dtype, device=device)
            return ExpertWeights(t, w.ggml_type, (n_slots, *w.shape[1:]))

        self.store = ExpertStore(pool(host.gate), pool(host.up), pool(host.down))
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
            ev = self._read_done[slot] = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.engine.device))

    def busy(self, slot: int) -> bool:
        return slot in self._pending or self._readers[slot] > 0
