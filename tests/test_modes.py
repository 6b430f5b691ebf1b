"""The placement flags end to end with the CPU as the device: generate --json in every mode gives the same
tokens, bench --json and the server's /metrics report the cache statistics and predicted tok/s, the plan
inspect_gguf prints is the plan that runs, and --device cuda without a GPU is one clear error."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pocketmoe.cli_util import cuda_memory_bytes
from pocketmoe.engine.runner import ModelRunner, RunnerConfig
from pocketmoe.gguf import open_bundle
from pocketmoe.placement import PlacementError
from pocketmoe.placement.run import RunPlacement
from pocketmoe.testing.live_server import LiveServer
from pocketmoe.testing.synth import write_fixture

ROOT = Path(__file__).resolve().parents[1]
IDS = "5,17,29,41,53,65,77,89,101,113,125,137"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("modes") / "tiny.gguf"
    write_fixture("deepseek2", "tiny", "Q4_K_M", path, seed=7)
    return path


def cli(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)


def generate(model: Path, *flags: str) -> dict:
    r = cli("pocketmoe.generate", "--model", str(model), "--token-ids", IDS, "--max-tokens", "8", "--ignore-eos",
            "--json", "--n-ctx", "64", "--threads", "1", "--device", "cpu", *flags)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_generate_json_same_tokens_in_every_mode(model):
    runs = {"cpu": generate(model, "--mode", "cpu"),
            "all-device": generate(model, "--mode", "all-device"),
            "heterogeneous": generate(model, "--mode", "heterogeneous"),
            "heterogeneous tiny cache": generate(model, "--mode", "heterogeneous", "--expert-cache-slots", "1",
                                                 "--expert-policy", "cache"),
            "heterogeneous cpu policy": generate(model, "--mode", "heterogeneous", "--expert-policy", "cpu")}
    tokens = {k: v["token_ids"] for k, v in runs.items()}
    assert len(tokens["cpu"]) == 8 and all(t == tokens["cpu"] for t in tokens.values()), tokens
    assert {k: v["mode"] for k, v in runs.items()} == {k: k.split()[0] for k in runs}
    tiny = runs["heterogeneous tiny cache"]["experts"]
    assert tiny["cache_slots"] == 3 and tiny["stats"]["staged"] > 0 and tiny["stats"]["cpu_experts"] == 0
    assert runs["heterogeneous cpu policy"]["experts"]["stats"]["staged"] == 0
    resident = runs["all-device"]["experts"]["stats"]
    assert resident["hit_rate"] == 1.0 and resident["bytes_copied_per_token"] == 0
    assert "stats" not in runs["cpu"]["experts"] and runs["cpu"]["experts"]["plan_decode_tok_s"] > 0


def test_device_cuda_without_a_gpu_is_one_clear_line(model):
    if cuda_memory_bytes():
        pytest.skip("this machine has a GPU")
    r = cli("pocketmoe.generate", "--model", str(model), "--token-ids", "5", "--device", "cuda")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: --device cuda was asked for but torch sees no CUDA GPU (torch.cuda.is_available() is False); use "
        "--device cpu or --device auto."]


def test_flag_errors_are_one_sentence(model):
    r = cli("pocketmoe.generate", "--model", str(model), "--token-ids", "5", "--device", "cpu", "--mode",
            "all-device", "--gpu-memory-gib", "0.001")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "--mode all-device needs every weight" in r.stderr and "--mode heterogeneous" in r.stderr
    with pytest.raises(PlacementError, match="--gpu-memory-gib .* must be one or more positive sizes"):
        RunPlacement(gpu_memory_gib=(0.0,))


def test_inspect_prints_the_plan_that_runs(model):
    flags = ["--device", "cpu", "--mode", "heterogeneous", "--gpu-memory-gib", "1", "--expert-cache-slots", "2"]
    r = cli("pocketmoe.inspect_gguf", "--gguf-path", str(model), "--placement-report", "--json", "--context-length",
            "64", "--kv-dtype", "f32", "--host-memory-gib", "64", *flags)
    assert r.returncode == 0, r.stderr
    printed = json.loads(r.stdout)["placement"]
    with open_bundle(model) as b:
        rp = RunPlacement(device="cpu", mode="heterogeneous", gpu_memory_gib=(1.0,), expert_cache_slots=2)
        from pocketmoe.placement.run import run_plan

        runner = ModelRunner(b, RunnerConfig(n_ctx=64, placement=rp))
        # the runner's plan with inspect's remaining defaults (prefill chunk 512, the given host memory)
        same = run_plan(runner.spec, b.tensors, rp, runner.plan.options.__class__(
            context_length=64, batch=1, kv_dtype="f32"), host_memory_bytes=64 * 2**30)
        assert runner.plan.mode == printed["mode"] == "heterogeneous"
        assert runner.plan.slots_per_layer == {int(k): v for k, v in printed["slots_per_layer"].items()}
        assert same.to_json() == json.loads(json.dumps(printed))


def test_bench_json_reports_cache_stats_and_predictions(model):
    r = cli("pocketmoe.bench", "--model", str(model), "--prompt-tokens", "16", "--gen-tokens", "4", "--threads", "1",
            "--bandwidth-mib", "16", "--json", "--device", "cpu", "--mode", "heterogeneous", "--expert-cache-slots",
            "2")
    assert r.returncode == 0, r.stderr
    x = json.loads(r.stdout)["pocketmoe"]["experts"]
    assert x["mode"] == "heterogeneous" and x["cache_slots"] == 6
    st, pre = x["stats"], x["prefill_stats"]
    assert st["tokens"] == 4 and pre["tokens"] == 16  # the last timed run: 16 prompt tokens, 4 decode steps
    assert st["hits"] + st["misses"] > 0 and 0 <= st["hit_rate"] <= 1
    assert {"bytes_copied_per_token", "cpu_experts_per_token"} <= set(st)
    assert x["plan_decode_tok_s"] > 0 and x["cost_model_decode_tok_s"] > 0 and x["measured_decode_tok_s"] > 0


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_server_metrics_show_cache_statistics(model):
    with LiveServer(["--model", str(model), "--threads", "1", "--max-model-len", "64", "--max-num-seqs", "2",
                     "--device", "cpu", "--mode", "heterogeneous", "--expert-cache-slots", "2"]) as srv:
        assert "placement heterogeneous" in "".join(srv.stdout)
        body = {"model": "tiny", "prompt": [5, 17, 29, 41], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        text = httpx.get(srv.url + "/metrics").text
    hits, misses = _metric(text, "pocketmoe_expert_hits"), _metric(text, "pocketmoe_expert_misses")
    assert hits + misses > 0
    assert _metric(text, "pocketmoe_expert_hit_rate") == pytest.approx(hits / (hits + misses))
    for name in ("staged", "cpu_experts", "bytes_copied_per_token", "cpu_experts_per_token"):
        assert _metric(text, "pocketmoe_expert_" + name) >= 0
    assert _metric(text, "pocketmoe_predicted_plan_decode_tok_s") > 0
    assert _metric(text, "pocketmoe_predicted_cost_model_decode_tok_s") > 0
    assert _metric(text, "pocketmoe_measured_decode_tok_s") > 0


def test_auto_mode_picks_heterogeneous_when_the_device_is_small(model):
    from pocketmoe.placement import PlanOptions
    from pocketmoe.placement.inventory import ROUTED
    from pocketmoe.placement.run import run_plan

    opts = PlanOptions(context_length=64, batch=1, kv_dtype="f32")
    with open_bundle(model) as b:
        runner = ModelRunner(b, RunnerConfig(n_ctx=64, placement=RunPlacement(device="cpu", mode="cpu")))
        full = run_plan(runner.spec, b.tensors, RunPlacement(device="cpu", mode="all-device"), opts)
        need = full.devices[0].used
        routed = full.devices[0].weights[ROUTED]
        roomy = RunPlacement(device="cpu", gpu_memory_gib=(need / 2**30 * 1.01,))
        small = RunPlacement(device="cpu", gpu_memory_gib=((need - routed / 2) / 2**30,))
        assert run_plan(runner.spec, b.tensors, roomy, opts).mode == "all-device"
        plan = run_plan(runner.spec, b.tensors, small, opts)
    assert plan.mode == "heterogeneous" and plan.devices[0].name == "cpu:0"
    assert 0 < plan.cache_slots < sum(len(v) for v in full.resident.values())  # half the experts' room
    assert "workspace" in plan.per_device_bytes["cpu:0"]


def test_each_torchrun_rank_plans_for_its_own_gpu(monkeypatch):
    """Under torchrun on GPUs a rank holds a tensor-parallel share of every layer on cuda:LOCAL_RANK (the device
    the process group set): its plan has that one GPU, not a layer split over all the GPUs it sees."""
    from pocketmoe.placement import run as run_mod

    gib = 2**30
    monkeypatch.setattr(run_mod, "cuda_memory_bytes", lambda: [24 * gib, 16 * gib])
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    host = 64 * gib
    got = run_mod.run_devices(RunPlacement(device="cuda"), "cuda", host)
    assert [(g.name, g.memory_bytes) for g in got.gpus] == [("cuda:1", 16 * gib)]
    for sizes, want in (((4.0,), 4 * gib), ((4.0, 8.0), 8 * gib)):
        got = run_mod.run_devices(RunPlacement(device="cuda", gpu_memory_gib=sizes), "cuda", host)
        assert [(g.name, g.memory_bytes) for g in got.gpus] == [("cuda:1", want)]
    # a printed plan (inspect_gguf) still plans for every GPU given
    assert len(run_mod.run_devices(RunPlacement(device="cuda", gpu_memory_gib=(4.0, 8.0)), "cuda", host,
                                   plan_only=True).gpus) == 2
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(PlacementError, match="LOCAL_RANK 2 but torch sees 2 GPU"):
        run_mod.run_devices(RunPlacement(device="cuda"), "cuda", host)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert len(run_mod.run_devices(RunPlacement(device="cuda"), "cuda", host).gpus) == 2


def test_generate_split_over_two_devices_gives_the_same_tokens(model):
    """--gpu-memory-gib 1,1 with the CPU as device: two devices, the layers split between them, in both modes."""
    cpu = generate(model, "--mode", "cpu")["token_ids"]
    for mode in ("all-device", "heterogeneous"):
        run = generate(model, "--mode", mode, "--gpu-memory-gib", "1,1")
        assert run["token_ids"] == cpu and run["mode"] == mode, run


def test_an_architecture_without_cuda_ops_runs_on_the_cpu(tmp_path, monkeypatch):
    """DeepSeek-V4 has no CUDA op backend: --device auto on a GPU machine plans it for the CPU, --device cuda is one
    clear error (a printed plan may still plan GPUs for it)."""
    from pocketmoe.engine.runner import load_spec
    from pocketmoe.placement import PlanOptions
    from pocketmoe.placement import run as run_mod

    monkeypatch.setattr(run_mod, "cuda_runtime", lambda: True)
    monkeypatch.setattr(run_mod, "cuda_memory_bytes", lambda: [24 * 2**30])
    path = write_fixture("deepseek4", "tiny", "F32", tmp_path / "v4.gguf")[0]
    with open_bundle(path) as b:
        spec, opts = load_spec(b), PlanOptions(context_length=64)
        assert run_mod.run_plan(spec, b.tensors, RunPlacement(device="auto"), opts).mode == "cpu"
        with pytest.raises(PlacementError, match="runs deepseek2 and minimax-m2, not deepseek4; run deepseek4 with "
                                                 "--device cpu"):
            run_mod.run_plan(spec, b.tensors, RunPlacement(device="cuda"), opts)
        printed = run_mod.run_plan(spec, b.tensors, RunPlacement(device="cuda"), opts, plan_only=True)
        assert printed.mode == "all-device" and printed.devices[0].name == "cuda:0"
