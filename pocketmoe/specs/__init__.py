"""Model specs keyed by `general.architecture` (never the file name): config, expected tensors, checks."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from pocketmoe.specs.base import (
    KV,
    ModelSpec,
    Role,
    SpecError,
    TensorSpec,
    UnknownArchitectureError,
    ValidationReport,
    plain,
)
from pocketmoe.specs.deepseek2 import DeepSeek2Config, DeepSeek2Spec
from pocketmoe.specs.deepseek4 import DeepSeek4Config, DeepSeek4Spec
from pocketmoe.specs.metadata import RopeScaling
from pocketmoe.specs.minimax_m2 import MiniMaxM2Config, MiniMaxM2Spec

__all__ = ["KV", "SUPPORTED_ARCHITECTURES", "DeepSeek2Config", "DeepSeek2Spec", "DeepSeek4Config",
           "DeepSeek4Spec", "MiniMaxM2Config", "MiniMaxM2Spec", "ModelSpec", "Role", "RopeScaling",
           "SpecError", "TensorSpec", "UnknownArchitectureError", "ValidationReport", "metadata_from_config",
           "plain", "register", "spec_class", "spec_from_bundle", "spec_from_metadata"]

S = TypeVar("S", bound=type[ModelSpec])
_REGISTRY: dict[str, type[ModelSpec]] = {}
_BLOCK = re.compile(r"blk\.(\d+)\.")


def register(arch: str) -> Callable[[S], S]:
    """Class decorator: make a ModelSpec subclass the spec for files whose architecture is `arch`."""
    def deco(cls: S) -> S:
        if arch in _REGISTRY and _REGISTRY[arch] is not cls:
            raise SpecError(f"architecture {arch!r} is already registered to {_REGISTRY[arch].__name__}; "
                            f"each architecture has exactly one spec.")
        cls.architecture = arch
        _REGISTRY[arch] = cls
        return cls
    return deco


register("deepseek2")(DeepSeek2Spec)
register("minimax-m2")(MiniMaxM2Spec)
register("deepseek4")(DeepSeek4Spec)

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_REGISTRY)


def spec_class(arch: str) -> type[ModelSpec]:
    try:
        return _REGISTRY[arch]
    except KeyError:
        raise UnknownArchitectureError(
            f"architecture {arch!r} (general.architecture) is not supported; PocketMoE supports "
            f"{', '.join(_REGISTRY)}, so use a GGUF of one of those.") from None


def spec_from_metadata(metadata: Mapping[str, Any], n_vocab_hint: int | None = None) -> ModelSpec:
    """The spec for a file's metadata (raw values or `KV`s). `n_vocab_hint`: token_embd rows, used
    only when neither `{arch}.vocab_size` nor `tokenizer.ggml.tokens` is present."""
    arch = plain(metadata).get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise UnknownArchitectureError(
            f"the GGUF metadata has no 'general.architecture' string (got {arch!r}); PocketMoE supports "
            f"{', '.join(_REGISTRY)}, so re-convert the model with llama.cpp.")
    return spec_class(arch).from_metadata(metadata, n_vocab_hint)


def spec_from_bundle(bundle: Any) -> ModelSpec:
    """The spec for an open bundle (`.metadata`, `.tensors` with torch-order `.shape`)."""
    embd = bundle.tensors.get("token_embd.weight")
    hint = int(embd.shape[0]) if embd is not None and len(embd.shape) == 2 else None
    spec = spec_from_metadata(bundle.metadata, hint)
    # Before anything builds per-layer lists: a damaged block_count would otherwise ask for millions.
    blocks = {int(m.group(1)) for m in map(_BLOCK.match, bundle.tensors) if m}
    held = max(blocks) + 1 if blocks else 0
    if spec.config.n_layer > held:
        raise SpecError(f"{spec.architecture}.block_count is {spec.config.n_layer} but the file holds tensors for "
                        f"{held} blocks (blk.0..blk.{held - 1}); the file is damaged or incomplete.")
    return spec


def metadata_from_config(arch: str, config: Any) -> dict[str, KV]:
    """The GGUF KV pairs (keys as llama.cpp writes them) a writer should emit for `config`.

    Each value is a `KV(value, GGUFValueType, item_type)`. `general.architecture` is included; a
    `gguf.GGUFWriter` writes that key itself, so skip it there.
    """
    cls = spec_class(arch)
    if not isinstance(config, cls.config_cls):
        raise SpecError(f"metadata_from_config({arch!r}) needs a {cls.config_cls.__name__} but got "
                        f"{type(config).__name__}; pass the config of that architecture.")
    return config.to_metadata()
