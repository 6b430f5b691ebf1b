"""GGUF files and sharded bundles: checked parsing and zero-copy tensor views."""

from pocketmoe.gguf.bundle import SHARD_PATTERN, GGUFBundle, find_shards, open_bundle
from pocketmoe.gguf.reader import GGUFFile, TensorInfo, open_gguf, type_name, type_sizes
from pocketmoe.gguf.values import GGUFError

__all__ = [
    "GGUFError", "TensorInfo", "GGUFFile", "GGUFBundle", "open_bundle", "open_gguf", "find_shards",
    "SHARD_PATTERN", "type_name", "type_sizes",
]
