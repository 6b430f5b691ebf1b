"""Real bytes of a model's tensors, grouped by role and layer: the input of every placement decision."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from pocketmoe.quant import format_of

ROUTED = "routed_expert"
EMBEDDING = "embedding"
OTHER = "other"
_BLOCK = re.compile(r"^blk\.(\d+)\.")


class TensorLike(Protocol):
    """What placement needs of a tensor: `pocketmoe.gguf.TensorInfo` satisfies it."""

    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor the file would hold: name, type, torch-order shape and its exact byte size."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    nbytes: int

    def __post_init__(self) -> None:
        if self.nbytes < 0 or any(d < 0 for d in self.shape):
            raise ValueError(f"{self.name}: negative shape {self.shape} or size {self.nbytes}")


@dataclass(frozen=True)
class TensorBytes:
    name: str
    role: str
    layer: int | None
    nbytes: int
    rows: int  # shape[0]: experts of a stacked routed tensor, vocab rows of an embedding


@dataclass(frozen=True)
class ModelBytes:
    """Tensor bytes of one model with the MoE facts placement needs (k, E, bytes of one expert)."""

    tensors: tuple[TensorBytes, ...]
    n_experts: int
    n_experts_used: int
    n_layers: int
    expert_bytes: Mapping[int, int] = field(default_factory=dict)  # MoE layer -> gate+up+down of one expert

    def __post_init__(self) -> None:
        if self.n_experts < 0 or not 0 <= self.n_experts_used <= max(self.n_experts, 0):
            raise ValueError(f"top-k {self.n_experts_used} of {self.n_experts} experts is not valid")
        object.__setattr__(self, "expert_bytes", MappingProxyType(dict(self.expert_bytes)))

    @property
    def total(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def routed(self) -> int:
        return sum(t.nbytes for t in self.tensors if t.role == ROUTED)

    @property
    def non_expert(self) -> int:
        return self.total - self.routed

    @property
    def moe_layers(self) -> list[int]:
        return sorted(self.expert_bytes)

    @property
    def max_expert_bytes(self) -> int:
        return max(self.expert_bytes.values(), default=0)

    def by_role(self, select: Callable[[TensorBytes], bool] = lambda t: True) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors:
            if select(t):
                out[t.role] = out.get(t.role, 0) + t.nbytes
        return out

    def layer_bytes(self, layer: int | None, include_routed: bool) -> dict[str, int]:
        return self.by_role(lambda t: t.layer == layer and (include_routed or t.role != ROUTED))

    def routed_bytes_per_token(self) -> int:
        """B_tok: sum over MoE layers of k * bytes(one expert) (ANCHORS.md)."""
        return sum(self.n_experts_used * b for b in self.expert_bytes.values())

    def non_expert_read_per_token(self) -> int:
        """Non-expert bytes one decode token reads: every tensor fully, embeddings one row."""
        return sum(_row_bytes(t) if t.role == EMBEDDING else t.nbytes for t in self.tensors if t.role != ROUTED)


def _row_bytes(t: TensorBytes) -> int:
    return t.nbytes // t.rows if t.rows else t.nbytes


def _role_name(role: Any) -> str:
    return str(getattr(role, "value", role))


def _attr(obj: Any, name: str) -> int:
    v = getattr(obj, name)
    return int(v() if callable(v) else v)


def model_bytes(spec: Any, tensors: Mapping[str, TensorLike]) -> ModelBytes:
    """Roles and layers from the spec, bytes from the file: a tensor the spec does not know is "other"."""
    known = {t.name: t for t in spec.tensors(present=set(tensors))}
    n_experts = _attr(spec, "n_experts")
    out: list[TensorBytes] = []
    per_expert: dict[int, int] = {}
    for name, info in tensors.items():
        ts = known.get(name)
        if ts is not None:
            role, layer = _role_name(ts.role), ts.layer
        else:
            m = _BLOCK.match(name)
            role, layer = OTHER, (int(m.group(1)) if m else None)
        shape = tuple(int(d) for d in info.shape)
        rows = shape[0] if shape else 1
        out.append(TensorBytes(name, role, layer, int(info.nbytes), rows))
        if role == ROUTED and layer is not None:
            experts = rows if len(shape) == 3 else n_experts
            per_expert[layer] = per_expert.get(layer, 0) + int(info.nbytes) // max(experts, 1)
    layers = {t.layer for t in out if t.layer is not None}
    n_layers = max(int(getattr(spec.config, "n_layer", 0)), max(layers, default=-1) + 1)
    return ModelBytes(tuple(out), n_experts, _attr(spec, "n_experts_used"), n_layers, per_expert)


def spec_tensor_infos(spec: Any, types: Callable[[Any], int] | Mapping[str, int],
                      present: Iterable[str] | None = None) -> dict[str, PlannedTensor]:
    """The tensors a file of this spec would hold with the given type per tensor, sized exactly.

    `types` maps a TensorSpec to a GGML type id (or is a name -> id mapping). Lets a plan be made for
    full-size shapes without writing the file. Optional tensors are included only when `present`
    names them.
    """
    wanted = None if present is None else set(present)
    out: dict[str, PlannedTensor] = {}
    for ts in spec.tensors(present=wanted):
        if ts.optional and (wanted is None or ts.name not in wanted):
            continue
        t = types(ts) if callable(types) else types[ts.name]
        shape = tuple(int(d) for d in ts.shape)
        out[ts.name] = PlannedTensor(ts.name, int(t), shape, format_of(int(t)).nbytes(shape))
    return out
