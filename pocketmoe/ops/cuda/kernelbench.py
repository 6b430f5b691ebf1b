"""Speed of the CUDA kernels alone: the decode GEMV of each weight type and the grouped expert GEMM of a
prefill chunk on raw blocks, in GB/s of weights read, and the decode attention over DeepSeek-V2-Lite's latent
cache at a few context lengths, in GB/s of cache read; each beside the device's own copy bandwidth.

    python -m pocketmoe.ops.cuda.kernelbench [--types q4_k,q6_k] [--gemv 8192x2048] [--tokens 1,8]
                                             [--experts 64x1408x2048] [--chunk 256] [--top-k 6]
                                             [--attention-keys 512,4096,32768] [--attention-seqs 1,8] [--json]

Attention is timed as the engine runs it (a block per span of keys and up to 16 heads, so each latent row is read
once for all of them, the spans merged), with each token's keys in one span ("one_span_us": what the split gains),
and with a block per head ("per_head_us": what sharing the rows gains).

Where the engine's decode falls short of the HBM bound (scripts/gpu_check.sh), this tells whether the kernels
or what surrounds them (launches, glue ops, the host) lose the time: "us" is a kernel's own time (the launches
queued behind a spin kernel, so they run back to back), "host_us" what the host spends launching it. Weights are rotated over copies that
together pass 256 MiB, so a GEMV reads memory, not the L2 cache. Every timed kernel's output is first checked
against gguf.quants.dequantize and a float64 matmul within the tests' rounding bound
(pocketmoe.testing.cuda_matmul.tolerance): a fast wrong kernel reports its error, not a speed.

--device cpu runs the same host code and kernels under the CPU execution shim: it checks the bench itself;
its times say nothing of a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pocketmoe.ops.cuda import matmul

DEFAULT_TYPES = "q4_k,q5_k,q6_k,q8_0,q4_0,q5_0,q2_k,q3_k,iq2_xxs,iq1_m,iq4_xs,mxfp4,nvfp4,f16,bf16,f32,q4_1,q5_1,iq4_nl,iq3_xxs,iq1_s,iq2_xs,iq2_s,iq3_s,tq2_0,tq1_0,q1_0"
ROTATE_BYTES = 256 << 20  # weights rotated over copies this large in all: past any GPU's L2
CHECK_ROWS = 64           # output rows checked against the float64 reference
MLA_ATTENTION = (16, 512, 64)  # DeepSeek-V2-Lite's heads, kv_lora and rope dims: the attention bench's shape
TARGET_S = 0.05           # timed launches per figure: about this long


@dataclass(frozen=True)
class Shape:
    rows: int
    cols: int


def parse_dims(text: str, what: str, n: int) -> tuple[int, ...]:
    """'8192x2048' -> (8192, 2048): n positive sizes joined by 'x'."""
    try:
        dims = tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        dims = ()
    if len(dims) != n or min(dims) <= 0:
        example = "x".join(["64", "1408", "2048"][-n:])
        raise ValueError(f"{what} is {text!r}; write {n} positive sizes joined by 'x', e.g. {example}")
    return dims


class Timer:
    """Seconds per call of a function that launches kernels: CUDA events on a GPU, the wall clock elsewhere.

    On a GPU the timed launches queue behind a spin kernel, so they run back to back and the events time the
    kernels, not the host's launch overhead (about as long as a small kernel); that overhead is measured apart."""

    SPIN_CYCLES = 200_000_000  # about 0.1 s at 2 GHz: longer than queueing MAX_REPS launches takes
    MAX_REPS = 200

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host_s: list[float] = []  # host seconds per launching call, one entry per per_call()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def per_call(self, fn: Callable[[int], Any]) -> float:
        """fn(i) launches call i (i picks the weight copy); warmed up, then timed over about TARGET_S."""
        fn(0)
        self.sync()
        t0 = time.perf_counter()
        fn(1)
        self.sync()
        one = time.perf_counter() - t0
        if not self.cuda:
            self.host_s.append(one)
            return one
        reps = max(3, min(self.MAX_REPS, math.ceil(TARGET_S / max(one, 1e-6))))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(self.SPIN_CYCLES)
        start.record()
        t0 = time.perf_counter()
        for i in range(reps):
            fn(i)
        self.host_s.append((time.perf_counter() - t0) / reps)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps


