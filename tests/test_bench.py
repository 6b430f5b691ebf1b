"""python -m pocketmoe.bench: JSON report shape, the bytes-per-token bound, bad inputs, llama.cpp side."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from pocketmoe.bench import render
from pocketmoe.benchmark import matching_prefix, prompt_ids

ROOT = Path(__file__).resolve().parents[1]
ENGINE_KEYS = {"backend", "prefill_tok_s", "decode_tok_s", "peak_rss_mib", "peak_anon_mib", "load_s"}
FAST = ["--prompt-tokens", "8", "--gen-tokens", "4", "--threads", "1", "--bandwidth-mib", "32", "--json"]


def bench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-m", "pocketmoe.bench", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pocketmoe.testing.synth import write_fixture

    return write_fixture("deepseek2", "tiny", "Q4_K_M", tmp_path_factory.mktemp("bench") / "m.gguf")[0]


@pytest.fixture(scope="module")
def report(model: Path) -> dict:
    proc = bench("--model", str(model), *FAST, "--profile")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def expected_bytes_per_token(path: Path) -> int:
    """Independent of pocketmoe: k/E of each *_exps tensor, one token_embd row, everything else whole."""
    r = gguf.GGUFReader(path)
    n_expert = int(r.fields["deepseek2.expert_count"].contents())
    k = int(r.fields["deepseek2.expert_used_count"].contents())
    names = {t.name for t in r.tensors}
    total = 0
    for t in r.tensors:
        if "_exps." in t.name:
            total += int(t.n_bytes) // n_expert * k
        elif t.name == "token_embd.weight" and "output.weight" in names:
            total += int(t.n_bytes) // int(t.shape[-1])
        else:
            total += int(t.n_bytes)
    return total


def test_json_report(report: dict, model: Path) -> None:
    assert {"model", "architecture", "file_bytes", "threads", "prompt_tokens", "gen_tokens", "pocketmoe",
            "llama_cpp", "ratio", "bound"} <= report.keys()
    assert report["architecture"] == "deepseek2"
    assert report["file_bytes"] == model.stat().st_size
    assert (report["prompt_tokens"], report["gen_tokens"], report["threads"]) == (8, 4, 1)
    assert report["llama_cpp"] is None and report["ratio"] is None
    ours = report["pocketmoe"]
    assert ENGINE_KEYS <= ours.keys()
    for key in ENGINE_KEYS - {"backend"}:
        assert ours[key] > 0, key
    bound = report["bound"]
    for key in ("read_bandwidth_gbps", "bytes_per_token", "decode_tok_s_bound", "decode_fraction_of_bound"):
        assert bound[key] > 0, key
    assert bound["method"]
    assert bound["decode_tok_s_bound"] == pytest.approx(
        bound["read_bandwidth_gbps"] * 1e9 / bound["bytes_per_token"], rel=1e-2)


def test_bytes_per_token_matches_gguf_reader(report: dict, model: Path) -> None:
    assert report["bound"]["bytes_per_token"] == expected_bytes_per_token(model)
    assert 0 < report["bound"]["routed_bytes_per_token"] < report["bound"]["bytes_per_token"]


def test_table_render(report: dict) -> None:
    text = render(report)
    assert "pocketmoe" in text and "prefill tok/s" in text and "GB/s" in text
    assert "by op" in render(report, profile=True)


def test_op_profile_accounts_for_the_time(report: dict) -> None:
    """--profile: prefill covers the 8 prompt tokens, decode the 4 steps, and the ops add up to no more than
    the measured wall time per token (the runner's Python between them adds a little)."""
    ours = report["pocketmoe"]
    prof = ours["profile"]
    assert prof["prefill"]["tokens"] == 8 and prof["decode"]["tokens"] == 4
    for phase, rate in (("prefill", ours["prefill_tok_s"]), ("decode", ours["decode_tok_s"])):
        ms = prof[phase]["ms_per_token"]
        # each sublayer is one outermost op (its fine ops count inside it); the head is a linear
        assert {"moe_sublayer", "mla_sublayer", "linear", "embed"} <= ms.keys()
        assert all(v >= 0 for v in ms.values()) and ms["moe_sublayer"] > 0
        assert sum(ms.values()) <= 1e3 / rate * 1.05


def test_op_profile_brackets_each_outermost_op_with_the_sync() -> None:
    """On a GPU the ops return before their kernels run: the profile syncs before and after each outermost op
    (a nested op adds none), so what it times is the kernels'."""
    from pocketmoe.ops.profile import OPS, OpProfile

    events: list[str] = []

    class Ops:
        def linear(self, x):  # noqa: ANN001, ANN202
            events.append("linear")
            return x

        def rms_norm(self, x):  # noqa: ANN001, ANN202
            events.append("rms_norm")
            return self.linear(x)  # nested: counted in rms_norm

    ops = Ops()
    for name in set(OPS) - {"linear", "rms_norm"}:
        setattr(ops, name, lambda *a: None)
    prof = OpProfile(ops, sync=lambda: events.append("sync"))
    ops.rms_norm(1)
    ops.linear(2)
    assert events == ["sync", "rms_norm", "linear", "sync", "sync", "linear", "sync"]
    assert prof.snapshot()["calls"] == {"rms_norm": 1, "linear": 1}


def test_prompt_ids_deterministic_and_ordinary() -> None:
    allowed = list(range(100, 200))
    a = prompt_ids(64, 1000, allowed)
    assert a == prompt_ids(64, 1000, allowed)
    assert len(a) == 64 and set(a) <= set(allowed)
    assert matching_prefix([1, 2, 3], [1, 2, 4]) == 2


@pytest.mark.parametrize("args", [["--model", "/nonexistent/m.gguf"], ["--prompt-tokens", "0"],
                                  ["--gen-tokens", "4", "--n-ctx", "8"]])
def test_bad_inputs_one_line_exit_2(args: list[str], model: Path) -> None:
    full = (["--model", str(model)] if "--model" not in args else []) + args + ["--threads", "1"]
    proc = bench(*full)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert proc.stdout == ""


@pytest.mark.parity
def test_llama_cpp_side_by_side(model: Path) -> None:
    pytest.importorskip("llama_cpp")
    proc = bench("--model", str(model), *FAST, "--llama-cpp")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    theirs = r["llama_cpp"]
    assert ENGINE_KEYS | {"version"} <= theirs.keys()
    assert theirs["version"].startswith("llama-cpp-python")
    for key in ("prefill_tok_s", "decode_tok_s", "peak_rss_mib", "load_s"):
        assert theirs[key] > 0, key
    assert r["ratio"]["prefill"] > 0 and r["ratio"]["decode"] > 0
    assert r["greedy_agreement"]["compared_tokens"] == 5
    assert "CPU" in theirs["system_info"]  # llama.cpp's build features (AVX2 = 1, ...), said with the figures


def test_llama_python_must_be_a_file(model: Path) -> None:
    proc = bench("--model", str(model), *FAST, "--llama-cpp", env={"POCKETMOE_LLAMA_PYTHON": "/nonexistent/python"})
    assert proc.returncode == 2 and "POCKETMOE_LLAMA_PYTHON" in proc.stderr and proc.stderr.count("\n") == 1


@pytest.mark.parity
def test_llama_cpp_child_runs_without_torch(model: Path) -> None:
    """$POCKETMOE_LLAMA_PYTHON is a separate venv built for this CPU: the child needs llama-cpp-python,
    numpy and gguf, not torch."""
    pytest.importorskip("llama_cpp")
    argv = ["pocketmoe.bench", "--engine", "llama-cpp", "--model", str(model), "--token-ids", "1,2,3",
            "--gen-tokens", "2", "--threads", "1", "--repeats", "1", "--n-ctx", "64", "--json"]
    code = ("import runpy, sys\nsys.modules['torch'] = None  # any import of torch raises ImportError\n"
            f"sys.argv = {argv!r}\nrunpy.run_module('pocketmoe.bench', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["tokens"]) == 3 and out["llama_cpp"]["decode_tok_s"] > 0


def test_llama_python_missing_a_module_says_what_to_install(model: Path, tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'gguf'\" >&2\nexit 1\n")
    fake.chmod(0o755)
    proc = bench("--model", str(model), *FAST, "--llama-cpp", env={"POCKETMOE_LLAMA_PYTHON": str(fake)})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"in {fake} failed: it has no module 'gguf'" in proc.stderr and "-m pip install" in proc.stderr


def test_llama_bench_spellings() -> None:
    """llama-bench's -m, -p, -n, -t, -r mean the same counts here."""
    from pocketmoe.bench import parse_args

    a = parse_args(["-m", "x.gguf", "-p", "512", "-n", "64", "-t", "2", "-r", "3"])
    assert (a.model, a.prompt_tokens, a.gen_tokens, a.threads, a.repeats) == ("x.gguf", 512, 64, 2, 3)
