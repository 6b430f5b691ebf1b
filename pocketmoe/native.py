"""Native CPU kernels (pocketmoe._native): GEMM and routed MoE experts on raw GGUF blocks.

The C++ engine (cpp_engine/) quantizes activations to Q8_K / Q8_0 once per row and runs integer
dot products on the weights as stored in the file: AVX2, or AVX-VNNI / AVX-512 VNNI / AMX where the CPU
has them (chosen at run time, bitwise the same results; see kernel_isa()). Float weights
(F32/F16/BF16) use float activations. It has its own thread pool (default: one thread per physical core). Results are
bitwise repeatable for any thread count and batch composition.

Arrays: weights are C-contiguous uint8 (numpy, or CPU torch tensors), activations float32.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from pocketmoe.errors import PocketMoEError

REQUIRED_CPU_FLAGS = frozenset({"avx2", "fma", "f16c", "bmi2"})


class NativeKernelError(PocketMoEError, ValueError):
    """The native kernels are missing, or refused their arguments."""


def _cpu_flags() -> frozenset[str] | None:
    """CPU feature flags from /proc/cpuinfo; None where that file does not exist."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        return None
    return frozenset()


def _load() -> tuple[ModuleType | None, str]:
    # Checked before the import: the extension is compiled for AVX2 and would crash elsewhere.
    flags = _cpu_flags()
    if flags is not None and not REQUIRED_CPU_FLAGS <= flags:
        missing = ", ".join(sorted(REQUIRED_CPU_FLAGS - flags))
        return None, f"this CPU lacks {missing}, which the native kernels need; the torch path is used instead"
    try:
        from pocketmoe import _native
    except ImportError as exc:
        return None, (f"pocketmoe._native is not built ({exc}); build it with "
                      "`python setup.py build_ext --inplace` or `pip install -e .`")
    return _native, ""


_NATIVE, _UNAVAILABLE_REASON = _load()


def available() -> bool:
    """True when the extension is built and this CPU can run it."""
    return _NATIVE is not None


def unavailable_reason() -> str:
    """Why available() is False, in one sentence ("" when it is True)."""
    return _UNAVAILABLE_REASON


def describe() -> str:
    """The instruction set in use and the thread count, e.g. for `inspect` and benchmark reports."""
    if _NATIVE is None:
        return f"native kernels unavailable: {_UNAVAILABLE_REASON}"
    return str(_call(_NATIVE.describe))


def kernel_isa() -> dict[str, str]:
    """{"name": "amx" | "avx512vnni" | "avxvnni" | "avx2", "note": why a wider set this CPU has is unused}.

    The widest set the CPU has is used once its kernels pass a start-up check (bitwise equal to the
    AVX2 kernels on random blocks of every integer type). The environment variable POCKETMOE_ISA
    (auto, amx, avx512vnni, avxvnni, avx2) caps it; an unknown value raises NativeKernelError.
    """
    return dict(_call(_lib().kernel_isa))


def _lib() -> ModuleType:
    if _NATIVE is None:
        raise NativeKernelError(f"native kernels unavailable: {_UNAVAILABLE_REASON}")
    return _NATIVE


