"""Engine: latent KV cache and the model runner (build from a bundle, chunked prefill, decode)."""

from pocketmoe.engine.kv_cache import ContextLengthError, LatentKVCache
from pocketmoe.engine.runner import ModelRunner, RunnerConfig

__all__ = ["ContextLengthError", "LatentKVCache", "ModelRunner", "RunnerConfig"]
