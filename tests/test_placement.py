"""Placement plans and decode estimates, checked against byte sums from gguf.GGUFReader and the formulas
of ANCHORS.md recomputed here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import pytest

from pocketmoe.gguf import open_bundle
from pocketmoe.placement import (
    Bandwidths,
    ComputeRates,
    Devices,
    DeviceSpec,
    PlacementError,
    PlanOptions,
    kv_reserve,
    make_plan,
    plan_report,
    spec_tensor_infos,
)
from pocketmoe.placement.reserve import ACT_BUFFERS
from pocketmoe.specs import DeepSeek4Config, DeepSeek4Spec, plain, spec_from_bundle
from pocketmoe.testing import plan_fixture, write_fixture

GIB = 2**30
HOST = 64 * GIB


class Ref:
    """Independent facts about a GGUF file (or its shards), read with gguf.GGUFReader."""

    def __init__(self, paths: list[Path]) -> None:
        self.tensors: dict[str, tuple[int, tuple[int, ...]]] = {}
        self.fields: dict[str, object] = {}
        for p in paths:
            r = gguf.GGUFReader(p)
            for t in r.tensors:
                self.tensors[t.name] = (int(t.n_bytes), tuple(int(d) for d in reversed(t.shape)))
            if not self.fields:
                self.fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.")}
        self.arch = self.fields["general.architecture"]

    def key(self, suffix: str) -> int:
        return int(self.fields[f"{self.arch}.{suffix}"])

    def total(self, routed: bool | None = None) -> int:
        return sum(b for n, (b, _) in self.tensors.items() if routed is None or ("_exps." in n) == routed)

    def expert_bytes(self) -> dict[int, int]:
        """MoE layer -> bytes of one expert: the layer's stacked *_exps tensors over E."""
        out: dict[int, int] = {}
        for name, (b, shape) in self.tensors.items():
            if "_exps." in name:
                layer = int(name.split(".")[1])
                out[layer] = out.get(layer, 0) + b // shape[0]
        return out

    def b_tok(self) -> int:
        return self.key("expert_used_count") * sum(self.expert_bytes().values())

    def non_expert_read(self) -> int:
        b, shape = self.tensors["token_embd.weight"]
        return self.total(routed=False) - b + b // shape[0]

    def kv(self, ctx: int, batch: int, size: int = 2) -> int:
        dims = self.key("attention.kv_lora_rank") + self.key("rope.dimension_count")
        return self.key("block_count") * dims * ctx * batch * size

    def attn_flops(self, ctx: int) -> int:
        """Absorbed MLA for the last of ctx tokens, from the file's keys (2 FLOPs a multiply-add): in every layer
        each head scores ctx latent rows (kv_lora + rope values) and sums their kv_lora values."""
        lora, rope = self.key("attention.kv_lora_rank"), self.key("rope.dimension_count")
        return 2 * self.key("block_count") * self.key("attention.head_count") * ctx * (2 * lora + rope)

    def workspace(self, opts: PlanOptions, head: bool) -> int:
        hidden, vocab = self.key("embedding_length"), self.tensors["output.weight"][1][0]
        act = ACT_BUFFERS * opts.batch * min(opts.prefill_chunk, opts.context_length) * hidden * 4
        return act + int(opts.cuda_context_gib * GIB) + (vocab * opts.batch * 4 if head else 0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], Ref]:
    paths = write_fixture("deepseek2", "tiny", "Q4_K_M", tmp_path_factory.mktemp("pl") / "tiny.gguf")
    return paths, Ref(paths)


def plan_for(paths: list[Path], devices: Devices, opts: PlanOptions):
    with open_bundle(paths[0]) as b:
        return make_plan(spec_from_bundle(b), b.tensors, devices, opts)


def one_gpu(mem: int) -> Devices:
    return Devices((DeviceSpec("cuda:0", mem),), HOST)


RATES = ComputeRates(cpu_gflops=80.0, gpu_gflops=1500.0)
OPTS = PlanOptions(context_length=256, cuda_context_gib=0.0, kv_dtype="f16", compute=RATES)


