"""Engine: the paged KV cache, the step context, the model runner (build from the plan, run steps)."""

from pocketmoe.engine.kv_cache import ContextLengthError, KVPoolFullError, PagedKVCache
from pocketmoe.engine.runner import ModelRunner, RunnerConfig
from pocketmoe.engine.step import SeqChunk, Step, StepContext

__all__ = ["ContextLengthError", "KVPoolFullError", "ModelRunner", "PagedKVCache", "RunnerConfig", "SeqChunk",
           "Step", "StepContext"]
