"""CudaOps' matmuls on raw blocks (linear, linear_multi, per-head batched) and the CUDA routed-expert kernels,
for every weight type, plus the host-side logic of the CUDA runtime that needs no GPU: which backend a plan takes,
which expert kernels a device gets, and the copy engine's stream / event order (a fake CUDA API that logs calls).

"shim": the kernels under the CPU execution shim, launched by the same CudaOps glue the GPU runs; "gpu": CuPy on
torch's CUDA device (skipped without one; scripts/gpu_check.sh runs them). References: weights through
gguf.quants.dequantize and a float64 matmul on the activations as the kernels quantize them (the model of
pocketmoe.testing.cuda_matmul, checked bit for bit against the kernels), within the derived rounding bound; and
the torch reference ops (ops/reference.py) on the same activations, within the sum of both bounds.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pocketmoe.errors import PocketMoEError
from pocketmoe.experts import build
from pocketmoe.experts.kernels import Activations, ExpertStore, ReferenceKernels
from pocketmoe.experts.staging import CopyEngine
from pocketmoe.layers import QuantLinear
from pocketmoe.layers.experts import ExpertWeights, combine
from pocketmoe.ops import cuda
from pocketmoe.ops.cuda import matmul
from pocketmoe.ops.cuda.backend import CudaOps
from pocketmoe.ops.cuda.experts import CudaExpertKernels
from pocketmoe.ops.reference import ReferenceOps
from pocketmoe.quant.quantize import random_blocks
from pocketmoe.testing.cuda_matmul import (
    TYPES,
    act_inputs,
    exact,
    gamma,
    random_acts,
    reference_weight,
    tolerance,
)
from pocketmoe.testing.cuda_shim import ShimFaultError, ShimLauncher, shim_unavailable_reason

REASON = shim_unavailable_reason()
REF = ReferenceOps(tile_rows=None)


class CountingShimLauncher(ShimLauncher):
    """CudaOps' launcher on the CPU shim (one module per source), counting launches per kernel and keeping each
    launch's grid."""

    def __init__(self, src=None) -> None:  # noqa: ANN001
        super().__init__(src)
        self.calls: dict[str, int] = {}
        self.grids: dict[str, list[tuple[int, int, int]]] = {}

    def __call__(self, source, kernel, grid, block, args, shared_mem=0) -> None:  # noqa: ANN001
        self.calls[kernel] = self.calls.get(kernel, 0) + 1
        self.grids.setdefault(kernel, []).append(tuple(grid))
        super().__call__(source, kernel, grid, block, args, shared_mem)


@pytest.fixture(scope="module", params=["shim", "gpu"])
def sub(request) -> tuple[CudaOps, torch.device]:
    if request.param == "gpu":
        if not cuda.available():
            pytest.skip(f"the CUDA backend cannot run here: {cuda.unavailable_reason()}")
        return CudaOps(tile_rows=None), torch.device("cuda")
    if REASON is not None:
        pytest.skip(REASON)
    return CudaOps(tile_rows=None, launcher=CountingShimLauncher()), torch.device("cpu")


