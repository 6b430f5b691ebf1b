"""Kernel signatures for the CUDA shim harness (pocketmoe.testing.cuda_shim): parsing `__global__` functions
from CUDA C text, the translation unit with a launch wrapper per kernel, and packing Python arguments.
"""

from __future__ import annotations

import ctypes
import numbers
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pocketmoe.errors import PocketMoEError


class ShimError(PocketMoEError):
    """A kernel could not be built or run under the CPU execution shim."""


class ShimCompileError(ShimError):
    """g++ refused the sources."""


class ShimLaunchError(ShimError, ValueError):
    """A launch configuration CUDA would refuse (block size, grid size, shared memory)."""


class ShimDivergenceError(ShimError):
    """Threads of a block (or lanes of a warp) wait at different synchronisation points, or exited early."""


class ShimDeadlockError(ShimError):
    """No thread of a block can proceed."""


class ShimFaultError(ShimError):
    """A kernel thread accessed invalid memory, overflowed its stack, or divided an integer by zero."""


class ShimSanitizerError(ShimError):
    """AddressSanitizer reported an error while a kernel ran (a sanitize=True module)."""


RESULT_ERRORS = {1: ShimLaunchError, 2: ShimDivergenceError, 3: ShimDeadlockError, 4: ShimError, 5: ShimFaultError,
            6: ShimSanitizerError}
_SCALARS = {
    "int": ("int", ctypes.c_int32), "int32_t": ("int", ctypes.c_int32),
    "unsigned": ("int", ctypes.c_uint32), "unsigned int": ("int", ctypes.c_uint32),
    "uint32_t": ("int", ctypes.c_uint32), "long long": ("int", ctypes.c_int64),
    "long long int": ("int", ctypes.c_int64), "int64_t": ("int", ctypes.c_int64),
    "unsigned long long": ("int", ctypes.c_uint64), "uint64_t": ("int", ctypes.c_uint64),
    "float": ("float", ctypes.c_float),
}
_POINTEES = {  # pointer element type -> torch dtype name (None: any dtype)
    "float": "float32", "double": "float64", "__half": "float16", "half": "float16",
    "__nv_bfloat16": "bfloat16", "uint8_t": "uint8", "unsigned char": "uint8", "int8_t": "int8",
    "signed char": "int8", "char": "int8", "int16_t": "int16", "uint16_t": "uint16", "int": "int32",
    "int32_t": "int32", "unsigned int": "uint32", "uint32_t": "uint32", "long long": "int64",
    "int64_t": "int64", "void": None,
}
_KERNEL = re.compile(r'(?:extern\s+"C"\s+)?__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s+)?void\s+'
                     r'(?:__launch_bounds__\s*\([^)]*\)\s+)?(\w+)\s*\(([^)]*)\)\s*\{')
_EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+([^;\[\]{}]*?)\s*\b(\w+)\s*\[\s*\]\s*;")
_ALIGN = re.compile(r"(?:__align__|alignas)\s*\(\s*\d+\s*\)")
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str   # as declared, without __restrict__
    kind: str    # "int" | "float" | "ptr" | "ptrs"
    dtype: str | None = None  # torch dtype name a tensor must have (pointers; None: any)
    scalar: Any = None        # ctypes type (scalars)


@dataclass(frozen=True)
class Kernel:
    name: str
    source: str
    params: tuple[Param, ...]


def _parse_param(text: str, kernel: str) -> Param:
    text = re.sub(r"\b__restrict__\b|\b__restrict\b", " ", text)
    m = re.match(r"^(.*?)(\w+)\s*$", text.strip(), re.S)
    if not m or not m.group(1).strip():
        raise ShimError(f"kernel {kernel!r}: cannot read the parameter {text.strip()!r}; give every "
                        "parameter a type and a name")
    ctype, name = " ".join(m.group(1).replace("*", " * ").split()), m.group(2)
    stars = ctype.count("*")
    base = " ".join(w for w in ctype.replace("*", " ").split() if w != "const")
    if stars == 0 and base in _SCALARS:
        kind, scalar = _SCALARS[base]
        return Param(name, ctype, kind, scalar=scalar)
    if stars in (1, 2) and base in _POINTEES:
        return Param(name, ctype, "ptr" if stars == 1 else "ptrs", dtype=_POINTEES[base])
    raise ShimError(f"kernel {kernel!r}: parameter {name!r} has type {ctype!r}, which the shim does not "
                    f"pass; use a pointer to one of {sorted(_POINTEES)} or one of {sorted(_SCALARS)}")


def parse_kernels(text: str, source: str) -> list[Kernel]:
    """Every `__global__ void name(params) {` of a source text (comments ignored)."""
    out = []
    for m in _KERNEL.finditer(_COMMENT.sub(" ", text)):
        params = [p for p in m.group(2).split(",") if p.strip() and p.strip() != "void"]
        out.append(Kernel(m.group(1), source, tuple(_parse_param(p, m.group(1)) for p in params)))
    return out


