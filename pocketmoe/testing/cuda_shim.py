"""Run the package's CUDA C kernels on the CPU: g++ + the execution shim in pocketmoe/ops/cuda/shim.

    mod = ShimModule(["matmul.cu"])            # names under pocketmoe/ops/cuda/src/, or absolute paths
    mod.launch("q8_0_gemv", grid=(rows, 1, 1), block=(32, 1, 1), args=[w_u8, x_f32, y_f32, cols, rows])

Each source becomes one translation unit with a generated launch wrapper per `__global__ void` kernel
(its signature parsed from the text); all of them and the shim link into one `.so`, cached under
``$XDG_CACHE_HOME/pocketmoe/cuda_shim`` by a hash of everything that goes into it. Torch CPU tensors pass as
pointers (contiguous, dtype matching the parameter), a list of tensors as a pointer array, Python ints and
floats as the parameter's scalar type. Divergence, deadlock and bad launches raise a ShimError subclass.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import numbers
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from pocketmoe.errors import PocketMoEError

CUDA_DIR = Path(__file__).resolve().parent.parent / "ops" / "cuda"
SRC_DIR, SHIM_DIR = CUDA_DIR / "src", CUDA_DIR / "shim"
_FLAGS = ("-O2", "-std=c++17", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fstack-clash-protection",
          "-Wno-attributes")
_ASAN_FLAGS = ("-fsanitize=address", "-fno-omit-frame-pointer", "-g", "-O1", "-DPM_SHIM_ASAN")
_LOCK = threading.Lock()


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


_RESULTS = {1: ShimLaunchError, 2: ShimDivergenceError, 3: ShimDeadlockError, 4: ShimError, 5: ShimFaultError}
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


def _rewrite_extern_shared(text: str) -> str:
    def sub(m: re.Match) -> str:
        t = " ".join(_ALIGN.sub(" ", m.group(1)).split())
        return (f"static {t}* const {m.group(2)} = reinterpret_cast<{t}*>(::pm_shim::g_dynamic_shared);"
                + "\n" * m.group(0).count("\n"))
    return _EXTERN_SHARED.sub(sub, text)


def _wrapper(k: Kernel) -> str:
    args = ", ".join(f"*({p.ctype}*)a[{i}]" for i, p in enumerate(k.params))
    return (f'extern "C" void pm_entry_{k.name}(void* const* a) {{ (void)a; {k.name}({args}); }}\n'
            f'extern "C" int pm_launch_{k.name}(const long long* g, const long long* b, long long s, '
            f'void* const* a, int order, char* err, int n) {{\n'
            f'  return pm_shim_launch("{k.name}", pm_entry_{k.name}, g, b, s, a, order, err, n);\n}}\n')


@cache
def cuda_include_dir() -> Path | None:
    """The toolkit's include directory holding cuda_fp16.h: $CUDA_HOME, nvcc on PATH, /usr/local/cuda*, or
    the pip package nvidia-cuda-runtime-cu12."""
    cands = [Path(os.environ[v]) / "include" for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    if nvcc := shutil.which("nvcc"):
        cands.append(Path(nvcc).resolve().parent.parent / "include")
    cands += [Path("/usr/local/cuda/include")]
    cands += [Path(p) for p in sorted(glob.glob("/usr/local/cuda-*/include"), reverse=True)]
    try:
        import nvidia.cuda_runtime as rt  # type: ignore[import-not-found]

        cands += [Path(p) / "include" for p in rt.__path__]
    except ImportError:
        pass
    return next((c for c in cands if (c / "cuda_fp16.h").is_file()), None)


def _cxx() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def shim_unavailable_reason() -> str | None:
    """None when kernels can be built and run here, else why not (tests skip with this)."""
    if _cxx() is None:
        return "the CUDA shim needs g++ (or $CXX) on PATH, and none was found"
    if cuda_include_dir() is None:
        return ("the CUDA shim needs the CUDA toolkit headers (cuda_fp16.h): none under $CUDA_HOME, nvcc's "
                "toolkit, /usr/local/cuda*, or the pip package nvidia-cuda-runtime-cu12")
    return None


def asan_runtime() -> str:
    """The path of g++'s libasan.so, to LD_PRELOAD into a Python that loads a sanitize=True module."""
    return subprocess.run([_cxx() or "g++", "-print-file-name=libasan.so"], capture_output=True, text=True,
                          check=True).stdout.strip()


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "pocketmoe" / "cuda_shim"


def _resolve(src: str | os.PathLike) -> Path:
    p = Path(src)
    p = p if p.is_absolute() else SRC_DIR / p
    if not p.is_file():
        raise ShimError(f"CUDA source {str(src)!r} not found (looked at {p}); give a name under {SRC_DIR} "
                        "or an absolute path")
    return p


