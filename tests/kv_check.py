"""KV cache dtypes for the attention tests, and how close two caches written by different backends must be."""

from __future__ import annotations

import torch

# Each --kv-dtype's torch dtype and how far apart two caches may be whose float32 rows differ by summation order:
# 1e-6 for float32; for the half types at most one rounding step (a value on the other side of a tie).
KV_DTYPES = {"f32": (torch.float32, 1e-6), "f16": (torch.float16, 2.0 ** -10), "bf16": (torch.bfloat16, 2.0 ** -7)}


def close_caches(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype
    step = next(tol for dtype, tol in KV_DTYPES.values() if dtype == a.dtype)
    torch.testing.assert_close(a.float(), b.float(), rtol=step, atol=1e-6)
