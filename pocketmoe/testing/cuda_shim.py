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
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from pocketmoe.testing.cuda_shim_kernels import (
    RESULT_ERRORS,
    Kernel,
    ShimCompileError,
    ShimDeadlockError,
    ShimDivergenceError,
    ShimError,
    ShimFaultError,
    ShimLaunchError,
    ShimSanitizerError,
    dim3,
    pack_args,
    parse_kernels,
    translation_unit,
)

__all__ = ["ORDERS", "ORDER_ENV", "POISONS", "POISON_ENV", "SANITIZE_ENV", "ShimCompileError", "ShimDeadlockError",
           "ShimDivergenceError", "ShimError", "ShimFaultError", "ShimLaunchError", "ShimLauncher", "ShimModule",
           "ShimSanitizerError", "asan_env", "asan_runtime", "cuda_include_dir", "parse_kernels",
           "shim_unavailable_reason"]

CUDA_DIR = Path(__file__).resolve().parent.parent / "ops" / "cuda"
SRC_DIR, SHIM_DIR = CUDA_DIR / "src", CUDA_DIR / "shim"
_FLAGS = ("-O2", "-std=c++17", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fstack-clash-protection",
          "-Wno-attributes")
# A load or store through a pointer not aligned to its type traps (SIGILL, raised as ShimFaultError): x86 reads
# it, a GPU stops the kernel with cudaErrorMisalignedAddress. ASan builds leave it out (their fault handling is
# ASan's own).
_ALIGN_FLAGS = ("-fsanitize=alignment", "-fsanitize-undefined-trap-on-error")
_ASAN_FLAGS = ("-fsanitize=address", "-fsanitize-recover=address", "-fno-omit-frame-pointer", "-g", "-O1",
               "-DPM_SHIM_ASAN")
SANITIZE_ENV = "POCKETMOE_CUDA_SHIM_SANITIZE"  # "1": every ShimModule builds with sanitize=True
# The thread schedules of a launch (cuda_shim.cpp run_block): "forward" / "reverse", every thread one step per
# round, lowest / highest id first; "warps" / "warps-reverse", one warp at a time, each until it waits at a
# __syncthreads() (an unfair schedule a GPU may pick: it shows inter-warp races on shared memory).
ORDERS = {"forward": 0, "reverse": 1, "warps": 2, "warps-reverse": 3}
ORDER_ENV = "POCKETMOE_CUDA_SHIM_ORDER"  # the schedule of launches that name none (default "forward")
# What shared memory holds before a block writes it (cuda_shim.cpp pm_shim_set_poison): "nan", 0xFF bytes (NaN
# as float or half; fmaxf / fminf drop it), or "huge", 0x7F bytes (3.4e38 as float, which they keep).
POISONS = {"nan": 0xFF, "huge": 0x7F}
POISON_ENV = "POCKETMOE_CUDA_SHIM_POISON"  # default "nan"
_LOCK = threading.Lock()


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


_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def _local_includes(sources: list[Path], include_dirs: list[Path]) -> list[Path]:
    """Every file the sources `#include "..."`, transitively (the toolkit's <...> headers are keyed by path)."""
    seen: dict[Path, None] = {}
    todo = list(sources)
    while todo:
        src = todo.pop()
        for name in _INCLUDE.findall(src.read_text()):
            hit = next((d / name for d in [src.parent, *include_dirs] if (d / name).is_file()), None)
            if hit is not None and hit.resolve() not in seen:
                seen[hit.resolve()] = None
                todo.append(hit)
    return sorted(seen)