def _build(units: dict[str, str], include_dirs: list[Path], flags: tuple[str, ...]) -> Path:
    cxx, inc = _cxx(), cuda_include_dir()
    if reason := shim_unavailable_reason():
        raise ShimError(reason)
    h = hashlib.sha256(repr((cxx, str(inc), flags, sorted(units.items()))).encode())
    for d in [SHIM_DIR, *include_dirs]:
        for f in sorted(d.iterdir()):
            if f.suffix in (".h", ".cuh", ".cu", ".cpp", ".hpp"):
                h.update(f.name.encode() + b"\0" + f.read_bytes())
    out = cache_dir() / f"{h.hexdigest()[:32]}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix="build-") as tmp:
        files = []
        for name, text in units.items():
            files.append(Path(tmp) / f"{name}.cpp")
            files[-1].write_text(text)
        incs = [f"-I{d}" for d in [SHIM_DIR, inc, *include_dirs]]
        cmd = [cxx, *flags, *incs, str(SHIM_DIR / "cuda_shim.cpp"), *map(str, files), "-o", f"{tmp}/m.so"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise ShimCompileError(f"g++ could not build {', '.join(units)} for the CUDA shim:\n"
                                   f"{r.stderr[-6000:]}")
        os.replace(f"{tmp}/m.so", out)  # atomic: concurrent builders of the same hash both end with one file
    return out


class ShimModule:
    """CUDA sources built for the host with the execution shim; `launch` runs one kernel over a grid."""

    def __init__(self, sources: Sequence[str | os.PathLike], sanitize: bool = False,
                 defines: Sequence[str] = ()) -> None:
        paths = [_resolve(s) for s in sources]
        self.kernels: dict[str, Kernel] = {}
        units = {}
        for i, p in enumerate(paths):
            text = p.read_text()
            kernels = parse_kernels(text, p.name)
            for k in kernels:
                if k.name in self.kernels:
                    raise ShimError(f"kernel {k.name!r} is defined in both {self.kernels[k.name].source} and "
                                    f"{p.name}; kernel names must be unique in a module")
                self.kernels[k.name] = k
            decl = ('extern "C" int pm_shim_launch(const char*, void (*)(void* const*), const long long*, '
                    'const long long*, long long, void* const*, int, char*, int);\n')
            units[f"{i}_{p.stem}"] = (f'#include "cuda_shim.h"\n{decl}#line 1 "{p}"\n'
                                      f"{_rewrite_extern_shared(text)}\n#line 1 \"<shim wrappers>\"\n"
                                      + "".join(_wrapper(k) for k in kernels))
        if sanitize and not hasattr(ctypes.CDLL(None), "__asan_init"):
            raise ShimError("sanitize=True needs the AddressSanitizer runtime in this process: run Python with "
                            f"LD_PRELOAD={asan_runtime()} ASAN_OPTIONS=detect_leaks=0")
        dirs = list(dict.fromkeys([*(p.parent for p in paths), SRC_DIR]))
        flags = _FLAGS + (_ASAN_FLAGS if sanitize else ()) + tuple(f"-D{d}" for d in defines)
        self.path = _build(units, dirs, flags)
        self._lib = ctypes.CDLL(str(self.path))

    def launch(self, name: str, grid: int | Sequence[int], block: int | Sequence[int], args: Sequence[Any],
               shared_mem: int = 0, order: str = "forward") -> None:
        """Runs kernel `name` over the grid; blocks one after another, threads lowest id first (or highest
        first with order="reverse")."""
        k = self.kernels.get(name)
        if k is None:
            raise ShimError(f"no kernel {name!r} in this module; it has {', '.join(sorted(self.kernels))}")
        if order not in ("forward", "reverse"):
            raise ValueError(f"order is {order!r}; use 'forward' or 'reverse'")
        if len(args) != len(k.params):
            raise TypeError(f"kernel {name!r} takes {len(k.params)} arguments "
                            f"({', '.join(p.name for p in k.params)}), got {len(args)}")
        keep: list[Any] = []
        ptrs = (ctypes.c_void_p * max(len(args), 1))()
        for i, (p, a) in enumerate(zip(k.params, args, strict=True)):
            v = _convert(name, p, a, keep)
            keep.append(v)
            ptrs[i] = ctypes.addressof(v)
        g, b = _dim3(grid, "grid"), _dim3(block, "block")
        err = ctypes.create_string_buffer(4096)
        fn = getattr(self._lib, f"pm_launch_{name}")
        with _LOCK:
            rc = fn((ctypes.c_longlong * 3)(*g), (ctypes.c_longlong * 3)(*b), ctypes.c_longlong(shared_mem), ptrs,
                    ctypes.c_int(order == "reverse"), err, ctypes.c_int(len(err)))
        if rc != 0:
            raise _RESULTS.get(rc, ShimError)(err.value.decode(errors="replace"))


def _dim3(v: int | Sequence[int], what: str) -> tuple[int, int, int]:
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