def copy_gbps(device: torch.device, timer: Timer, nbytes: int = ROTATE_BYTES) -> float:
    """The device's copy bandwidth (bytes read + written per second): the bound a weight-reading kernel meets."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    return 2 * nbytes / timer.per_call(lambda i: b.copy_(a)) / 1e9


def _copies(raw: np.ndarray, device: torch.device, rotate_bytes: int) -> list[torch.Tensor]:
    first = torch.from_numpy(raw).to(device)
    n = max(1, min(64, math.ceil(rotate_bytes / max(raw.nbytes, 1))))
    return [first] + [first.clone() for _ in range(n - 1)]


def _check(name: str, y: np.ndarray, raw: np.ndarray, xd: np.ndarray, model: list[torch.Tensor]) -> str:
    """'ok', or where the kernel's output leaves the rounding bound of the float64 reference (model: the
    activation arguments as pocketmoe.testing.cuda_matmul.act_inputs makes them, for the rows of xd)."""
    from pocketmoe.testing.cuda_matmul import exact, reference_weight, tolerance

    w = reference_weight(raw, name)
    ref = exact(name, raw, w, xd, model)
    err, tol = np.abs(y - ref), tolerance(name, raw, w, xd, model)
    bad = ~(err <= tol)
    if not bad.any():
        return "ok"
    t, r = np.argwhere(bad)[0]
    return f"wrong: token {t} row {r} is {y[t, r]:.6g}, the reference {ref[t, r]:.6g} (bound {tol[t, r]:.3g})"


def _inputs(name: str, rows: int, cols: int, tokens: int, rng: np.random.Generator, launch: Any,
            device: torch.device) -> tuple[np.ndarray, list[torch.Tensor], np.ndarray, list[torch.Tensor]]:
    """(raw blocks [rows, row_bytes], the kernel's activation arguments on the device, their float64 values, the
    host model of those arguments)."""
    from pocketmoe.quant.quantize import random_blocks
    from pocketmoe.testing.cuda_matmul import TYPES, act_inputs

    ggml_type, bv = TYPES[name]
    x = rng.standard_normal((tokens, cols), dtype=np.float32)
    acts = matmul.quantize_activations(launch, torch.from_numpy(x).to(device), bv)
    model, xd = act_inputs(x, bv)  # the model of that quantization (bit for bit, tests/test_cuda_matmul.py)
    return random_blocks(ggml_type, (rows, cols), rng), acts, xd, model


def bench_gemv(name: str, shape: Shape, tokens: int, launch: Any, device: torch.device, timer: Timer,
               bound_gbps: float, rotate_bytes: int = ROTATE_BYTES) -> dict[str, Any]:
    from pocketmoe.testing.cuda_matmul import TYPES

    ggml_type = TYPES[name][0]
    rng = np.random.default_rng([ggml_type, tokens])
    raw, acts, xd, model = _inputs(name, shape.rows, shape.cols, tokens, rng, launch, device)
    weights = _copies(raw, device, rotate_bytes)
    y = torch.empty((tokens, shape.rows), dtype=torch.float32, device=device)

    def call(i: int) -> None:
        matmul.gemv(launch, weights[i % len(weights)], ggml_type, shape.cols, acts, out=y)

    call(0)
    check = _check(name, y[:, :CHECK_ROWS].cpu().numpy(), raw[:CHECK_ROWS], xd, model)
    s = timer.per_call(call)
    gbps = raw.nbytes / s / 1e9
    return {"type": name, "rows": shape.rows, "cols": shape.cols, "tokens": tokens, "weight_mib": raw.nbytes / 2**20,
            "us": s * 1e6, "host_us": timer.host_s[-1] * 1e6, "gbps": gbps, "fraction_of_copy_bound": gbps / bound_gbps,
            "check": check}


def bench_moe_gemm(name: str, experts: int, shape: Shape, chunk: int, top_k: int, launch: Any,
                   device: torch.device, timer: Timer, bound_gbps: float) -> dict[str, Any]:
    """A prefill chunk's gate (or up) projection: `chunk` tokens, each to top_k of `experts`, spread evenly."""
    from pocketmoe.testing.cuda_matmul import TYPES, grouped

    ggml_type = TYPES[name][0]
    rng = np.random.default_rng([ggml_type, experts, chunk])
    raw0, acts, xd, model = _inputs(name, shape.rows, shape.cols, chunk, rng, launch, device)
    first = torch.from_numpy(raw0).to(device)
    bank = [first] + [first.clone() for _ in range(experts - 1)]  # each its own memory; the values do not matter
    ids = (np.arange(chunk)[:, None] * top_k + np.arange(top_k)[None, :]) % experts  # top_k distinct per token
    offsets, tok, slot = (a.to(device) for a in grouped(ids, experts))
    counts = np.diff(offsets.cpu().numpy())
    out = torch.empty((chunk * top_k, shape.rows), dtype=torch.float32, device=device)

    def call(i: int) -> None:
        matmul.moe_gemm(launch, bank, ggml_type, shape.rows, shape.cols, offsets, tok, slot, acts, top_k, out,
                        max_pairs=int(counts.max()))

    call(0)
    p = np.arange(counts[0])
    tokens0, slots0 = tok.cpu().numpy()[p], slot.cpu().numpy()[p]
    y0 = out[torch.from_numpy(tokens0 * top_k + slots0).to(device).long(), :CHECK_ROWS].cpu().numpy()
    check = _check(name, y0, raw0[:CHECK_ROWS], xd[tokens0], [a[tokens0] for a in model])
    s = timer.per_call(call)
    nbytes = raw0.nbytes * experts
    gbps = nbytes / s / 1e9
    return {"type": name, "experts": experts, "rows": shape.rows, "cols": shape.cols, "chunk": chunk, "top_k": top_k,
            "pairs_per_expert": float(counts.mean()), "weight_mib": nbytes / 2**20, "us": s * 1e6,
            "host_us": timer.host_s[-1] * 1e6, "gbps": gbps,
            "fraction_of_copy_bound": gbps / bound_gbps,
            "tflops": 2 * chunk * top_k * shape.rows * shape.cols / s / 1e12, "check": check}


