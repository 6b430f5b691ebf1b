"""Decode tok/s estimates per placement mode: bytes moved per token over bandwidths (ANCHORS.md), plus the
attention arithmetic over the KV cache at the attention's compute rate (it grows with the context)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pocketmoe.placement.inventory import ModelBytes

GB = 1e9


def _check_rates(rates: Any, what: str, unit: str) -> None:
    """Every field of the dataclass `rates` is a positive finite number, else a ValueError naming it."""
    for name, v in vars(rates).items():
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{what} {name} must be a positive number of {unit}, got {v!r}")


@dataclass(frozen=True)
class Bandwidths:
    """Sustained bandwidths in GB/s (1e9 bytes). Defaults: a 4 GB laptop GPU on PCIe Gen3 with DDR4."""

    dram_gbps: float = 38.4  # dual-channel DDR4-3200: 75% of 51.2 GB/s
    pcie_gbps: float = 12.6  # PCIe Gen3 x16 pinned copies: ~80% of 15.75 GB/s
    gpu_gbps: float = 150.0  # ~80% of 192 GB/s (RTX 3050 laptop, 128-bit GDDR6)

    def __post_init__(self) -> None:
        _check_rates(self, "bandwidth", "GB/s")

    def describe(self) -> str:
        return (f"bandwidths: DRAM {self.dram_gbps:g} GB/s, PCIe {self.pcie_gbps:g} GB/s, device "
                f"{self.gpu_gbps:g} GB/s (defaults 38.4 / 12.6 / 150 = DDR4-3200 dual channel at 75%, "
                f"PCIe Gen3 x16 at 80%, RTX 3050 laptop at 80%; set --dram-gbps/--pcie-gbps/--gpu-gbps)")


# What a physical core of the native CPU kernels sustains in attention (fp32 FMA over the cache rows):
# 58-69 GFLOP/s per core measured on Zen 4 (bench --profile, DeepSeek-V2-Lite shapes at 2048 and 8192 keys).
CPU_ATTENTION_GFLOPS_PER_CORE = 60.0


def default_cpu_gflops(threads: int | None = None) -> float:
    """CPU_ATTENTION_GFLOPS_PER_CORE x the cores `threads` keep busy (default: every core this process may use)."""
    from pocketmoe.hostinfo import physical_cores

    cores = physical_cores()
    return CPU_ATTENTION_GFLOPS_PER_CORE * (cores if threads is None else min(threads, cores))


@dataclass(frozen=True)
class ComputeRates:
    """Sustained attention arithmetic in GFLOP/s (1e9 floating-point operations; a multiply-add is two)."""

    cpu_gflops: float = field(default_factory=default_cpu_gflops)
    gpu_gflops: float = 2000.0  # ~35% of an RTX 3050 laptop's 5.5 TFLOP/s fp32 peak

    def __post_init__(self) -> None:
        _check_rates(self, "compute rate", "GFLOP/s")

    def describe(self) -> str:
        return (f"attention arithmetic: CPU {self.cpu_gflops:g} GFLOP/s, device {self.gpu_gflops:g} GFLOP/s "
                f"(defaults {CPU_ATTENTION_GFLOPS_PER_CORE:g} per core of this host, what the native kernels "
                f"sustain, and 2000 = an RTX 3050 laptop at ~35% of its fp32 peak; set --cpu-gflops/--gpu-gflops)")


@dataclass(frozen=True)
class Term:
    """One resource used serially in a decode step: `amount` bytes at `rate` GB/s, or (unit "FLOP") floating-point
    operations at `rate` GFLOP/s."""

    label: str
    amount: float
    rate: float
    unit: str = "B"

    @property
    def seconds(self) -> float:
        return self.amount / (self.rate * GB)

    @property
    def text(self) -> str:
        return f"{self.amount / GB:.3f} G{self.unit} / {self.rate:g} G{self.unit}/s ({self.label})"

    def to_json(self) -> dict[str, Any]:
        if self.unit == "FLOP":
            return {"label": self.label, "flops": self.amount, "gflops": self.rate}
        return {"label": self.label, "bytes": self.amount, "gbps": self.rate}


@dataclass(frozen=True)
class Overlapped:
    """Terms one kernel works through at once (attention streams the KV cache while it computes): the slowest
    sets the time."""

    label: str
    terms: tuple[Term, ...]

    @property
    def seconds(self) -> float:
        return max(t.seconds for t in self.terms)

    @property
    def text(self) -> str:
        return "max(" + ", ".join(t.text for t in self.terms) + ")"

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "max_of": [t.to_json() for t in self.terms]}


@dataclass(frozen=True)
class Estimate:
    name: str
    terms: tuple[Term | Overlapped, ...]

    @property
    def seconds_per_token(self) -> float:
        return sum(t.seconds for t in self.terms)

    @property
    def tok_s(self) -> float:
        s = self.seconds_per_token
        return 1.0 / s if s > 0 else math.inf

    @property
    def formula(self) -> str:
        return "1 / (" + " + ".join(t.text for t in self.terms) + ")"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "tok_s": self.tok_s, "seconds_per_token": self.seconds_per_token,
                "formula": self.formula,
                "terms": [t.to_json() for t in self.terms]}


@dataclass(frozen=True)
class DecodeEstimates:
    bandwidths: Bandwidths
    routed_bytes_per_token: int  # B_tok
    non_expert_bytes_per_token: int
    kv_bytes_per_token: int
    hit_rate: float
    stage_threshold: float  # staging beats CPU compute only when hit_rate > this
    estimates: tuple[Estimate, ...]
    assumptions: tuple[str, ...]
    attention_flops_per_token: int | None = None  # at the full context; None: not modelled
    compute: ComputeRates | None = None
    attention_gflops: float | None = None  # the rate of where the mode runs attention

    def attention_seconds_per_token(self, kv_gbps: float) -> float:
        """Attention at the full context where the mode runs it: its KV read at `kv_gbps` or its arithmetic,
        whichever takes longer."""
        return attention_terms(self.kv_bytes_per_token, kv_gbps, self.attention_flops_per_token,
                               self.attention_gflops or 1.0)[0].seconds

    def __post_init__(self) -> None:
        if not 0.0 <= self.hit_rate <= 1.0:
            raise ValueError(f"hit rate {self.hit_rate} is not in [0, 1]")

    @property
    def best(self) -> Estimate:
        return max(self.estimates, key=lambda e: e.tok_s)

    def to_json(self) -> dict[str, Any]:
        return {"bandwidths_gbps": {"dram": self.bandwidths.dram_gbps, "pcie": self.bandwidths.pcie_gbps,
                                    "gpu": self.bandwidths.gpu_gbps},
                "routed_bytes_per_token": self.routed_bytes_per_token,
                "non_expert_bytes_per_token": self.non_expert_bytes_per_token,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "attention_flops_per_token": self.attention_flops_per_token,
                "compute_gflops": None if self.compute is None else {"cpu": self.compute.cpu_gflops,
                                                                     "gpu": self.compute.gpu_gflops},
                "hit_rate": self.hit_rate,
                "stage_threshold": self.stage_threshold, "best": self.best.name,
                "estimates": [e.to_json() for e in self.estimates], "assumptions": list(self.assumptions)}


def hit_rate(mb: ModelBytes, slots_per_layer: Mapping[int, int]) -> float:
    """Expected hit rate under uniform routing: h_l = min(slots_l, E) / E, weighted by k * bytes(expert)."""
    b_tok = mb.routed_bytes_per_token()
    if b_tok == 0 or mb.n_experts == 0:
        return 1.0 if b_tok == 0 else 0.0
    hit = sum(mb.n_experts_used * b * min(slots_per_layer.get(layer, 0), mb.n_experts) / mb.n_experts
              for layer, b in mb.expert_bytes.items())
    return hit / b_tok


def attention_terms(kv_read: int, gbps: float, attn_flops: int | None, gflops: float) -> tuple[Term | Overlapped, ...]:
    """The KV cache read at `gbps`, overlapped with the attention arithmetic at `gflops` when it is modelled."""
    kv = Term("KV cache", kv_read, gbps)
    if not attn_flops:
        return (kv,)
    return (Overlapped("attention", (kv, Term("attention math", attn_flops, gflops, "FLOP"))),)


def decode_estimates(mode: str, mb: ModelBytes, kv_read: int, slots_per_layer: Mapping[int, int],
                     bw: Bandwidths, attn_flops: int | None = None, compute: ComputeRates | None = None,
                     device_is_cpu: bool = False) -> DecodeEstimates:
    """Per-mode estimates: each term is bytes read per decode token over the bandwidth of where they sit, and
    attention (over the KV cache at the full context) the longer of its KV read and `attn_flops` at the compute
    rate of where it runs (the CPU's for cpu mode and for the CPU standing in for the device)."""
    b_tok, dense = mb.routed_bytes_per_token(), mb.non_expert_read_per_token()
    h = hit_rate(mb, slots_per_layer) if mode == "heterogeneous" else (1.0 if mode == "all-device" else 0.0)
    threshold = 1.0 - bw.pcie_gbps / bw.dram_gbps
    rates = compute or ComputeRates()
    device_gflops = rates.cpu_gflops if device_is_cpu else rates.gpu_gflops
    cpu = Estimate("cpu", (Term("all weights", b_tok + dense, bw.dram_gbps),
                           *attention_terms(kv_read, bw.dram_gbps, attn_flops, rates.cpu_gflops)))
    device_part = (Term("non-expert on device", dense, bw.gpu_gbps),
                   *attention_terms(kv_read, bw.gpu_gbps, attn_flops, device_gflops))
    if mode == "cpu":
        ests: tuple[Estimate, ...] = (cpu,)
    elif mode == "all-device":
        ests = (Estimate("all-device", (Term("all weights", b_tok + dense, bw.gpu_gbps),
                                        *attention_terms(kv_read, bw.gpu_gbps, attn_flops, device_gflops))), cpu)
    elif mode == "heterogeneous":
        hits = Term("cache hits on device", h * b_tok, bw.gpu_gbps)
        ests = (
            Estimate("cpu-experts", (Term("routed experts on CPU", b_tok, bw.dram_gbps), *device_part)),
            Estimate("staged", (Term("missed experts over PCIe", (1 - h) * b_tok, bw.pcie_gbps), hits,
                                *device_part)),
            Estimate("dispatch", (Term("missed experts on CPU", (1 - h) * b_tok, bw.dram_gbps), hits,
                                  *device_part)),
            cpu,
        )
    else:
        raise ValueError(f"unknown placement mode {mode!r}")
    math_line = ("attention math over the KV cache is not modelled for this architecture" if not attn_flops else
                 f"attention math at the full context (last token) = {attn_flops / GB:.3f} GFLOP at the rate of "
                 f"where attention runs, overlapped with its KV read (the longer counts); {rates.describe()}")
    assumptions = (
        "decode tok/s estimates: bytes read per token / bandwidth (a ceiling), and attention's KV read or its "
        "arithmetic at a sustained rate, summed over the resources one after another (no overlap between them); "
        "other compute and latency are ignored",
        f"B_tok = sum over {len(mb.expert_bytes)} MoE layers of k={mb.n_experts_used} x bytes(one expert) "
        f"from the file's tensor sizes = {b_tok / GB:.3f} GB/token",
        f"non-expert bytes read per token = every non-routed tensor once, one embedding row = "
        f"{dense / GB:.3f} GB; KV read at the full context (last token) = {kv_read / GB:.3f} GB",
        math_line,
        bw.describe(),
    )
    if mode == "heterogeneous":
        assumptions += (
            f"hit rate h = min(slots per layer, E) / E with E={mb.n_experts} under uniform routing, weighted "
            f"by expert bytes: h = {h:.3f}",
            f"dispatch rule: staging misses beats computing them on the CPU only when h > 1 - BW_PCIe/BW_DRAM"
            f" = {threshold:.3f}; 'dispatch' computes misses on the CPU and hits on the device",
        )
    return DecodeEstimates(bw, b_tok, dense, kv_read, h, threshold, ests, assumptions, attn_flops or None,
                           rates, rates.cpu_gflops if mode == "cpu" else device_gflops)
