"""The dispatcher's cost model: per MoE layer and step, each active expert is a cache hit, staged into a
device slot, or computed on the CPU, whichever finishes the layer soonest.

Times come from calibrated rates (GB/s of expert weight bytes): a run of an expert over n tokens takes
bytes / gbps for the first token (its weights are read once) plus (n - 1) * bytes / token_gbps (the
arithmetic of each further token). Staging adds bytes / copy_gbps on the copy engine, which overlaps
the device's compute (double-buffered), and CPU experts run while the device runs its own: the layer
takes max(device, CPU) and each miss goes where that maximum grows least (largest first).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pocketmoe.errors import PocketMoEError

GB = 1e9
HIT, STAGE, CPU = "hit", "stage", "cpu"
POLICIES = ("auto", "cache", "stage", "cpu")


@dataclass(frozen=True)
class Rates:
    """Calibrated (or given) rates in GB/s of expert weight bytes."""

    copy_gbps: float           # host -> device slot copies
    cpu_gbps: float            # CPU expert run, first token (weights read from host memory)
    cpu_token_gbps: float      # CPU, each further token of the same expert (compute)
    device_gbps: float         # device kernels, first token
    device_token_gbps: float   # device kernels, each further token

    def __post_init__(self) -> None:
        for name, v in vars(self).items():
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise PocketMoEError(f"expert rate {name} must be a positive number of GB/s, got {v!r}.")

    def cpu_s(self, tokens: int, nbytes: int) -> float:
        return nbytes / GB * (1 / self.cpu_gbps + (tokens - 1) / self.cpu_token_gbps)

    def device_s(self, tokens: int, nbytes: int) -> float:
        return nbytes / GB * (1 / self.device_gbps + (tokens - 1) / self.device_token_gbps)

    def copy_s(self, nbytes: int) -> float:
        return nbytes / GB / self.copy_gbps

    def to_json(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in vars(self).items()}


@dataclass(frozen=True)
class Active:
    """One active expert of a step: its id, the tokens routed to it, its bytes, whether a slot holds it."""

    expert: int
    tokens: int
    nbytes: int
    cached: bool


@dataclass(frozen=True)
class Decision:
    paths: dict[int, str]   # expert -> HIT | STAGE | CPU
    seconds: float          # the model's time for the layer: max(device incl. copies, CPU)


def decide(active: Sequence[Active], rates: Rates, policy: str = "auto", can_stage: bool = True) -> Decision:
    """Where each active expert runs. Hits stay on the device under every policy but "stage" (which
    keeps nothing) and "cpu"; without slots (`can_stage` False) a miss can only run on the CPU."""
    if policy not in POLICIES:
        raise PocketMoEError(f"expert policy {policy!r} is not one of {', '.join(POLICIES)}.")
    paths: dict[int, str] = {}
    copy = dev = cpu = 0.0
    misses = []
    for a in active:
        if a.cached and policy in ("auto", "cache"):
            paths[a.expert] = HIT
            dev += rates.device_s(a.tokens, a.nbytes)
        else:
            misses.append(a)
    for a in sorted(misses, key=lambda a: (-a.tokens * a.nbytes, a.expert)):
        c, d, p = rates.copy_s(a.nbytes), rates.device_s(a.tokens, a.nbytes), rates.cpu_s(a.tokens, a.nbytes)
        if policy == "cpu" or not can_stage:
            stage = False
        elif policy in ("cache", "stage"):
            stage = True
        else:  # the makespan if staged vs if computed on the CPU
            stage = max(max(dev, copy + c) + d, cpu) < max(dev, cpu + p)
        if stage:  # copies run one after another; the device starts an expert once its copy is in
            paths[a.expert] = STAGE
            copy += c
            dev = max(dev, copy) + d
        else:
            paths[a.expert] = CPU
            cpu += p
    return Decision(paths, max(dev, cpu))