def layer_of(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> QuantLinear:
    """A host QuantLinear of raw blocks (CudaOps uploads them on first use)."""
    return QuantLinear(torch.from_numpy(raw), ggml_type, shape)


def check_linear(y: np.ndarray, raw: np.ndarray, name: str, layer: QuantLinear, x: np.ndarray) -> None:
    """y against gguf dequantize x the kernels' activations (float64; Q4_1 / Q5_1 with their min against the
    activation's s: cuda_matmul.exact), and against the reference op."""
    _, bv = TYPES[name]
    acts, xd = act_inputs(x, bv)
    w = reference_weight(raw, name)
    value = exact(name, raw, w, xd, acts)
    tol = tolerance(name, raw, w, xd, acts)
    err = np.abs(y - value)
    assert (err <= tol).all(), f"{name}: max err {err.max():.3g} over the bound"
    # the torch reference op on the same activations: its own fp32 dot products are within gamma(I) |x| |w|
    ref = REF.linear(layer, torch.from_numpy(xd.astype(np.float32))).double().numpy()
    x32 = xd.astype(np.float32).astype(np.float64)
    ref_tol = gamma(x.shape[1]) * (np.abs(x32) @ np.abs(w).T) + np.abs(value - x32 @ w.T)
    assert (np.abs(y - ref) <= tol + ref_tol + 1e-30).all(), f"{name}: off the reference op"


@pytest.mark.parametrize("name", list(TYPES))
def test_linear_every_type_gemv_and_gemm(sub, name: str) -> None:
    """3 tokens take the GEMV, 13 the one-group GEMM: both within the bound, and a token's row has the same
    bits whichever ran and whatever else is in the batch."""
    ops, dev = sub
    ggml_type, bv = TYPES[name]
    rows, cols = 24, 512 if bv > 1 else 96
    rng = np.random.default_rng([ggml_type, 5])
    raw = random_blocks(ggml_type, (rows, cols), rng)
    layer = layer_of(raw, ggml_type, (rows, cols))
    x = random_acts(rng, 13, cols)
    y13 = ops.linear(layer, torch.from_numpy(x).to(dev)).cpu().numpy()
    y3 = ops.linear(layer, torch.from_numpy(x[:3]).to(dev)).cpu().numpy()
    assert isinstance(layer.backend_data, torch.Tensor) and layer.backend_data.device.type == dev.type
    check_linear(y13, raw, name, layer, x)
    np.testing.assert_array_equal(y3, y13[:3])


# Mutation check on the engine's own kernels: each mutant of the sources must fail the linear check, by leaving
# its bound or by a fault the GPU would raise (a 4-byte load from a Q8_0 block's 2-byte aligned quants).
OVER_BOUND = (AssertionError, "over the bound")
MUTANTS = {
    "nibbles swapped (Q4_0 GEMV)": ("quant.cuh", ("q[k] = to_signed(v & 0x0F0F0F0Fu, 8);\n"
                                                  "      q[k + 4] = to_signed((v >> 4) & 0x0F0F0F0Fu, 8);"),
                                    ("q[k] = to_signed((v >> 4) & 0x0F0F0F0Fu, 8);\n"
                                     "      q[k + 4] = to_signed(v & 0x0F0F0F0Fu, 8);"), "q4_0", 3, OVER_BOUND),
    "staging barrier removed (grouped GEMM)": ("gemm.cuh", "      __syncthreads();\n      const ActRows a{",
                                               "      const ActRows a{", "q4_k", 13, OVER_BOUND),
    "misaligned 4-byte load (Q8_0 GEMV)": ("quant.cuh", "static_cast<int>(ld_u32_a2(b + 2 + 4 * k))",
                                           "static_cast<int>(ld_u32(b + 2 + 4 * k))", "q8_0", 3,
                                           (ShimFaultError, "made a misaligned load or store")),
}


@pytest.mark.parametrize("mutant", [None, *MUTANTS])
def test_a_mutated_kernel_source_fails_the_linear_check(tmp_path, mutant: str | None) -> None:
    """A copy of src/ with two nibbles swapped in the Q4_0 decode, the barrier between staging the activation
    tile in shared memory and reading it removed, or a Q8_0 block's quants read as 4-byte words at 2-byte
    aligned addresses: the results leave the bound, or the shim traps the misaligned load as a GPU would. The
    unmutated copy passes."""
    if REASON is not None:
        pytest.skip(REASON)
    import shutil

    from pocketmoe.ops.cuda.compile import SRC

    src = tmp_path / "src"
    shutil.copytree(SRC, src)
    name, tokens = ("q4_k", 13) if mutant is None else MUTANTS[mutant][3:5]
    if mutant is not None:
        path, old, new = src / MUTANTS[mutant][0], *MUTANTS[mutant][1:3]
        text = path.read_text()
        assert text.count(old) == 1, f"the mutation site of {mutant!r} moved"
        path.write_text(text.replace(old, new))
    ops = CudaOps(tile_rows=None, launcher=CountingShimLauncher(src))
    ggml_type, _ = TYPES[name]
    rng = np.random.default_rng([ggml_type, 6])
    raw = random_blocks(ggml_type, (24, 512), rng)
    layer = layer_of(raw, ggml_type, (24, 512))
    x = random_acts(rng, tokens, 512)
    if mutant is None:
        check_linear(ops.linear(layer, torch.from_numpy(x)).numpy(), raw, name, layer, x)
    else:
        error, match = MUTANTS[mutant][5]
        with pytest.raises(error, match=match):
            check_linear(ops.linear(layer, torch.from_numpy(x)).numpy(), raw, name, layer, x)


def test_every_barrier_that_orders_something_is_tested() -> None:
    """The barrier sweep (pocketmoe.testing.barrier_sweep): each __syncthreads() of src/ removed in turn, the tests
    of its source under the plain schedule and the one-warp-at-a-time one. Every barrier fails a test, except
    those marked `// defensive:` (they order nothing where they stand), which must pass."""
    if REASON is not None:
        pytest.skip(REASON)
    from pocketmoe.testing import barrier_sweep

    summary = barrier_sweep.sweep()
    assert summary["barriers"] == len(barrier_sweep.barriers()) > 0
    assert not summary["untested"], (f"removing these barriers fails no test (a race the tests miss, or mark the "
                                     f"barrier `// defensive: why`): {summary}")
    assert not summary["marked_defensive_but_caught"], f"these barriers order something now; unmark them: {summary}"


def test_linear_multi_quantizes_each_block_size_once() -> None:
    if REASON is not None:
        pytest.skip(REASON)
    launcher = CountingShimLauncher()
    ops = CudaOps(tile_rows=None, launcher=launcher)
    rng = np.random.default_rng(8)
    cols = 512
    layers = [layer_of(random_blocks(TYPES[n][0], (16, cols), rng), TYPES[n][0], (16, cols))
              for n in ("q4_k", "q6_k", "q8_0", "q5_0")]
    x = torch.from_numpy(random_acts(rng, 4, cols))
    ys = ops.linear_multi(layers, x)
    assert launcher.calls == {"quantize_q8_k": 1, "quantize_q8_0": 1, "gemv_q4_k": 1, "gemv_q6_k": 1,
                              "gemv_q8_0": 1, "gemv_q5_0": 1}
    for layer, y in zip(layers, ys, strict=True):
        torch.testing.assert_close(y, ops.linear(layer, x), rtol=0, atol=0)


def test_linear_multi_stacks_alike_weights(sub) -> None:
    """Each run of weights of one type and column count (MLA's q and kv_a, GQA's q, k, v) is one matmul over their
    rows stacked: each output has the bits of that weight's own linear, in the GEMV (decode) and the GEMM."""
    ops, dev = sub
    rng = np.random.default_rng(21)
    cols = 512
    kinds = [("q4_k", 16), ("q4_k", 8), ("q6_k", 12), ("q6_k", 4), ("q4_k", 20), ("q8_0", 8)]
    layers = [layer_of(random_blocks(TYPES[n][0], (rows, cols), rng), TYPES[n][0], (rows, cols))
              for n, rows in kinds]
    calls = getattr(ops.launch, "calls", None)
    for t, kind in ((3, "gemv"), (11, "moe_gemm")):
        x = torch.from_numpy(random_acts(rng, t, cols)).to(dev)
        before = None if calls is None else dict(calls)
        ys = ops.linear_multi(layers, x)
        if calls is not None:  # runs: (q4_k, q4_k), (q6_k, q6_k), (q4_k), (q8_0)
            made = {k: v - before.get(k, 0) for k, v in calls.items() if v != before.get(k, 0)}
            assert made == {"quantize_q8_k": 1, "quantize_q8_0": 1, f"{kind}_q4_k": 2, f"{kind}_q6_k": 1,
                            f"{kind}_q8_0": 1}
        for layer, y in zip(layers, ys, strict=True):
            assert y.shape == (t, layer.shape[0]) and y.is_contiguous()
            np.testing.assert_array_equal(y.cpu().numpy(), ops.linear(layer, x).cpu().numpy())


@pytest.mark.parametrize("name", ["q8_0", "q4_k", "f32"])
def test_batched_per_head_is_one_grouped_gemm(sub, name: str) -> None:
    """[H, O, I] weights on x [H, T, I]: each head's slice equals that head's own linear, bit for bit."""
    ops, dev = sub
    ggml_type, bv = TYPES[name]
    h, o, cols, t = 3, 16, 256 if bv > 1 else 64, 5
    rng = np.random.default_rng([ggml_type, 9])
    raw = random_blocks(ggml_type, (h, o, cols), rng)
    layer = layer_of(raw, ggml_type, (h, o, cols))
    x = torch.from_numpy(np.stack([random_acts(rng, t, cols) for _ in range(h)]))
    y = ops.batched(layer, x.to(dev)).cpu()
    assert y.shape == (h, t, o)
    for i in range(h):
        head = layer_of(np.ascontiguousarray(raw[i]), ggml_type, (o, cols))
        np.testing.assert_array_equal(y[i].numpy(), ops.linear(head, x[i].to(dev)).cpu().numpy())
        check_linear(y[i].numpy(), np.ascontiguousarray(raw[i]), name, head, x[i].numpy())


def expert_store(ggml_type: int, n: int, d: int, f: int, rng: np.random.Generator, dev: torch.device) -> ExpertStore:
    def w(rows: int, cols: int) -> ExpertWeights:
        raw = torch.from_numpy(random_blocks(ggml_type, (n, rows, cols), rng)).to(dev)
        return ExpertWeights(raw, ggml_type, (n, rows, cols))

    return ExpertStore(w(f, d), w(f, d), w(d, f))


@pytest.mark.parametrize("name", ["q4_k", "q8_0", "iq4_xs", "f16"])
def test_expert_kernels_match_the_per_expert_linear_chain(sub, name: str) -> None:
    """CudaExpertKernels.outputs (grouped GEMMs over every slot, empty groups included) gives each pair the bits
    of gate / up / silu / down run as CudaOps linears on that expert alone; the pairs read their token's row by
    index (4 tokens, 3 experts each: gate and up in one launch), and give the bits of the same pairs handed their
    own rows (gate and up apart)."""
    ops, dev = sub
    ggml_type, bv = TYPES[name]
    d, f, n, k = 256, 256 if bv > 1 else 64, 5, 3
    rng = np.random.default_rng([ggml_type, 11])
    store = expert_store(ggml_type, n, d, f, rng, dev)
    which = torch.tensor([3, 0, 1, 3, 1, 0, 3, 0, 1, 3, 1, 0], dtype=torch.int64)  # expert 2, 4: no pair
    x = torch.from_numpy(random_acts(rng, len(which) // k, d))
    rows = torch.arange(len(which)) // k
    kernels = CudaExpertKernels(ops.launch)
    calls = getattr(ops.launch, "calls", None)
    gemms = lambda: sum(v for k, v in calls.items() if k.startswith("moe_gemm_"))  # noqa: E731
    before = None if calls is None else gemms()
    y = kernels.outputs(store, x.to(dev), which.to(dev), rows.to(dev)).cpu()
    if calls is not None:  # given the rows: gate and up in one launch, then down
        assert gemms() - before == 2
    np.testing.assert_array_equal(y.numpy(), kernels.outputs(store, x[rows].to(dev), which.to(dev)).cpu().numpy())
    for e in range(n):
        pairs = (which == e).nonzero().squeeze(1)
        if len(pairs) == 0:
            continue
        lin = [QuantLinear(w.raw[e].cpu(), ggml_type, w.shape[1:]) for w in (store.gate, store.up, store.down)]
        xe = x[rows[pairs]].to(dev)
        g, u = ops.linear(lin[0], xe), ops.linear(lin[1], xe)
        want = ops.linear(lin[2], (F.silu(g) * u).contiguous())
        np.testing.assert_array_equal(y[pairs].numpy(), want.cpu().numpy())
    weights = torch.rand(4, 3, generator=torch.Generator().manual_seed(1))
    contrib = y.view(4, 3, d)
    torch.testing.assert_close(kernels.combine(contrib.to(dev), weights.to(dev)).cpu(),
                               ReferenceKernels(None).combine(contrib, weights), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["q4_k", "q8_0", "f16"])
def test_ffn_gives_the_bits_of_the_expert_kernels(sub, name: str) -> None:
    """CudaOps.ffn (dense FFN, shared experts) makes silu(gate) * up as down's activations are quantized, as the
    expert kernels do: an expert's weights as a GatedMLP give that expert's pair outputs bit for bit (and those
    are the torch silu chain's: the test above)."""
    from pocketmoe.layers.mlp import GatedMLP

    ops, dev = sub
    ggml_type, bv = TYPES[name]
    d, f = 256, 256 if bv > 1 else 64
    rng = np.random.default_rng([ggml_type, 17])
    store = expert_store(ggml_type, 2, d, f, rng, dev)
    mlp = GatedMLP(*(QuantLinear(w.raw[1].cpu(), ggml_type, w.shape[1:]) for w in (store.gate, store.up, store.down)))
    for t in (1, 11):  # the GEMV, then the one-group GEMM
        x = torch.from_numpy(random_acts(rng, t, d)).to(dev)
        calls = getattr(ops.launch, "calls", None)
        fused = None if calls is None else calls.get(f"quantize_swiglu_q8_{'0' if bv == 32 else 'k'}", 0)
        y = ops.ffn(mlp, x).cpu()
        if calls is not None and bv > 1:
            assert calls[f"quantize_swiglu_q8_{'0' if bv == 32 else 'k'}"] == fused + 1
        want = CudaExpertKernels(ops.launch).outputs(store, x, torch.ones(t, dtype=torch.int64, device=dev)).cpu()
        np.testing.assert_array_equal(y.numpy(), want.numpy())


def test_expert_kernels_quantize_each_input_row_once() -> None:
    """The activations are quantized once per row, not once per pair: gate and up read a token's row whichever
    of its experts the pair is, and the calls of one layer over parts of its pairs (a dispatcher's hits, then
    each staged expert) share one quantization of the layer's rows through an Activations."""
    if REASON is not None:
        pytest.skip(REASON)
    launch = CountingShimLauncher()

    def quantized() -> list[int]:  # rows of each quantize launch since the last call (its grid's y): x's, then h's
        rows = [g[1] for name in ("quantize_q8_k", "quantize_swiglu_q8_k") for g in launch.grids.pop(name, [])]
        assert not launch.grids.get("quantize_q8_0") and not launch.grids.get("quantize_swiglu_q8_0")
        return rows

    rng = np.random.default_rng(13)
    t, k, d, f = 5, 4, 256, 256
    store = expert_store(TYPES["q4_k"][0], 6, d, f, rng, torch.device("cpu"))
    which = torch.from_numpy(rng.integers(0, 6, t * k)).long()
    rows = torch.arange(t * k) // k
    x = torch.from_numpy(random_acts(rng, t, d))
    kernels = CudaExpertKernels(launch)
    whole = kernels.outputs(store, x, which, rows)
    assert quantized() == [t, t * k]  # x once (gate and up share it: same block size), h once per pair
    acts = Activations(x)
    first, rest = torch.arange(0, 7), torch.arange(7, t * k)
    parts = [kernels.outputs(store, acts, which[p], rows[p]) for p in (first, rest)]
    assert quantized() == [t, 7, t * k - 7]
    np.testing.assert_array_equal(torch.cat(parts).numpy(), whole.numpy())


@pytest.mark.parametrize(("p", "n"), [(1, 5), (6, 64), (17, 33), (48, 256), (64, 8), (64, 1), (65, 64), (300, 256)])
def test_expert_groups_are_a_stable_sort_by_expert(sub, p: int, n: int) -> None:
    """CudaExpertKernels.groups against torch's stable argsort: up to 64 pairs the one-warp group_pairs kernel
    (route.cu; several rounds of 32 experts when n > 32, empty groups, every pair in one group), beyond it the
    torch path; either way the grid bound covers the largest group, given input rows the pairs' rows come back
    in the grouped order, and given a counter it gains the number of distinct experts."""
    ops, dev = sub
    k = CudaExpertKernels(ops.launch)
    gen = torch.Generator().manual_seed(p * 1000 + n)
    which = torch.randint(0, n, (p,), generator=gen) if n > 8 else torch.full((p,), n - 1)
    offsets, order, tokens, largest, groups = k.groups(which.to(dev), n)
    counts = torch.bincount(which, minlength=n)
    assert offsets.dtype == order.dtype == tokens.dtype == torch.int32
    assert offsets.cpu().tolist() == [0, *torch.cumsum(counts, 0).tolist()]
    assert order.cpu().tolist() == torch.argsort(which, stable=True).tolist()
    assert tokens.cpu().tolist() == order.cpu().tolist()
    assert largest >= int(counts.max())
    # with input rows: tokens gathers them in the grouped order (pair p of a K = 3 step reads row p // 3)
    rows = (torch.arange(p) // 3).flip(0).to(torch.int32)
    used = torch.full((), 7, dtype=torch.int64, device=dev)  # and a counter gains the distinct experts
    offsets2, order2, tokens2, _, _ = k.groups(which.to(dev), n, rows.to(dev), used)
    assert torch.equal(offsets2.cpu(), offsets.cpu()) and torch.equal(order2.cpu(), order.cpu())
    assert tokens2.dtype == torch.int32 and tokens2.cpu().tolist() == rows[order.cpu().long()].tolist()
    assert int(used) == 7 + len(torch.unique(which))
    # laid out twice (one launch over gate and up): the second copy's groups and output rows P further on
    offsets3, order3, tokens3, _, groups3 = k.groups(which.to(dev), n, rows.to(dev), None, copies=2)
    o, r, t = offsets.cpu().tolist(), order.cpu().tolist(), tokens2.cpu().tolist()
    assert offsets3.cpu().tolist() == o + [p + v for v in o[1:]]
    assert order3.cpu().tolist() == r + [p + v for v in r] and tokens3.cpu().tolist() == t + t
    if p <= 64:  # the kernel lists the non-empty groups (what the GEMM's grid takes), then -1s up to min(n, P)
        present = torch.unique(which).tolist()
        listed = present + [-1] * (min(n, p) - len(present))
        assert groups.dtype == torch.int32 and groups.cpu().tolist() == listed
        assert groups3.cpu().tolist() == listed + [n + v if v >= 0 else -1 for v in listed]
    else:  # torch's path: every group runs
        assert groups is None and groups3 is None


def test_expert_grid_takes_only_the_non_empty_groups(sub, monkeypatch) -> None:
    """A decode step's few pairs over many experts: the grouped GEMMs' grids take the min(E, P) groups that
    group_pairs lists (a copy), not all E, most of them idle; the outputs are the bits of the every-group path."""
    from pocketmoe.ops.cuda import experts as cuda_experts

    ops, dev = sub
    ggml_type = TYPES["q4_k"][0]
    rng = np.random.default_rng(23)
    store = expert_store(ggml_type, 40, 256, 256, rng, dev)
    which = torch.tensor([31, 3, 39, 3, 17, 8], dtype=torch.int64)  # one token, K = 6: 5 distinct experts
    x = torch.from_numpy(random_acts(rng, 1, 256)).to(dev)
    rows = torch.zeros(len(which), dtype=torch.int32)
    kernels = CudaExpertKernels(ops.launch)
    grids = getattr(ops.launch, "grids", None)
    before = None if grids is None else len(grids.get("moe_gemm_q4_k", []))
    y = kernels.outputs(store, x, which.to(dev), rows.to(dev))
    if grids is not None:  # gate and up (two copies of 6), then down
        assert [g[2] for g in grids["moe_gemm_q4_k"][before:]] == [12, 6]
    monkeypatch.setattr(cuda_experts, "SMALL_PAIRS", 0)  # torch's grouping: every group in the grid
    every = kernels.outputs(store, x, which.to(dev), rows.to(dev))
    np.testing.assert_array_equal(y.cpu().numpy(), every.cpu().numpy())


def test_expert_kernels_float_store_match_the_reference_kernels(sub) -> None:
    """F32 experts (float activations, nothing quantized): the torch reference's expert MLP, within fp32."""
    ops, dev = sub
    rng = np.random.default_rng(12)
    store = expert_store(0, 4, 64, 32, rng, dev)
    which = torch.tensor([2, 0, 2, 1, 2, 2, 0])
    x = torch.from_numpy(random_acts(rng, len(which), 64))
    y = CudaExpertKernels(ops.launch).outputs(store, x.to(dev), which.to(dev)).cpu()
    host = ExpertStore(*(ExpertWeights(w.raw.cpu(), 0, w.shape) for w in (store.gate, store.up, store.down)))
    torch.testing.assert_close(y, ReferenceKernels(None).outputs(host, x, which), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("shape", [(1, 6, 2048), (5, 8, 300), (3, 1, 64), (0, 6, 64)])
def test_expert_combine_is_one_launch_with_the_torch_bits(sub, shape: tuple[int, int, int]) -> None:
    """combine_f32 sums a token's K weighted outputs in slot order, each product and sum rounded alone: the bits of
    layers.experts.combine (torch's 2K - 1 ops), on a strided view too, in one launch."""
    ops, dev = sub
    t, k, d = shape
    g = torch.Generator().manual_seed(t * 100 + k)
    contrib = torch.randn(t, k, d + 3, generator=g)[..., 1:d + 1]  # not contiguous
    weights = torch.rand(t, k, generator=g)
    kernels = CudaExpertKernels(ops.launch)
    calls = getattr(ops.launch, "calls", None)
    before = None if calls is None else calls.get("combine_f32", 0)
    y = kernels.combine(contrib.to(dev), weights.to(dev)).cpu()
    assert torch.equal(y, combine(contrib, weights))
    if calls is not None:
        assert calls.get("combine_f32", 0) - before == (1 if t else 0)


# ---- host-side logic: backend choice, expert kernel hook, stream / event order -------------------------------

def _plan(mode: str, *names: str) -> SimpleNamespace:
    return SimpleNamespace(mode=mode, devices=[SimpleNamespace(name=n) for n in names])


def test_plan_backend_takes_cuda_only_for_a_cuda_plan(monkeypatch) -> None:
    assert cuda.plan_backend("auto", _plan("cpu")) == "auto"
    assert cuda.plan_backend("auto", _plan("heterogeneous", "cpu:0")) == "auto"
    assert cuda.plan_backend("native", _plan("all-device", "cuda:0")) == "native"
    monkeypatch.setattr(cuda, "unavailable_reason", lambda: None)
    assert cuda.plan_backend("auto", _plan("all-device", "cuda:0")) == "cuda"
    assert cuda.plan_backend("auto", _plan("all-device", "cuda:0"), "deepseek4") == "auto"
    assert cuda.plan_backend("auto", _plan("all-device", "cuda:0"), "deepseek2") == "cuda"
    monkeypatch.setattr(cuda, "unavailable_reason", lambda: "CuPy is not importable (test)")
    with pytest.raises(PocketMoEError, match=r"^the plan runs on cuda:0 but CuPy is not importable \(test\); "
                                             r"install CuPy or use --device cpu\.$"):
        cuda.plan_backend("auto", _plan("heterogeneous", "cuda:0"))


def test_expert_kernels_hook() -> None:
    """The CPU device keeps the host kernels; a CUDA device takes the backend's CUDA expert kernels (its own
    launcher); expert_kernels refuses the CPU device."""
    host = object()
    assert build.device_kernels(None, torch.device("cpu"), host) is host
    launcher = CountingShimLauncher()
    ops = CudaOps(tile_rows=None, launcher=launcher)
    k = build.device_kernels(ops, torch.device("cuda", 0), host)
    assert isinstance(k, CudaExpertKernels) and k.launch is launcher
    with pytest.raises(PocketMoEError, match="takes a CUDA device"):
        build.expert_kernels(torch.device("cpu"), ops)
    if not cuda.available():
        with pytest.raises(PocketMoEError, match="were placed on cuda:0 but"):
            build.expert_kernels(torch.device("cuda", 0), None)


class FakeCuda:
    """The copy engine's CUDA calls on the CPU: copies happen at once; every stream / event call is logged."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.n = 0
        self._active: str | None = None
        self.pinned_bytes: list[int] = []

    def stream(self, device):  # noqa: ANN001, ANN201
        return _FakeStream(self, "copy")

    def current_stream(self, device):  # noqa: ANN001, ANN201
        return _FakeStream(self, self._active or "compute")

    @contextlib.contextmanager
    def use(self, stream):  # noqa: ANN001, ANN201
        self._active = stream.name
        try:
            yield
        finally:
            self._active = None

    def event(self):  # noqa: ANN201
        self.n += 1
        return _FakeEvent(self, self.n)

    def pinned(self, nbytes: int) -> torch.Tensor:
        self.pinned_bytes.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)


class _FakeStream:
    def __init__(self, api: FakeCuda, name: str) -> None:
        self.api, self.name = api, name

    def wait_event(self, ev: _FakeEvent) -> None:
        self.api.log.append(("wait", self.name, ev.id))


class _FakeEvent:
    def __init__(self, api: FakeCuda, n: int) -> None:
        self.api, self.id = api, n

    def record(self, stream: _FakeStream) -> None:
        self.api.log.append(("record", stream.name, self.id))

    def synchronize(self) -> None:
        self.api.log.append(("sync", self.id))


class _GpuTensor:
    """Stands in for a CUDA tensor: the launcher reads only is_cuda, device and data_ptr()."""

    is_cuda, device = True, "cuda:0"

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


def test_cupy_launcher_host_path_on_a_fake_cupy(monkeypatch) -> None:
    """CupyLauncher's host side without a GPU: CuPy replaced by a recorder, torch's current device and stream by
    stand-ins. Each kernel is fetched from its module once however often it runs (a new RawKernel and a driver
    lookup per launch cost as much as the launch); scalars are packed by their C parameter type, pointers as the
    tensors' addresses, a list as one pointer array made once per address list; the launch names torch's
    current stream, itself wrapped once; a host tensor or a wrong argument count is refused."""
    import sys

    from pocketmoe.ops.cuda.backend import CupyLauncher

    modules, fetched, launches, wrapped = [], [], [], []

    class FakeModule:
        def __init__(self, code: str, options: tuple) -> None:
            assert "--std=c++17" in options and "__global__" in code
            modules.append(self)

        def get_function(self, name: str):  # noqa: ANN202
            fetched.append(name)
            return lambda grid, block, args, shared_mem=0, stream=None: launches.append(
                (name, grid, block, args, shared_mem, stream))

    def external_stream(handle: int) -> tuple:
        wrapped.append(handle)
        return ("stream", handle)

    fake = SimpleNamespace(RawModule=FakeModule, cuda=SimpleNamespace(Device=lambda d: contextlib.nullcontext(),
                                                                      ExternalStream=external_stream))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    stream = SimpleNamespace(cuda_stream=0xABC)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    launch = CupyLauncher()
    arrays: list[tuple] = []

    def pointer_array(ptrs: tuple, device: int) -> _GpuTensor:
        arrays.append(ptrs)
        return _GpuTensor(0x9000 + len(arrays))

    monkeypatch.setattr(launch, "_pointer_array", pointer_array)
    w, q, d, s, y = (_GpuTensor(0x1000 * (i + 1)) for i in range(5))
    for _ in range(3):
        launch("matmul.cu", "gemv_q4_k", (4, 1, 1), (128, 1, 1), [w, q, d, s, y, 16, 256, 1], 0)
    assert fetched == ["gemv_q4_k"] and len(modules) == 1 and wrapped == [0xABC]
    name, grid, block, args, shm, st = launches[-1]
    assert (name, grid, block, shm, st) == ("gemv_q4_k", (4, 1, 1), (128, 1, 1), 0, ("stream", 0xABC))
    assert [type(a) for a in args] == [np.uint64] * 5 + [np.int32] * 3
    assert [int(a) for a in args] == [0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 16, 256, 1]
    experts = [_GpuTensor(0x100), _GpuTensor(0x200)]
    launch("matmul.cu", "moe_gemm_q8_0", (1, 1, 2), (128, 1, 1),
           [experts, d, q, s, q, d, s, y, 16, 32, 2, 1, d, 0], 0)
    assert arrays == [(0x100, 0x200)] and int(launches[-1][3][0]) == 0x9001
    stream.cuda_stream = 0xDEF  # another current stream (a copy stream, a graph capture): wrapped once, used
    launch("norm_rope.cu", "rms_norm_f32", (1, 1, 1), (256, 1, 1), [w, 8, w, y, 8, 8, 1e-6], 0)
    assert launches[-1][5] == ("stream", 0xDEF) and wrapped == [0xABC, 0xDEF]
    # rms_norm_f32(const float* x, long long ldx, const float* w, float* y, long long ldy, int d, float eps)
    assert [type(a) for a in launches[-1][3]] == [np.uint64, np.int64, np.uint64, np.uint64, np.int64, np.int32,
                                                 np.float32]
    with pytest.raises(TypeError, match="gemv_q4_k argument 0 is a cpu tensor; the kernels read GPU memory"):
        launch("matmul.cu", "gemv_q4_k", (4, 1, 1), (128, 1, 1), [torch.zeros(1), q, d, s, y, 16, 256, 1], 0)
    with pytest.raises(TypeError, match="gemv_q4_k takes 8 arguments, 7 were given"):
        launch("matmul.cu", "gemv_q4_k", (4, 1, 1), (128, 1, 1), [w, q, d, s, y, 16, 256], 0)
    with pytest.raises(TypeError, match="matmul.cu has no kernel gemv_q9_k"):
        launch("matmul.cu", "gemv_q9_k", (4, 1, 1), (128, 1, 1), [], 0)


def test_copy_engine_cuda_order_on_a_fake_stream() -> None:
    """Through a slot pool of 2 slots for 4 experts (the dispatcher's calls: stage, acquire, kernel, release):
    each copy into a slot waits on the compute-stream event recorded after the last kernel that read the slot;
    each kernel's stream waits on its slot's copy event; a pinned buffer is refilled only after the copy out of
    it was synchronized; the slots end up holding the experts' bytes."""
    from pocketmoe.experts.staging import SlotPool

    api = FakeCuda()
    rng = np.random.default_rng(3)
    host = expert_store(8, 4, 64, 32, rng, torch.device("cpu"))
    engine = CopyEngine(torch.device("cpu"), delay=lambda slot, e: api.log.append(("copy", slot, e)), api=api)
    pool = SlotPool(host, 2, torch.device("cpu"), engine)
    order = [(0, 0), (1, 1), (0, 2), (1, 3), (0, 1), (1, 0)]  # (slot, expert): every slot reused
    for slot, e in order:
        pool.stage(slot, e)
        pool.acquire(slot)
        api.log.append(("kernel", slot))
        for w, hw in zip((pool.store.gate, pool.store.up, pool.store.down), (host.gate, host.up, host.down),
                         strict=True):
            assert torch.equal(w.raw[slot], hw.raw[e])
        pool.release(slot)
    log = api.log
    copies = [i for i, entry in enumerate(log) if entry[0] == "copy"]
    assert len(copies) == len(order)
    read_done: dict[int, int] = {}  # slot -> event recorded on compute after its last kernel
    done: list[int] = []            # copy events in order
    for i, entry in enumerate(log):
        if entry[0] == "kernel":
            slot = entry[1]
            # the kernel's stream waited on its slot's copy event first
            assert ("wait", "compute", done[-1]) in log[:i]
            nxt = log[i + 1]
            assert nxt[:2] == ("record", "compute")
            read_done[slot] = nxt[2]
        elif entry[0] == "copy":
            slot = entry[1]
            if slot in read_done:
                assert log[i - 1] == ("wait", "copy", read_done[slot]), "a copy into a slot read before"
            n = len(done)
            if n >= 2:  # two staging buffers: the copy out of this buffer two copies ago was synchronized
                assert ("sync", done[n - 2]) in log[:i]
            assert log[i + 1][:2] == ("record", "copy")
            done.append(log[i + 1][2])
    assert api.pinned_bytes == [host.expert_bytes()] * 2  # two buffers, made once


def test_copy_engine_cpu_device_stays_the_copy_thread() -> None:
    engine = CopyEngine(torch.device("cpu"))
    assert not engine.cuda and not hasattr(engine, "api")


# ---- a whole model on CudaOps (the kernels under the shim) ----------------------------------------------------

PROMPT = [(7 * i + 3) % 300 + 5 for i in range(20)]  # ids below the fixture's vocabulary; 20: GEMM and GEMV paths


@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory):
    from pocketmoe.gguf import open_bundle
    from pocketmoe.testing.synth import write_fixture

    path = tmp_path_factory.mktemp("cuda-model") / "ds2.gguf"
    write_fixture("deepseek2", "tiny", "Q4_K_M", path, seed=3)
    with open_bundle(path) as b:
        yield b


def _cpu_tokens(bundle) -> list[int]:  # noqa: ANN001
    from pocketmoe import native
    from pocketmoe.engine.runner import ModelRunner, RunnerConfig

    backend = "native" if native.available() else "reference"
    return ModelRunner(bundle, RunnerConfig(n_ctx=64, backend=backend)).generate_greedy(PROMPT, 4)


def _runner_on_cuda_ops(bundle, monkeypatch, mode: str, gpu_memory_gib=None):  # noqa: ANN001, ANN202
    """A ModelRunner with every op on CudaOps under the shim. all-device / heterogeneous: the plan's banks on the
    CPU device with their device kernels swapped for the CUDA expert kernels (resident bank; dispatch over slots,
    every miss staged), as on a GPU."""
    from pocketmoe.engine.runner import ModelRunner, RunnerConfig
    from pocketmoe.experts import resident
    from pocketmoe.experts.cost import Rates
    from pocketmoe.placement.run import RunPlacement

    ops = CudaOps(tile_rows=None, launcher=CountingShimLauncher())
    kernels = ops.expert_kernels(ops.device)  # as the runtime makes them (sharing the MoE input's quantization)
    placement = None
    if mode != "cpu":
        placement = RunPlacement(device="cpu", mode=mode, expert_policy="cache", expert_cache_slots=2,
                                 gpu_memory_gib=gpu_memory_gib)
        monkeypatch.setattr(build, "device_kernels", lambda ops_, device, host: kernels)
        monkeypatch.setattr(build, "resident_bank", lambda store, k, device, stats, tile_rows, counts:
                            resident.ResidentExperts(store, k, stats, counts))
    rates = Rates(4.0, 6.0, 6.0, 20.0, 200.0)
    return ModelRunner(bundle, RunnerConfig(n_ctx=64, placement=placement, expert_rates=rates), ops=ops)


@pytest.mark.parametrize("mode", ["cpu", "all-device", "heterogeneous"])
def test_model_on_cuda_ops_gives_the_cpu_greedy_tokens(tiny_bundle, monkeypatch, mode: str) -> None:
    """DeepSeek-V2 tiny (Q4_K_M) with every op on CudaOps under the shim: the CPU-only path's greedy tokens."""
    if REASON is not None:
        pytest.skip(REASON)
    r = _runner_on_cuda_ops(tiny_bundle, monkeypatch, mode)
    ops = r.ops
    assert r.cache.data.device == ops.device
    assert r.generate_greedy(PROMPT, 4) == _cpu_tokens(tiny_bundle)
    calls = ops.launch.calls
    assert calls.get("gemv_q4_k", 0) and calls.get("mla_attention_f32", 0) and calls.get("route_f32", 0)
    if mode != "cpu":
        assert any(k.startswith("moe_gemm_") for k in calls)
        if mode == "heterogeneous":
            st = r.experts.stats
            assert st.staged > 0 and st.hits > 0 and st.cpu_experts == 0


@pytest.mark.parametrize("mode", ["all-device", "heterogeneous"])
def test_model_split_by_layer_over_two_devices(tiny_bundle, monkeypatch, mode: str) -> None:
    """Two devices (the CPU standing in for each): the plan splits the layers, every layer's weights are uploaded
    while its plan device is current and the head's on the last, and the greedy tokens are the CPU path's."""
    if REASON is not None:
        pytest.skip(REASON)
    r = _runner_on_cuda_ops(tiny_bundle, monkeypatch, mode, gpu_memory_gib=(1.0, 1.0))
    plan = r.plan
    assert [d.name for d in plan.devices] == ["cpu:0", "cpu:1"] and len(set(plan.layer_device.values())) == 2
    assert r.generate_greedy(PROMPT, 4) == _cpu_tokens(tiny_bundle)
    placed = r.ops.placed
    want = {name: plan.devices[plan.layer_device[int(name.split(".")[1])]].name
            for name in placed if name.startswith("blk.")}
    assert want and {n: d for n, d in placed.items() if n.startswith("blk.")} == want
    assert placed["output.weight"] == "cpu:1"
    assert {d for n, d in placed.items() if n.startswith("blk.")} == {"cpu:0", "cpu:1"}


class _FakeGraph:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def _fake_graphs(ops: CudaOps, capture=lambda graph: contextlib.nullcontext()):  # noqa: ANN001, ANN202
    from pocketmoe.ops.cuda.graphs import DecodeGraphs

    return DecodeGraphs(ops.device, reset=ops._drop_step, pinned=lambda shape, dtype: torch.empty(shape, dtype=dtype),
                        new_graph=_FakeGraph, capture=capture, sync=lambda device: None)


def _shim_runner(bundle, monkeypatch, graphs: bool = False, capture=None):  # noqa: ANN001, ANN202
    """All-device on the CPU device with resident banks over the CUDA expert kernels (the shape graphs take)."""
    from pocketmoe.engine.runner import ModelRunner, RunnerConfig
    from pocketmoe.experts import resident
    from pocketmoe.placement.run import RunPlacement

    ops = CudaOps(tile_rows=None, launcher=CountingShimLauncher())
    if graphs:
        ops.graphs = _fake_graphs(ops) if capture is None else _fake_graphs(ops, capture)
    kernels = ops.expert_kernels(ops.device)  # as the runtime makes them (sharing the MoE input's quantization)
    monkeypatch.setattr(build, "device_kernels", lambda ops_, device, host: kernels)
    monkeypatch.setattr(build, "resident_bank", lambda store, k, device, stats, tile_rows, counts:
                        resident.ResidentExperts(store, k, stats, counts))
    rp = RunPlacement(device="cpu", mode="all-device")
    return ModelRunner(bundle, RunnerConfig(n_ctx=64, placement=rp), ops=ops)


# Ops that read a device tensor's values back to the host: on a GPU each waits for every kernel queued before it,
# so the host stops queueing the next ones (item() / int() / bool(), unique, nonzero, masked selection).
READ_BACKS = {"_local_scalar_dense", "item", "_unique2", "unique_dim", "unique_consecutive", "nonzero",
              "masked_select", "equal"}


def test_all_device_decode_reads_nothing_back(tiny_bundle, monkeypatch) -> None:
    """An all-device decode step on CudaOps (under the shim) reads no device value on the host: the expert grid is
    sized without reading the group sizes back, the distinct experts are counted on the device (settled into the
    statistics when they are read). Prefill may read back (a chunk's largest expert group sizes its grid)."""
    if REASON is not None:
        pytest.skip(REASON)
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if func.overloadpacket.__name__ in READ_BACKS:
                self.seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    r = _shim_runner(tiny_bundle, monkeypatch)
    ref = _shim_runner(tiny_bundle, monkeypatch)
    prompt = PROMPT[:6]
    r.forward(prompt, 0)
    ref.forward(prompt, 0)
    r.experts.stats.reset()
    with Reads() as reads:
        for i in range(3):
            logits = r.decode(11 + i, len(prompt) + i)
    assert reads.seen == []
    for i in range(3):
        want = ref.decode(11 + i, len(prompt) + i)
    assert torch.equal(logits, want)
    # one token a step routes to K distinct experts in each MoE layer
    st = r.experts.stats.to_json()
    k = tiny_bundle.metadata[f"{tiny_bundle.architecture}.expert_used_count"]
    assert st["tokens"] == 3 and st["resident"] == 3 * len(r.plan.resident) * k


def test_decode_quantizes_each_input_once_and_fuses_gate_up(tiny_bundle, monkeypatch) -> None:
    """One all-device decode step: no activation rows are quantized twice for one block size (the MoE input once
    for the routed and the shared experts), a finalize quantizes the next sublayer's input, every FFN makes
    silu(gate) * up in its quantize launch, routed gate and up go in one launch, the shared / dense gate and up
    in one matmul, and so do MLA's q and kv_a; the MoE finalize combines the routed experts' outputs."""
    if REASON is not None:
        pytest.skip(REASON)
    seen: list[tuple[int, tuple[int, ...], int]] = []
    kept: list[torch.Tensor] = []  # alive, so no other tensor takes their addresses this step
    real = matmul.quantize_activations

    def counted(launch, x, block):  # noqa: ANN001, ANN202
        seen.append((x.data_ptr(), tuple(x.shape), block))
        kept.append(x)
        return real(launch, x, block)

    r = _shim_runner(tiny_bundle, monkeypatch)
    r.forward(PROMPT[:6], 0)
    monkeypatch.setattr(matmul, "quantize_activations", counted)
    calls = r.ops.launch.calls
    calls.clear()
    r.decode(11, 6)
    assert seen and len(seen) == len(set(seen))
    n_layer = tiny_bundle.metadata[f"{tiny_bundle.architecture}.block_count"]
    moe = len(r.plan.resident)
    # silu(gate) * up: the FFN of every layer (dense or shared), and the routed experts of the MoE layers
    assert sum(v for k, v in calls.items() if k.startswith("quantize_swiglu_")) == n_layer + moe
    assert sum(v for k, v in calls.items() if k.startswith("moe_gemm_")) == 2 * moe + 2 * n_layer  # + k_b, v_b
    # GEMVs: q and kv_a (one, stacked) and wo, then the FFN's (dense or shared) gate_up and down in every layer;
    # the router's in each MoE layer; the output head's
    assert sum(v for k, v in calls.items() if k.startswith("gemv_")) == 4 * n_layer + moe + 1
    # every finalize but the last (the output norm follows it) quantizes the next sublayer's input as it makes it
    assert sum(v for k, v in calls.items() if k.startswith("finalize_q8_")) == 2 * n_layer - 1
    assert calls["finalize_f32"] == 1
    assert "combine_f32" not in calls  # the routed experts' combine runs in their sublayer's finalize


def test_decode_graph_host_logic_on_a_fake_capture(tiny_bundle, monkeypatch) -> None:
    """DecodeGraphs with CPU stand-ins for the CUDA calls (the "capture" runs the step; a replay runs nothing): the
    first decode step of a shape runs eagerly, the second is captured with the step's host-made inputs (embedding
    rows, seq, keys, padded page table, write rows, rope tables) registered and checked against an eager run, the
    third refills those inputs from its own step before the replay; a failing capture leaves the shape eager."""
    if REASON is not None:
        pytest.skip(REASON)
    from pocketmoe.engine.runner import SOLO

    r, ref = _shim_runner(tiny_bundle, monkeypatch, graphs=True), _shim_runner(tiny_bundle, monkeypatch)
    graphs = r.ops.graphs
    prompt = PROMPT[:6]
    assert torch.equal(r.forward(prompt, 0), ref.forward(prompt, 0))  # prefill: not decode-shaped, eager
    pos, tok = len(prompt), 11
    assert torch.equal(r.decode(tok, pos), ref.decode(tok, pos)) and not graphs.graphs  # warm-up, eager
    assert torch.equal(r.decode(tok + 1, pos + 1), ref.decode(tok + 1, pos + 1))  # captured, checked
    entry = graphs.graphs[(id(r.model), 1)]
    assert entry.checked and entry.graph.replays == 1 and len(entry.inputs) == 7
    r.decode(tok + 2, pos + 2)  # a replay: the inputs now hold this step's values
    assert entry.graph.replays == 2
    emb, seq, keys, table, write_rows, cos2, _ = (i.pinned for i in entry.inputs)
    assert torch.equal(emb, r.model.embed(torch.tensor([tok + 2])))
    assert keys.tolist() == [pos + 3] and seq.tolist() == [0]
    assert table.shape[1] == -(-r.cache.max_seq_len // r.cache.page)
    assert write_rows.tolist() == r.cache.rows(SOLO, pos + 2, 1).tolist()
    assert torch.equal(cos2, r.model.rotary.at(np.array([pos + 2]))[0].float())

    def broken(graph):  # noqa: ANN001, ANN202
        raise RuntimeError("operation not permitted when stream is capturing")

    r2, ref2 = (_shim_runner(tiny_bundle, monkeypatch, graphs=True, capture=broken),
                _shim_runner(tiny_bundle, monkeypatch))
    for runner in (r2, ref2):
        runner.forward(prompt, 0)
        runner.decode(tok, pos)
    with pytest.warns(RuntimeWarning, match="could not be captured"):
        got = r2.decode(tok + 1, pos + 1)
    assert torch.equal(got, ref2.decode(tok + 1, pos + 1))
    assert r2.ops.graphs.graphs[(id(r2.model), 1)] is False
    assert "not permitted" in next(iter(r2.ops.graphs.failures.values()))
