"""PocketMoE: run huge Mixture-of-Experts GGUF models on the hardware people own."""

from typing import TYPE_CHECKING

from pocketmoe.errors import PocketMoEError

__version__ = "0.1.0"
__all__ = ["LLM", "Grammar", "PocketMoEError", "ReasoningBudget", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from pocketmoe.engine.budget import ReasoningBudget
    from pocketmoe.engine.llm import LLM
    from pocketmoe.engine.sampler import SamplingParams
    from pocketmoe.engine.structured import Grammar


def __getattr__(name: str):
    # The engine (and torch) load only when the API is used, so `inspect_gguf` starts fast.
    if name == "LLM":
        from pocketmoe.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pocketmoe.engine.sampler import SamplingParams

        return SamplingParams
    if name == "Grammar":
        from pocketmoe.engine.structured import Grammar

        return Grammar
    if name == "ReasoningBudget":
        from pocketmoe.engine.budget import ReasoningBudget

        return ReasoningBudget
    raise AttributeError(f"module 'pocketmoe' has no attribute {name!r}")
