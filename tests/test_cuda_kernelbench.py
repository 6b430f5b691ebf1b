"""python -m pocketmoe.ops.cuda.kernelbench on the CPU shim: the report's figures and checks, a wrong kernel
reported as wrong (never as a speed), and bad flags as one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pocketmoe.ops.cuda import kernelbench
from pocketmoe.testing.cuda_shim import ShimLauncher, shim_unavailable_reason

pytestmark = pytest.mark.skipif(shim_unavailable_reason() is not None, reason=str(shim_unavailable_reason()))

SMALL = dict(gemv_shape=kernelbench.Shape(40, 512), tokens=[1, 3], experts=4,
             expert_shape=kernelbench.Shape(24, 512), chunk=6, top_k=2, device=torch.device("cpu"),
             rotate_bytes=1 << 16)


def test_report_of_correct_kernels():
    r = kernelbench.run(["q4_k", "q8_0", "bf16"], launch=ShimLauncher(), **SMALL)
    assert r["wrong"] == [] and r["copy_gbps"] > 0
    assert [(g["type"], g["tokens"]) for g in r["gemv"]] == [(t, n) for t in ("q4_k", "q8_0", "bf16") for n in (1, 3)]
    for g in r["gemv"] + r["moe_gemm"]:
        assert g["check"] == "ok" and g["us"] > 0 and g["gbps"] > 0
    q4 = r["moe_gemm"][0]
    assert q4["pairs_per_expert"] == 6 * 2 / 4 and q4["weight_mib"] == 4 * 24 * (512 // 256) * 144 / 2**20


def test_attention_report_splits_long_contexts():
    """The decode attention rows: spans as the backend splits the keys, the cache read once per sequence, each
    output checked against the float64 softmax."""
    r = kernelbench.run([], launch=ShimLauncher(), attention_keys=[100, 700], attention_seqs=[1, 2], **SMALL)
    assert r["wrong"] == [] and r["gemv"] == []
    assert [(a["keys"], a["seqs"], a["spans"]) for a in r["attention"]] == [(100, 1, 1), (100, 2, 1), (700, 1, 6),
                                                                             (700, 2, 6)]
    for a in r["attention"]:
        assert a["check"] == "ok" and a["us"] > 0 and a["one_span_us"] > 0
        assert a["cache_mib"] == a["seqs"] * (a["keys"] + 1) * 576 * 4 / 2**20


class SkewedMerge(ShimLauncher):
    """The merged attention output a hair too large."""

    def __call__(self, source, kernel, grid, block, args, shared_mem=0) -> None:  # noqa: ANN001
        super().__call__(source, kernel, grid, block, args, shared_mem)
        if kernel == "attention_merge_f32":
            args[2].mul_(1 + 1e-3)


def test_a_wrong_attention_is_reported_wrong():
    r = kernelbench.run([], launch=SkewedMerge(), attention_keys=[700], **SMALL)
    assert r["wrong"] == ["attention 700 keys x 1: " + r["attention"][0]["check"]]
    assert r["attention"][0]["check"].startswith("wrong: sequence 0 is ")


class ScaledGemv(ShimLauncher):
    """Every GEMV / GEMM output a hair too large: inside float noise, outside the rounding bound."""

    def __call__(self, source, kernel, grid, block, args, shared_mem=0) -> None:  # noqa: ANN001
        super().__call__(source, kernel, grid, block, args, shared_mem)
        if kernel.startswith(("gemv_", "moe_gemm_")):
            # y: before the GEMV's rows, cols, n_tokens; the GEMM's rows, cols, top_k, act_by_pair, groups, has_groups
            out = args[-4] if kernel.startswith("gemv_") else args[-7]
            out.mul_(1 + 1e-4)


def test_a_wrong_kernel_is_reported_wrong():
    r = kernelbench.run(["q6_k"], launch=ScaledGemv(), **SMALL)
    assert len(r["wrong"]) == 3, r["wrong"]
    assert all(g["check"].startswith("wrong: token 0 row") for g in r["gemv"] + r["moe_gemm"])


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pocketmoe.ops.cuda.kernelbench", *args], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize(("args", "message"), [
    (["--types", "q4_k,q7_k"], "no CUDA matmul kernel for q7_k; the types are"),
    (["--gemv", "8192"], "--gemv is '8192'; write 2 positive sizes joined by 'x', e.g. 1408x2048"),
    (["--tokens", "9"], "--tokens 9: each count must be 1..8"),
    (["--experts", "4x32x512", "--top-k", "6"], "--top-k 6 is more than the 4 experts"),
    (["--device", "cuda"], "--device cuda, but "),
    (["--attention-keys", "0"], "--attention-keys '0' and --attention-seqs '1' must be positive counts"),
])
def test_bad_flags_are_one_line(args, message):
    if args[:2] == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = cli("--device", "cpu", *args) if "--device" not in args else cli(*args)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("kernelbench: ") and message in r.stderr, r.stderr


def test_cli_json_on_the_shim():
    r = cli("--device", "cpu", "--types", "iq4_xs", "--gemv", "8x256", "--tokens", "2", "--experts", "3x8x256",
            "--chunk", "3", "--top-k", "2", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["wrong"] == [] and len(out["gemv"]) == 1 and out["moe_gemm"][0]["experts"] == 3
    assert [(a["keys"], a["seqs"], a["spans"]) for a in out["attention"]] == [(300, 1, 3)]
