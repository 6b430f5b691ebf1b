"""The CPU execution shim for CUDA C (pocketmoe/ops/cuda/shim + pocketmoe.testing.cuda_shim), on small kernels
of its own (tests/cuda_kernels/), against numpy/torch/gguf computations of the same thing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pocketmoe.testing.cuda_shim import (
    ORDER_ENV,
    ORDERS,
    POISON_ENV,
    POISONS,
    SANITIZE_ENV,
    ShimDeadlockError,
    ShimDivergenceError,
    ShimError,
    ShimFaultError,
    ShimLaunchError,
    ShimModule,
    ShimSanitizerError,
    parse_kernels,
    shim_unavailable_reason,
)

pytestmark = pytest.mark.skipif(shim_unavailable_reason() is not None, reason=str(shim_unavailable_reason()))

KERNELS = Path(__file__).parent / "cuda_kernels"
SANITIZED = os.environ.get(SANITIZE_ENV) == "1"  # inside test_address_sanitizer_run


@pytest.fixture(scope="module")
def basics() -> ShimModule:
    return ShimModule([KERNELS / "shim_basics.cu"])


@pytest.fixture(scope="module")
def errors() -> ShimModule:
    return ShimModule([KERNELS / "shim_errors.cu"])


def _line_of(path: Path, needle: str, after: str) -> int:
    """1-based line of the first `needle` after the line holding `after`."""
    lines = path.read_text().splitlines()
    start = next(i for i, s in enumerate(lines) if after in s)
    return next(i for i in range(start, len(lines)) if needle in lines[i]) + 1


@pytest.mark.parametrize("order", list(ORDERS))
def test_block_reduction_through_shared_memory(order: str) -> None:
    mod = ShimModule([KERNELS / "shim_reduce.cu"])
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    out = torch.zeros(4)
    mod.launch("block_tree_sum", grid=4, block=256, args=[x, out, 1000], order=order)
    ref = np.pad(x.numpy().astype(np.float64), (0, 24)).reshape(4, 256).sum(1)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("order", list(ORDERS))
def test_two_block_sums_through_one_scratch(order: str) -> None:
    """Every schedule sums right when the scratch array's reuse is behind a barrier."""
    mod = ShimModule([KERNELS / "shim_reduce.cu"])
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(3))
    s, s2 = torch.zeros(2, 256), torch.zeros(2, 256)
    mod.launch("sum_and_squares", grid=2, block=256, args=[x, s, s2], order=order)
    ref = x.double().sum(1, keepdim=True).expand(2, 256)
    np.testing.assert_allclose(s.numpy(), ref.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s2.numpy(), (x.double() ** 2).sum(1, keepdim=True).expand(2, 256).numpy(), rtol=1e-5)


@pytest.mark.parametrize("order", ["warps", "warps-reverse"])
def test_one_warp_at_a_time_shows_a_missing_reuse_barrier(order: str) -> None:
    """Without the barrier before the second sum writes scratch, a warp that runs ahead overwrites a partial
    another warp has yet to read (on a GPU, a race): the warps-one-at-a-time schedules get wrong sums."""
    mod = ShimModule([KERNELS / "shim_reduce.cu"], defines=["NO_REUSE_BARRIER"])
    x = torch.rand(2, 256, generator=torch.Generator().manual_seed(3)) + 0.5
    s, s2 = torch.zeros(2, 256), torch.zeros(2, 256)
    mod.launch("sum_and_squares", grid=2, block=256, args=[x, s, s2], order=order)
    ref = x.double().sum(1, keepdim=True).expand(2, 256).numpy()
    assert not np.allclose(s.numpy(), ref, rtol=1e-3), "the racy kernel still sums right"


