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


# float32 bit patterns where rounding to the half types is delicate (1.0 plus: float16 keeps 10 mantissa bits of
# 23, bfloat16 7): exact ties both ways to even, their neighbours, float16 subnormals and its smallest values,
# float32 subnormals, the largest float16 and the values around its overflow, float32's largest, infinities.
_ONE = 0x3F800000
ROUNDING_BITS = [_ONE + (1 << 12), _ONE + (3 << 12), _ONE + (1 << 15), _ONE + (3 << 15), _ONE + (1 << 12) + 1,
                 _ONE + (1 << 15) - 1, 0x33000000, 0x33800001, 0x38800000, 0x387FC000, 0x00000001, 0x80000001,
                 0x477FF000, 0x477FEFFF, 0x47800000, 0x7F7FFFFF, 0x7F800000, 0xFF800000]


def rounding_values() -> torch.Tensor:
    """ROUNDING_BITS as float32, and their negatives."""
    x = torch.tensor(ROUNDING_BITS, dtype=torch.int64).to(torch.int32).view(torch.float32)
    return torch.cat([x, -x])
