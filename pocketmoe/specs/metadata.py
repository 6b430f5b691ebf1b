"""Reading `{arch}.*` GGUF metadata with llama.cpp's defaults, and typed KV pairs for writers."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGUFValueType

from pocketmoe.errors import PocketMoEError

_FIX = "re-convert the model with llama.cpp's convert_hf_to_gguf.py or fix the key with gguf_set_metadata"


class SpecError(PocketMoEError):
    """The file's metadata or tensors do not describe a model this architecture spec accepts."""


class UnknownArchitectureError(SpecError):
    """`general.architecture` names an architecture PocketMoE has no spec for."""


def f32(x: float) -> float:
    """The nearest float32 value, as a Python float (GGUF stores every float hyperparameter as f32)."""
    return float(np.float32(x))


@dataclass(frozen=True)
class KV:
    """One GGUF metadata value with the exact value type a writer must emit (item_type for arrays)."""

    value: Any
    type: GGUFValueType
    item_type: GGUFValueType | None = None

    def __post_init__(self) -> None:
        if (self.type == GGUFValueType.ARRAY) != (self.item_type is not None):
            raise ValueError(f"KV {self.value!r}: item_type is required for arrays and only for arrays")

    @staticmethod
    def u32(v: int) -> KV:
        return KV(int(v), GGUFValueType.UINT32)

    @staticmethod
    def f32(v: float) -> KV:
        return KV(f32(v), GGUFValueType.FLOAT32)

    @staticmethod
    def string(v: str) -> KV:
        return KV(v, GGUFValueType.STRING)

    @staticmethod
    def boolean(v: bool) -> KV:
        return KV(bool(v), GGUFValueType.BOOL)

    @staticmethod
    def i32_array(v: tuple[int, ...] | list[int]) -> KV:
        return KV([int(x) for x in v], GGUFValueType.ARRAY, GGUFValueType.INT32)

    @staticmethod
    def f32_array(v: tuple[float, ...] | list[float]) -> KV:
        return KV([f32(x) for x in v], GGUFValueType.ARRAY, GGUFValueType.FLOAT32)


