"""The plan a run uses, from the placement flags: the one function generate, bench, serve and
`inspect_gguf --placement-report` call, so the report shows the plan that runs.

Devices: `--device cpu` makes the CPU the "device" (device memory is host memory; staging is a copy into
a slot tensor), `cuda` the visible GPUs, `auto` the GPUs when torch sees any, else the CPU. `--mode auto`
with the CPU device and no `--gpu-memory-gib` is the CPU-only plan, as before these flags.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from pocketmoe.cli_util import cuda_memory_bytes
from pocketmoe.placement.plan import GIB, Devices, DeviceSpec, PlacementError, PlacementPlan, PlanOptions
from pocketmoe.placement.planner import make_plan

DEVICES = ("auto", "cpu", "cuda")
RUN_MODES = ("auto", "all-device", "heterogeneous", "cpu")


@dataclass(frozen=True)
class RunPlacement:
    device: str = "auto"
    mode: str = "auto"
    gpu_memory_gib: tuple[float, ...] | None = None   # per device; one value: every device
    expert_policy: str = "auto"
    expert_cache_slots: int | None = None             # per MoE layer; None: the plan's share of free memory
    num_devices: int | None = None                    # None: as many as --gpu-memory-gib sizes (or GPUs seen)
    numa: str = "auto"                                # host experts' pages over the memory nodes (pocketmoe.numa)

    def __post_init__(self) -> None:
        from pocketmoe.experts.cost import POLICIES
        from pocketmoe.numa import NUMA_POLICIES

        for flag, value, allowed in (("--device", self.device, DEVICES), ("--mode", self.mode, RUN_MODES),
                                     ("--expert-policy", self.expert_policy, POLICIES),
                                     ("--numa", self.numa, NUMA_POLICIES)):
            if value not in allowed:
                raise PlacementError(f"{flag} {value!r} is not one of {', '.join(allowed)}.")
        if self.gpu_memory_gib is not None:
            object.__setattr__(self, "gpu_memory_gib", tuple(float(g) for g in self.gpu_memory_gib))
            if not self.gpu_memory_gib or any(not g > 0 for g in self.gpu_memory_gib):
                raise PlacementError(f"--gpu-memory-gib {','.join(map(str, self.gpu_memory_gib))} must be one or "
                                     f"more positive sizes in GiB, e.g. 4 or 22,22.")
        if self.expert_cache_slots is not None and self.expert_cache_slots < 0:
            raise PlacementError(f"--expert-cache-slots is {self.expert_cache_slots}; give 0 or more.")


def cuda_runtime() -> bool:
    """Whether this build can run a model on CUDA: a GPU torch sees and the CUDA op backend (CuPy imports)."""
    from pocketmoe.ops import BACKENDS, cuda

    return bool(cuda_memory_bytes()) and "cuda" in BACKENDS and cuda.available()


def device_kind(device: str, plan_only: bool = False, sizes_given: bool = False) -> str:
    """"cpu" or "cuda" for the --device flag. --device cuda without a GPU is a user error, unless the plan
    is only printed (inspect_gguf plans for GPUs this machine lacks). auto: cuda where this build can run
    there (or, for a printed plan, where GPU sizes were given), else the CPU."""
    if device == "cuda" and not plan_only and not cuda_memory_bytes():
        raise PlacementError("--device cuda was asked for but torch sees no CUDA GPU (torch.cuda.is_available() "
                             "is False); use --device cpu or --device auto.")
    if device == "auto":
        return "cuda" if cuda_runtime() or (plan_only and (sizes_given or bool(cuda_memory_bytes()))) else "cpu"
    return device


def run_devices(rp: RunPlacement, kind: str, host_bytes: int, plan_only: bool = False) -> Devices:
    """The devices the plan may use: none for --mode cpu (or the CPU device with nothing asked of it)."""
    if rp.mode == "cpu" or (kind == "cpu" and rp.mode == "auto" and rp.gpu_memory_gib is None):
        return Devices((), host_bytes)
    if kind == "cuda" and not plan_only and tensor_parallel_ranks() > 1:
        return _rank_device(rp, host_bytes)
    if rp.gpu_memory_gib is not None:
        sizes = list(rp.gpu_memory_gib)
    elif kind == "cuda":
        sizes = [b / GIB for b in cuda_memory_bytes()]
        if not sizes:
            raise PlacementError("torch sees no CUDA GPU to plan for; give --gpu-memory-gib (e.g. 4) to plan for "
                                 "one, or use --device cpu.")
    else:
        sizes = [host_bytes / GIB]  # the CPU as device: its memory is the host's
    n = rp.num_devices if rp.num_devices is not None else len(sizes)
    if len(sizes) == 1:
        sizes = sizes * n
    if len(sizes) != n:
        raise PlacementError(f"--gpu-memory-gib gives {len(sizes)} sizes for {n} devices; give one size for all "
                             f"of them or one per device.")
    if kind == "cuda" and not plan_only and n > len(cuda_memory_bytes()):
        raise PlacementError(f"{n} GPUs were planned for but torch sees {len(cuda_memory_bytes())}; give fewer "
                             f"--gpu-memory-gib sizes.")
    return Devices.from_gib(n, sizes, host_bytes / GIB, kind=kind)


def tensor_parallel_ranks() -> int:
    """torchrun's world size (1 outside torchrun), read before the process group exists."""
    from pocketmoe.parallel.group import under_torchrun

    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else 1


