"""Benchmark parts: the timing loop, each engine's side, and the physical decode bound."""

from pocketmoe.benchmark.bounds import DecodeBytes, decode_bound, decode_bytes_per_token
from pocketmoe.benchmark.timing import Measured, Run, matching_prefix, measure, prompt_ids

__all__ = ["DecodeBytes", "Measured", "Run", "decode_bound", "decode_bytes_per_token", "matching_prefix",
           "measure", "prompt_ids"]
