"""The ExpertBank of each MoE layer as the placement plan says: host (cpu plan), resident (all-device)
or dispatch over a slot cache (heterogeneous)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from pocketmoe.errors import PocketMoEError
from pocketmoe.experts.cache import DEFAULT_ADMISSION, DEFAULT_EVICTION, SlotCache
from pocketmoe.experts.calibrate import calibrate
from pocketmoe.experts.cost import POLICIES, Rates
from pocketmoe.experts.dispatch import DispatchExperts
from pocketmoe.experts.kernels import ExpertKernels, ExpertStore, host_kernels
from pocketmoe.experts.resident import resident_bank
from pocketmoe.experts.staging import CopyDelay, CopyEngine, SlotPool
from pocketmoe.experts.stats import ExpertStats
from pocketmoe.layers.experts import ExpertBank, ExpertsFactory, ExpertWeights, host_experts_factory
from pocketmoe.placement.plan import torch_device


def plan_device(plan: Any, layer: int) -> torch.device:
    """The torch device of the plan's device that holds `layer` (its name: cpu:i or cuda:i)."""
    return torch_device(plan.devices[plan.layer_device.get(layer, 0)].name)


@dataclass
class ExpertRuntime:
    """What the banks of one model share: statistics, the copy engine, the CPU worker and the rates."""

    policy: str = "auto"
    rates: Rates | None = None          # None: calibrated on the first heterogeneous layer
    copy_delay: CopyDelay | None = None
    eviction: str = DEFAULT_EVICTION
    admission: str = DEFAULT_ADMISSION
    depth: int = 2                      # staged copies in flight per layer (2: double-buffered)
    stats: ExpertStats = field(default_factory=ExpertStats)
    engines: dict[str, CopyEngine] = field(default_factory=dict)
    worker: ThreadPoolExecutor | None = None
    caches: dict[int, SlotCache] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise PocketMoEError(f"--expert-policy {self.policy!r} is not one of {', '.join(POLICIES)}.")

    def engine(self, device: torch.device) -> CopyEngine:
        key = str(device)
        if key not in self.engines:
            self.engines[key] = CopyEngine(device, self.copy_delay)
        return self.engines[key]


def expert_kernels(device: torch.device, ops: Any = None) -> ExpertKernels:
    """The kernels that read raw expert blocks (a slot pool, a resident bank) on the CUDA `device`: the op
    backend's own (CudaOps.expert_kernels: its launcher), else the CUDA expert kernels on a CuPy launcher."""
    if device.type != "cuda":
        raise PocketMoEError(f"expert_kernels takes a CUDA device, got {device}; the CPU device runs the host kernels.")
    hook = getattr(ops, "expert_kernels", None)
    if hook is not None:
        return hook(device)
    from pocketmoe.ops import cuda

    if not cuda.available():
        raise PocketMoEError(f"the routed experts were placed on {device} but {cuda.unavailable_reason()}; run "
                             "with --device cpu (or --mode cpu).")
    from pocketmoe.ops.cuda.backend import CupyLauncher
    from pocketmoe.ops.cuda.experts import CudaExpertKernels

    return CudaExpertKernels(CupyLauncher())


def device_kernels(ops: Any, device: torch.device, host: ExpertKernels) -> ExpertKernels:
    """The kernels that read a slot pool on `device`: on the CPU device, the host's own; on CUDA, expert_kernels."""
    if device.type == "cpu":
        return host
    return expert_kernels(device, ops)


def plan_experts_factory(plan: Any, ops: Any, tile_rows: int | None, rt: ExpertRuntime) -> ExpertsFactory:
    """Banks for `plan`: the CPU plan's host banks, resident banks (all-device), dispatch (heterogeneous)."""
    types = getattr(ops, "types", None)
    if plan.mode == "cpu":
        return host_experts_factory(types, tile_rows)
    first = min(plan.resident, default=0)  # the first MoE layer counts the tokens

    def make(layer: int, gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights,
             swiglu_limit: float = 0.0) -> ExpertBank:
        host = ExpertStore(gate, up, down, swiglu_limit)
        hk = host_kernels(host, types, tile_rows)
        device = plan_device(plan, layer)
        dk = device_kernels(ops, device, hk)
        if plan.mode == "all-device":
            return resident_bank(host, dk, device, rt.stats, tile_rows, layer == first)
        slots = int(plan.slots_per_layer.get(layer, 0))
        pool = SlotPool(host, slots, device, rt.engine(device)) if slots else None
        if rt.rates is None:
            probe = pool if pool is not None else SlotPool(host, 1, device, rt.engine(device))
            rt.rates = calibrate(host, hk, probe, dk)
        if rt.worker is None:
            rt.worker = ThreadPoolExecutor(1, thread_name_prefix="pocketmoe-cpu-experts")
        cache = rt.caches[layer] = SlotCache(slots, rt.eviction, rt.admission)
        return DispatchExperts(host, hk, pool, cache, dk, rt.rates, rt.policy, rt.stats, rt.worker,
                               counts_tokens=layer == first, depth=rt.depth)

    return make
