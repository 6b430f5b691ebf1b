"""Host side of src/matmul.cu: the kernel names, argument lists and launch geometry of the activation
quantization, the GEMV and the grouped expert GEMM, on any launcher (backend.Launcher: CuPy on a GPU, the CPU
shim in tests). Torch tensors in and out, on the launcher's device.

Legend: T tokens, O output rows, I input columns, P (token, slot) pairs, G expert groups of one launch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pocketmoe.errors import PocketMoEError
from pocketmoe.layers.experts import swiglu
from pocketmoe.quant.formats import format_of

Launcher = Callable[[str, str, tuple[int, int, int], tuple[int, int, int], Sequence[Any], int], None]

SOURCE = "matmul.cu"
THREADS = 128        # 4 warps: GEMV one row per warp, GEMM 4 rows per warp
GEMV_TOKENS = 8      # tokens per blockIdx.y of a GEMV
GEMM_ROWS = 4 * (THREADS // 32)
# ggml type -> (kernel suffix, activation block: 32 = Q8_0 rows, 256 = Q8_K rows, 1 = float rows)
KERNELS: dict[int, tuple[str, int]] = {
    0: ("f32", 1), 1: ("f16", 1), 30: ("bf16", 1),
    2: ("q4_0", 32), 3: ("q4_1", 32), 6: ("q5_0", 32), 7: ("q5_1", 32), 8: ("q8_0", 32), 20: ("iq4_nl", 32),
    39: ("mxfp4", 32), 40: ("nvfp4", 32), 41: ("q1_0", 32),
    10: ("q2_k", 256), 11: ("q3_k", 256), 12: ("q4_k", 256), 13: ("q5_k", 256), 14: ("q6_k", 256),
    16: ("iq2_xxs", 256), 17: ("iq2_xs", 256), 22: ("iq2_s", 256), 18: ("iq3_xxs", 256), 21: ("iq3_s", 256),
    19: ("iq1_s", 256), 29: ("iq1_m", 256), 23: ("iq4_xs", 256), 35: ("tq2_0", 256), 34: ("tq1_0", 256),
}


class CudaMatmulError(PocketMoEError, ValueError):
    """A weight type or shape the CUDA matmul kernels do not take."""


def _kernel(ggml_type: int, cols: int) -> tuple[str, int]:
    if ggml_type not in KERNELS:
        raise CudaMatmulError(f"ggml type {ggml_type} has no CUDA matmul kernel; the types with one are "
                              f"{sorted(KERNELS)}")
    name, bv = KERNELS[ggml_type]
    need = max(bv, format_of(ggml_type).block_size)  # NVFP4: 64-value blocks under 32-value activation blocks
    if cols <= 0 or cols % need != 0:
        raise CudaMatmulError(f"{name} rows need a positive multiple of {need} columns, got {cols}")
    return name, bv


def quantize_activations(launch: Launcher, x: torch.Tensor, block: int) -> list[torch.Tensor]:
    """x float32 [R, I] -> the activation arguments of a `block`-value weight type: [q, d, sums] (Q8_K, 256),
    [q, d, s] (Q8_0, 32; s float32 [R, I/32], fp16(d32 * sum of the block's q): src/matmul.cu) or [x] (float
    weights, 1). One quantization per row, reused by every matmul."""
    if x.dtype != torch.float32:
        x = x.float()
    if block != 1 and not x.is_contiguous() and (rows := _rows_in_place(x)) is not None:
        return _quantize(launch, "quantize", [rows, rows.shape[1]], x.shape, block, x.device)
    if not x.is_contiguous():
        x = x.contiguous()
    if block == 1:
        return [x]
    return _quantize(launch, "quantize", [x, x.shape[1]], x.shape, block, x.device)


def _rows_in_place(x: torch.Tensor) -> torch.Tensor | None:
    """For x [R, I] whose rows lie ld > I floats apart (each row's leading values of a wider tensor, as MLA's
    per-head q_nope): the contiguous [R, ld] tensor over the same memory, which the quantize kernels read at
    stride ld with no copy first. None for any other layout, or when the last row's ld floats would run past
    x's storage."""
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[0] < 2 or x.stride(0) <= x.shape[1]:
        return None
    r, ld = x.shape[0], x.stride(0)
    if x.storage_offset() + r * ld > x.untyped_storage().nbytes() // x.element_size():
        return None
    return x.as_strided((r, ld), (ld, 1))


def quantize_swiglu(launch: Launcher, gu: torch.Tensor, block: int, limit: float = 0.0) -> list[torch.Tensor]:
    """quantize_activations of swiglu(gate, up, limit) (layers.experts.swiglu) for gu float32 holding gate and up:
    stacked [2, R, F] (gate's rows, then up's) or side by side [R, 2F] (a row's gate, then its up: one matmul
    over both weights). One launch that makes each value as it quantizes it, where torch's silu, product (and
    clamps) would each be a launch writing [R, F]. Float weights (block 1) read the product itself, made by
    torch."""
    stacked = gu.dim() == 3
    if (gu.shape[0] != 2 if stacked else gu.dim() != 2 or gu.shape[1] % 2) or gu.dtype != torch.float32:
        raise CudaMatmulError(f"gate and up come stacked [2, R, F] or side by side [R, 2F] in float32, not "
                              f"{gu.dtype} {tuple(gu.shape)}")
    r, f = (gu.shape[1], gu.shape[2]) if stacked else (gu.shape[0], gu.shape[1] // 2)
    if block == 1:
        g, u = (gu[0], gu[1]) if stacked else (gu[:, :f], gu[:, f:])
        return quantize_activations(launch, swiglu(g, u, limit), block)
    gu = gu.contiguous()
    u_off, ld = (r * f, f) if stacked else (f, 2 * f)  # where up's row 0 starts, and floats from a row to the next
    return _quantize(launch, "quantize_swiglu", [gu, u_off, ld, float(limit)], (r, f), block, gu.device)


def _quantize(launch: Launcher, kernel: str, inputs: list[Any], shape: tuple[int, int], block: int,
              dev: torch.device) -> list[torch.Tensor]:
    """The outputs of `kernel`_q8_0 (block 32) or `kernel`_q8_k (256) for rows of `shape`, launched on `inputs`."""
    r, n = shape
    out = activation_buffers(shape, block, dev)
    grid = (math.ceil(n // block / (THREADS // 32)), r, 1)
    launch(SOURCE, f"{kernel}_q8_{'0' if block == 32 else 'k'}", grid, (THREADS, 1, 1), [*inputs, *out, n], 0)
    return out


def activation_buffers(shape: tuple[int, int], block: int, dev: torch.device) -> list[torch.Tensor]:
    """Empty quantized activations of float rows of `shape` for `block`-value weights: [q, d, s] (32: Q8_0) or
    [q, d, sums] (256: Q8_K), as the quantize kernels write them."""
    r, n = shape
    if block not in (32, 256) or n % block != 0:
        raise CudaMatmulError(f"activation rows of {n} values do not split into blocks of {block}; "
                              f"pad the row to a multiple of {block}")
    q = torch.empty((r, n), dtype=torch.int8, device=dev)
    d = torch.empty((r, n // block), dtype=torch.float32, device=dev)
    if block == 32:
        return [q, d, torch.empty((r, n // 32), dtype=torch.float32, device=dev)]
    return [q, d, torch.empty((r, n // 16), dtype=torch.int16, device=dev)]


def activation_block(ggml_type: int) -> int:
    """Values per activation scale the type's kernels read (1 for float weights)."""
    return KERNELS[ggml_type][1] if ggml_type in KERNELS else 0


def gemv(launch: Launcher, weight: torch.Tensor, ggml_type: int, cols: int, acts: list[torch.Tensor],
         out: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, O] = x [T, I] W^T; weight uint8 [O, row_bytes] (contiguous rows); acts from quantize_activations."""
    name, _ = _kernel(ggml_type, cols)
    rows, t = weight.shape[0], acts[0].shape[0]
    y = out if out is not None else torch.empty((t, rows), dtype=torch.float32, device=weight.device)
    if t == 0 or rows == 0:
        return y
    grid = (math.ceil(rows / (THREADS // 32)), math.ceil(t / GEMV_TOKENS), 1)
    launch(SOURCE, f"gemv_{name}", grid, (THREADS, 1, 1), [weight, *acts, y, rows, cols, t], 0)
    return y


def moe_gemm(launch: Launcher, experts: Sequence[torch.Tensor], ggml_type: int, rows: int, cols: int,
             offsets: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor, acts: list[torch.Tensor],
             top_k: int, out: torch.Tensor, act_by_pair: bool = False, max_pairs: int | None = None,
             groups: torch.Tensor | None = None) -> torch.Tensor:
    """out [T * K, O]: row tokens[p] * top_k + slots[p] = W_g x_p for the pairs p of group g (offsets [G + 1]).

    experts[g]: uint8 [O, row_bytes] (a cached slot, a freshly staged one or a resident expert: any mix);
    x_p is activation row tokens[p] (act_by_pair False: gate / up) or tokens[p] * top_k + slots[p] (down).
    top_k 0 makes slots[p] the output row itself (pairs whose rows are not a [T, K] grid, tokens[p] their input
    rows).
    max_pairs (the largest group) sizes blockIdx.y; without it, offsets are read back (a device sync).
    groups (int32, the group indices to run, -1 for none: group_pairs' non-empty ones) sizes blockIdx.z in place of
    every group: a decode step's few experts launch a few blocks, not a grid of E mostly idle ones."""
    name, _ = _kernel(ggml_type, cols)
    z = len(experts) if groups is None else len(groups)
    if z == 0 or rows == 0:
        return out
    if max_pairs is None:
        max_pairs = int((offsets[1:] - offsets[:-1]).max())
    tiles = max(1, math.ceil(max_pairs / 8))
    grid = (math.ceil(rows / GEMM_ROWS), tiles, z)
    launch(SOURCE, f"moe_gemm_{name}", grid, (THREADS, 1, 1),
           [list(experts), offsets, tokens, slots, *acts, out, rows, cols, top_k, int(act_by_pair),
            offsets if groups is None else groups, int(groups is not None)], 0)
    return out