def test_all_device_when_everything_fits(tiny) -> None:
    paths, ref = tiny
    plan = plan_for(paths, one_gpu(GIB), OPTS)
    assert plan.mode == "all-device"
    (dev,) = plan.devices
    assert sum(dev.weights.values()) == ref.total()
    assert plan.kv_reserve_bytes == dev.kv_bytes == ref.kv(256, 1)
    assert plan.workspace_bytes == ref.workspace(OPTS, head=True)
    assert plan.cache_slots == 0 and not plan.host_bytes
    assert plan.resident == {layer: frozenset(range(ref.key("expert_count"))) for layer in ref.expert_bytes()}
    assert dev.free == GIB - ref.total() - ref.kv(256, 1) - ref.workspace(OPTS, head=True)
    assert plan.expert_slot_bytes == max(ref.expert_bytes().values())
    est = {e.name: e for e in plan.estimates.estimates}
    # weights, then attention: the longer of its KV read and its arithmetic
    weights, kv, flops = ref.b_tok() + ref.non_expert_read(), ref.kv(256, 1), ref.attn_flops(256)
    assert est["all-device"].tok_s == pytest.approx(1 / (weights / 150e9 + max(kv / 150e9, flops / 1500e9)))
    assert est["cpu"].tok_s == pytest.approx(1 / (weights / 38.4e9 + max(kv / 38.4e9, flops / 80e9)))
    assert plan.estimates.attention_flops_per_token == flops
    assert json.loads(json.dumps(plan.to_json()))["mode"] == "all-device"


