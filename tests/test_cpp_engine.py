"""The standalone C++ tests of cpp_engine/ (kernels vs the scalar reference, bitwise stability, gemm_multi,
gemm_batched and MoE against gemm, the VNNI kernels against AVX2 through SIMDe's portable vpdpbusd /
vpdpwssd, the AVX-512 set's 512-bit tiles against AVX2 through SIMDe's AVX-512, and the AMX set over an
emulation of the tile instructions), built with CMake into a temporary folder and run."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_cpp_kernel_tests(tmp_path: Path) -> None:
    build = tmp_path / "build"
    subprocess.run(["cmake", "-S", str(ROOT / "cpp_engine"), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release"],
                   check=True, capture_output=True, text=True, timeout=300)
    made = subprocess.run(["cmake", "--build", str(build), "-j2", "--target", "test_kernels"],
                          capture_output=True, text=True, timeout=900)
    assert made.returncode == 0, made.stdout[-4000:] + made.stderr[-4000:]
    run = subprocess.run([str(build / "test_kernels")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.rstrip().endswith("all passed"), run.stdout[-4000:]
    # The VNNI kernels cannot run natively on an AVX2-only machine; with SIMDe (Debian libsimde-dev,
    # which `make test` installs) they run here, and must have.
    if Path("/usr/include/simde/x86/avx512/dpbusd.h").exists():
        assert re.search(r"^vnni_kernels_match_avx2\s+ok$", run.stdout, re.M), run.stdout[-4000:]
        assert re.search(r"^avx512_kernels_match_avx2\s+ok$", run.stdout, re.M), run.stdout[-4000:]
        assert re.search(r"^amx_kernels_match_avx2\s+ok$", run.stdout, re.M), run.stdout[-4000:]
