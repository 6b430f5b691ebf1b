"""The dispatcher's cost model on its inputs (tokens per expert, expert bytes, rates) and the slot cache's
bookkeeping. Expected choices follow from the stated formulas and ANCHORS.md's rule, not from the code."""

from __future__ import annotations

import pytest

from pocketmoe.errors import PocketMoEError
from pocketmoe.experts import CPU, HIT, STAGE, Active, Rates, SlotCache, decide

MB = 5_230_000  # one V2-Lite Q4_K_M expert
# A laptop: PCIe Gen3 copies 12.6 GB/s, DDR4 38.4 GB/s for a 1-token CPU expert, the CPU's arithmetic
# 20 GB/s of weights per further token; the GPU 150 GB/s and 3000 GB/s per further token.
LAPTOP = Rates(copy_gbps=12.6, cpu_gbps=38.4, cpu_token_gbps=20.0, device_gbps=150.0, device_token_gbps=3000.0)


def rates(**kw: float) -> Rates:
    return Rates(**{**vars(LAPTOP), **kw})


def one(tokens: int, r: Rates = LAPTOP, cached: bool = False, policy: str = "auto") -> str:
    return decide([Active(0, tokens, MB, cached)], r, policy).paths[0]


def test_decode_misses_go_to_the_cpu_when_pcie_is_slower_than_dram():
    assert one(1) == CPU


def test_prefill_misses_are_staged():
    assert one(64) == STAGE


def test_choice_flips_once_as_tokens_grow():
    choices = [one(n) for n in range(1, 65)]
    first = choices.index(STAGE)
    assert 1 < first and all(c == STAGE for c in choices[first:]) and all(c == CPU for c in choices[:first])


def test_faster_pcie_or_slower_dram_makes_decode_stage():
    assert one(1, rates(copy_gbps=63.0)) == STAGE          # PCIe Gen5 beats DDR4
    assert one(1, rates(cpu_gbps=6.0)) == STAGE            # a slow CPU
    assert one(1, rates(copy_gbps=63.0, cpu_gbps=200.0)) == CPU


def test_hits_stay_on_the_device_unless_the_policy_says_otherwise():
    assert one(1, cached=True) == HIT
    assert one(1, cached=True, policy="cache") == HIT
    assert one(1, cached=True, policy="stage") == STAGE
    assert one(1, cached=True, policy="cpu") == CPU


def test_policies_force_their_path():
    assert one(1, policy="cache") == STAGE and one(1, policy="stage") == STAGE
    assert one(512, policy="cpu") == CPU


def test_without_slots_every_miss_is_computed_on_the_cpu():
    d = decide([Active(0, 512, MB, False), Active(1, 1, MB, True)], LAPTOP, "cache", can_stage=False)
    assert d.paths == {0: CPU, 1: HIT}


def test_equal_work_is_split_between_device_and_cpu():
    """Copy and CPU equally fast: staging everything doubles the copy queue, so the model balances."""
    r = Rates(copy_gbps=10.0, cpu_gbps=10.0, cpu_token_gbps=10.0, device_gbps=1e6, device_token_gbps=1e6)
    d = decide([Active(e, 1, MB, False) for e in range(8)], r)
    paths = list(d.paths.values())
    assert paths.count(STAGE) == 4 and paths.count(CPU) == 4
    assert d.seconds == pytest.approx(4 * MB / 10e9, rel=0.01)


def test_the_layer_time_is_the_slower_side():
    d = decide([Active(0, 1, MB, False)], LAPTOP, "cpu")
    assert d.seconds == pytest.approx(MB / 38.4e9)
    d = decide([Active(0, 1, MB, False)], LAPTOP, "stage")
    assert d.seconds == pytest.approx(MB / 12.6e9 + MB / 150e9)


def test_bad_inputs_are_one_sentence():
    with pytest.raises(PocketMoEError, match="copy_gbps must be a positive"):
        rates(copy_gbps=0.0)
    with pytest.raises(PocketMoEError, match="is not one of auto, cache, stage, cpu"):
        decide([], LAPTOP, "fast")


@pytest.mark.parametrize("eviction,expect", [("lru", 1), ("lfu", 2), ("fifo", 0)])
def test_eviction_picks_by_policy(eviction, expect):
    """Slots 0, 1, 2 filled with 10, 11, 12 in that order; then 11 used 3 times, 10 twice, 12 once.
    Uses: 10 x3, 11 x4, 12 x2; last use: 11 first, then 10, then 12."""
    c = SlotCache(3, eviction, "always")
    for slot, e in enumerate((10, 11, 12)):
        c.touch([e])
        c.put(e, slot)
    for e in (11, 11, 11, 10, 10, 12):
        c.touch([e])
    assert c.victim() == expect


def test_pinned_slots_are_never_victims_and_free_ones_come_first():
    c = SlotCache(2)
    assert c.victim() == 0
    c.put(5, 0)
    assert c.victim() == 1
    c.put(6, 1)
    c.pinned.update({0, 1})
    assert c.victim() is None
    c.pinned.discard(1)
    assert c.victim() == 1


def test_second_use_admission():
    c = SlotCache(1, "lru", "second")
    c.touch([3])
    assert not c.admits(3)
    c.touch([3])
    assert c.admits(3)


def test_a_decode_step_uses_pcie_beside_dram():
    """Six single-token misses on the laptop: each is cheaper on the CPU (0.136 ms vs 0.415 ms copy), but the
    CPU queue grows, so the fourth (largest-first order, all equal) is staged while the CPU runs the rest:
    the layer takes 5 x 0.136 ms instead of 6 x 0.136 ms."""
    d = decide([Active(e, 1, MB, False) for e in range(6)], LAPTOP)
    assert list(d.paths.values()).count(STAGE) == 1
    assert d.seconds == pytest.approx(5 * MB / 38.4e9)
