"""Why native logits on a deepseek2 Q4_K_M file made by llama.cpp's quantizer differ from llama.cpp's by ~1e-2
(docs/fidelity.md): every op agrees to the last float bits, and an activation quantizer (Q8_K / Q8_0 rows
before each quantized matmul) turns a last-bit difference into a whole int8 step where a value sits within a
few ulp of a rounding tie. Such a row then differs by ~1e-3 and spreads through attention and routing.
llama.cpp's own batch split does the same to it: its CPU kernels for Q4_K sum in another order for tokens
in groups of four (GEMM) than for the rest (GEMV), so the same prompt decoded in ubatches of 1 differs
from one decoded at once by as much as we do.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from llama_parity import llama_quantize, llama_tensors

from pocketmoe import native
from pocketmoe.engine import ModelRunner, RunnerConfig
from pocketmoe.gguf import open_bundle
from pocketmoe.quant.formats import type_name
from pocketmoe.testing.synth import write_fixture

pytest.importorskip("llama_cpp")
pytestmark = [pytest.mark.parity, pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not native.available(), reason="native kernels")]

# V2-Lite's layout with 512-wide rows: two Q4_K super-blocks per row, so the per-row float sums have an order
SHAPE = dict(n_embd=512, n_vocab=1024, n_layer=3, n_ff=512, n_ff_exp=256, n_expert=8, n_expert_used=3)
PROMPT = [int(t) for t in np.random.default_rng(9).integers(2, 1024, 24)]
TIE_ULPS = 16   # "near a tie": x * (127 / amax) within this many float32 spacings of k + 0.5
N_NOPE, N_ROPE = 64, 32  # the preset's head dims: q_nope (per head, Q8_0 blocks of 32) feeds attn_k_b
MATCH = 2e-6    # relative, per row: float noise (ops agree to a few ulp)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("fidelity")
    f32 = write_fixture("deepseek2", "tiny", "F32", d / "f32.gguf", **SHAPE)[0]
    return {"F32": f32, "Q4_K_M": llama_quantize(f32, d / "q4_k_m.gguf", "Q4_K_M")}


def ours(path: Path) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Native logits at every prompt position and the residual stream after each sublayer of layer 0."""
    r = ModelRunner(open_bundle(path), RunnerConfig(n_ctx=64, backend="native", threads=1))
    ops, seen = r.ops, {}
    mla, ffn = ops.mla_sublayer, ops.ffn_sublayer

    def mla_hook(attn, x, ctx, layer, residual):  # noqa: ANN001, ANN202
        y = mla(attn, x, ctx, layer, residual)
        seen.setdefault(f"ffn_inp-{layer}", residual.x.numpy().copy())
        return y

    def ffn_hook(mlp, x, residual):  # noqa: ANN001, ANN202
        y = ffn(mlp, x, residual)
        seen.setdefault("l_out-0", residual.x.numpy().copy())
        return y

    ops.mla_sublayer, ops.ffn_sublayer = mla_hook, ffn_hook
    return r.forward(PROMPT, 0).numpy(), seen


def tie_ulps(rows: np.ndarray, block: int) -> np.ndarray:
    """[T]: per row, how near its Q8 rounding (blocks of `block`) comes to a tie: min over the row's values of
    |x * 127 / amax - (k + 0.5)| in float32 spacings at that value."""
    x = rows.astype(np.float32).reshape(len(rows), -1, block)
    v = np.abs(x * (np.float32(127) / np.abs(x).max(-1, keepdims=True))).astype(np.float32)
    return (np.abs(v - np.floor(v) - 0.5) / np.spacing(v)).reshape(len(rows), -1).min(-1)


def near_tie(rows: np.ndarray, block: int) -> np.ndarray:
    """[T] bool: the row holds a value within TIE_ULPS of a Q8 rounding tie."""
    return tie_ulps(rows, block) <= TIE_ULPS


def row_rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.abs(a - b).max(-1) / np.abs(b).max(-1)


def test_f32_file_matches_and_is_batch_invariant(files: dict[str, Path]) -> None:
    whole, _ = llama_tensors(files["F32"], PROMPT, set())
    single, _ = llama_tensors(files["F32"], PROMPT, set(), ubatch=1)
    assert np.abs(whole - single).max() <= 1e-5
    assert np.abs(ours(files["F32"])[0] - whole).max() <= 1e-5


def test_rows_part_only_at_activation_rounding_ties(files: dict[str, Path]) -> None:
    """Layer 0 on the Q4_K_M file: the embedding and first norm are bit-identical; after the attention and
    the FFN, every row whose quantizer inputs hold no near-tie matches to float noise, and the rows that
    differ beyond it are rows with a near-tie."""
    t = len(PROMPT)
    names = {"attn_norm-0", "q-0", "kqv-0", "kqv_out-0", "ffn_inp-0", "ffn_norm-0", "ffn_swiglu-0", "l_out-0"}
    _, theirs = llama_tensors(files["Q4_K_M"], PROMPT, names)
    _, mine = ours(files["Q4_K_M"])
    rows = {k: v.reshape(t, -1) if k != "kqv-0" else np.moveaxis(v.reshape(-1, t, v.shape[-1]), 1, 0).reshape(t, -1)
            for k, v in theirs.items()}
    q_nope = rows["q-0"].reshape(t, -1, N_NOPE + N_ROPE)[..., :N_NOPE].reshape(t, -1)
    tie_attn = near_tie(q_nope, 32) | near_tie(rows["kqv-0"], 256) | near_tie(rows["kqv_out-0"], 256)
    tie_ffn = tie_attn | near_tie(rows["ffn_norm-0"], 256) | near_tie(rows["ffn_swiglu-0"], 256)
    for name, ties in (("ffn_inp-0", tie_attn), ("l_out-0", tie_ffn)):
        rel = row_rel(mine[name], rows[name])
        parted = rel > MATCH
        assert not (parted & ~ties).any(), (name, rel[~ties].max())
        # a parted row moved by a whole int8 step, not by noise (x86: row 20 here; another CPU's llama.cpp
        # kernels may land no value across a tie, and then every row matches)
        assert not parted.any() or rel[parted].min() > 100 * MATCH, name