def rewrite_extern_shared(text: str) -> str:
    """`extern __shared__ T name[];` -> a pointer to the shim's dynamic shared buffer (same line count)."""
    def sub(m: re.Match) -> str:
        t = " ".join(_ALIGN.sub(" ", m.group(1)).split())
        return (f"static {t}* const {m.group(2)} = reinterpret_cast<{t}*>(::pm_shim::g_dynamic_shared);"
                + "\n" * m.group(0).count("\n"))
    return _EXTERN_SHARED.sub(sub, text)


def translation_unit(path: Path, text: str, kernels: list[Kernel]) -> str:
    """The C++ that g++ builds for one source: the shim header, the source (its own file and line numbers), and
    per kernel `pm_entry_<name>(void** args)` and `pm_launch_<name>(grid, block, shared bytes, args, ...)`."""
    return (f'#include "cuda_shim.h"\n{_LAUNCH_DECL}#line 1 "{path}"\n{rewrite_extern_shared(text)}\n'
            '#line 1 "<shim wrappers>"\n' + "".join(_wrapper(k) for k in kernels))


_LAUNCH_DECL = ('extern "C" int pm_shim_launch(const char*, void (*)(void* const*), const long long*, '
                'const long long*, long long, void* const*, int, char*, int);\n')


def _wrapper(k: Kernel) -> str:
    args = ", ".join(f"*({p.ctype}*)a[{i}]" for i, p in enumerate(k.params))
    return (f'extern "C" void pm_entry_{k.name}(void* const* a) {{ (void)a; {k.name}({args}); }}\n'
            f'extern "C" int pm_launch_{k.name}(const long long* g, const long long* b, long long s, '
            f'void* const* a, int order, char* err, int n) {{\n'
            f'  return pm_shim_launch("{k.name}", pm_entry_{k.name}, g, b, s, a, order, err, n);\n}}\n')


def dim3(v: int | Sequence[int], what: str) -> tuple[int, int, int]:
    t = (v,) if isinstance(v, int) else tuple(v)
    if not 1 <= len(t) <= 3 or not all(isinstance(x, int) for x in t):
        raise TypeError(f"{what} is {v!r}; give an int or a tuple of 1-3 ints")
    return (t + (1, 1))[:3]


def _tensor_ptr(kernel: str, p: Param, t: Any) -> int:
    import torch

    if t is None:
        return 0
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"kernel {kernel!r} argument {p.name!r} ({p.ctype}) needs a torch CPU tensor or None, "
                        f"got {type(t).__name__}")
    if t.device.type != "cpu":
        raise TypeError(f"kernel {kernel!r} argument {p.name!r} is on {t.device}; the shim runs on CPU tensors")
    if not t.is_contiguous():
        raise TypeError(f"kernel {kernel!r} argument {p.name!r} is not contiguous (shape {tuple(t.shape)}, "
                        f"strides {t.stride()}); pass .contiguous()")
    if p.dtype is not None and t.dtype != getattr(torch, p.dtype):
        raise TypeError(f"kernel {kernel!r} argument {p.name!r} ({p.ctype}) needs torch.{p.dtype}, got {t.dtype}")
    return t.data_ptr()


def _convert(kernel: str, p: Param, a: Any, keep: list[Any]) -> Any:
    if p.kind == "ptr":
        return ctypes.c_void_p(_tensor_ptr(kernel, p, a))
    if p.kind == "ptrs":
        if not isinstance(a, (list, tuple)):
            raise TypeError(f"kernel {kernel!r} argument {p.name!r} ({p.ctype}) needs a list of tensors, "
                            f"got {type(a).__name__}")
        arr = (ctypes.c_void_p * max(len(a), 1))(*[_tensor_ptr(kernel, p, t) for t in a])
        keep.append(arr)
        return ctypes.c_void_p(ctypes.addressof(arr))
    if isinstance(a, bool) or not isinstance(a, numbers.Integral if p.kind == "int" else numbers.Real):
        raise TypeError(f"kernel {kernel!r} argument {p.name!r} ({p.ctype}) needs a Python "
                        f"{p.kind}, got {type(a).__name__}")
    if p.kind == "float":
        return p.scalar(float(a))
    a = int(a)
    bits, signed = ctypes.sizeof(p.scalar) * 8, p.scalar(-1).value < 0
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    if not lo <= a <= hi:
        raise TypeError(f"kernel {kernel!r} argument {p.name!r} is {a}, which does not fit {p.ctype} "
                        f"({lo}..{hi})")
    return p.scalar(a)


def pack_args(k: Kernel, args: Sequence[Any]) -> tuple[Any, list[Any]]:
    """A `void*[]` with one pointer per parameter to its converted value, and the objects to keep alive."""
    if len(args) != len(k.params):
        raise TypeError(f"kernel {k.name!r} takes {len(k.params)} arguments "
                        f"({', '.join(p.name for p in k.params)}), got {len(args)}")
    keep: list[Any] = []
    ptrs = (ctypes.c_void_p * max(len(args), 1))()
    for i, (p, a) in enumerate(zip(k.params, args, strict=True)):
        v = _convert(k.name, p, a, keep)
        keep.append(v)
        ptrs[i] = ctypes.addressof(v)
    return ptrs, keep
