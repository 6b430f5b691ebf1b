"""PlacementPlan: where every tensor, the KV cache and the hot-expert cache live, decided before the build."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from pocketmoe.errors import PocketMoEError
from pocketmoe.kv_dtypes import DEFAULT_KV_DTYPE, KV_DTYPE_BYTES
from pocketmoe.placement.estimate import Bandwidths, ComputeRates, DecodeEstimates

GIB = 2**30
MODES = ("all-device", "heterogeneous", "cpu")


class PlacementError(PocketMoEError):
    """The model cannot be placed on the given devices and host memory."""


def torch_device(name: str) -> Any:
    """The torch device of a plan's device name: cuda:i, or the host for cpu:i (the CPU as device)."""
    import torch

    return torch.device("cpu") if name.startswith("cpu") else torch.device(name)


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bytes: int

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise PlacementError(f"{self.name} has {self.memory_bytes} bytes of memory; give a positive "
                                 f"--gpu-memory-gib.")


@dataclass(frozen=True)
class Devices:
    """The GPUs (none = CPU only) and the host memory the plan may use."""

    gpus: tuple[DeviceSpec, ...]
    host_memory_bytes: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpus", tuple(self.gpus))
        if self.host_memory_bytes <= 0:
            raise PlacementError(f"host memory is {self.host_memory_bytes} bytes; give a positive "
                                 f"--host-memory-gib.")

    @staticmethod
    def from_gib(num_gpus: int, gpu_memory_gib: float | Sequence[float], host_memory_gib: float,
                 kind: str = "cuda") -> Devices:
        """`gpu_memory_gib`: one size for every GPU, or one per GPU; `kind` names them (cpu: the CPU as device)."""
        sizes = [gpu_memory_gib] * num_gpus if isinstance(gpu_memory_gib, (int, float)) else list(gpu_memory_gib)
        if num_gpus < 0 or len(sizes) != num_gpus:
            raise PlacementError(f"{len(sizes)} GPU memory sizes were given for {num_gpus} GPUs; give one "
                                 f"size for all of them or one per GPU.")
        return Devices(tuple(DeviceSpec(f"{kind}:{i}", int(g * GIB)) for i, g in enumerate(sizes)),
                       int(host_memory_gib * GIB))


@dataclass(frozen=True)
class PlanOptions:
    context_length: int = 4096
    batch: int = 1
    kv_dtype: str = DEFAULT_KV_DTYPE
    prefill_chunk: int = 512
    cuda_context_gib: float = 0.4  # CUDA context + allocator slack per GPU
    host_reserve_gib: float = 1.0  # host memory kept for the OS and the Python process
    bandwidths: Bandwidths = field(default_factory=Bandwidths)
    compute: ComputeRates = field(default_factory=ComputeRates)

    def __post_init__(self) -> None:
        for name in ("context_length", "batch", "prefill_chunk"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise PlacementError(f"{name.replace('_', ' ')} is {v!r}; it must be a positive integer.")
        if self.kv_dtype not in KV_DTYPE_BYTES:
            raise PlacementError(f"KV cache dtype {self.kv_dtype!r} is not supported; choose one of "
                                 f"{', '.join(KV_DTYPE_BYTES)}.")
        if self.cuda_context_gib < 0 or self.host_reserve_gib < 0:
            raise PlacementError(f"reserves must be >= 0 GiB (CUDA context {self.cuda_context_gib}, host "
                                 f"{self.host_reserve_gib}).")


@dataclass(frozen=True)
class DeviceAssignment:
    """What one GPU holds: weights by role, its layers' KV cache, workspace, and hot-expert cache slots."""

    name: str
    memory_bytes: int
    layers: tuple[int, ...]
    weights: Mapping[str, int]
    kv_bytes: int
    workspace_bytes: int
    cache_slots: int = 0
    cache_bytes: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "weights", MappingProxyType(dict(self.weights)))
        if self.used > self.memory_bytes:
            raise ValueError(f"{self.name}: {self.used} bytes planned on {self.memory_bytes} bytes of memory")

    @property
    def used(self) -> int:
        return sum(self.weights.values()) + self.kv_bytes + self.workspace_bytes + self.cache_bytes

    @property
    def free(self) -> int:
        return self.memory_bytes - self.used

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "memory_bytes": self.memory_bytes, "layers": list(self.layers),
                "weights_by_role": dict(self.weights), "kv_bytes": self.kv_bytes,
                "workspace_bytes": self.workspace_bytes, "cache_slots": self.cache_slots,
                "cache_bytes": self.cache_bytes, "used_bytes": self.used, "free_bytes": self.free}


@dataclass(frozen=True)
class PlacementPlan:
    mode: str
    devices: tuple[DeviceAssignment, ...]
    host_memory_bytes: int
    host_bytes: Mapping[str, int]  # role (or "kv_cache" / "workspace") -> bytes kept in host memory
    layer_device: Mapping[int, int]  # layer -> index into devices (empty in cpu mode)
    resident: Mapping[int, frozenset[int]]  # MoE layer -> expert ids kept on device for the whole run
    cache_slots: int  # hot-expert cache slots over all devices (heterogeneous mode)
    slots_per_layer: Mapping[int, int]
    expert_slot_bytes: int  # bytes of one slot: max over layers of gate+up+down of one expert
    kv_reserve_bytes: int
    workspace_bytes: int
    options: PlanOptions
    estimates: DecodeEstimates
    assumptions: tuple[str, ...]
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"placement mode {self.mode!r} is not one of {MODES}")
        if (self.mode == "cpu") != (not self.devices):
            raise ValueError(f"mode {self.mode} with {len(self.devices)} devices")
        if self.cache_slots < 0 or self.cache_slots != sum(self.slots_per_layer.values()):
            raise ValueError(f"cache slots {self.cache_slots} != sum of slots per layer")
        for name in ("host_bytes", "layer_device", "resident", "slots_per_layer"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
        object.__setattr__(self, "devices", tuple(self.devices))

    @property
    def per_device_bytes(self) -> dict[str, dict[str, int]]:
        """Device name -> role -> bytes, with the KV cache, workspace and expert cache as extra roles."""
        return {d.name: {**d.weights, "kv_cache": d.kv_bytes, "workspace": d.workspace_bytes,
                         "expert_cache": d.cache_bytes} for d in self.devices}

    @property
    def host_total(self) -> int:
        return sum(self.host_bytes.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "devices": [d.to_json() for d in self.devices],
            "per_device_bytes": self.per_device_bytes,
            "host_memory_bytes": self.host_memory_bytes,
            "host_bytes": dict(self.host_bytes),
            "layer_device": {str(k): v for k, v in self.layer_device.items()},
            "resident": {str(k): sorted(v) for k, v in self.resident.items()},
            "cache_slots": self.cache_slots,
            "slots_per_layer": {str(k): v for k, v in self.slots_per_layer.items()},
            "expert_slot_bytes": self.expert_slot_bytes,
            "kv_reserve_bytes": self.kv_reserve_bytes,
            "workspace_bytes": self.workspace_bytes,
            "options": {"context_length": self.options.context_length, "batch": self.options.batch,
                        "kv_dtype": self.options.kv_dtype, "prefill_chunk": self.options.prefill_chunk,
                        "cuda_context_gib": self.options.cuda_context_gib,
                        "host_reserve_gib": self.options.host_reserve_gib},
            "estimates": self.estimates.to_json(),
            "assumptions": list(self.assumptions),
            "notes": list(self.notes),
        }