def bench_attention(keys: int, seqs: int, launch: Any, device: torch.device, timer: Timer, bound_gbps: float,
                    rotate_bytes: int = ROTATE_BYTES) -> dict[str, Any]:
    """One decode step's MLA attention core (attention.cu over an f32 latent cache): `seqs` sequences, each one
    token after `keys` cached positions. Each sequence's latent rows are read once (the heads share them)."""
    from pocketmoe.engine import PagedKVCache, SeqChunk, Step, StepContext
    from pocketmoe.ops.cuda.backend import KV_TYPES, CudaOps, attention_spans

    heads, lora, rope = MLA_ATTENTION
    width, n = lora + rope, keys + 1
    per_layer = seqs * n * width * 4
    layers = max(1, min(16, math.ceil(rotate_bytes / per_layer)))  # the cache rotated over layers, past the L2
    cache = PagedKVCache(n_layer=layers, width=width, n_pages=seqs * -(-n // 64), max_seq_len=n, device=device,
                         page=64)
    gen = torch.Generator(device=device).manual_seed(keys * 31 + seqs)
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen, device=device))
    names = [f"s{i}" for i in range(seqs)]
    for name in names:
        cache.reserve(name, keys)
    ctx = StepContext.build(Step([SeqChunk(name, [0], keys) for name in names]), cache, 1)
    ctx.cos2 = ctx.sin2 = torch.zeros(seqs, rope)  # the step's tables (_step_arrays makes them; unread here)
    nope = 128  # V2-Lite's qk_nope: the kernel reads q_pe after it in the model's q
    # the step's rope tables as the identity, so the kernel's queries are [q_abs, q_pe]
    rot = torch.ones(seqs, rope, device=device), torch.zeros(seqs, rope, device=device)
    q_abs = torch.randn(seqs, heads, lora, generator=gen, device=device)
    q_model = torch.randn(seqs, heads, nope + rope, generator=gen, device=device)
    out = torch.empty(seqs, heads, lora, dtype=torch.float32, device=device)
    scale = 192 ** -0.5  # V2-Lite's (qk_nope + qk_rope) ** -0.5
    split, single, per_head = (CudaOps(tile_rows=None, launcher=launch, device=device) for _ in range(3))
    single.att_max_spans = 1
    per_head.att_heads = 1
    dims = [heads, lora, rope, nope, scale, KV_TYPES[torch.float32]]

    def attend(ops: CudaOps, layer: int) -> None:
        ops._attend("mla_attention_f32", ctx, q_abs, cache.layer_rows(layer), out, heads, dims, width,
                    per_token=(q_model, *rot))

    def timed(ops: CudaOps) -> float:
        return timer.per_call(lambda i: attend(ops, i % layers))

    s1, s_head, s = timed(single), timed(per_head), timed(split)
    attend(split, 0)
    q = torch.cat([q_abs, q_model[..., nope:]], dim=-1)
    rows = torch.from_numpy(cache.rows(names[-1], 0, n)).long().to(device)
    k = cache.data[0, rows].double()
    ref = torch.softmax(q[-1].double() @ k.T * scale, dim=-1) @ k[:, :lora]
    err = float((out[-1].double() - ref).abs().max() / ref.abs().max())
    check = "ok" if err <= 1e-5 else f"wrong: sequence {seqs - 1} is {err:.2e} (relative) off the float64 reference"
    gbps = per_layer / s / 1e9
    return {"kernel": "mla_attention_f32", "heads": heads, "width": width, "keys": keys, "seqs": seqs,
            "spans": attention_spans(n), "cache_mib": per_layer / 2**20, "us": s * 1e6,
            "host_us": timer.host_s[-1] * 1e6, "one_span_us": s1 * 1e6, "per_head_us": s_head * 1e6, "gbps": gbps,
            "fraction_of_copy_bound": gbps / bound_gbps, "check": check}