def test_llama_cpp_differs_from_itself_by_as_much(files: dict[str, Path]) -> None:
    """The same prompt in llama.cpp at once (Q4_K GEMM in groups of 4 tokens) and one token per ubatch (GEMV):
    mean |dlogit| is of the order of ours against either."""
    whole, _ = llama_tensors(files["Q4_K_M"], PROMPT, set())
    single, _ = llama_tensors(files["Q4_K_M"], PROMPT, set(), ubatch=1)
    mine = ours(files["Q4_K_M"])[0]
    itself = float(np.abs(whole - single).mean())
    if itself < 1e-6:
        pytest.skip("llama.cpp's kernels here give the same logits in both batch modes (no repacked Q4_K GEMM)")
    for ref in (whole, single):
        assert float(np.abs(mine - ref).mean()) <= 3 * itself
    assert (mine.argmax(-1) == whole.argmax(-1)).mean() >= 0.9


# Other llama.cpp mixes -> the fallback type its quantizer gives attn_k_b (64-value rows here, 128 in V2-Lite)
MIXES = {"Q5_K_M": "Q5_1", "IQ4_XS": "IQ4_NL", "Q3_K_M": "Q4_0", "Q4_1": "Q4_1", "IQ3_S": "IQ4_NL",
         "IQ3_M": "IQ4_NL"}


@pytest.mark.parametrize("mix", list(MIXES))
def test_other_mixes_run_native_and_part_only_at_ties(files: dict[str, Path], mix: str) -> None:
    """Files in the other mixes users download, fallback types included (Q5_1 for Q5_K_M: min terms against
    llama.cpp's Q8_1 activation sums): every weight runs native (a decode step replays as one call), and
    layer 0 matches llama.cpp as the Q4_K_M file does: rows part only where a quantizer input holds a tie."""
    path = llama_quantize(files["F32"], files["F32"].with_name(f"{mix}.gguf"), mix)
    types = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}
    assert types["blk.0.attn_k_b.weight"] == MIXES[mix]
    check_native_layer0(path, types)


def test_nvfp4_file_runs_native_and_parts_only_at_ties(tmp_path: Path) -> None:
    """An NVFP4 file (a scale per 16 values: llama.cpp's CPU dot takes a float step per 16 against Q8_0
    activations) written here, as this llama.cpp's quantizer does not make the type: the same checks."""
    path = write_fixture("deepseek2", "tiny", "NVFP4", tmp_path / "nvfp4.gguf", **SHAPE)[0]
    types = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}
    assert set(types.values()) == {"NVFP4", "F32"}
    check_native_layer0(path, types)


def check_native_layer0(path: Path, types: dict[str, str]) -> None:
    """Every weight of `path` has a native kernel, a decode step replays as one native call, and layer 0's
    rows match llama.cpp's graph tensors to MATCH except where a quantizer input holds a near-tie."""
    known = {"F32", *(type_name(t) for t in native.supported_types())}
    assert {n: t for n, t in types.items() if t not in known} == {}
    r = ModelRunner(open_bundle(path), RunnerConfig(n_ctx=64, backend="native", threads=1))
    r.generate_greedy(PROMPT[:4], 3)
    assert [bool(p) for _, p in r.ops._programs.values()] == [True]

    t = len(PROMPT)
    names = {"attn_norm-0", "q-0", "kqv-0", "kqv_out-0", "ffn_inp-0", "ffn_norm-0", "ffn_swiglu-0", "l_out-0"}
    _, theirs = llama_tensors(path, PROMPT, names)
    _, mine = ours(path)
    rows = {k: v.reshape(t, -1) if k != "kqv-0" else np.moveaxis(v.reshape(-1, t, v.shape[-1]), 1, 0).reshape(t, -1)
            for k, v in theirs.items()}
    q_nope = rows["q-0"].reshape(t, -1, N_NOPE + N_ROPE)[..., :N_NOPE].reshape(t, -1)

    def tie(x: np.ndarray) -> np.ndarray:  # blocks of 32 (legacy types' Q8_0 / Q8_1 rows) or 256 (k-quants)
        return near_tie(x, 32) | near_tie(x, 256)

    tie_attn = tie(rows["attn_norm-0"]) | tie(q_nope) | tie(rows["kqv-0"]) | tie(rows["kqv_out-0"])
    tie_ffn = tie_attn | tie(rows["ffn_norm-0"]) | tie(rows["ffn_swiglu-0"])
    assert (~tie_ffn).sum() >= t // 2, "too few rows without a near-tie to judge"
    for name, ties in (("ffn_inp-0", tie_attn), ("l_out-0", tie_ffn)):
        rel = row_rel(mine[name], rows[name])
        assert not ((rel > MATCH) & ~ties).any(), (name, rel[~ties].max())
