"""llama.cpp (llama-cpp-python) as the parity reference: logits at every prompt position and greedy tokens;
also its quantizer, and its per-node tensors (the graph's eval callback) for finding where two engines part."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest


def llama_run(path: Path, prompt: list[int], gen: int, n_ctx: int) -> tuple[np.ndarray, list[int]]:
    """llama.cpp's logits at every prompt position (F32 KV cache, flash attention off) and its greedy tokens."""
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=2,
                          n_threads_batch=2, logits_all=True, type_k=0, type_v=0, flash_attn=False, verbose=False)
    try:
        llm.eval(prompt)
        logits = np.array(llm.scores[:len(prompt)], dtype=np.float32)
        out: list[int] = []
        while len(out) < gen:
            out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            if len(out) < gen:
                llm.eval(out[-1:])
        return logits, out
    finally:
        llm.close()


def llama_quantize(src: Path, dst: Path, ftype: str) -> Path:
    """`src` quantized by llama.cpp's own quantizer (llama_model_quantize) to `ftype`, e.g. "Q4_K_M"."""
    llama_cpp = pytest.importorskip("llama_cpp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 1
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize returned {rc}"
    return dst


class _Tensor(ctypes.Structure):
    """The head of ggml.h's struct ggml_tensor up to its name (GGML_MAX_DIMS 4, GGML_MAX_SRC 10)."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]


_DTYPES = {0: np.float32, 26: np.int32}  # GGML_TYPE_F32, GGML_TYPE_I32
_QUIET: list[object] = []  # the log callback, kept alive while llama.cpp holds it


def llama_tensors(path: Path, prompt: list[int], names: set[str], ubatch: int | None = None
                  ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """llama.cpp's logits at every prompt position and its graph tensors named in `names` (e.g. "kqv_out-0",
    the last one of that name) as numpy arrays [..., ne0], from one decode of the prompt in ubatches of
    `ubatch` tokens (all at once by default). One thread, F32 KV cache, flash attention off."""
    lib = pytest.importorskip("llama_cpp")
    n = len(prompt)
    got: dict[str, np.ndarray] = {}

    @lib.ggml_backend_sched_eval_callback
    def callback(t: int, ask: bool, _user: int) -> bool:
        tensor = ctypes.cast(t, ctypes.POINTER(_Tensor)).contents
        name = tensor.name.decode()
        if ask or name not in names:
            return name in names
        if tensor.type in _DTYPES and tensor.data:
            dt = np.dtype(_DTYPES[tensor.type])
            ne, nb = list(tensor.ne), list(tensor.nb)
            span = sum((e - 1) * s for e, s in zip(ne, nb, strict=True)) + dt.itemsize
            flat = np.frombuffer((ctypes.c_char * span).from_address(tensor.data), dtype=dt)
            got[name] = np.array(np.lib.stride_tricks.as_strided(flat, shape=ne[::-1], strides=nb[::-1]))
        return True

    if not _QUIET:
        _QUIET.append(lib.llama_log_callback(lambda _level, _text, _user: None))
        lib.llama_log_set(_QUIET[0], ctypes.c_void_p())
    lib.llama_backend_init()
    model = lib.llama_model_load_from_file(str(path).encode(), lib.llama_model_default_params())
    assert model, f"llama.cpp could not load {path}"
    cp = lib.llama_context_default_params()
    cp.n_ctx = cp.n_batch = max(64, n)
    cp.n_ubatch = ubatch or cp.n_batch
    cp.n_threads = cp.n_threads_batch = 1
    cp.type_k = cp.type_v = 0
    cp.flash_attn_type = 0
    cp.cb_eval, cp.cb_eval_user_data = callback, None
    ctx = lib.llama_init_from_model(model, cp)
    if not ctx:
        lib.llama_model_free(model)
        raise AssertionError(f"llama.cpp could not make a context for {path}")
    batch = lib.llama_batch_init(n, 0, 1)
    try:
        for i, tok in enumerate(prompt):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, i, 1, 1
            batch.seq_id[i][0] = 0
        batch.n_tokens = n
        assert lib.llama_decode(ctx, batch) == 0
        n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
        logits = np.ctypeslib.as_array(lib.llama_get_logits(ctx), shape=(n, n_vocab)).copy()
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
        lib.llama_model_free(model)
    return logits, got


def activation_codes(rows: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Activation rows [T, n] quantized as llama.cpp (x86) and our kernels do it before a quantized matmul:
    int8 q [T, B, block] = rint(x * 127 / amax) per block (Q8_0: 32 values, an fp16 scale; Q8_K: 256, an F32
    one), the fp16 scale d [T, B] (None for Q8_K: an F32 scale moves the product by an ulp, never a step),
    and x * 127 / amax itself. Signs as ours; llama.cpp's Q8_K codes are these negated when the block's
    largest-magnitude value is positive, which changes no comparison."""
    x = rows.astype(np.float32).reshape(len(rows), -1, block)
    amax = np.abs(x).max(-1)
    v = (x * (np.float32(127) / amax[..., None])).astype(np.float32)
    return np.rint(v), (amax / np.float32(127)).astype(np.float16) if block == 32 else None, v


