"""Field readers over uint8 blocks [n, type_size]; little-endian, any device, no numpy."""

from __future__ import annotations

import torch


def view_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret uint8 [..., k * itemsize] as dtype [..., k], copying first when not aligned/dense."""
    if not x.is_contiguous() or x.storage_offset() % dtype.itemsize:
        x = x.clone(memory_format=torch.contiguous_format)
    return x.view(dtype)


def f16(b: torch.Tensor, off: int) -> torch.Tensor:
    """fp16 field at byte `off` -> float32 [n, 1]."""
    return view_as(b[:, off : off + 2], torch.float16).float()


def f32(b: torch.Tensor, off: int) -> torch.Tensor:
    """fp32 field at byte `off` -> float32 [n, 1]."""
    return view_as(b[:, off : off + 4], torch.float32)


def i32(b: torch.Tensor, off: int, count: int) -> torch.Tensor:
    """`count` 32-bit words from byte `off` -> int32 [n, count] (mask after shifting)."""
    return view_as(b[:, off : off + 4 * count], torch.int32)


def u16(b: torch.Tensor, off: int, count: int) -> torch.Tensor:
    """`count` unsigned 16-bit words from byte `off` -> int32 [n, count] in 0..65535."""
    return view_as(b[:, off : off + 2 * count], torch.int16).int() & 0xFFFF


def nibbles(x: torch.Tensor) -> torch.Tensor:
    """uint8 [..., k] -> [..., 2k]: all low nibbles, then all high nibbles."""
    return torch.cat([x & 0x0F, x >> 4], dim=-1)


def fields(x: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 [..., k] -> [..., 8 // width, k]: field j is (x >> j*width) & mask (plane order)."""
    x, mask = x.contiguous(), (1 << width) - 1  # scalar shifts of dense tensors vectorize best
    return torch.stack([(x >> s) & mask for s in range(0, 8, width)], dim=-2)


def unpack(x: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 [..., k] -> [..., k * 8 // width]: field j of byte i (LSB first) at i * 8 // width + j."""
    x, mask = x.contiguous(), (1 << width) - 1
    return torch.stack([(x >> s) & mask for s in range(0, 8, width)], dim=-1).flatten(-2)


def half_from_bits(h: torch.Tensor) -> torch.Tensor:
    """int tensor of fp16 bit patterns (0..65535) -> float32."""
    h = h.int()
    return (h - ((h >> 15) << 16)).to(torch.int16).view(torch.float16).float()


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2**e for integer e in -126..127, exactly, as float32."""
    return ((e.int() + 127) << 23).view(torch.float32)