def plain(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The metadata with every `KV` unwrapped to its Python value (raw values pass through)."""
    return {k: (v.value if isinstance(v, KV) else v) for k, v in metadata.items()}


class MetadataReader:
    """Typed access to `{arch}.<key>` values; every problem is a `SpecError` naming the full key.

    A getter without a default treats the key as required. `full=True` takes the key as written
    (for `tokenizer.*` / `general.*`) instead of prefixing the architecture.
    """

    def __init__(self, metadata: Mapping[str, Any], arch: str) -> None:
        self.meta = plain(metadata)
        self.arch = arch

    def key(self, suffix: str, full: bool = False) -> str:
        return suffix if full else f"{self.arch}.{suffix}"

    def has(self, suffix: str, full: bool = False) -> bool:
        return self.key(suffix, full) in self.meta

    def _get(self, k: str, kind: str, default: Any) -> Any:
        if k in self.meta:
            return self.meta[k]
        if default is None:
            raise SpecError(f"GGUF metadata key {k!r} ({kind}) is required for architecture "
                            f"{self.arch!r} but is missing; {_FIX}.")
        return default

    @staticmethod
    def _bad(k: str, kind: str, value: Any) -> SpecError:
        return SpecError(f"GGUF metadata key {k!r} should be {kind} but is {type(value).__name__} "
                         f"{value!r}; {_FIX}.")

    def get_int(self, suffix: str, default: int | None = None, *, full: bool = False) -> int:
        k = self.key(suffix, full)
        v = self._get(k, "an integer", default)
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise self._bad(k, "an integer", v)
        if v < 0:
            raise SpecError(f"GGUF metadata key {k!r} is {v} but must be >= 0; {_FIX}.")
        return int(v)

    def get_opt_int(self, suffix: str, *, full: bool = False) -> int | None:
        return self.get_int(suffix, full=full) if self.has(suffix, full) else None

    def get_float(self, suffix: str, default: float | None = None) -> float:
        k = self.key(suffix)
        v = self._get(k, "a number", default)
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise self._bad(k, "a number", v)
        if not math.isfinite(float(v)):
            raise SpecError(f"GGUF metadata key {k!r} is {v} but must be finite; {_FIX}.")
        return f32(v)

    def get_bool(self, suffix: str, default: bool | None = None) -> bool:
        k = self.key(suffix)
        v = self._get(k, "a bool", default)
        if not isinstance(v, (bool, np.bool_)):
            raise self._bad(k, "a bool", v)
        return bool(v)

    def get_str(self, suffix: str, default: str | None = None) -> str:
        k = self.key(suffix)
        v = self._get(k, "a string", default)
        if not isinstance(v, str):
            raise self._bad(k, "a string", v)
        return v

    def get_ints(self, suffix: str, default: tuple[int, ...] | None = None) -> tuple[int, ...]:
        k = self.key(suffix)
        v = self._get(k, "an integer array", default)
        if not isinstance(v, (list, tuple)) or any(
                isinstance(x, bool) or not isinstance(x, (int, np.integer)) for x in v):
            raise self._bad(k, "an integer array", v)
        return tuple(int(x) for x in v)

    def get_floats(self, suffix: str, default: tuple[float, ...] | None = None) -> tuple[float, ...]:
        k = self.key(suffix)
        v = self._get(k, "a float array", default)
        if not isinstance(v, (list, tuple)) or any(
                isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)) for x in v):
            raise self._bad(k, "a float array", v)
        return tuple(f32(x) for x in v)

    def vocab_size(self, hint: int | None = None) -> int:
        """`{arch}.vocab_size`, else the tokenizer's token count, else `hint` (token_embd rows)."""
        if self.has("vocab_size"):
            return self.get_int("vocab_size")
        tokens = self.meta.get("tokenizer.ggml.tokens")
        if isinstance(tokens, (list, tuple)) and tokens:
            return len(tokens)
        if hint is not None:
            return int(hint)
        raise SpecError(f"cannot tell the vocabulary size: none of {self.key('vocab_size')!r}, "
                        f"'tokenizer.ggml.tokens' or a token_embd.weight tensor is present; {_FIX}.")

    def token_ids(self) -> tuple[int | None, int | None]:
        return (self.get_opt_int("tokenizer.ggml.bos_token_id", full=True),
                self.get_opt_int("tokenizer.ggml.eos_token_id", full=True))


def token_kvs(bos: int | None, eos: int | None) -> dict[str, KV]:
    out: dict[str, KV] = {}
    if bos is not None:
        out["tokenizer.ggml.bos_token_id"] = KV.u32(bos)
    if eos is not None:
        out["tokenizer.ggml.eos_token_id"] = KV.u32(eos)
    return out


ROPE_SCALING_TYPES = ("none", "linear", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """`rope.scaling.*` as llama.cpp reads it. `orig_ctx` 0 means "the model's context length"."""

    kind: str = "none"
    factor: float = 1.0
    orig_ctx: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALING_TYPES:
            raise SpecError(f"rope scaling type {self.kind!r} is not supported; expected one of "
                            f"{', '.join(ROPE_SCALING_TYPES)}; {_FIX}.")
        if self.factor <= 0 or self.orig_ctx < 0:
            raise SpecError(f"rope scaling factor {self.factor} / original context {self.orig_ctx} must be "
                            f"positive; {_FIX}.")
        for name in ("factor", "beta_fast", "beta_slow"):
            object.__setattr__(self, name, f32(getattr(self, name)))

    @staticmethod
    def read(r: MetadataReader) -> RopeScaling:
        """llama.cpp defaults: no type = none, factor 0 = 1, betas 32 / 1."""
        return RopeScaling(kind=r.get_str("rope.scaling.type", "none"),
                           factor=r.get_float("rope.scaling.factor", 1.0) or 1.0,
                           orig_ctx=r.get_int("rope.scaling.original_context_length", 0),
                           beta_fast=r.get_float("rope.scaling.yarn_beta_fast", 32.0),
                           beta_slow=r.get_float("rope.scaling.yarn_beta_slow", 1.0))

    def kvs(self, arch: str) -> dict[str, KV]:
        p = f"{arch}.rope.scaling."
        return {p + "type": KV.string(self.kind), p + "factor": KV.f32(self.factor),
                p + "original_context_length": KV.u32(self.orig_ctx),
                p + "yarn_beta_fast": KV.f32(self.beta_fast), p + "yarn_beta_slow": KV.f32(self.beta_slow)}


# deepseek2 stores rope.scaling.yarn_log_multiplier = 0.1 * mscale_all_dim; llama.cpp divides by 0.1
# (TAG_DEEPSEEK2_YARN_LOG_MUL_FIX).
def decode_log_mul(value: float) -> float:
    """mscale_all_dim from `rope.scaling.yarn_log_multiplier` (= 0.1 * mscale_all_dim), in f32 like llama.cpp."""
    return float(np.float32(value) / np.float32(0.1))


def encode_log_mul(mscale_all_dim: float) -> float:
    """The f32 yarn_log_multiplier whose decoding is closest to (usually exactly) `mscale_all_dim`."""
    x = np.float32(0.1 * mscale_all_dim)
    cands = [x]
    for direction in (np.float32(np.inf), np.float32(-np.inf)):
        y = x
        for _ in range(3):
            y = np.nextafter(y, direction, dtype=np.float32)
            cands.append(y)
    return float(min(cands, key=lambda c: abs(decode_log_mul(float(c)) - mscale_all_dim)))


def canonical_mscale(mscale_all_dim: float) -> float:
    """The nearest value a GGUF file can carry (f32 log multiplier / 0.1), so configs round-trip exactly."""
    return decode_log_mul(encode_log_mul(f32(mscale_all_dim)))
