"""Model math per architecture; `MODELS[arch](bundle, config, ops, make_linear, make_experts)` builds one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pocketmoe.errors import PocketMoEError
from pocketmoe.models import deepseek2, deepseek4, minimax_m2

MODELS: dict[str, Callable[..., Any]] = {"deepseek2": deepseek2.build, "minimax-m2": minimax_m2.build,
                                         "deepseek4": deepseek4.build}


def model_builder(architecture: str) -> Callable[..., Any]:
    try:
        return MODELS[architecture]
    except KeyError:
        raise PocketMoEError(
            f"architecture {architecture!r} has no forward pass yet (supported: {', '.join(sorted(MODELS))})."
        ) from None
