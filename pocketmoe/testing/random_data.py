"""Seeded random tensor contents, generated in chunks: valid quant blocks, float weights, expert ids."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator

import numpy as np

from pocketmoe.quant.quantize import random_blocks
from pocketmoe.testing.quant_mix import tensor_nbytes
from pocketmoe.testing.writer import TensorPlan

F32, F16, BF16, I32 = 0, 1, 30, 26
CHUNK_BYTES = 1 << 24
WEIGHT_STD = 0.02


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    """A generator keyed by (seed, tensor name), so shard count and tensor order do not change contents."""
    digest = hashlib.sha256(name.encode()).digest()
    return np.random.default_rng([seed, int.from_bytes(digest[:8], "little")])


def float_distribution(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of a float tensor: norms near 1, routers with unit-std logits, weights N(0, 0.02)."""
    if name.endswith("_norm.weight"):
        return 1.0, 0.1
    if "ffn_gate_inp" in name:
        return 0.0, 1.0 / math.sqrt(shape[-1])
    return 0.0, WEIGHT_STD


def to_float_bytes(values: np.ndarray, ggml_type: int) -> np.ndarray:
    """float32 values -> the raw F32 / F16 / BF16 (round to nearest even) bytes."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if ggml_type == F32:
        return values.view(np.uint8)
    if ggml_type == F16:
        return values.astype(np.float16).view(np.uint8)
    if ggml_type == BF16:
        u = values.view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16).view(np.uint8)
    raise ValueError(f"GGML type {ggml_type} is not a float type")


def _expert_ids(rng: np.random.Generator, rows: int, k: int, n_expert: int) -> np.ndarray:
    """[rows, k] int32 of k distinct expert ids per row (hash routing tables)."""
    return np.argpartition(rng.random((rows, n_expert)), k - 1, axis=1)[:, :k].astype(np.int32)


def tensor_chunks(plan: TensorPlan, seed: int, n_expert: int = 0) -> Iterator[np.ndarray]:
    """The tensor's raw bytes in C order, in chunks of about CHUNK_BYTES."""
    rng = tensor_rng(seed, plan.name)
    shape = plan.shape
    n = shape[-1]
    rows = math.prod(shape[:-1])
    if plan.ggml_type == I32:
        if n_expert < n:
            raise ValueError(f"{plan.name}: need n_expert >= {n} distinct ids per row, got {n_expert}")
        step = max(1, CHUNK_BYTES // (8 * n_expert))
        for r in range(0, rows, step):
            yield _expert_ids(rng, min(step, rows - r), n, n_expert)
        return
    step = max(1, CHUNK_BYTES // max(1, tensor_nbytes(plan.ggml_type, (n,))))
    mean, std = float_distribution(plan.name, shape)
    for r in range(0, rows, step):
        k = min(step, rows - r)
        if plan.ggml_type in (F32, F16, BF16):
            values = rng.standard_normal((k, n), dtype=np.float32)
            values *= np.float32(std)
            values += np.float32(mean)
            yield to_float_bytes(values, plan.ggml_type)
        else:
            yield random_blocks(plan.ggml_type, (k, n), rng)
