"""Decode tok/s bounds per placement mode from bytes moved per token and bandwidths (ANCHORS.md)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pocketmoe.placement.inventory import ModelBytes

GB = 1e9


@dataclass(frozen=True)
class Bandwidths:
    """Sustained bandwidths in GB/s (1e9 bytes). Defaults: a 4 GB laptop GPU on PCIe Gen3 with DDR4."""

    dram_gbps: float = 38.4  # dual-channel DDR4-3200: 75% of 51.2 GB/s
    pcie_gbps: float = 12.6  # PCIe Gen3 x16 pinned copies: ~80% of 15.75 GB/s
    gpu_gbps: float = 150.0  # ~80% of 192 GB/s (RTX 3050 laptop, 128-bit GDDR6)

    def __post_init__(self) -> None:
        for name in ("dram_gbps", "pcie_gbps", "gpu_gbps"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"bandwidth {name} must be a positive number of GB/s, got {v!r}")

    def describe(self) -> str:
        return (f"bandwidths: DRAM {self.dram_gbps:g} GB/s, PCIe {self.pcie_gbps:g} GB/s, device "
                f"{self.gpu_gbps:g} GB/s (defaults 38.4 / 12.6 / 150 = DDR4-3200 dual channel at 75%, "
                f"PCIe Gen3 x16 at 80%, RTX 3050 laptop at 80%; set --dram-gbps/--pcie-gbps/--gpu-gbps)")


@dataclass(frozen=True)
class Term:
    """One resource read serially in a decode step: `nbytes` over `gbps`."""

    label: str
    nbytes: float
    gbps: float

    @property
    def seconds(self) -> float:
        return self.nbytes / (self.gbps * GB)


@dataclass(frozen=True)
class Estimate:
    name: str
    terms: tuple[Term, ...]

    @property
    def seconds_per_token(self) -> float:
        return sum(t.seconds for t in self.terms)

    @property
    def tok_s(self) -> float:
        s = self.seconds_per_token
        return 1.0 / s if s > 0 else math.inf

    @property
    def formula(self) -> str:
        parts = [f"{t.nbytes / GB:.3f} GB / {t.gbps:g} GB/s ({t.label})" for t in self.terms]
        return "1 / (" + " + ".join(parts) + ")"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "tok_s": self.tok_s, "seconds_per_token": self.seconds_per_token,
                "formula": self.formula,
                "terms": [{"label": t.label, "bytes": t.nbytes, "gbps": t.gbps} for t in self.terms]}


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
                "kv_bytes_per_token": self.kv_bytes_per_token, "hit_rate": self.hit_rate,
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


def decode_estimates(mode: str, mb: ModelBytes, kv_read: int, slots_per_layer: Mapping[int, int],
                     bw: Bandwidths) -> DecodeEstimates:
    """Per-mode bounds: each term is bytes read per decode token over the bandwidth of where they sit."""
    b_tok, dense = mb.routed_bytes_per_token(), mb.non_expert_read_per_token()
    h = hit_rate(mb, slots_per_layer) if mode == "heterogeneous" else (1.0 if mode == "all-device" else 0.0)
    threshold = 1.0 - bw.pcie_gbps / bw.dram_gbps
    everything = Term("all weights + KV", b_tok + dense + kv_read, bw.dram_gbps)
    cpu = Estimate("cpu", (everything,))
    device_part = Term("non-expert + KV on device", dense + kv_read, bw.gpu_gbps)
    if mode == "cpu":
        ests: tuple[Estimate, ...] = (cpu,)
    elif mode == "all-device":
        ests = (Estimate("all-device", (Term("all weights + KV", b_tok + dense + kv_read, bw.gpu_gbps),)), cpu)
    elif mode == "heterogeneous":
        hits = Term("cache hits on device", h * b_tok, bw.gpu_gbps)
        ests = (
            Estimate("cpu-experts", (Term("routed experts on CPU", b_tok, bw.dram_gbps), device_part)),
            Estimate("staged", (Term("missed experts over PCIe", (1 - h) * b_tok, bw.pcie_gbps), hits,
                                device_part)),
            Estimate("dispatch", (Term("missed experts on CPU", (1 - h) * b_tok, bw.dram_gbps), hits,
                                  device_part)),
            cpu,
        )
    else:
        raise ValueError(f"unknown placement mode {mode!r}")
    assumptions = (
        "decode tok/s are upper bounds: bytes read per token / bandwidth, summed over the resources "
        "one after another (no overlap); compute time, attention math and latency are ignored",
        f"B_tok = sum over {len(mb.expert_bytes)} MoE layers of k={mb.n_experts_used} x bytes(one expert) "
        f"from the file's tensor sizes = {b_tok / GB:.3f} GB/token",
        f"non-expert bytes read per token = every non-routed tensor once, one embedding row = "
        f"{dense / GB:.3f} GB; KV read at the full context (last token) = {kv_read / GB:.3f} GB",
        bw.describe(),
    )
    if mode == "heterogeneous":
        assumptions += (
            f"hit rate h = min(slots per layer, E) / E with E={mb.n_experts} under uniform routing, weighted "
            f"by expert bytes: h = {h:.3f}",
            f"dispatch rule: staging misses beats computing them on the CPU only when h > 1 - BW_PCIe/BW_DRAM"
            f" = {threshold:.3f}; 'dispatch' computes misses on the CPU and hits on the device",
        )
    return DecodeEstimates(bw, b_tok, dense, kv_read, h, threshold, ests, assumptions)
