"""Placement modes, expert policies and cache sizes against the CPU-only path, with the CPU as the device.

Every mode (all-device, heterogeneous), policy (auto, cache, stage, cpu) and cache size (cold, warm, one
slot that forces evictions) runs the same kernels as the CPU plan on the CPU device, so logits are
bitwise those of the CPU-only runner and greedy tokens the same; on both op backends (native kernels,
torch reference), on deepseek2, minimax-m2 and deepseek4 (clamped SwiGLU) fixtures and a DeepSeek-V3-routed
one with fused gate_up experts. Plus the slowed-copy race test.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from deepseek2_fixture import (
    Tiny,
    ds2_config,
    fuse_gate_up,
    gguf_state_dict,
    hf_model,
    quantize_experts,
    write_gguf,
)
from gguf import GGMLQuantizationType as Q

from pocketmoe import native
from pocketmoe.engine.runner import ModelRunner, RunnerConfig
from pocketmoe.experts import Rates, SlotInUseError, SlotPool
from pocketmoe.experts.dispatch import DispatchExperts
from pocketmoe.experts.kernels import Activations
from pocketmoe.gguf import open_bundle
from pocketmoe.placement.run import RunPlacement
from pocketmoe.testing.synth import write_fixture

PROMPT = [(7 * i + 3) % 300 + 5 for i in range(40)]  # ids below every fixture's vocabulary
GEN = 6
BACKENDS = ["native", "reference"] if native.available() else ["reference"]
# Staging pays off for experts with several tokens, the CPU wins single-token ones: with these rates a
# prefill chunk mixes hits, staged and CPU experts in one layer, and so do decode steps with a warm cache.
MIXED = Rates(copy_gbps=4.0, cpu_gbps=6.0, cpu_token_gbps=6.0, device_gbps=20.0, device_token_gbps=200.0)


# DeepSeek-V3 routing (sigmoid, selection bias, expert groups, weight norm and scale) on the HF-derived
# fixture, with gate and up stored as one fused tensor: the slots copy each half's strided experts.
V3 = Tiny(v3=True, experts=8, top_k=3, groups=2, groups_used=1, norm_topk=True, scale=2.5)


def write_v3_fused(path):
    model = hf_model(V3, seed=2)
    blocks, types = quantize_experts(model, V3, int(Q.Q8_0), seed=6)
    sd = gguf_state_dict(model, V3)
    fuse_gate_up(V3, sd, blocks, types)
    return write_gguf(path, ds2_config(V3), sd, blocks, types)


@pytest.fixture(scope="module", params=["deepseek2", "minimax-m2", "deepseek2-v3-fused", "deepseek4"])
def bundle(request, tmp_path_factory):
    name = request.param
    path = tmp_path_factory.mktemp("experts") / f"{name}.gguf"
    if name == "deepseek2-v3-fused":
        write_v3_fused(path)
    elif name == "deepseek4":  # MXFP4 experts, hash routing, a SwiGLU clamp low enough to bite (every path clamps)
        write_fixture(name, "tiny", "MXFP4_MOE", path, seed=3, swiglu_clamp_exp=(CLAMP,) * 4)
    else:
        write_fixture(name, "tiny", "Q4_K_M", path, seed=3 if name == "deepseek2" else 4)
    with open_bundle(path) as b:
        yield b


CLAMP = 0.0625  # (exact in f32) the deepseek4 fixture's routed-expert SwiGLU limit


def test_the_deepseek4_fixture_clamp_bites(tmp_path):
    """Without the clamp the logits move: the bitwise checks below then show each expert path clamps."""
    path = write_fixture("deepseek4", "tiny", "MXFP4_MOE", tmp_path / "v4.gguf", seed=3, swiglu_clamp_exp=(CLAMP,) * 4)[0]
    with open_bundle(path) as b:
        r = ModelRunner(b, RunnerConfig(n_ctx=128, backend=BACKENDS[0]))
        clamped = r.forward(PROMPT, 0)
        for blk in r.model.blocks:
            assert blk.moe.experts.swiglu_limit == CLAMP
            blk.moe.experts.swiglu_limit = 0.0
        assert (r.forward(PROMPT, 0) - clamped).abs().max() > 1e-3


_BASE: dict[tuple[int, str], tuple[object, torch.Tensor, list[int]]] = {}


def baseline(bundle, backend: str) -> tuple[torch.Tensor, list[int]]:
    """Prompt logits and greedy tokens of the CPU-only plan (cached with the bundle itself: a later bundle
    may reuse a closed one's id)."""
    key = (id(bundle), backend)
    if key not in _BASE or _BASE[key][0] is not bundle:
        r = ModelRunner(bundle, RunnerConfig(n_ctx=128, backend=backend))
        _BASE[key] = (bundle, r.forward(PROMPT, 0), r.generate_greedy(PROMPT, GEN))
    return _BASE[key][1], _BASE[key][2]


def runner(bundle, backend: str, mode: str, policy: str = "auto", slots: int | None = None,
           rates: Rates | None = MIXED, delay=None) -> ModelRunner:
    rp = RunPlacement(device="cpu", mode=mode, expert_policy=policy, expert_cache_slots=slots)
    return ModelRunner(bundle, RunnerConfig(n_ctx=128, backend=backend, placement=rp, expert_rates=rates,
                                            copy_delay=delay))


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_device_matches_cpu_bitwise(bundle, backend):
    logits, tokens = baseline(bundle, backend)
    r = runner(bundle, backend, "all-device")
    assert r.plan.mode == "all-device" and r.plan.devices[0].name == "cpu:0"
    assert torch.equal(r.forward(PROMPT, 0), logits)
    assert r.generate_greedy(PROMPT, GEN) == tokens


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("policy", ["auto", "cache", "stage", "cpu"])
@pytest.mark.parametrize("slots", [None, 1], ids=["plan-slots", "one-slot"])
def test_heterogeneous_matches_cpu_bitwise_cold_and_warm(bundle, backend, policy, slots):
    logits, tokens = baseline(bundle, backend)
    r = runner(bundle, backend, "heterogeneous", policy, slots)
    assert r.plan.mode == "heterogeneous"
    n_experts = bundle.metadata[f"{bundle.architecture}.expert_count"]
    assert set(r.plan.slots_per_layer.values()) == {n_experts if slots is None else 1}
    assert torch.equal(r.forward(PROMPT, 0), logits)          # cold cache
    assert torch.equal(r.forward(PROMPT, 0), logits)          # warm: the cache holds what the first run left
    assert r.generate_greedy(PROMPT, GEN) == tokens
    st = r.experts.stats
    assert st.hits + st.misses > 0
    if policy == "cpu":
        assert st.staged == 0 and st.hits == 0 and st.cpu_experts == st.misses
    if policy in ("cache", "stage"):
        assert st.cpu_experts == 0 and st.staged == st.misses
    if policy == "stage":
        assert st.hits == 0
    if policy == "cache":
        assert st.hits > 0
        if slots == 1:  # one slot for every expert of a layer: staging evicts all the time
            assert st.staged > n_experts * len(r.plan.slots_per_layer)
    if policy == "auto" and slots is None:  # all three paths ran
        assert st.hits > 0 and st.staged > 0 and st.cpu_experts > 0
    assert (st.bytes_copied > 0) == (st.staged > 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_calibrated_rates_run_and_match(bundle, backend):
    """No rates given: they are measured at start-up, positive and finite, and the run still matches."""
    logits, tokens = baseline(bundle, backend)
    r = runner(bundle, backend, "heterogeneous", rates=None)
    rates = r.experts.rates
    assert all(v > 0 for v in vars(rates).values())
    assert torch.equal(r.forward(PROMPT, 0), logits)
    assert r.generate_greedy(PROMPT, GEN) == tokens


def test_slowed_copies_never_race(bundle):
    """Each copy sleeps 3 ms on the copy thread before it writes: compute that did not wait for its
    copy would read the slot's previous expert, and a copy into a slot still being read would change it
    under the kernel. Two slots for 8 experts, every expert staged: logits stay bitwise the CPU path's,
    copies overlap compute, and the pool's guard never fires."""
    backend = BACKENDS[0]
    logits, tokens = baseline(bundle, backend)
    events: list[tuple[str, float]] = []
    lock = threading.Lock()

    def slow(slot: int, expert: int) -> None:
        with lock:
            events.append(("copy", time.perf_counter()))
        time.sleep(0.003)

    r = runner(bundle, backend, "heterogeneous", "stage", slots=2, delay=slow)
    banks = [b for b in _banks(r) if isinstance(b, DispatchExperts)]
    for bank in banks:
        _trace_compute(bank, events, lock)
    assert torch.equal(r.forward(PROMPT, 0), logits)
    assert r.generate_greedy(PROMPT, GEN) == tokens
    # some copy was in flight (its 3 ms sleep) while a kernel ran: the next copy overlaps the current compute
    spans, start = [], None
    for kind, t in events:
        if kind == "start":
            start = t
        elif kind == "end":
            spans.append((start, t))
    copies = [t for kind, t in events if kind == "copy"]
    assert any(t < e and t + 0.003 > s for s, e in spans for t in copies)


def test_cpu_experts_read_their_inputs_before_the_device_work_is_queued(bundle):
    """On a GPU a read of device memory waits for every kernel queued before it: the CPU experts' rows and ids
    come to the host before the layer queues its hits and staged experts (so the CPU runs while the device
    does), and the worker is handed those host copies, never the device tensors. The layer's device calls (its
    hits, then each staged expert) share one Activations, so the device kernels quantize its rows once."""
    backend = BACKENDS[0]
    logits, _ = baseline(bundle, backend)
    r = runner(bundle, backend, "heterogeneous")
    events: dict[int, list[str]] = {}  # bank -> what it did, in order (one call each: one prefill forward)
    inputs: dict[int, set[int]] = {}  # bank -> the Activations its device calls were handed
    for bank in [b for b in _banks(r) if isinstance(b, DispatchExperts)]:
        log = events[id(bank)] = []
        seen = inputs[id(bank)] = set()
        outputs, submit = bank.device_kernels.outputs, bank.worker.submit

        def device(store, x, which, rows=None, outputs=outputs, log=log, seen=seen):  # noqa: ANN001, ANN202
            assert isinstance(x, Activations) and rows is not None and len(rows) == len(which)
            log.append("device")
            seen.add(id(x))
            return outputs(store, x, which, rows)

        def recorded(fn, host_x, rows, which, device, submit=submit, log=log):  # noqa: ANN001, ANN202
            # the CPU pairs' rows, copied before the submit (not the layer's input to gather later): each token's
            # row once with the pairs' row indices, or the pairs' own rows, whichever are fewer
            assert host_x.device.type == "cpu" and which.device.type == "cpu"
            assert (rows is None and len(host_x) == len(which)) or \
                (rows.device.type == "cpu" and len(rows) == len(which) and len(host_x) <= len(which))
            log.append("submit")
            return submit(fn, host_x, rows, which, device)

        bank.device_kernels = SimpleNamespace(outputs=device, name="traced", combine=bank.device_kernels.combine)
        bank.worker = SimpleNamespace(submit=recorded)
    assert torch.equal(r.forward(PROMPT, 0), logits)
    mixed = [log for log in events.values() if "submit" in log and "device" in log]
    assert mixed and all(log[0] == "submit" and log.count("submit") == 1 for log in mixed), events
    assert any(log.count("device") > 1 for log in events.values())
    assert all(len(seen) <= 1 for seen in inputs.values())


def test_the_race_test_catches_a_compute_that_does_not_wait(bundle, monkeypatch):
    """Mutation check: with acquire() not waiting for the copy, the slowed-copy run gives other logits."""
    backend = BACKENDS[0]
    logits, _ = baseline(bundle, backend)

    def no_wait(self, slot):
        self._pending.pop(slot, None)
        self._readers[slot] += 1

    monkeypatch.setattr(SlotPool, "acquire", no_wait)
    r = runner(bundle, backend, "heterogeneous", "stage", slots=2, delay=lambda s, e: time.sleep(0.003))
    assert not torch.equal(r.forward(PROMPT, 0), logits)


def test_pool_refuses_to_overwrite_a_slot_in_use(bundle):
    r = runner(bundle, BACKENDS[0], "heterogeneous", "stage", slots=2, delay=lambda s, e: time.sleep(0.01))
    pool = next(b for b in _banks(r) if isinstance(b, DispatchExperts)).pool
    pool.stage(0, 1)
    with pytest.raises(SlotInUseError, match="copy into it"):
        pool.stage(0, 2)  # the copy into slot 0 was not waited for
    pool.acquire(0)
    with pytest.raises(SlotInUseError, match="kernel reading it"):
        pool.stage(0, 2)
    pool.release(0)
    pool.stage(0, 2)
    pool.acquire(0)
    pool.release(0)
    assert torch.equal(pool.store.gate.raw[0], pool.host.gate.raw[2])


def _banks(r: ModelRunner) -> list:
    return [m.experts for m in _moe_blocks(r.model)]


def _moe_blocks(model) -> list:
    from pocketmoe.layers.dsv4_moe import DSV4MoE
    from pocketmoe.layers.moe import MoEBlock

    found, seen, todo = [], set(), [model]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (MoEBlock, DSV4MoE)):
            found.append(obj)
            continue
        if isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("pocketmoe"):
            todo.extend(vars(obj).values())
    return found


def _trace_compute(bank: DispatchExperts, events: list, lock: threading.Lock) -> None:
    outputs = bank.device_kernels.outputs

    def traced(store, x, which, rows=None):
        with lock:
            events.append(("start", time.perf_counter()))
        y = outputs(store, x, which, rows)
        with lock:
            events.append(("end", time.perf_counter()))
        return y

    bank.device_kernels = type("Traced", (), {"outputs": staticmethod(traced), "name": "traced",
                                              "combine": bank.device_kernels.combine})()


def test_device_counters_settle_when_read():
    """ExpertStats.counter is one persistent device tensor per field and device that kernels add to in place (a
    graph replay included); to_json reads what it gained since the last read into the field, reset forgets what
    it held, and a snapshot (the bench's prefill statistics) holds no live counter."""
    from dataclasses import replace

    from pocketmoe.experts import ExpertStats

    st = ExpertStats()
    st.add(resident=2)
    c = st.counter("resident", torch.device("cpu"))
    assert st.counter("resident", "cpu") is c and c.dtype == torch.int64
    for i in range(1000):
        c += i % 4
    assert st.resident == 2
    assert st.to_json()["resident"] == 2 + sum(i % 4 for i in range(1000))
    assert st.to_json()["resident"] == 2 + sum(i % 4 for i in range(1000))  # read once, not again
    c += 5
    snap = replace(st, _counters={})
    st.reset()
    assert st.to_json()["resident"] == 0 and snap.to_json()["resident"] == 2 + sum(i % 4 for i in range(1000))
    c += 3
    assert st.to_json()["resident"] == 3


def test_cpu_experts_inputs_cross_once_per_token_or_per_pair_whichever_is_fewer():
    """The activations the CPU experts read go down as the fewer rows: a decode token's one row for its K pairs
    (with the pairs' row indices), or a long chunk's few CPU pairs' own rows."""
    x = torch.arange(2 * 3, dtype=torch.float32).view(2, 3)
    pairs = torch.tensor([0, 1, 2, 3, 5])  # K 3: tokens 0, 0, 0, 1, 1
    flat = torch.tensor([7, 1, 4, 2, 0, 5])
    host_x, rows, which, _ = DispatchExperts._host_inputs(x, 3, pairs, flat)
    assert torch.equal(host_x, x) and rows.tolist() == [0, 0, 0, 1, 1] and which.tolist() == [7, 1, 4, 2, 5]
    x = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    host_x, rows, which, _ = DispatchExperts._host_inputs(x, 3, torch.tensor([4, 20]), torch.arange(24))
    assert rows is None and torch.equal(host_x, x[[1, 6]]) and which.tolist() == [4, 20]
