"""Test fixtures: real-convention GGUF files for each architecture (random or from float weights)."""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "PRESETS": "pocketmoe.testing.presets",
    "preset_config": "pocketmoe.testing.presets",
    "plan_fixture": "pocketmoe.testing.synth",
    "write_fixture": "pocketmoe.testing.synth",
    "write_from_state_dict": "pocketmoe.testing.state_dict",
    "hf_deepseek2_config": "pocketmoe.testing.hf_map",
    "hf_deepseek2_to_gguf_state_dict": "pocketmoe.testing.hf_map",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:  # lazy, so `pocketmoe.testing.vocab` users do not import torch
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pocketmoe.testing' has no attribute {name!r}")