def test_heterogeneous_cache_slots_and_estimates(tiny) -> None:
    paths, ref = tiny
    slot = max(ref.expert_bytes().values())
    fixed = ref.total(routed=False) + ref.kv(256, 1) + ref.workspace(OPTS, head=True)
    bw = Bandwidths(dram_gbps=30.0, pcie_gbps=10.0, gpu_gbps=200.0)
    opts = PlanOptions(context_length=256, cuda_context_gib=0.0, bandwidths=bw, kv_dtype="f16", compute=RATES)
    plan = plan_for(paths, one_gpu(fixed + 5 * slot + slot // 2), opts)
    assert plan.mode == "heterogeneous"
    (dev,) = plan.devices
    assert plan.host_bytes == {"routed_expert": ref.total(routed=True)}
    assert sum(dev.weights.values()) == ref.total(routed=False)
    assert plan.cache_slots == dev.cache_slots == 5
    slots = dict(plan.slots_per_layer)
    assert set(slots) == set(ref.expert_bytes()) and max(slots.values()) - min(slots.values()) <= 1
    assert all(not r for r in plan.resident.values())
    assert dev.free == slot // 2
    # uniform routing: h_l = slots_l / E, weighted by k * bytes(expert) of each layer
    e, k, eb = ref.key("expert_count"), ref.key("expert_used_count"), ref.expert_bytes()
    h = sum(k * eb[layer] * min(s, e) / e for layer, s in slots.items()) / ref.b_tok()
    b, dense, kv, flops = ref.b_tok(), ref.non_expert_read(), ref.kv(256, 1), ref.attn_flops(256)
    on_device = dense / 200e9 + max(kv / 200e9, flops / 1500e9)  # attention runs on the device
    est = {x.name: x.tok_s for x in plan.estimates.estimates}
    assert plan.estimates.hit_rate == pytest.approx(h)
    assert est["cpu-experts"] == pytest.approx(1 / (b / 30e9 + on_device))
    assert est["staged"] == pytest.approx(1 / ((1 - h) * b / 10e9 + h * b / 200e9 + on_device))
    assert est["dispatch"] == pytest.approx(1 / ((1 - h) * b / 30e9 + h * b / 200e9 + on_device))
    assert est["cpu"] == pytest.approx(1 / ((b + dense) / 30e9 + max(kv / 30e9, flops / 80e9)))
    assert plan.estimates.stage_threshold == pytest.approx(1 - 10 / 30)
    assert "uniform routing" in plan_report(plan)


def test_refuses_when_non_expert_part_does_not_fit(tiny) -> None:
    paths, ref = tiny
    fixed = ref.total(routed=False) + ref.kv(256, 1) + ref.workspace(OPTS, head=True)
    with pytest.raises(PlacementError) as e:
        plan_for(paths, one_gpu(fixed - 1), OPTS)
    msg = str(e.value)
    assert "\n" not in msg and "--context-length" in msg and "1 GPU(s)" in msg
    assert f"{ref.total(routed=False) / 2**20:.2f} MiB" in msg


def test_refuses_when_host_cannot_hold_routed_experts(tiny) -> None:
    paths, ref = tiny
    fixed = ref.total(routed=False) + ref.kv(256, 1) + ref.workspace(OPTS, head=True)
    opts = PlanOptions(context_length=256, cuda_context_gib=0.0, host_reserve_gib=0.0, kv_dtype="f16")
    small_host = Devices((DeviceSpec("cuda:0", fixed + 1),), ref.total(routed=True) - 1)
    with pytest.raises(PlacementError, match="host memory") as e:
        plan_for(paths, small_host, opts)
    assert f"{ref.total(routed=True) / 2**20:.2f} MiB" in str(e.value)
    plan = plan_for(paths, Devices(small_host.gpus, ref.total(routed=True)), opts)
    assert plan.mode == "heterogeneous" and plan.cache_slots == 0 and plan.notes


def test_cpu_mode(tiny) -> None:
    paths, ref = tiny
    opts = PlanOptions(context_length=256, kv_dtype="f16", compute=RATES)
    plan = plan_for(paths, Devices((), HOST), opts)
    assert plan.mode == "cpu" and plan.devices == () and plan.layer_device == {}
    weights = {k: v for k, v in plan.host_bytes.items() if k not in ("kv_cache", "workspace")}
    assert sum(weights.values()) == ref.total()
    assert plan.host_bytes["kv_cache"] == ref.kv(256, 1)
    assert plan.host_bytes["workspace"] == ref.workspace(PlanOptions(context_length=256, cuda_context_gib=0, kv_dtype="f16"),
                                                         head=True)
    (est,) = plan.estimates.estimates
    weights, kv = ref.b_tok() + ref.non_expert_read(), ref.kv(256, 1)
    assert est.tok_s == pytest.approx(1 / (weights / 38.4e9 + max(kv / 38.4e9, ref.attn_flops(256) / 80e9)))
    with pytest.raises(PlacementError, match="CPU-only"):
        plan_for(paths, Devices((), ref.total()), opts)


def test_multi_gpu_pipeline_split(tiny) -> None:
    paths, ref = tiny
    need = ref.total() + ref.kv(256, 1)
    ws, ws_last = ref.workspace(OPTS, head=False), ref.workspace(OPTS, head=True)
    share = int(need * 0.45)
    gpus = (DeviceSpec("cuda:0", share + ws), DeviceSpec("cuda:1", share + ws), DeviceSpec("cuda:2", share + ws_last))
    plan = plan_for(paths, Devices(gpus, HOST), OPTS)
    assert plan.mode == "all-device"
    assert sum(sum(d.weights.values()) for d in plan.devices) == ref.total()
    assert sum(d.kv_bytes for d in plan.devices) == ref.kv(256, 1)
    order = [layer for d in plan.devices for layer in d.layers]
    assert order == list(range(ref.key("block_count")))
    assert all(d.layers for d in plan.devices)
    assert plan.devices[0].weights["embedding"] == ref.tensors["token_embd.weight"][0]
    assert "head" in plan.devices[-1].weights and all("head" not in d.weights for d in plan.devices[:-1])
    assert all(d.used <= d.memory_bytes for d in plan.devices)
    assert plan.workspace_bytes == 2 * ws + ws_last
    single = Devices((DeviceSpec("cuda:0", ref.total(routed=False) + ref.kv(256, 1) + ws_last),), HOST)
    assert plan_for(paths, single, OPTS).mode == "heterogeneous"


def test_sharded_bundle_bytes_match_reader(tmp_path: Path) -> None:
    paths = write_fixture("deepseek2", "tiny", "Q4_K_M", tmp_path / "sh.gguf", shards=2)
    ref = Ref(paths)
    plan = plan_for(paths, Devices((), HOST), PlanOptions(context_length=64, kv_dtype="f16"))
    assert len(paths) == 2
    weights = {k: v for k, v in plan.host_bytes.items() if k not in ("kv_cache", "workspace")}
    assert sum(weights.values()) == ref.total()
    assert weights["routed_expert"] == ref.total(routed=True)
    assert plan.estimates.routed_bytes_per_token == ref.b_tok()


def test_v2_lite_q4_k_m_on_a_4_gib_gpu() -> None:
    fp = plan_fixture("deepseek2", "full", "Q4_K_M")  # sizes from gguf's GGML_QUANT_SIZES, no file
    tensors = {t.name: t for t in fp.tensors}
    routed = sum(t.nbytes for t in fp.tensors if "_exps." in t.name)
    assert sum(t.nbytes for t in fp.tensors) == pytest.approx(10.37e9, rel=0.01)  # ANCHORS.md
    plan = make_plan(fp.spec, tensors, Devices.from_gib(1, 4, 24), PlanOptions(context_length=4096, kv_dtype="f16"))
    assert plan.mode == "heterogeneous"
    (dev,) = plan.devices
    assert sum(dev.weights.values()) == sum(t.nbytes for t in fp.tensors) - routed
    assert 0.5 * GIB < sum(dev.weights.values()) < 1.5 * GIB
    assert plan.host_bytes == {"routed_expert": routed}
    k, e = 6, 64
    assert all(k <= s < e for s in plan.slots_per_layer.values()) and len(plan.slots_per_layer) == 26
    assert plan.cache_slots == dev.cache_slots > 26 * k
    eb: dict[int, int] = {}
    for t in fp.tensors:
        if "_exps." in t.name:
            eb[int(t.name.split(".")[1])] = eb.get(int(t.name.split(".")[1]), 0) + t.nbytes // e
    b_tok = k * sum(eb.values())
    est = plan.estimates
    assert est.routed_bytes_per_token == b_tok
    # ANCHORS.md: 1.61 GB read per decode token (experts + the rest) for this shape and type mix
    assert (b_tok + est.non_expert_bytes_per_token) / 1e9 == pytest.approx(1.61, abs=0.02)
    assert est.kv_bytes_per_token == 27 * 576 * 2 * 4096
    h = sum(k * eb[layer] * s / e for layer, s in plan.slots_per_layer.items()) / b_tok
    assert est.hit_rate == pytest.approx(h) and 0 < h < est.stage_threshold
    assert est.best.name == "dispatch"
    types = {t.name: t.ggml_type for t in fp.tensors}
    infos = spec_tensor_infos(fp.spec, types, present=types)
    assert {n: i.nbytes for n, i in infos.items()} == {t.name: t.nbytes for t in fp.tensors}
    assert make_plan(fp.spec, infos, Devices.from_gib(1, 4, 24), PlanOptions(kv_dtype="f16")).to_json() == plan.to_json()


def test_kv_rules(tiny) -> None:
    paths, ref = tiny
    with open_bundle(paths[0]) as b:
        spec = spec_from_bundle(b)
        f32 = make_plan(spec, b.tensors, one_gpu(GIB), PlanOptions(context_length=256, batch=3, kv_dtype="f32"))
    assert f32.kv_reserve_bytes == ref.kv(256, 3, size=4)
    mm = write_fixture("minimax-m2", "tiny", "Q4_K_M", Path(paths[0]).parent / "mm.gguf")
    mref = Ref(mm)
    plan = plan_for(mm, one_gpu(GIB), OPTS)
    per_token = 2 * mref.key("attention.head_count_kv") * mref.key("attention.key_length") * 2
    assert plan.kv_reserve_bytes == mref.key("block_count") * per_token * 256
    meta = plain(DeepSeek4Spec(DeepSeek4Config.flash()).metadata())
    ratios = meta["deepseek4.attention.compress_ratios"]
    kv = kv_reserve("deepseek4", meta, 65536, 1)
    for layer in (0, 2, 3):
        r = ratios[layer]
        expect = (128 + (65536 // r if r else 0)) * 512 + (65536 // 4 * 128 if r == 4 else 0)
        assert kv.per_layer[layer] == expect * 2
    assert len(kv.per_layer) == meta["deepseek4.block_count"]


def test_attention_math_per_architecture(tiny) -> None:
    """The attention FLOPs the estimates add, recomputed from each file's metadata keys."""
    paths, ref = tiny
    mm = write_fixture("minimax-m2", "tiny", "Q4_K_M", Path(paths[0]).parent / "mm_attn.gguf")
    mref = Ref(mm)
    heads, dk = mref.key("attention.head_count"), mref.key("attention.key_length")
    dv = int(mref.fields.get("minimax-m2.attention.value_length", dk))
    for ctx in (1, 256, 4096):
        plan = plan_for(mm, Devices((), HOST), PlanOptions(context_length=ctx, compute=RATES))
        assert plan.estimates.attention_flops_per_token == 2 * mref.key("block_count") * heads * ctx * (dk + dv)
        plan = plan_for(paths, Devices((), HOST), PlanOptions(context_length=ctx, compute=RATES))
        assert plan.estimates.attention_flops_per_token == ref.attn_flops(ctx)
    # DeepSeek-V4: per layer the 128-token window, then the top-512 of ctx/4 entries (plus the indexer's
    # 64 x 128 scores over all ctx/4) on ratio-4 layers, all ctx/128 entries on ratio-128 layers
    meta = plain(DeepSeek4Spec(DeepSeek4Config.flash()).metadata())
    ratios, n = meta["deepseek4.attention.compress_ratios"], 65536
    heads, d = meta["deepseek4.attention.head_count"], meta["deepseek4.attention.key_length"]
    expect = 0
    for r in ratios[:meta["deepseek4.block_count"]]:
        entries = {0: 0, 4: min(512, n // 4), 128: n // 128}[r]
        expect += 2 * heads * (128 + entries) * 2 * d + (2 * 64 * (n // 4) * 128 if r == 4 else 0)
    assert DeepSeek4Spec(DeepSeek4Config.flash()).attention_flops_per_token(n) == expect


def test_attention_runs_where_the_mode_puts_it(tiny) -> None:
    """The CPU standing in for the device (--device cpu) does the device's attention at the CPU's rate."""
    paths, ref = tiny
    flops = ref.attn_flops(256)
    for kind, rate in (("cuda", 1500e9), ("cpu", 80e9)):
        plan = plan_for(paths, Devices.from_gib(1, 1, 64, kind=kind), OPTS)
        assert plan.mode == "all-device"
        est = {e.name: e for e in plan.estimates.estimates}
        (attn,) = [t for t in est["all-device"].terms if t.label == "attention"]
        kv_term, math_term = attn.terms
        assert (kv_term.amount, kv_term.rate, kv_term.unit) == (ref.kv(256, 1), 150.0, "B")
        assert (math_term.amount, math_term.rate * 1e9, math_term.unit) == (flops, rate, "FLOP")
        assert attn.seconds == max(kv_term.seconds, math_term.seconds)
        assert plan.estimates.attention_seconds_per_token(1e-3) == pytest.approx(ref.kv(256, 1) / 1e6)  # KV-bound
        assert plan.estimates.attention_seconds_per_token(1e6) == pytest.approx(flops / rate)  # math-bound
        assert "GFLOP/s (attention math))" in est["all-device"].formula
    js = plan.to_json()["estimates"]
    assert js["attention_flops_per_token"] == flops and js["compute_gflops"] == {"cpu": 80.0, "gpu": 1500.0}
    assert {"label": "attention math", "flops": flops, "gflops": 80.0} in js["estimates"][0]["terms"][1]["max_of"]
    with pytest.raises(ValueError, match="cpu_gflops"):
        ComputeRates(cpu_gflops=0.0)


def test_options_and_devices_are_checked() -> None:
    for bad in ({"context_length": 0}, {"batch": -1}, {"kv_dtype": "q4"}, {"cuda_context_gib": -1.0}):
        with pytest.raises(PlacementError):
            PlanOptions(**bad)
    with pytest.raises(PlacementError, match="2 GPUs"):
        Devices.from_gib(2, [4.0], 16)
    with pytest.raises(PlacementError):
        Devices.from_gib(1, 0, 16)
    with pytest.raises(ValueError):
        Bandwidths(dram_gbps=math.nan)


def test_cost_model_prediction_adds_attention(tiny) -> None:
    """expert_report's cost-model tok/s: the steps' expert seconds, the non-expert bytes at the device's calibrated
    GB/s, and attention at the full context (the longer of its KV read and its arithmetic)."""
    from types import SimpleNamespace

    from pocketmoe.experts import Rates
    from pocketmoe.experts.report import expert_report

    paths, ref = tiny
    plan = plan_for(paths, Devices.from_gib(1, 1, 64, kind="cpu"), OPTS)
    stats = {"tokens": 4, "model_expert_seconds_per_token": 0.004}
    for device_gbps in (1e-3, 50.0):  # KV-bound, then math-bound
        rates = Rates(copy_gbps=10.0, cpu_gbps=20.0, cpu_token_gbps=20.0, device_gbps=device_gbps,
                      device_token_gbps=100.0)
        runner = SimpleNamespace(plan=plan, experts=SimpleNamespace(policy="auto", rates=rates,
                                                                      stats=SimpleNamespace(to_json=lambda: dict(stats))))
        attention = max(ref.kv(256, 1) / (device_gbps * 1e9), ref.attn_flops(256) / 80e9)
        seconds = 0.004 + ref.non_expert_read() / (device_gbps * 1e9) + attention
        assert expert_report(runner)["cost_model_decode_tok_s"] == pytest.approx(1 / seconds)
