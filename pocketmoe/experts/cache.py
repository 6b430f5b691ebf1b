"""Hot-expert cache bookkeeping for one MoE layer: which expert each device slot holds, and which
slot a new one takes (eviction) and whether it takes one at all (admission).

Eviction: "lru" (least recently used), "lfu" (fewest uses, counts halved as they age, ties by
recency) or "fifo". Admission: "always", or "second" (an expert stays in the slot it was staged into
only from its second use on, counts aged as for LFU; a first-time expert is still staged, into the
victim slot, which is left empty after the step, so one-off experts churn through one slot instead of
pushing out hot ones). The default, LFU with every staged expert admitted, had the best decode hit
rates on the trained demo model's routing (E=16, top-2, 4 MoE layers, 12 held-out texts, 368 decode
steps; scripts/expert_cache_policies.py):

  slots/layer  uniform  lru/always  lru/second  lfu/always  lfu/second  fifo/always  fifo/second
  2            0.125    0.338       0.320       0.338       0.320       0.338       0.320   (4 texts)
  4            0.250    0.499       0.499       0.515       0.510       0.490       0.490
  8            0.500    0.743       0.736       0.767       0.760       0.718       0.720

(at 2 slots = top-k every step's misses take the only unpinned slots, so the policies cannot differ).
Slots pinned for the current step (a hit being read, a copy in flight) are never chosen.
"""

from __future__ import annotations

from collections.abc import Iterable

from pocketmoe.errors import PocketMoEError

EVICTIONS = ("lru", "lfu", "fifo")
ADMISSIONS = ("always", "second")
DEFAULT_EVICTION, DEFAULT_ADMISSION = "lfu", "always"


class SlotCache:
    def __init__(self, n_slots: int, eviction: str = DEFAULT_EVICTION, admission: str = DEFAULT_ADMISSION,
                 age_every: int = 0) -> None:
        """age_every: uses between two halvings of every count (0: 16 per slot)."""
        if n_slots < 0:
            raise PocketMoEError(f"a layer's expert cache needs >= 0 slots, got {n_slots}.")
        if eviction not in EVICTIONS or admission not in ADMISSIONS:
            raise PocketMoEError(f"cache policy {eviction}/{admission} is not one of {EVICTIONS} x {ADMISSIONS}.")
        self.n_slots, self.eviction, self.admission = n_slots, eviction, admission
        self.expert_in: list[int | None] = [None] * n_slots  # slot -> expert
        self.slot_of: dict[int, int] = {}                    # expert -> slot
        self.pinned: set[int] = set()
        self.freq: dict[int, float] = {}
        self.last_use: dict[int, int] = {}
        self.filled_at: list[int] = [0] * n_slots
        self.clock = 0
        self.age_every = age_every or 16 * max(n_slots, 1)
        self._uses = 0

    def lookup(self, expert: int) -> int | None:
        return self.slot_of.get(expert)

    def touch(self, experts: Iterable[int]) -> None:
        """Count a step's use of these experts (hit or miss)."""
        self.clock += 1
        for e in experts:
            self.freq[e] = self.freq.get(e, 0.0) + 1.0
            self.last_use[e] = self.clock
            self._uses += 1
        if self._uses >= self.age_every:
            self._uses = 0
            self.freq = {e: f / 2 for e, f in self.freq.items() if f >= 0.5}

    def victim(self) -> int | None:
        """The slot a newcomer would take: a free one, else the policy's pick among the unpinned; None if all
        are pinned."""
        free = [s for s, e in enumerate(self.expert_in) if e is None and s not in self.pinned]
        if free:
            return free[0]
        held = [s for s in range(self.n_slots) if s not in self.pinned]
        if not held:
            return None
        if self.eviction == "fifo":
            return min(held, key=lambda s: (self.filled_at[s], s))
        if self.eviction == "lru":
            return min(held, key=lambda s: (self.last_use.get(self.expert_in[s], 0), s))
        return min(held, key=lambda s: (self.freq.get(self.expert_in[s], 0.0), self.last_use.get(self.expert_in[s], 0), s))

    def admits(self, expert: int) -> bool:
        """Whether `expert`, staged into a slot this step (counted by touch() already), stays there after."""
        return self.admission == "always" or self.freq.get(expert, 0.0) >= 2.0

    def put(self, expert: int, slot: int) -> None:
        self.drop(slot)
        self.expert_in[slot] = expert
        self.slot_of[expert] = slot
        self.filled_at[slot] = self.clock

    def drop(self, slot: int) -> None:
        old = self.expert_in[slot]
        if old is not None:
            del self.slot_of[old]
            self.expert_in[slot] = None

    def resident(self) -> list[int]:
        return sorted(self.slot_of)