def test_ucontext_switch_gives_the_same_results() -> None:
    """The portable swapcontext path (the default elsewhere than x86-64) on the reduction and the shuffles."""
    mod = ShimModule([KERNELS / "shim_reduce.cu", KERNELS / "shim_basics.cu"], defines=["PM_SHIM_UCONTEXT"])
    x = torch.randn(512, generator=torch.Generator().manual_seed(8))
    out = torch.zeros(2)
    mod.launch("block_tree_sum", grid=2, block=256, args=[x, out, 512])
    np.testing.assert_allclose(out.numpy(), x.view(2, 256).double().sum(1).numpy(), rtol=1e-5, atol=1e-4)
    xor_sum, down, bcast = torch.empty(64), torch.empty(64), torch.empty(64)
    mod.launch("warp_shuffles", grid=1, block=64, args=[x[:64].contiguous(), xor_sum, down, bcast, 3, 9, 32])
    np.testing.assert_array_equal(down[:32].numpy(), _shfl_down(x[:32].numpy(), 3, 32))
    np.testing.assert_array_equal(bcast[32:].numpy(), _shfl_idx(x[32:64].numpy(), 9, 32))


@pytest.mark.parametrize("which", [0, 1])
def test_mutation_removing_a_barrier_breaks_the_reduction(tmp_path: Path, which: int) -> None:
    """Mutation check: the reduction with its first (or its loop's) __syncthreads() removed goes wrong."""
    text = (KERNELS / "shim_reduce.cu").read_text()
    at = [i for i in range(len(text)) if text.startswith("__syncthreads();", i)][which]
    mutated = tmp_path / f"reduce_mutated_{which}.cu"
    mutated.write_text(text[:at] + "/* barrier removed */;" + text[at + len("__syncthreads();"):])
    mod = ShimModule([mutated])
    x = torch.rand(1024, generator=torch.Generator().manual_seed(2)) + 0.5
    ref = x.numpy().astype(np.float64).reshape(4, 256).sum(1)
    out = torch.zeros(4)
    mod.launch("block_tree_sum", grid=4, block=256, args=[x, out, 1024])  # the default, lowest thread first
    assert not np.allclose(out.numpy(), ref, rtol=1e-3), f"the mutant still sums right: {out} vs {ref}"


