"""The compile gate: every CUDA source of src/ through NVRTC for each target architecture, no GPU needed,
and nvcc's per-kernel registers, shared memory and spills when nvcc is installed.

NVRTC comes from CuPy's low-level binding (`cupy.cuda.nvrtc`, which loads libnvrtc of the pip package
nvidia-cuda-nvrtc-cu12 through cuda-pathfinder); compiling to cubin needs neither a device nor a driver.
NVRTC has no system headers: cuda_fp16.h / cuda_bf16.h come from the toolkit include directory
(`cuda_include_dir`). `python -m pocketmoe.ops.cuda.compile` prints the per-kernel table.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pocketmoe.errors import PocketMoEError

SRC = Path(__file__).parent / "src"
ARCHS = ("sm_75", "sm_86", "sm_89", "sm_90")


class CompileError(PocketMoEError):
    """A CUDA source that NVRTC or nvcc rejects; the message carries the compiler's log."""


def sources() -> list[Path]:
    """Every compilable source (the .cu files; headers come in through them)."""
    return sorted(SRC.glob("*.cu"))


def cuda_include_dir() -> str | None:
    """The directory holding cuda_fp16.h: $CUDA_PATH / $CUDA_HOME, /usr/local/cuda*, then cuda-pathfinder's
    search (pip nvidia-cuda-runtime headers among others); None when there is none."""
    roots = [os.environ.get(v) for v in ("CUDA_PATH", "CUDA_HOME")] + ["/usr/local/cuda"]
    roots += sorted((str(p) for p in Path("/usr/local").glob("cuda-*")), reverse=True)
    for root in roots:
        if root and (Path(root) / "include" / "cuda_fp16.h").is_file():
            return str(Path(root) / "include")
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("cudart")
    except Exception:  # noqa: BLE001 - pathfinder absent or nothing found
        return None
    return found if found and (Path(found) / "cuda_fp16.h").is_file() else None


def nvrtc_options(arch: str, include_dir: str) -> list[str]:
    return [f"--gpu-architecture={arch}", "--std=c++17", f"-I{SRC}", f"-I{include_dir}"]


def nvrtc_unavailable_reason() -> str | None:
    """Why NVRTC cannot compile here (None when it can)."""
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # noqa: BLE001 - import error or libnvrtc missing
        return f"CuPy's NVRTC binding is unavailable ({exc}); pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12"
    if cuda_include_dir() is None:
        return "no CUDA include directory with cuda_fp16.h was found; set CUDA_PATH to a CUDA toolkit"
    return None


def nvrtc_compile(path: Path, arch: str, include_dir: str | None = None) -> bytes:
    """The cubin of one source for one architecture (CompileError with NVRTC's log on failure)."""
    from cupy.cuda import nvrtc

    include_dir = include_dir or cuda_include_dir()
    if include_dir is None:
        raise CompileError("no CUDA include directory with cuda_fp16.h was found; set CUDA_PATH to a CUDA toolkit.")
    prog = nvrtc.createProgram(path.read_text(), path.name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, nvrtc_options(arch, include_dir))
        except nvrtc.NVRTCError as exc:
            raise CompileError(f"NVRTC failed on {path.name} for {arch} ({exc}):\n{nvrtc.getProgramLog(prog)}") from exc
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


@dataclass(frozen=True)
class KernelUsage:
    """ptxas's resource report of one kernel for one architecture."""

    source: str
    kernel: str
    arch: str
    registers: int
    shared_bytes: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int


_FUNC = re.compile(r"Function properties for (\w+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?, (\d+) bytes smem)?")


def parse_ptxas(log: str, source: str, arch: str) -> list[KernelUsage]:
    """KernelUsage per 'Function properties' block of `nvcc -Xptxas -v` output (extern "C" names)."""
    out, name, frame = [], None, (0, 0, 0)
    for line in log.splitlines():
        if m := _FUNC.search(line):
            name, frame = m.group(1), (0, 0, 0)
        elif (m := _FRAME.search(line)) and name:
            frame = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
        elif (m := _USED.search(line)) and name:
            out.append(KernelUsage(source, name, arch, int(m.group(1)), int(m.group(2) or 0), *frame))
            name = None
    return out


def nvcc_path() -> str | None:
    return shutil.which("nvcc") or next((str(p) for p in sorted(Path("/usr/local").glob("cuda*/bin/nvcc"))), None)


def nvcc_usage(path: Path, arch: str, nvcc: str | None = None) -> list[KernelUsage]:
    """`nvcc -cubin -Xptxas -v` of one source: the kernels' registers, shared memory and spills."""
    nvcc = nvcc or nvcc_path()
    if nvcc is None:
        raise CompileError("nvcc was not found; install a CUDA toolkit or put nvcc on PATH.")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [nvcc, "-cubin", f"-arch={arch}", "-Xptxas", "-v", "-std=c++17", f"-I{SRC}", str(path),
               "-o", str(Path(tmp) / "out.cubin")]
        res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise CompileError(f"nvcc failed on {path.name} for {arch}:\n{res.stderr}")
    return parse_ptxas(res.stderr, path.name, arch)


def main(argv: list[str] | None = None) -> int:
    archs = tuple(argv) if argv else ARCHS
    reason = nvrtc_unavailable_reason()
    failed = 0
    for path in sources():
        for arch in archs:
            if reason is None:
                try:
                    size = len(nvrtc_compile(path, arch))
                    print(f"nvrtc {arch} {path.name}: ok ({size} bytes cubin)")
                except CompileError as exc:
                    failed += 1
                    print(exc)
    if reason is not None:
        print(f"nvrtc: skipped ({reason})")
    if nvcc_path() is None:
        print("nvcc: not found; no per-kernel table")
        return 1 if failed else 0
    print(f"\n{'source':<14} {'kernel':<28} {'arch':<6} {'regs':>5} {'smem B':>7} {'stack B':>7} {'spill st/ld':>12}")
    for path in sources():
        for arch in archs:
            try:
                rows = nvcc_usage(path, arch)
            except CompileError as exc:
                failed += 1
                print(exc)
                continue
            for u in rows:
                print(f"{u.source:<14} {u.kernel:<28} {u.arch:<6} {u.registers:>5} {u.shared_bytes:>7} "
                      f"{u.stack_bytes:>7} {u.spill_stores:>6}/{u.spill_loads:<5}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