def run(types: Sequence[str], gemv_shape: Shape, tokens: Sequence[int], experts: int, expert_shape: Shape,
        chunk: int, top_k: int, device: torch.device, launch: Any = None,
        rotate_bytes: int = ROTATE_BYTES, attention_keys: Sequence[int] = (),
        attention_seqs: Sequence[int] = (1,)) -> dict[str, Any]:
    """The whole report; launch: a backend.Launcher (default: CuPy on a GPU, the CPU shim on the CPU)."""
    from pocketmoe.testing.cuda_matmul import TYPES

    unknown = [t for t in types if t not in TYPES]
    if unknown:
        raise ValueError(f"no CUDA matmul kernel for {', '.join(unknown)}; the types are {', '.join(TYPES)}")
    if top_k > experts:
        raise ValueError(f"--top-k {top_k} is more than the {experts} experts; each token picks distinct experts")
    if launch is None:
        if device.type == "cuda":
            from pocketmoe.ops.cuda.backend import CupyLauncher

            launch = CupyLauncher()
        else:
            from pocketmoe.testing.cuda_shim import ShimLauncher

            launch = ShimLauncher()
    timer = Timer(device)
    bound = copy_gbps(device, timer, rotate_bytes)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (CUDA shim: times mean nothing)",
        "copy_gbps": bound, "gemv": [], "moe_gemm": [], "attention": []}
    for name in types:
        for t in tokens:
            report["gemv"].append(bench_gemv(name, gemv_shape, t, launch, device, timer, bound, rotate_bytes))
        report["moe_gemm"].append(bench_moe_gemm(name, experts, expert_shape, chunk, top_k, launch, device, timer,
                                                 bound))
    for keys in attention_keys:
        for seqs in attention_seqs:
            report["attention"].append(bench_attention(keys, seqs, launch, device, timer, bound, rotate_bytes))
    report["wrong"] = [f"{kind} {r['type']}: {r['check']}" for kind in ("gemv", "moe_gemm") for r in report[kind]
                       if r["check"] != "ok"]
    report["wrong"] += [f"attention {r['keys']} keys x {r['seqs']}: {r['check']}" for r in report["attention"]
                        if r["check"] != "ok"]
    return report