def _build(units: dict[str, str], deps: list[Path], include_dirs: list[Path], flags: tuple[str, ...]) -> Path:
    cxx, inc = _cxx(), cuda_include_dir()
    if reason := shim_unavailable_reason():
        raise ShimError(reason)
    h = hashlib.sha256(repr((cxx, str(inc), flags, sorted(units.items()))).encode())
    for f in [*sorted(SHIM_DIR.iterdir()), *deps]:
        if f.is_file():
            h.update(str(f).encode() + b"\0" + f.read_bytes())
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

    def __init__(self, sources: Sequence[str | os.PathLike], sanitize: bool | None = None,
                 defines: Sequence[str] = ()) -> None:
        """`sanitize`: build with AddressSanitizer (default: $POCKETMOE_CUDA_SHIM_SANITIZE == "1"; the process needs libasan
        preloaded, see `python -m pocketmoe.testing.cuda_shim --asan`); `defines`: extra -D macros."""
        if sanitize is None:
            sanitize = os.environ.get(SANITIZE_ENV) == "1"
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
            units[f"{i}_{p.stem}"] = translation_unit(p, text, kernels)
        if sanitize and not hasattr(ctypes.CDLL(None), "__asan_init"):
            raise ShimError("sanitize=True needs the AddressSanitizer runtime in this process: run Python with "
                            f"LD_PRELOAD={asan_runtime()} ASAN_OPTIONS=detect_leaks=0:halt_on_error=0, or run "
                            "pytest with python -m pocketmoe.testing.cuda_shim --asan")
        dirs = list(dict.fromkeys([*(p.parent for p in paths), SRC_DIR]))
        flags = _FLAGS + (_ASAN_FLAGS if sanitize else _ALIGN_FLAGS) + tuple(f"-D{d}" for d in defines)
        self.path = _build(units, _local_includes(paths, dirs), dirs, flags)
        self._lib = ctypes.CDLL(str(self.path))

    def launch(self, name: str, grid: int | Sequence[int], block: int | Sequence[int], args: Sequence[Any],
               shared_mem: int = 0, order: str | None = None) -> None:
        """Runs kernel `name` over the grid; blocks one after another, their threads in `order` (ORDERS; None:
        $POCKETMOE_CUDA_SHIM_ORDER, else "forward")."""
        what = "order"
        if order is None:
            order, what = os.environ.get(ORDER_ENV) or "forward", f"${ORDER_ENV}"
        k = self.kernels.get(name)
        if k is None:
            raise ShimError(f"no kernel {name!r} in this module; it has {', '.join(sorted(self.kernels))}")
        if order not in ORDERS:
            raise ValueError(f"{what} is {order!r}; use one of {', '.join(map(repr, ORDERS))}")
        poison = os.environ.get(POISON_ENV) or "nan"
        if poison not in POISONS:
            raise ValueError(f"${POISON_ENV} is {poison!r}; use one of {', '.join(map(repr, POISONS))}")
        ptrs, keep = pack_args(k, args)
        g, b = dim3(grid, "grid"), dim3(block, "block")
        err = ctypes.create_string_buffer(4096)
        fn = getattr(self._lib, f"pm_launch_{name}")
        with _LOCK:
            self._lib.pm_shim_set_poison(ctypes.c_int(POISONS[poison]))
            rc = fn((ctypes.c_longlong * 3)(*g), (ctypes.c_longlong * 3)(*b), ctypes.c_longlong(shared_mem), ptrs,
                    ctypes.c_int(ORDERS[order]), err, ctypes.c_int(len(err)))
        if rc != 0:
            raise RESULT_ERRORS.get(rc, ShimError)(err.value.decode(errors="replace"))


class ShimLauncher:
    """The CUDA op backend's launcher (backend.Launcher) on the shim: one ShimModule per source, built on first use,
    its threads run in `order` (ORDERS; None: $POCKETMOE_CUDA_SHIM_ORDER, else "forward")."""

    def __init__(self, src: Path | None = None, order: str | None = None) -> None:
        """src: a folder holding (a copy of) the kernel sources (default: the package's own)."""
        self.src, self.order = src, order
        self.modules: dict[str, ShimModule] = {}

    def __call__(self, source: str, kernel: str, grid: Sequence[int], block: Sequence[int], args: Sequence[Any],
                 shared_mem: int = 0) -> None:
        if source not in self.modules:
            self.modules[source] = ShimModule([source if self.src is None else self.src / source])
        self.modules[source].launch(kernel, grid=grid, block=block, args=args, shared_mem=shared_mem,
                                    order=self.order)


def asan_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """An environment in which Python loads sanitize=True modules (and builds every module so): libasan
    preloaded, leak checks off (Python itself leaks), reports raised as ShimSanitizerError, not fatal."""
    env = dict(os.environ if base is None else base)
    opts = "detect_leaks=0:halt_on_error=0"
    env.update(LD_PRELOAD=asan_runtime(), ASAN_OPTIONS=opts + ":" + env.get("ASAN_OPTIONS", ""))
    env[SANITIZE_ENV] = "1"
    return env


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m pocketmoe.testing.cuda_shim --asan [pytest args]`: pytest with every shim kernel under ASan."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "--asan":
        print("usage: python -m pocketmoe.testing.cuda_shim --asan [pytest arguments]", file=sys.stderr)
        return 2
    return subprocess.run([sys.executable, "-m", "pytest", *args[1:]], env=asan_env()).returncode


if __name__ == "__main__":
    raise SystemExit(main())