def _rank_device(rp: RunPlacement, host_bytes: int) -> Devices:
    """Under torchrun on GPUs each rank plans for its own GPU (cuda:LOCAL_RANK, as the process group set it):
    it holds a tensor-parallel share of every layer there. --gpu-memory-gib: one size, or one per local rank."""
    local, seen = int(os.environ.get("LOCAL_RANK", "0")), cuda_memory_bytes()
    if local >= len(seen):
        raise PlacementError(f"rank {os.environ.get('RANK')} has LOCAL_RANK {local} but torch sees {len(seen)} GPU(s); "
                             f"start at most {len(seen)} ranks per node (--nproc-per-node).")
    sizes = rp.gpu_memory_gib
    if sizes is not None and 1 < len(sizes) <= local:
        raise PlacementError(f"--gpu-memory-gib gives {len(sizes)} sizes but this is local rank {local}; give one "
                             "size for every GPU or one per GPU of the node.")
    gib = seen[local] / GIB if sizes is None else sizes[0 if len(sizes) == 1 else local]
    return Devices((DeviceSpec(f"cuda:{local}", int(gib * GIB)),), host_bytes)


def run_plan(spec: Any, tensors: Mapping[str, Any], rp: RunPlacement, options: PlanOptions,
             host_memory_bytes: int | None = None, plan_only: bool = False) -> PlacementPlan:
    """The placement plan of a run with these flags (the one `inspect_gguf --placement-report` prints,
    with plan_only: GPUs this machine lacks may be planned for)."""
    from pocketmoe.hostinfo import host_memory_bytes as host_total

    host = host_memory_bytes if host_memory_bytes is not None else max(host_total() or 0, 1 << 30)
    kind = device_kind(rp.device, plan_only, rp.gpu_memory_gib is not None)
    if kind == "cuda" and not plan_only:
        from pocketmoe.ops.cuda import ARCHITECTURES

        arch = getattr(spec, "architecture", None)
        if arch is not None and arch not in ARCHITECTURES:
            if rp.device == "cuda":
                raise PlacementError(f"the CUDA op backend runs {' and '.join(ARCHITECTURES)}, not {arch}; run "
                                     f"{arch} with --device cpu.")
            kind = "cpu"  # --device auto: the CPU, where every architecture runs
    devices = run_devices(rp, kind, host, plan_only)
    if not devices.gpus:
        return make_plan(spec, tensors, devices, options)
    if kind == "cpu":  # the CPU as device has no CUDA context to reserve
        options = replace(options, cuda_context_gib=0.0)
    mode = None if rp.mode == "auto" else rp.mode
    return make_plan(spec, tensors, devices, options, mode=mode, cache_slots=rp.expert_cache_slots)