def render(r: dict[str, Any]) -> str:
    lines = [f"{r['device']}: device copy {r['copy_gbps']:.1f} GB/s", "",
             f"{'GEMV':10} {'shape':>11} {'T':>3} {'MiB':>7} {'us':>9} {'host us':>8} {'GB/s':>8} {'of copy':>8}  check"]
    for g in r["gemv"]:
        lines.append(f"{g['type']:10} {g['rows']:>5}x{g['cols']:<5} {g['tokens']:>3} {g['weight_mib']:7.1f} "
                     f"{g['us']:9.1f} {g['host_us']:8.1f} {g['gbps']:8.1f} {g['fraction_of_copy_bound']:8.0%}  "
                     f"{g['check']}")
    lines += ["", f"{'MoE GEMM':10} {'experts':>16} {'pairs':>6} {'MiB':>7} {'us':>9} {'host us':>8} {'GB/s':>8} "
                  f"{'TFLOP/s':>8}  check"]
    for g in r["moe_gemm"]:
        lines.append(f"{g['type']:10} {g['experts']:>4}x{g['rows']:>5}x{g['cols']:<5} {g['pairs_per_expert']:6.1f} "
                     f"{g['weight_mib']:7.1f} {g['us']:9.1f} {g['host_us']:8.1f} {g['gbps']:8.1f} {g['tflops']:8.2f}  "
                     f"{g['check']}")
    if r.get("attention"):
        lines += ["", f"{'attention':10} {'keys':>7} {'seqs':>4} {'spans':>5} {'MiB':>7} {'us':>9} {'1-span us':>9} "
                      f"{'1-head us':>9} {'GB/s':>8} {'of copy':>8}  check"]
        for a in r["attention"]:
            lines.append(f"{'mla':10} {a['keys']:>7} {a['seqs']:>4} {a['spans']:>5} {a['cache_mib']:7.1f} "
                         f"{a['us']:9.1f} {a['one_span_us']:9.1f} {a['per_head_us']:9.1f} {a['gbps']:8.1f} "
                         f"{a['fraction_of_copy_bound']:8.0%}  {a['check']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pocketmoe.ops.cuda.kernelbench",
                                description="Time the CUDA matmul kernels on raw blocks against the device's copy "
                                            "bandwidth, each output checked first.")
    p.add_argument("--types", default=DEFAULT_TYPES, help="kernel types, comma-separated (default: all)")
    p.add_argument("--gemv", default="8192x2048", help="GEMV weight rows x columns (default 8192x2048)")
    p.add_argument("--tokens", default="1,8", help="GEMV tokens per launch, comma-separated (at most 8 each)")
    p.add_argument("--experts", default="64x1408x2048",
                   help="MoE GEMM experts x rows x columns (default: DeepSeek-V2-Lite's gate / up, 64x1408x2048)")
    p.add_argument("--chunk", type=int, default=256, help="MoE GEMM prefill tokens (default 256)")
    p.add_argument("--top-k", type=int, default=6, help="experts per token (default 6)")
    p.add_argument("--attention-keys", default=None,
                   help="decode attention: cached positions per sequence, comma-separated ('' for none; default "
                        "512,4096,32768 on cuda, 300 on the cpu shim)")
    p.add_argument("--attention-seqs", default=None,
                   help="decode attention: sequences per step, comma-separated (default 1,8 on cuda, 1 on cpu)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda (CuPy), or cpu: the kernels under the CPU shim (checks the bench, not the speed)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    try:
        types = [t.strip().lower() for t in a.types.split(",") if t.strip()]
        rows, cols = parse_dims(a.gemv, "--gemv", 2)
        e, er, ec = parse_dims(a.experts, "--experts", 3)
        tokens = [int(t) for t in a.tokens.split(",")]
        if any(not 1 <= t <= matmul.GEMV_TOKENS for t in tokens):
            raise ValueError(f"--tokens {a.tokens}: each count must be 1..{matmul.GEMV_TOKENS} (the GEMV's range)")
        if a.chunk <= 0 or a.top_k <= 0:
            raise ValueError("--chunk and --top-k must be positive")
        cuda_dev = a.device == "cuda"
        if a.attention_keys is None:
            a.attention_keys = "512,4096,32768" if cuda_dev else "300"
        if a.attention_seqs is None:
            a.attention_seqs = "1,8" if cuda_dev else "1"
        att_keys = [int(k) for k in a.attention_keys.split(",") if k.strip()]
        att_seqs = [int(k) for k in a.attention_seqs.split(",") if k.strip()]
        if any(k <= 0 for k in att_keys) or not att_seqs or any(n <= 0 for n in att_seqs):
            raise ValueError(f"--attention-keys {a.attention_keys!r} and --attention-seqs {a.attention_seqs!r} must "
                             "be positive counts, comma-separated")
        if cuda_dev:
            from pocketmoe.ops import cuda

            if not cuda.available():
                raise ValueError(f"--device cuda, but {cuda.unavailable_reason()}; use --device cpu to check the "
                                 "bench on the CPU shim")
        report = run(types, Shape(rows, cols), tokens, e, Shape(er, ec), a.chunk, a.top_k, torch.device(a.device),
                     attention_keys=att_keys, attention_seqs=att_seqs)
    except ValueError as exc:
        print(f"kernelbench: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report) if a.json else render(report))
    return 1 if report["wrong"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
