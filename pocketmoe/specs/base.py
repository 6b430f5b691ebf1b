"""What a model file must contain: tensor roles, expected tensors, and the ModelSpec base class."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, is_dataclass
from enum import Enum
from typing import Any, ClassVar

from gguf import GGMLQuantizationType

from pocketmoe.errors import PocketMoEError
from pocketmoe.specs.metadata import (
    KV,
    MetadataReader,
    RopeScaling,
    SpecError,
    UnknownArchitectureError,
    f32,
    plain,
)
from pocketmoe.specs.report import ValidationReport

__all__ = ["KV", "F32", "F16", "BF16", "I32", "FLOAT_TYPES", "MetadataReader", "ModelSpec", "Role",
           "RopeScaling", "SpecError", "TensorSpec", "UnknownArchitectureError", "ValidationReport",
           "f32", "plain"]

F32, F16, BF16, I32 = 0, 1, 30, 26
FLOAT_TYPES: tuple[int, ...] = (F32, F16, BF16)
# What gguf 0.19 can dequantize (SPECS.md section 4); used only until pocketmoe.quant is importable.
_FALLBACK_RUNNABLE = frozenset({0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 16, 17, 18, 19, 20, 21, 22, 23,
                                29, 30, 34, 35, 39, 40})
_LAYER = re.compile(r"^blk\.(\d+)\.")


class Role(str, Enum):
    EMBEDDING = "embedding"
    ATTENTION = "attention"
    NORM = "norm"
    ROUTER = "router"
    SHARED_EXPERT = "shared_expert"
    ROUTED_EXPERT = "routed_expert"
    DENSE_FFN = "dense_ffn"
    HEAD = "head"
    OTHER = "other"


@dataclass(frozen=True)
class TensorSpec:
    """One expected tensor. `shape` is torch order (GGUF ne reversed).

    `float_only` tensors must be F32/F16/BF16; a non-empty `allowed_types` lists the only GGML type
    ids accepted (e.g. I32 for deepseek4's ffn_gate_tid2eid) and overrides `float_only`.
    """

    name: str
    shape: tuple[int, ...]
    role: Role
    layer: int | None
    optional: bool = False
    float_only: bool = False
    allowed_types: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.name or not self.shape or any(int(d) <= 0 for d in self.shape):
            raise SpecError(f"tensor spec {self.name!r} has shape {self.shape}; every dimension must be "
                            f"positive, so the model's hyperparameters are wrong.")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "role", Role(self.role))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def ne(self) -> tuple[int, ...]:
        """The GGUF dimension order."""
        return tuple(reversed(self.shape))


def _type_name(ggml_type: int) -> str:
    try:
        from pocketmoe.quant import type_name
        return type_name(ggml_type)
    except (ImportError, PocketMoEError):
        try:
            return GGMLQuantizationType(ggml_type).name
        except ValueError:
            return f"unknown GGML type {ggml_type}"


def engine_can_run(ggml_type: int) -> bool:
    """True if PocketMoE can dequantize/compute with this GGML type (per `pocketmoe.quant`)."""
    try:
        from pocketmoe.quant import format_of
    except ImportError:
        return ggml_type in _FALLBACK_RUNNABLE
    try:
        return bool(format_of(ggml_type).can_dequantize)
    except PocketMoEError:  # QuantError: an id it does not know
        return False


def type_accepted(spec: TensorSpec, ggml_type: int) -> bool:
    if spec.allowed_types:
        return ggml_type in spec.allowed_types
    if spec.float_only:
        return ggml_type in FLOAT_TYPES
    return engine_can_run(ggml_type)


def layer_of(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def _rounded(v: Any) -> Any:
    if isinstance(v, float):
        return float(f"{v:.7g}")
    if isinstance(v, (list, tuple)):
        return [_rounded(x) for x in v]
    if isinstance(v, dict):
        return {k: _rounded(x) for k, x in v.items()}
    return v


class ModelSpec:
    """One architecture's view of one model: its config and the tensors a file must hold.

    Subclasses set `architecture` and `config_cls` (a frozen dataclass with `from_metadata` and
    `to_metadata`), and implement `_tensors`, `capability_details`.
    """

    architecture: ClassVar[str] = ""
    config_cls: ClassVar[type] = object

    def __init__(self, config: Any) -> None:
        if not isinstance(config, self.config_cls):
            raise SpecError(f"the {self.architecture} spec needs a {self.config_cls.__name__} but got "
                            f"{type(config).__name__}; build the config with {self.config_cls.__name__}.")
        self.config = config

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], n_vocab_hint: int | None = None) -> ModelSpec:
        return cls(cls.config_cls.from_metadata(metadata, n_vocab_hint))  # type: ignore[attr-defined]

    def metadata(self) -> dict[str, KV]:
        return self.config.to_metadata()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    # --- tensors -------------------------------------------------------------------------------
    def _tensors(self, present: frozenset[str] | None) -> list[TensorSpec]:
        raise NotImplementedError

    def tensors(self, present: Iterable[str] | None = None) -> list[TensorSpec]:
        """Every expected tensor; `present` (the file's names) picks between alternative layouts."""
        return self._tensors(None if present is None else frozenset(present))

    def is_ignored(self, name: str) -> bool:
        """Tensors the engine knowingly skips: multi-token-prediction (MTP / nextn) layers."""
        layer = layer_of(name)
        return ".nextn." in name or (layer is not None and layer >= self.config.n_layer)

    def validate(self, bundle: Any) -> ValidationReport:
        """Check `bundle.tensors` (name -> info with `.shape` torch order, `.ggml_type`) against the spec."""
        infos: Mapping[str, Any] = bundle.tensors
        expected = self.tensors(infos.keys())
        names = {t.name for t in expected}
        missing, wrong, bad_type = [], [], []
        for t in expected:
            info = infos.get(t.name)
            if info is None:
                if not t.optional:
                    missing.append(t.name)
                continue
            actual = tuple(int(d) for d in info.shape)
            if actual != t.shape:
                wrong.append((t.name, t.shape, actual))
            if not type_accepted(t, int(info.ggml_type)):
                bad_type.append((t.name, _type_name(int(info.ggml_type))))
        others = [n for n in infos if n not in names]
        ignored = [n for n in others if self.is_ignored(n)]
        unexpected = [n for n in others if not self.is_ignored(n)]
        return ValidationReport.build(self.architecture, missing, unexpected, wrong, bad_type, ignored)

    # --- structure -----------------------------------------------------------------------------
    def moe_layers(self) -> list[int]:
        raise NotImplementedError

    def kv_values_per_token(self) -> int | None:
        """Values one token keeps in every layer's KV cache, where that is one number for all layers
        (None: the architecture's cache is not uniform; placement/reserve.py has its rule)."""
        return None

    def attention_flops_per_token(self, context_length: int) -> int | None:
        """Floating-point operations (a multiply-add is two) of attention over the KV cache, all layers, for one
        decode token whose sequence holds `context_length` positions: the query-key scores and the weighted sum
        of the values, as the engine computes them (None: not modelled for this architecture)."""
        return None

    @property
    def n_experts(self) -> int:
        return int(self.config.n_expert)

    @property
    def n_experts_used(self) -> int:
        return int(self.config.n_expert_used)

    def expert_tensor_names(self, layer: int, present: Iterable[str] | None = None) -> list[str]:
        """Names of the stacked routed-expert tensors [E, out, in] of `layer` ([] for a dense layer).

        Without `present` these are the required ones (gate, up, down); with it, the ones the file has.
        """
        if not 0 <= layer < self.config.n_layer:
            raise SpecError(f"layer {layer} is out of range: the {self.architecture} model has "
                            f"{self.config.n_layer} layers (0..{self.config.n_layer - 1}).")
        have = None if present is None else frozenset(present)
        return [t.name for t in self.tensors(have)
                if t.role is Role.ROUTED_EXPERT and t.layer == layer
                and (t.name in have if have is not None else not t.optional)]

    def n_params(self, present: Iterable[str] | None = None) -> int:
        """Parameter count from shapes (optional tensors count only when `present` includes them)."""
        have = None if present is None else frozenset(present)
        return sum(t.numel for t in self.tensors(have)
                   if (t.name in have if have is not None else not t.optional))

    def describe(self, present: Iterable[str] | None = None) -> dict[str, Any]:
        """A JSON-able summary for `--spec-summary`: hyperparameters plus counts derived from them.

        Counts cover the required tensors, plus the optional ones in `present` when it is given.
        """
        have = None if present is None else frozenset(present)
        specs = [t for t in self.tensors(have) if (t.name in have if have is not None else not t.optional)]
        routed = sum(t.numel for t in specs if t.role is Role.ROUTED_EXPERT)
        total = sum(t.numel for t in specs)
        active = total - routed + (routed * self.n_experts_used) // max(self.n_experts, 1)
        cfg = asdict(self.config) if is_dataclass(self.config) else dict(vars(self.config))
        return {
            "architecture": self.architecture,
            "config": _rounded(cfg),
            "n_layer": self.config.n_layer,
            "moe_layers": self.moe_layers(),
            "n_experts": self.n_experts,
            "n_experts_used": self.n_experts_used,
            "n_tensors": len(specs),
            "n_params": total,
            "n_params_routed_experts": routed,
            "n_params_active_per_token": active,
        }

    def capability_details(self) -> dict[str, Any]:
        return {}

    def capability(self) -> dict[str, Any]:
        """What PocketMoE can do with a file of this architecture and config."""
        return {"architecture": self.architecture, "inspect": True, "validate": True,
                **self.capability_details()}


def shared_expert_specs(prefix: str, layer: int, hidden: int, width: int) -> list[TensorSpec]:
    """ffn_{gate,up,down}_shexp of one MoE layer: the same three tensors in every architecture."""
    S = Role.SHARED_EXPERT
    return [TensorSpec(prefix + "ffn_gate_shexp.weight", (width, hidden), S, layer),
            TensorSpec(prefix + "ffn_up_shexp.weight", (width, hidden), S, layer),
            TensorSpec(prefix + "ffn_down_shexp.weight", (hidden, width), S, layer)]


def check_positive(owner: str, **values: int) -> None:
    bad = {k: v for k, v in values.items() if not isinstance(v, int) or isinstance(v, bool) or v <= 0}
    if bad:
        items = ", ".join(f"{k}={v!r}" for k, v in bad.items())
        raise SpecError(f"{owner}: {items} must be positive integers; fix the config or the file's metadata.")


def normalize_floats(obj: Any, *names: str) -> None:
    """Round float fields of a frozen dataclass to float32, the precision GGUF stores them in."""
    for n in names:
        object.__setattr__(obj, n, f32(getattr(obj, n)))