def _shfl_down(x: np.ndarray, delta: int, width: int) -> np.ndarray:
    out = x.copy()
    for lane in range(32):
        if lane + delta < (lane // width + 1) * width:  # stays inside the lane's width-segment
            out[lane] = x[lane + delta]
    return out


def _shfl_idx(x: np.ndarray, src: int, width: int) -> np.ndarray:
    return np.array([x[(lane // width) * width + src % width] for lane in range(32)], dtype=x.dtype)


@pytest.mark.parametrize(("delta", "src", "width"), [(1, 0, 32), (5, 7, 32), (16, 31, 32), (31, 40, 32),
                                                     (3, 5, 8), (1, 17, 16), (8, 3, 16)])
def test_warp_shuffles_match_cuda_semantics(basics: ShimModule, delta: int, src: int, width: int) -> None:
    x = torch.randn(128, generator=torch.Generator().manual_seed(3))
    xor_sum, down, bcast = torch.empty(128), torch.empty(128), torch.empty(128)
    basics.launch("warp_shuffles", grid=2, block=64, args=[x, xor_sum, down, bcast, delta, src, width])
    for w in range(4):
        xw = x[32 * w:32 * w + 32].numpy()
        np.testing.assert_allclose(xor_sum[32 * w:32 * w + 32].numpy(), np.full(32, xw.sum()), rtol=1e-5, atol=1e-5)
        assert len(set(xor_sum[32 * w:32 * w + 32].tolist())) == 1  # the butterfly leaves every lane bitwise equal
        np.testing.assert_array_equal(down[32 * w:32 * w + 32].numpy(), _shfl_down(xw, delta, width))
        np.testing.assert_array_equal(bcast[32 * w:32 * w + 32].numpy(), _shfl_idx(xw, src, width))


def test_dp4a_matches_numpy(basics: ShimModule) -> None:
    rng = np.random.default_rng(4)
    a, b, c = (rng.integers(-2**31, 2**31, 1000, dtype=np.int64).astype(np.int32) for _ in range(3))
    a[:4] = [-2**31, 2**31 - 1, 0x7F7F7F7F, -1]
    b[:4] = [-2**31, 2**31 - 1, 0x7F7F7F7F, -1]
    c[:4] = [2**31 - 1, -2**31, 2**31 - 1, 0]  # the accumulator wraps as the hardware's does
    out = torch.empty(1000, dtype=torch.int32)
    basics.launch("dp4a_kernel", grid=8, block=128, args=[torch.from_numpy(a), torch.from_numpy(b),
                                                          torch.from_numpy(c), out, 1000])
    dot = (a.view(np.int8).reshape(-1, 4).astype(np.int64) * b.view(np.int8).reshape(-1, 4)).sum(1)
    ref = ((dot + c + 2**31) % 2**32 - 2**31).astype(np.int32)
    np.testing.assert_array_equal(out.numpy(), ref)


def test_half_and_bf16_round_trips_match_torch(basics: ShimModule) -> None:
    special = [0.0, -0.0, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 65504.0, 65520.0, 1e-8, 6e-8, -3e-5, 1.0 + 2**-8,
               1.0 + 3 * 2**-8, 3e38, float("inf"), -float("inf"), float("nan")]
    x = torch.cat([torch.tensor(special), torch.randn(500, generator=torch.Generator().manual_seed(5)) * 300])
    n = x.numel()
    h = (torch.randn(n, generator=torch.Generator().manual_seed(6)) * 1000).half()
    via_half, via_bf16, h_bf16 = torch.empty(n), torch.empty(n), torch.empty(n, dtype=torch.bfloat16)
    basics.launch("half_round_trip", grid=(n + 127) // 128, block=128, args=[x, via_half, via_bf16, h, h_bf16, n])
    torch.testing.assert_close(via_half, x.half().float(), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(via_bf16, x.bfloat16().float(), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(h_bf16, h.float().bfloat16(), rtol=0, atol=0)


def test_dynamic_shared_memory(basics: ShimModule) -> None:
    x = torch.arange(384, dtype=torch.float32)
    y = torch.empty(384)
    basics.launch("dynamic_reverse", grid=3, block=128, args=[x, y], shared_mem=128 * 4)
    torch.testing.assert_close(y, x.view(3, 128).flip(1).reshape(-1), rtol=0, atol=0)


@pytest.mark.parametrize("poison", [None, *POISONS])
def test_shared_memory_is_poisoned_each_block(basics: ShimModule, monkeypatch, poison: str | None) -> None:
    if poison is not None:
        monkeypatch.setenv(POISON_ENV, poison)
    static_bits, dynamic_bits = torch.zeros(128, dtype=torch.int32), torch.zeros(128, dtype=torch.int32)
    basics.launch("read_unwritten", grid=2, block=64, args=[static_bits, dynamic_bits], shared_mem=64 * 4)
    word = int.from_bytes(bytes([POISONS[poison or "nan"]]) * 4, "little", signed=True)  # nan: -1
    assert (static_bits == word).all() and (dynamic_bits == word).all()


def test_unknown_order_is_a_clear_error(basics: ShimModule, monkeypatch) -> None:
    monkeypatch.setenv(ORDER_ENV, "random")
    with pytest.raises(ValueError, match=r"POCKETMOE_CUDA_SHIM_ORDER is 'random'; use one of 'forward', 'reverse'"):
        basics.launch("read_unwritten", grid=1, block=64, args=[torch.zeros(64, dtype=torch.int32)] * 2,
                      shared_mem=64 * 4)
    with pytest.raises(ValueError, match=r"order is 'sideways'"):
        basics.launch("read_unwritten", grid=1, block=64, args=[torch.zeros(64, dtype=torch.int32)] * 2,
                      shared_mem=64 * 4, order="sideways")


def test_unknown_poison_is_a_clear_error(basics: ShimModule, monkeypatch) -> None:
    monkeypatch.setenv(POISON_ENV, "zeros")
    with pytest.raises(ValueError, match=r"POCKETMOE_CUDA_SHIM_POISON is 'zeros'; use one of 'nan', 'huge'"):
        basics.launch("read_unwritten", grid=1, block=64, args=[torch.zeros(64, dtype=torch.int32)] * 2,
                      shared_mem=64 * 4)


def test_multidimensional_grid_and_block(basics: ShimModule) -> None:
    grid, block = (3, 2, 2), (32, 2, 2)
    nb, nt = 12, 128
    out = torch.full((nb * nt, 12), -7, dtype=torch.int32)
    basics.launch("coordinates", grid=grid, block=block, args=[out])
    bz, by, bx, tz, ty, tx = np.meshgrid(*(np.arange(d) for d in (grid[2], grid[1], grid[0], block[2], block[1],
                                                                   block[0])), indexing="ij")
    ref = np.stack([tx, ty, tz, bx, by, bz] + [np.full_like(tx, d) for d in block + grid], -1).reshape(-1, 12)
    np.testing.assert_array_equal(out.numpy(), ref)


def test_pointer_array_long_long_and_float_parameters(basics: ShimModule) -> None:
    ts = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (10, 40, 7)]
    out = torch.zeros(3)
    basics.launch("pointer_array_sum", grid=1, block=32, args=[ts, out, 3, 7, 0.5])
    torch.testing.assert_close(out, torch.stack([t[:7].sum() for t in ts]) + 0.5)


def test_barrier_reached_by_one_warp_is_divergence(errors: ShimModule) -> None:
    line = _line_of(KERNELS / "shim_errors.cu", "__syncthreads", "barrier_in_branch")
    with pytest.raises(ShimDivergenceError) as e:
        errors.launch("barrier_in_branch", grid=2, block=64, args=[torch.zeros(64)])
    msg = str(e.value)
    assert "kernel 'barrier_in_branch' block (0,0,0)" in msg and "threads 32-63 have exited" in msg
    assert f"threads 0-31 wait at __syncthreads() ({KERNELS / 'shim_errors.cu'}:{line})" in msg


def test_two_different_barriers_are_divergence(errors: ShimModule) -> None:
    with pytest.raises(ShimDivergenceError, match=r"threads 0-31 wait at __syncthreads\(\) .*threads 32-63 wait"):
        errors.launch("two_barriers", grid=1, block=64, args=[torch.zeros(64)])


def test_half_warp_at_a_shuffle_is_divergence(errors: ShimModule) -> None:
    with pytest.raises(ShimDivergenceError, match=r"warp 0: threads 0-15 wait at __shfl_xor_sync\(\)"):
        errors.launch("shuffle_half_warp", grid=1, block=32, args=[torch.zeros(32)])


def test_shuffle_against_barrier_is_deadlock(errors: ShimModule) -> None:
    with pytest.raises(ShimDeadlockError, match=r"no thread can proceed: threads 16-31,48-63 wait at __syncthreads"):
        errors.launch("shuffle_vs_barrier", grid=1, block=64, args=[torch.zeros(64)])


def test_module_runs_again_after_an_error(errors: ShimModule) -> None:
    with pytest.raises(ShimDivergenceError):
        errors.launch("barrier_in_branch", grid=1, block=64, args=[torch.zeros(64)])
    y = torch.zeros(128)
    errors.launch("write_past_end", grid=2, block=64, args=[y, 127])
    assert (y == 2).all()


@pytest.mark.parametrize(("kernel", "args", "match"), [
    ("write_past_end", [None, 10], r"thread \(0,0,0\) accessed invalid memory at address 0x0"),
    ("huge_locals", [torch.zeros(64), 32768], r"thread \(0,0,0\) overflowed its 64 KiB stack"),
    ("divide", [torch.zeros(64, dtype=torch.int32), 0], r"thread \(0,0,0\) raised an arithmetic exception"),
    ("misaligned_load", [torch.arange(64, dtype=torch.uint8), 2, torch.zeros(64, dtype=torch.int32)],
     r"thread \(0,0,0\) made a misaligned load or store \(in misaligned_load\+0x[0-9a-f]+\).*"
     r"cudaErrorMisalignedAddress"),
])
@pytest.mark.skipif(SANITIZED, reason="AddressSanitizer reports faults itself")
def test_faults_are_errors_not_crashes(errors: ShimModule, kernel: str, args: list, match: str) -> None:
    with pytest.raises(ShimFaultError, match=rf"kernel '{kernel}' block \(0,0,0\): {match}"):
        errors.launch(kernel, grid=1, block=64, args=args)
    y = torch.zeros(64, dtype=torch.int32)
    errors.launch("divide", grid=1, block=64, args=[y, 7])  # the module still runs
    assert (y == 1000 // 7).all()


@pytest.mark.skipif(SANITIZED, reason="the AddressSanitizer build does not check alignment")
def test_aligned_loads_do_not_trap(errors: ShimModule) -> None:
    """The alignment check is exact: a 4-byte load at offset 4 reads its word (offset 2 traps, above)."""
    p, y = torch.arange(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.int32)
    errors.launch("misaligned_load", grid=1, block=64, args=[p, 4, y])
    assert (y == int.from_bytes(bytes(range(4, 8)), "little")).all()


@pytest.mark.parametrize(("grid", "block", "shared", "match"), [
    (1, (1056, 1, 1), 0, r"block\.x is 1056; it must be in 1\.\.1024"),
    (1, (32, 33, 1), 0, r"the block has 1056 threads; at most 1024"),
    (1, 48, 0, r"blockDim\.x is 48; it must be a multiple of 32"),
    (0, 32, 0, r"grid\.x is 0"),
    (1, 32, 300_000, r"shared_mem is 300000 bytes"),
    (1, 32, 49_153, r"shared_mem is 49153 bytes; it must be in 0\.\.49152 \(more needs cudaFuncSetAttribute"),
])
def test_bad_launch_configuration(errors: ShimModule, grid, block, shared: int, match: str) -> None:
    with pytest.raises(ShimLaunchError, match=match):
        errors.launch("write_past_end", grid=grid, block=block, args=[torch.zeros(64), 0], shared_mem=shared)


@pytest.mark.parametrize(("args", "match"), [
    ([torch.zeros(8)], r"takes 2 arguments \(y, n\), got 1"),
    ([torch.zeros(8, dtype=torch.float64), 1], r"needs torch\.float32, got torch\.float64"),
    ([torch.zeros(8, 2).t(), 1], r"is not contiguous"),
    ([torch.zeros(8), 1.5], r"needs a Python int, got float"),
    ([torch.zeros(8), True], r"needs a Python int, got bool"),
    ([torch.zeros(8), 2**31], r"does not fit int"),
    ([[torch.zeros(8)], 1], r"needs a torch CPU tensor or None, got list"),
])
def test_wrong_arguments_are_type_errors(errors: ShimModule, args: list, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        errors.launch("write_past_end", grid=1, block=32, args=args)


def test_signature_parsing() -> None:
    src = textwrap.dedent("""\
        // extern "C" __global__ void commented_out(int a) {}
        extern "C" __global__ void __launch_bounds__(256) k(const uint8_t* const* __restrict__ w,
                                                           const __half* x, long long n, float s) {}
        """)
    (k,) = parse_kernels(src, "x.cu")
    assert k.name == "k" and [(p.name, p.kind, p.dtype) for p in k.params] == [
        ("w", "ptrs", "uint8"), ("x", "ptr", "float16"), ("n", "int", None), ("s", "float", None)]
    with pytest.raises(ShimError, match=r"parameter 'v' has type 'double'"):
        parse_kernels('extern "C" __global__ void bad(double v) {}', "y.cu")


def test_q8_0_gemv_1024_matches_gguf_and_is_fast() -> None:
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize

    mod = ShimModule([KERNELS / "shim_gemv.cu"])
    rng = np.random.default_rng(7)
    q = quantize(rng.standard_normal((1024, 1024)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    x = rng.standard_normal(1024).astype(np.float32)
    y = torch.empty(1024)
    start = time.perf_counter()
    mod.launch("q8_0_gemv_f32", grid=256, block=128, args=[torch.from_numpy(q), torch.from_numpy(x), y, 1024, 1024])
    print(f"shim Q8_0 GEMV 1024x1024 (4 warps per block, one row per warp): {time.perf_counter() - start:.3f} s")
    ref = dequantize(q, gguf.GGMLQuantizationType.Q8_0).astype(np.float64) @ x.astype(np.float64)
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-4, atol=1e-3)


@pytest.mark.skipif(not SANITIZED, reason="runs inside the AddressSanitizer run (test_address_sanitizer_run)")
def test_sanitizer_reports_an_out_of_bounds_write(errors: ShimModule) -> None:
    y = torch.zeros(100)
    errors.launch("write_past_end", grid=4, block=32, args=[y, 99])  # in bounds: clean
    with pytest.raises(ShimSanitizerError, match=r"kernel 'write_past_end' block \(3,0,0\): thread \(4,0,0\): "
                                                 r"AddressSanitizer: heap-buffer-overflow .*shim_errors\.cu:\d+"):
        errors.launch("write_past_end", grid=4, block=32, args=[y, 100])


@pytest.mark.skipif(not SANITIZED, reason="runs inside the AddressSanitizer run (test_address_sanitizer_run)")
def test_sanitizer_reports_dynamic_shared_memory_past_the_launch_size(errors: ShimModule) -> None:
    y = torch.zeros(64)
    errors.launch("shared_past_end", grid=1, block=64, args=[y, 0], shared_mem=64 * 4)
    assert (y == 1).all()
    with pytest.raises(ShimSanitizerError, match=r"thread \(0,0,0\): AddressSanitizer: use-after-poison"):
        errors.launch("shared_past_end", grid=1, block=64, args=[y, 64], shared_mem=64 * 4)


def _asan_pytest(files: list[str], deselect: str, timeout: int, **env: str) -> subprocess.CompletedProcess:
    """pytest on `files` with every shim kernel built with -fsanitize=address, libasan preloaded."""
    return subprocess.run([sys.executable, "-m", "pocketmoe.testing.cuda_shim", "--asan", *files, "-q", "-rA",
                           "-p", "no:cacheprovider", "-k", deselect],
                          env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent), **env),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(SANITIZED, reason="this is the outer run")
def test_address_sanitizer_run() -> None:
    """This file again, every kernel built with -fsanitize=address, in a Python with libasan preloaded: the
    kernels run clean, and the two deliberate out-of-bounds accesses above are caught."""
    r = _asan_pytest([__file__], "not mutation and not ucontext", timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    for name in ("test_sanitizer_reports_an_out_of_bounds_write",
                 "test_sanitizer_reports_dynamic_shared_memory_past_the_launch_size", "test_dp4a_matches_numpy"):
        assert f"PASSED tests/test_cuda_shim.py::{name}" in r.stdout, r.stdout[-4000:]


@pytest.mark.skipif(SANITIZED, reason="this is the outer run")
def test_engine_kernels_under_address_sanitizer_one_warp_at_a_time() -> None:
    """The engine's kernels (src/: matmul, attention, norms, rope, routing, finalize, the expert kernels) under
    AddressSanitizer, through their own tests against the torch / gguf references: no kernel reads or writes
    past a buffer it is given (an access a GPU may not fault on, or faults on far from its cause). The schedule
    and the poison differ from the plain run's (every thread a step per round, lowest first; NaN): one warp at a
    time, highest first, so a warp runs ahead of the others to its next barrier, and shared memory starts as
    3.4e38, which fmaxf keeps where it drops NaN. A read of shared memory that another warp writes with no
    barrier between (or a write over a value another warp has yet to read) then meets the poison. New tensors
    start as NaN (conftest.py FILL_ENV), as stale device memory would: an output read before it is written
    shows. The mutation checks and the barrier sweep stay out (they test the tests; the misaligned-load mutant
    is the plain build's to trap)."""
    tests = Path(__file__).resolve().parent
    files = [str(tests / f) for f in ("test_cuda_ops.py", "test_cuda_matmul.py", "test_cuda_backend.py")]
    r = _asan_pytest(files, "not mutated and not every_barrier", timeout=1800,
                     **{ORDER_ENV: "warps-reverse", POISON_ENV: "huge", "POCKETMOE_TEST_FILL_UNINITIALIZED": "1"})
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    summary = r.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