def fp16_midpoint_distance(d: float) -> float:
    """Relative distance of d from the nearest midpoint between two adjacent fp16 values."""
    lo = float(np.float16(d))
    hi = float(np.nextafter(np.float16(lo), np.float16(np.inf if d > lo else -np.inf)))
    return abs(d - (lo + hi) / 2) / abs(d)


def activation_block(ggml_type: int) -> int | None:
    """The activation block a weight of ggml_type quantizes its input to on llama.cpp's x86 CPU and ours: 32
    (Q8_0 / Q8_1) for the 32-value types, 256 (Q8_K) for k-quants and IQ types, None for float weights."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)][0]
    return block if block in (32, 256) else None


def rows_reached_by_ties(sites: list[tuple[str, np.ndarray, np.ndarray, set[int], bool]],
                         tol: float = 1e-3) -> np.ndarray:
    """Which rows a rounding tie reaches, from the quantizer inputs of one forward, in the order the forward
    meets them: (name, ours [T, n], llama.cpp's [T, n], the activation blocks the site's weights use, whether
    the site feeds later rows: attention's keys and values). A row's quantized activations may differ from
    llama.cpp's only at a tie: an int8 value within `tol` of k + 0.5, or a Q8_0 fp16 scale within 1e-6 of a
    midpoint, on llama.cpp's side (its value is the last-bit neighbour of ours). Asserted at each row's first
    difference; from then on that row, and every later row when the site feeds them, differs by a whole
    step, so it is reached and not checked further. Returns reached [T] bool."""
    reached = np.zeros(len(sites[0][1]), dtype=bool)
    for name, mine, theirs, blocks, feeds_later_rows in sites:
        crossed = np.zeros_like(reached)
        for block in blocks:
            (qa, da, _), (qb, db, vb) = activation_codes(mine, block), activation_codes(theirs, block)
            int8 = (qa != qb).any(-1)
            scale = (da != db) if da is not None else np.zeros_like(int8)
            crossed |= (int8 | scale).any(-1)
            for row in np.nonzero((int8 | scale).any(-1) & ~reached)[0]:
                v = vb[row][qa[row] != qb[row]]
                assert (np.abs(np.abs(v) % 1 - 0.5) < tol).all(), f"{name} row {row}: {v} are no ties"
                amax = np.abs(theirs[row].reshape(-1, block)).max(-1) / np.float32(127)
                assert all(fp16_midpoint_distance(float(d)) < 1e-6 for d in amax[scale[row]]), (name, row)
        if feeds_later_rows and crossed.any():
            crossed[crossed.argmax():] = True
        reached |= crossed
    return reached


def record_linear_inputs(ops: Any, keep: Callable[[str, Any], None]) -> None:
    """Has this ops object's linear and linear_multi hand each weight's name and input to keep(name, x)
    before they run: our side of a comparison with llama_tensors."""
    linear, linear_multi = ops.linear, ops.linear_multi

    def hook_linear(w, x):  # noqa: ANN001, ANN202
        keep(w.name, x)
        return linear(w, x)

    def hook_multi(ws, x):  # noqa: ANN001, ANN202
        for w in ws:
            keep(w.name, x)
        return linear_multi(ws, x)

    ops.linear, ops.linear_multi = hook_linear, hook_multi
