"""PocketMoE: run huge Mixture-of-Experts GGUF models on the hardware people own."""

__version__ = "0.1.0"

from pocketmoe.errors import PocketMoEError

__all__ = ["PocketMoEError", "__version__"]
