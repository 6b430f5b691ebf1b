"""References for the CUDA matmul tests (tests/test_cuda_matmul.py): the CPU's activation quantization as
numpy, weights through gguf.quants.dequantize, the exact value of a kernel output (Q4_1 / Q5_1: against the
activation block sums s the kernels take, as llama.cpp's Q8_1 dot does), its derived float-rounding bound, and
expert routings with uneven (and empty) groups.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from pocketmoe.quant.formats import format_of
from pocketmoe.testing.dequant import dequantize_reference

# kernel suffix -> (ggml type, values per activation block); 32: Q8_0 activations, 256: Q8_K, 1: float
# activations.
TYPES = {
    "q4_0": (2, 32), "q4_1": (3, 32), "q5_0": (6, 32), "q5_1": (7, 32), "q8_0": (8, 32), "iq4_nl": (20, 32),
    "mxfp4": (39, 32), "nvfp4": (40, 32), "q1_0": (41, 32),
    "q2_k": (10, 256), "q3_k": (11, 256), "q4_k": (12, 256), "q5_k": (13, 256), "q6_k": (14, 256),
    "iq2_xxs": (16, 256), "iq2_xs": (17, 256), "iq2_s": (22, 256), "iq3_xxs": (18, 256), "iq3_s": (21, 256),
    "iq1_s": (19, 256), "iq1_m": (29, 256), "iq4_xs": (23, 256), "tq2_0": (35, 256), "tq1_0": (34, 256),
    "f32": (0, 1), "f16": (1, 1), "bf16": (30, 1),
}
# Types with a min term: (byte offset of the fp16 dmin, largest min multiplier); Q4_1 / Q5_1 add their m itself.
MINS = {"q4_1": (2, 1), "q5_1": (2, 1), "q2_k": (82, 15), "q4_k": (2, 63), "q5_k": (2, 63)}
BLOCK_S = ("q4_1", "q5_1")   # the min types that take the Q8_0 rows' s
PER_16 = ("nvfp4",)          # a float step per 16 values (a scale per 16) under Q8_0 activations
U = 2.0 ** -24   # unit roundoff of float32
FP16_MAX = np.float32(65504)


def quantize_model(x: np.ndarray, bv: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x float32 [T, I] -> q int8 [T, I], d float32 [T, I/bv] and, as the CPU does, Q8_K: sums of 16 int16
    [T, I/16], Q8_0: s float32 [T, I/32]. d = max|x| / 127, q = rint(x * (127 / max|x|)) (ties to even); Q8_0
    keeps d rounded to fp16 and s = fp16(d32 * sum of the block's q), d32 the fp32 d (the product unrounded
    past fp16's range)."""
    t, n = x.shape
    xb = x.reshape(t, n // bv, bv)
    amax = np.abs(xb).max(axis=-1)
    zero = ~(amax > 0)
    inv = np.float32(127) / np.where(zero, np.float32(1), amax)
    q = np.rint(xb * inv[..., None]).astype(np.int8)
    q[zero] = 0
    d = np.where(zero, np.float32(0), amax / np.float32(127)).astype(np.float32)
    if bv == 32:
        prod = d * q.sum(axis=-1, dtype=np.int32).astype(np.float32)
        with np.errstate(over="ignore"):
            rounded = prod.astype(np.float16).astype(np.float32)
        s = np.where(np.abs(prod) > FP16_MAX, prod, rounded).astype(np.float32)
        return q.reshape(t, n), d.astype(np.float16).astype(np.float32), s
    q = q.reshape(t, n)
    return q, d, q.reshape(t, n // 16, 16).sum(axis=-1, dtype=np.int16)


def act_inputs(x: np.ndarray, bv: int) -> tuple[list, np.ndarray]:
    """The kernel's activation arguments for x, and the float64 values they stand for (acts[2] of a Q8_0 row is
    its s, which exact() and tolerance() read)."""
    if bv == 1:
        return [torch.from_numpy(x)], x.astype(np.float64)
    q, d, s = quantize_model(x, bv)
    deq = q.astype(np.float64) * np.repeat(d.astype(np.float64), bv, axis=1)
    return [torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(s)], deq


def reference_weight(raw: np.ndarray, name: str) -> np.ndarray:
    return dequantize_reference(raw, TYPES[name][0]).astype(np.float64)


def block_mins(raw: np.ndarray, name: str) -> np.ndarray:
    """The fp16 m of each block of a Q4_1 / Q5_1 matrix (bytes 2-3), float64 [O, I/32]."""
    blocks = raw.reshape(raw.shape[0], -1, format_of(TYPES[name][0]).type_size)
    return blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)


def split_min(raw: np.ndarray, name: str, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d q [O, I], m [O, I/32]) of a Q4_1 / Q5_1 matrix: gguf's w = fl(d q + m) less m (d q is exact in
    float32, so the float64 difference is within U |w| of it)."""
    m = block_mins(raw, name)
    return w - np.repeat(m, 32, axis=1), m


def exact(name: str, raw: np.ndarray, w: np.ndarray, xd: np.ndarray, acts: list) -> np.ndarray:
    """The value a kernel output stands for, float64 [T, O]: xd W^T, where Q4_1 / Q5_1 take their min against
    the activation's s (acts[2], llama.cpp's Q8_1 s) rather than the sum of xd: sum_i d q_i xd_i + sum_b m_b s_b."""
    if name not in BLOCK_S:
        return xd @ w.T
    dq, m = split_min(raw, name, w)
    return xd @ dq.T + acts[2].numpy().astype(np.float64) @ m.T


def steps(name: str) -> int:
    """Float steps per activation block: two with a min term or a scale per 16, else one."""
    return 2 if name in MINS or name in PER_16 else 1


def chain(name: str, cols: int) -> int:
    """Roundings a kernel output's sum goes through: each lane adds its blocks in turn (32-value types: blocks
    l, l + 32, ...; 256-value: one in 4; floats: one value in 32), steps(name) fmas per block, then 5
    butterfly levels."""
    bv = TYPES[name][1]
    per_lane = math.ceil(cols / 32) if bv == 1 else math.ceil(cols // bv / (32 if bv == 32 else 4))
    return per_lane * steps(name) + 5


def cpu_chain(name: str, cols: int) -> int:
    """The same for the native CPU kernels: one vector lane per row adds every block in turn (k-quants: 8 lanes
    of partial sums per block, two fmas with a min term, then a horizontal add of 8; NVFP4: a step per 16);
    floats: 8 lanes of cols / 8 fmas, a horizontal add and the cols % 8 tail."""
    bv = TYPES[name][1]
    if bv == 1:
        return cols // 8 + 3 + cols % 8
    return cols // bv * steps(name) + (3 if bv == 256 else 0)


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def tolerance(name: str, raw: np.ndarray, w: np.ndarray, xd: np.ndarray, acts: list,
              n_chain: int | None = None) -> np.ndarray:
    """Bound on |kernel - exact(...)| per output [T, O] (n_chain: the sum's roundings, chain(...) by default).

    The integer block dots are exact. A term of the sum is d*da*isum (and dmin*da*msum): float(isum) (|isum|
    may pass 2^24) and d*da round once each before it enters the sum, whose additions (the fmas) round
    n_chain times at most: error <= gamma(n_chain + 2) * sum |terms| (recursive summation). sum |terms| <=
    S + 2M, S = sum_i |w_i x_i|, M = sum over blocks |dmin| * max_min * sum_i |x_i| (as |d sc q| <= |w| +
    |dmin m|). gguf's float32 dequantization rounds a weight at most 4 times (Q2_K: d*sc, dmin*m, *q, -),
    relative to |d sc q| + |dmin m|: 4u (S + 2M) more; the float64 reference matmul adds nothing visible.
    Q4_1 / Q5_1: the terms are d*da*isum and m*s (exact inside its fma), sum |terms| <= (1 + u) S' + Ms with
    S' = sum_i |d q_i x_i| and Ms = sum over blocks |m s|; the reference's d q (w - m) is off by gamma(1) |w|
    at most (one rounding of d q + m), in the value and in S'.
    NVFP4: a term per 16 values (d_s*da*isum16), the same bound with S.
    Float weights: exact weights and products inside fmas, gamma(n_chain) * S."""
    n_chain = chain(name, w.shape[1]) if n_chain is None else n_chain
    if name in BLOCK_S:
        dq, m = split_min(raw, name, w)
        dq_abs = np.abs(dq) + gamma(1) * np.abs(w)
        terms = (1 + U) * (np.abs(xd) @ dq_abs.T) + np.abs(acts[2].numpy().astype(np.float64)) @ np.abs(m).T
        return gamma(n_chain + 2) * terms + gamma(1) * (np.abs(xd) @ np.abs(w).T)
    s = np.abs(xd) @ np.abs(w).T
    if TYPES[name][1] == 1:
        return gamma(n_chain) * s
    m = np.zeros_like(s)
    if name in MINS:
        off, max_min = MINS[name]
        bv = TYPES[name][1]
        rows, nb = w.shape[0], w.shape[1] // bv
        dmin = raw.reshape(rows, nb, -1)[:, :, off:off + 2].copy().view(np.float16).astype(np.float64)[..., 0]
        xabs = np.abs(xd).reshape(xd.shape[0], nb, bv).sum(axis=-1)
        m = xabs @ (np.abs(dmin) * max_min).T
    return (gamma(n_chain + 2) + 4 * U) * (s + 2 * m)


def random_acts(rng: np.random.Generator, t: int, cols: int) -> np.ndarray:
    return rng.standard_normal((t, cols), dtype=np.float32)


def routing(rng: np.random.Generator, t: int) -> np.ndarray:
    """ids [T, 2] over 5 experts: token 0 alone uses expert 4, expert 1 gets no token, and 0, 2, 3 share the rest
    (2T - 1 pairs over three experts, so one of them has more than a tile of 8)."""
    ids = np.stack([rng.choice([0, 2, 3], size=2, replace=False) for _ in range(t)]).astype(np.int32)
    ids[0] = (4, 0)
    return ids


def grouped(ids: np.ndarray, n_groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """offsets [G + 1], tokens [P], slots [P]: the pairs of each expert, in token order."""
    t_idx, k_idx = np.indices(ids.shape).reshape(2, -1)
    order = np.lexsort((t_idx, ids.reshape(-1)))
    counts = np.bincount(ids.reshape(-1), minlength=n_groups)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    as_t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))  # noqa: E731
    return as_t(offsets), as_t(t_idx[order]), as_t(k_idx[order])


def select_acts(acts: list, idx: np.ndarray) -> list:
    return [a[idx].contiguous() for a in acts]
