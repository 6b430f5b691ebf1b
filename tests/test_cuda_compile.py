"""The CUDA compile gate: every source through NVRTC for four architectures (no GPU needed), and nvcc's
resource report: no register spills on the hot kernels (matmul and attention)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pocketmoe.ops.cuda import compile as cc

REASON = cc.nvrtc_unavailable_reason()
SOURCES = cc.sources()
HOT = ("matmul.cu", "attention.cu")
_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(')


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
@pytest.mark.parametrize("arch", cc.ARCHS)
@pytest.mark.parametrize("path", SOURCES, ids=[p.name for p in SOURCES])
def test_nvrtc_compiles(path: Path, arch: str) -> None:
    cubin = cc.nvrtc_compile(path, arch)
    assert cubin[:4] == b"\x7fELF"  # a cubin is an ELF image


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_nvrtc_error_carries_the_log(tmp_path: Path) -> None:
    bad = tmp_path / "bad.cu"
    bad.write_text('#include "common.cuh"\nextern "C" __global__ void k(float* y) { y[0] = undeclared_name; }\n')
    with pytest.raises(cc.CompileError, match="undeclared_name"):
        cc.nvrtc_compile(bad, "sm_86")


def test_sources_cover_the_contract() -> None:
    names = {p.name for p in SOURCES}
    assert {"norm_rope.cu", "route.cu", "attention.cu", "finalize.cu"} <= names
    assert (cc.SRC / "common.cuh").is_file()


def test_matmul_defines_every_registered_type() -> None:
    """Each weight type of the host table (matmul.KERNELS: NVFP4 among them) has its GEMV and grouped GEMM in
    matmul.cu, so the compile and spill gates cover it."""
    from pocketmoe.ops.cuda.matmul import KERNELS

    defined = set(_KERNEL.findall((cc.SRC / "matmul.cu").read_text()))
    want = {f"{kind}_{name}" for name, _ in KERNELS.values() for kind in ("gemv", "moe_gemm")}
    assert "gemv_nvfp4" in want and want <= defined, sorted(want - defined)


@pytest.mark.skipif(cc.nvcc_path() is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch", cc.ARCHS)
def test_hot_kernels_do_not_spill(arch: str) -> None:
    hot = [p for p in SOURCES if p.name in HOT]
    assert hot, "no hot kernel sources found"
    for path in hot:
        usage = cc.nvcc_usage(path, arch)
        # every kernel of the source is in the report, or the spill check would pass by missing one
        assert {u.kernel for u in usage} == set(_KERNEL.findall(path.read_text())), path.name
        spilled = [u for u in usage if u.spill_stores or u.spill_loads]
        assert not spilled, f"{path.name} {arch}: kernels spill registers: {spilled}"
        # nor keep arrays in local memory (a stack frame: a struct copied out of shared memory took 4.6 KiB)
        stacked = [u for u in usage if u.stack_bytes]
        assert not stacked, f"{path.name} {arch}: kernels keep a stack frame in local memory: {stacked}"
        assert all(0 < u.registers <= 255 for u in usage)


@pytest.mark.skipif(cc.nvcc_path() is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch", cc.ARCHS)
def test_attention_blocks_fit_the_shared_memory_of_a_launch(arch: str) -> None:
    """An attention block's static shared memory plus the most queries the backend gives it (ATT_QUERY_BYTES of
    dynamic shared memory) stays within the 48 KiB a launch gets without opting in: static arrays declared in a
    template instantiated per KV type took three times their size and V2-Lite's 37 KiB of queries went past it."""
    from pocketmoe.ops.cuda.backend import ATT_HEADS, ATT_QUERY_BYTES

    usage = {u.kernel: u for u in cc.nvcc_usage(cc.SRC / "attention.cu", arch)}
    assert ATT_HEADS * 576 * 4 <= ATT_QUERY_BYTES  # V2-Lite / V3's 16-head blocks of 576-float queries fit
    for kernel in ("mla_attention_f32", "gqa_attention_f32"):
        assert 0 < usage[kernel].shared_bytes and usage[kernel].shared_bytes + ATT_QUERY_BYTES <= 48 << 10, \
            usage[kernel]
