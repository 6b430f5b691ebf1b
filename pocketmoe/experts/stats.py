"""What the expert banks did, summed over the MoE layers: hits, misses, copies, CPU experts, model time."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ExpertStats:
    tokens: int = 0            # tokens through the model (counted at the first MoE layer)
    hits: int = 0              # active (layer, expert) pairs a device slot held
    misses: int = 0            # active pairs no slot held (staged or computed on the CPU)
    staged: int = 0            # misses copied into a slot
    cpu_experts: int = 0       # misses computed on the CPU
    resident: int = 0          # active pairs of all-device layers (always on the device)
    bytes_copied: int = 0
    model_seconds: float = 0.0  # the cost model's time for the routed experts of every step
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    # counts still on a device (reading one on the hot path would stall the stream): a persistent counter per
    # (field, device) that kernels add to (counter()), read back when the statistics are: [tensor, value settled]
    _counters: dict[tuple[str, str], list[Any]] = field(default_factory=dict, repr=False, compare=False)

    def add(self, **counts: float) -> None:
        with self._lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def counter(self, name: str, device: Any) -> Any:
        """An int64 0-d tensor on `device` that kernels add `name`'s counts to in place (a CUDA graph's replays
        too: the tensor stays the same), settled into `name` by settle(). One per field and device; make it
        before any capture."""
        import torch

        key = (name, str(device))
        with self._lock:
            got = self._counters.get(key)
            if got is None:
                got = self._counters[key] = [torch.zeros((), dtype=torch.int64, device=device), 0]
            return got[0]

    def settle(self) -> None:
        """Reads back the device counts added since the last settle."""
        with self._lock:
            for (name, _), entry in self._counters.items():
                total = int(entry[0])
                setattr(self, name, getattr(self, name) + total - entry[1])
                entry[1] = total

    def reset(self) -> None:
        with self._lock:
            self.tokens = self.hits = self.misses = self.staged = self.cpu_experts = self.resident = 0
            self.bytes_copied, self.model_seconds = 0, 0.0
            for entry in self._counters.values():  # what the counters hold so far is before the reset
                entry[1] = int(entry[0])

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0

    def to_json(self) -> dict[str, Any]:
        self.settle()
        per = max(self.tokens, 1)
        return {"tokens": self.tokens, "hits": self.hits, "misses": self.misses, "staged": self.staged,
                "cpu_experts": self.cpu_experts, "resident": self.resident, "hit_rate": round(self.hit_rate, 4),
                "bytes_copied": self.bytes_copied, "bytes_copied_per_token": round(self.bytes_copied / per, 1),
                "cpu_experts_per_token": round(self.cpu_experts / per, 3),
                "model_expert_seconds_per_token": self.model_seconds / per}