def _call(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except ValueError as exc:
        raise NativeKernelError(str(exc)) from None


def _numpy(a: Any) -> np.ndarray:
    if type(a) is np.ndarray:
        return a
    try:
        return a.numpy()  # a torch tensor on the CPU without grad: a view, no copy (the common case)
    except (AttributeError, TypeError, RuntimeError, NotImplementedError):
        pass
    if hasattr(a, "numpy") and hasattr(a, "device"):  # other torch tensors: CPU only, no copy
        if a.device.type != "cpu":
            raise NativeKernelError(f"native kernels read host memory; got a tensor on {a.device}")
        return a.detach().numpy()
    return np.asarray(a)


def _weight(a: Any, name: str) -> np.ndarray:
    w = _numpy(a)
    if w.dtype != np.uint8 or not w.flags.c_contiguous:
        raise NativeKernelError(f"{name} must be C-contiguous uint8 GGUF blocks, got {w.dtype} "
                                f"({'contiguous' if w.flags.c_contiguous else 'strided'})")
    return w


def _floats(a: Any) -> np.ndarray:
    return np.ascontiguousarray(_numpy(a), dtype=np.float32)


def supported_types() -> frozenset[int]:
    """GGML type ids that have a native kernel."""
    return frozenset(int(t) for t in _lib().supported_types())


def set_num_threads(n: int) -> None:
    """Threads of the native pool (the caller counts as one)."""
    _call(_lib().set_num_threads, int(n))


def get_num_threads() -> int:
    return int(_lib().get_num_threads())


def gemm(weight: Any, ggml_type: int, x: Any, out: np.ndarray | None = None) -> np.ndarray:
    """y = x @ W^T. weight: uint8 [rows, row_bytes]; x: float32 [T, cols] or [cols] -> [T, rows] or [rows]."""
    # Hot path of decode (~50 calls per token): the extension checks dtypes, contiguity and shapes and
    # converts x to float32 only when needed, so arrays go straight through.
    lib = _NATIVE if _NATIVE is not None else _lib()
    try:
        return lib.gemm(weight if type(weight) is np.ndarray else _numpy(weight), int(ggml_type),
                        x if type(x) is np.ndarray else _numpy(x), out)
    except ValueError as exc:
        raise NativeKernelError(str(exc)) from None


def gemm_batched(weight: Any, ggml_type: int, x: Any, out: np.ndarray | None = None) -> np.ndarray:
    """y[h] = x[h] @ W[h]^T for every head h, in one call (DeepSeek MLA's attn_k_b / attn_v_b).

    weight: C-contiguous uint8 [H, rows, row_bytes]; x: float32 [H, T, cols] -> float32 [H, T, rows].
    y[h] is bitwise gemm(weight[h], ggml_type, x[h]).
    """
    lib = _NATIVE if _NATIVE is not None else _lib()
    return _call(lib.gemm_batched, weight if type(weight) is np.ndarray else _weight(weight, "weight"),
                 int(ggml_type), x if type(x) is np.ndarray else _numpy(x), out)


def moe_forward(x: Any, expert_ids: Any, expert_weights: Any, gate: Any, gate_type: int, up: Any, up_type: int,
                down: Any, down_type: int, n_experts: int, ffn: int, out: np.ndarray | None = None,
                swiglu_limit: float = 0.0) -> np.ndarray:
    """Routed experts of one MoE layer, summed per token in slot order in fp32.

    x: float32 [T, D]; expert_ids: int [T, K]; expert_weights: float [T, K];
    gate, up: uint8 [E, ffn, row_bytes(D)] (or flat); down: uint8 [E, D, row_bytes(ffn)] (or flat).
    Returns float32 [T, D] = sum_k w[t, k] * down_e(silu(gate_e x[t]) * up_e x[t]), e = ids[t, k];
    with swiglu_limit L > 0 the SwiGLU is silu(min(gate, L)) * clamp(up, -L, L) (DeepSeek-V4).
    """
    lib = _NATIVE if _NATIVE is not None else _lib()
    # The extension converts x / ids / weights to float32 / int32 C order only when they are not already.
    return _call(
        lib.moe_forward,
        x if type(x) is np.ndarray else _numpy(x),
        expert_ids if type(expert_ids) is np.ndarray else _numpy(expert_ids),
        expert_weights if type(expert_weights) is np.ndarray else _numpy(expert_weights),
        gate if type(gate) is np.ndarray else _weight(gate, "gate"),
        int(gate_type),
        up if type(up) is np.ndarray else _weight(up, "up"),
        int(up_type),
        down if type(down) is np.ndarray else _weight(down, "down"),
        int(down_type),
        int(n_experts),
        int(ffn),
        out,
        float(swiglu_limit),
    )


def dequantize(raw: Any, ggml_type: int, n: int) -> np.ndarray:
    """The scalar C++ reference dequantizer: n values of ggml_type -> float32 [n] (tests, debugging)."""
    return _call(_lib().dequantize, _weight(raw, "raw"), int(ggml_type), int(n))


def activation_roundtrip(x: Any, ggml_type: int) -> np.ndarray:
    """float32 [T, cols]: the activations ggml_type's kernel really multiplies (after Q8_K / Q8_0 rounding)."""
    return _call(_lib().activation_roundtrip, _floats(x), int(ggml_type))

