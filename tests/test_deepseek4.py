"""DeepSeek-V4 generation (models/deepseek4.py) against llama.cpp on the same GGUF files.

The tiny preset has a window-only layer, two ratio-4 layers (indexer top-16) and a ratio-128 layer, one
hash-routed layer and three biased top-k layers, a 32-token window. The 140-token prompt makes 35 ratio-4
entries (so the indexer's top-k drops some), one ratio-128 entry, and outruns the window; our side prefills
it in chunks of 50, so blocks complete across steps, and greedy decoding completes more.

F32 fixture: max |dlogit| <= 1e-4 at every prompt position and the same greedy tokens, on both backends.
MXFP4 experts + Q8_0 dense: within llama.cpp's activation-quantization noise, the same greedy tokens. Also:
several sequences in one step give each its solo logits; native = reference on F32 weights; the server.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import llama_parity
import numpy as np
import pytest
import torch
from batch_check import assert_batched_step_is_solo

from pocketmoe import native
from pocketmoe.engine import ModelRunner, RunnerConfig
from pocketmoe.gguf import open_bundle
from pocketmoe.testing.synth import write_fixture

PROMPT = [int(t) for t in np.random.default_rng(7).integers(2, 512, 140)]
GEN = 8
N_CTX = 256
F32_TOL = 1e-4
BACKENDS = ["reference"] + (["native"] if native.available() else [])


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("ds4")
    return {q: write_fixture("deepseek4", "tiny", q, d / f"{q}.gguf", seed=3)[0] for q in ("F32", "MXFP4_MOE")}


def llama_run(path: Path, prompt: list[int], gen: int) -> tuple[np.ndarray, list[int]]:
    return llama_parity.llama_run(path, prompt, gen, N_CTX)


def runner(path: Path, backend: str, **kw: object) -> ModelRunner:
    return ModelRunner(open_bundle(path), RunnerConfig(n_ctx=N_CTX, backend=backend, chunk_size=50, **kw))


@pytest.fixture(scope="module")
def llama_f32(fixtures: dict[str, Path]) -> tuple[np.ndarray, list[int]]:
    return llama_run(fixtures["F32"], PROMPT, GEN)


@pytest.mark.parity
@pytest.mark.parametrize("backend", BACKENDS)
def test_f32_matches_llama_cpp(fixtures: dict[str, Path], llama_f32: tuple[np.ndarray, list[int]],
                               backend: str) -> None:
    theirs, their_tokens = llama_f32
    r = runner(fixtures["F32"], backend)
    ours = r.forward(PROMPT, 0).numpy()
    assert float(np.abs(ours - theirs).max()) <= F32_TOL
    assert r.generate_greedy(PROMPT, GEN) == their_tokens


@pytest.mark.parity
@pytest.mark.skipif(not native.available(), reason="native kernels")
def test_mxfp4_q8_0_greedy_matches_llama_cpp(fixtures: dict[str, Path]) -> None:
    _, their_tokens = llama_run(fixtures["MXFP4_MOE"], PROMPT, GEN)
    assert runner(fixtures["MXFP4_MOE"], "native").generate_greedy(PROMPT, GEN) == their_tokens


@pytest.mark.parity
@pytest.mark.skipif(not native.available(), reason="native kernels")
@pytest.mark.xfail(strict=True, reason="not reachable by a float-noise engine (docs/fidelity.md): in layer 0 a "
                   "last-bit difference crosses a Q8_0 rounding tie (an int8 value, or a block scale's fp16 "
                   "rounding) in 2 rows; the ratio-4 layer after it spreads that to every row. llama.cpp in "
                   "ubatches of 1 misses this bound against itself too (max 0.011)")
def test_mxfp4_q8_0_logits_match_llama_cpp(fixtures: dict[str, Path]) -> None:
    theirs, _ = llama_run(fixtures["MXFP4_MOE"], PROMPT, GEN)
    ours = runner(fixtures["MXFP4_MOE"], "native").forward(PROMPT, 0).numpy()
    spread = float(theirs.max() - theirs.min())
    assert float(np.abs(ours - theirs).max()) <= 1e-3 * spread


@pytest.mark.parity
@pytest.mark.skipif(not native.available(), reason="native kernels")
def test_layer0_rows_part_only_where_an_activation_rounds_across_a_tie(fixtures: dict[str, Path]) -> None:
    """Why the logits above differ: layer 0's attention (window-only) on the MXFP4+Q8_0 file, against
    llama.cpp's graph tensors. A row whose Q8_0 activations (int8 values and fp16 block scales) feeding
    attn_q_a / attn_kv, attn_q_b, attn_output_a and attn_output_b are the same on both sides matches to
    float noise. The rows that part do so at a quantizer where llama.cpp's value and ours sit on either
    side of a rounding tie, an int8 one within 1e-3 of k + 0.5 or an fp16 scale within 1e-6 of a midpoint."""
    path, t = fixtures["MXFP4_MOE"], len(PROMPT)
    sites = {"blk.0.attn_q_a.weight": "attn_norm-0", "blk.0.attn_q_b.weight": "qr_norm-0",
             "blk.0.attn_output_a.weight": "attn_derope-0", "blk.0.attn_output_b.weight": "attn_wo_a-0"}
    _, theirs = llama_parity.llama_tensors(path, PROMPT, {*sites.values(), "attn_out-0"})
    r = ModelRunner(open_bundle(path), RunnerConfig(n_ctx=N_CTX, backend="native", chunk_size=N_CTX, threads=1))
    r.model.blocks[0].attn.native = False  # layer 0 op by op (the fine native ops), so its activations show
    ops, mine = r.ops, {}
    grouped, attend = ops._grouped_output, ops.dsv4_attention

    def keep(name: str, x: torch.Tensor) -> None:
        if name in sites and x.shape[0] == t:
            mine.setdefault(name, x.reshape(t, -1).numpy().copy())

    def hook_grouped(attn, o):  # noqa: ANN001, ANN202
        keep(attn.wo_a.name, o)
        return grouped(attn, o)

    def hook_attend(attn, x, ctx, layer, rope):  # noqa: ANN001, ANN202
        y = attend(attn, x, ctx, layer, rope)
        if layer == 0 and x.shape[0] == t:
            mine.setdefault("attn_out-0", y.numpy().copy())
        return y

    llama_parity.record_linear_inputs(ops, keep)
    ops._grouped_output, ops.dsv4_attention = hook_grouped, hook_attend
    r.forward(PROMPT, 0)
    wo_a = theirs["attn_wo_a-0"]  # [G, T, r]: per group
    their_rows = {k: (np.moveaxis(wo_a.reshape(-1, t, wo_a.shape[-1]), 1, 0) if v == "attn_wo_a-0" else theirs[v])
                  .reshape(t, -1) for k, v in sites.items()}
    names = list(sites)
    quant = {k: (llama_parity.activation_codes(mine[k], 32), llama_parity.activation_codes(their_rows[k], 32))
             for k in names}
    crossed = np.stack([((qa != qb).any(-1) | (da != db)).any(-1) for (qa, da, _), (qb, db, _) in quant.values()])
    first = np.where(crossed.any(0), crossed.argmax(0), -1)  # per row: the first site whose activation differs
    out = theirs["attn_out-0"].reshape(t, -1)
    rel = np.abs(mine["attn_out-0"] - out).max(-1) / np.abs(out).max(-1)
    same = first < 0
    assert rel[same].max() <= 2e-6
    assert same.all() or rel[~same].min() > 1e-4  # a crossing is a whole step (x86: rows 36 and 98 here)
    for row in np.nonzero(~same)[0]:
        (qa, da, _), (qb, db, vb) = (tuple(a[row] for a in side) for side in quant[names[first[row]]])
        int8 = vb[qa != qb]
        assert (np.abs(np.abs(int8) % 1 - 0.5) < 1e-3).all(), (row, names[first[row]], int8)
        amax = np.abs(their_rows[names[first[row]]][row].reshape(-1, 32)).max(-1) / np.float32(127)
        midpoint = llama_parity.fp16_midpoint_distance
        assert all(midpoint(float(d)) < 1e-6 for d in amax[da != db]), (row, names[first[row]])


@pytest.mark.skipif(not native.available(), reason="native kernels")
def test_native_is_the_reference_on_f32(fixtures: dict[str, Path]) -> None:
    """Native linears and norms against torch's: the same math in another float order."""
    want = runner(fixtures["F32"], "reference").forward(PROMPT, 0)
    got = runner(fixtures["F32"], "native").forward(PROMPT, 0)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


@pytest.mark.skipif(not native.available(), reason="native kernels")
@pytest.mark.parametrize("kv", ["f16", "bf16"])
def test_half_kv_cache(fixtures: dict[str, Path], kv: str) -> None:
    """An f16 / bf16 cache runs DeepSeek-V4's attention natively (no layer falls back to the reference) and gives
    the reference's logits over the same dtype's cache. Greedy tokens are not compared with a float32 cache's:
    on this random model the rounding of the cache alone moves the reference's logits by 0.02-0.12. The two
    backends' cache rows are float32 sums in different orders, and where one rounds to the other half the
    logits move: by up to 1.2e-4 for f16 (3% of the cache's values differ by then), and for bf16 2.8e-4 but for
    one row in 140 where the indexer's choice of entries changes (0.04). So: every row but a few within 1e-3,
    where the float32 cache's logits are further off in most rows (32 of 140 for f16, all for bf16)."""
    half = runner(fixtures["F32"], "native", kv_dtype=kv)
    assert half.cache.data.dtype == {"f16": torch.float16, "bf16": torch.bfloat16}[kv]
    got = half.forward(PROMPT, 0)
    assert all(blk.attn.native not in (None, False) for blk in half.model.blocks)
    want = runner(fixtures["F32"], "reference", kv_dtype=kv).forward(PROMPT, 0)
    off = (got - want).abs().amax(1)
    assert (off > 1e-3).sum().item() <= 3 and off.max().item() < 0.1, off
    f32 = runner(fixtures["F32"], "reference").forward(PROMPT, 0)
    assert ((f32 - want).abs().amax(1) > 1e-3).sum().item() >= 20


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_step_gives_each_sequence_its_solo_logits(fixtures: dict[str, Path], backend: str) -> None:
    prompts = {"a": PROMPT[:131], "b": PROMPT[5:12], "c": PROMPT[40:47]}
    assert_batched_step_is_solo(lambda: runner(fixtures["MXFP4_MOE"], backend, max_seqs=3), prompts)


def test_cache_row_and_capability(fixtures: dict[str, Path]) -> None:
    """The cache holds one row per position of the widest layer (ratio 4: kv, compressor and indexer states,
    entries) and the spec says the architecture generates."""
    r = runner(fixtures["F32"], "reference")
    c = r.spec.config
    d, i = c.head_dim, c.indexer_head_dim
    assert r.cache.data.shape[-1] == r.spec.kv_values_per_token() == d + 2 * 2 * d + d + 2 * 2 * i + i
    assert r.spec.capability_details()["generate"] is True


def test_served(fixtures: dict[str, Path]) -> None:
    from pocketmoe.testing.live_server import LiveServer
    from pocketmoe.tokenizer import Tokenizer

    path = fixtures["MXFP4_MOE"]
    want = runner(path, "auto").generate_greedy(PROMPT, 4)
    args = ["--model", str(path), "--served-model-name", "ds4", "--max-model-len", str(N_CTX), "--threads", "1"]
    with LiveServer(args) as srv:
        body = {"model": "ds4", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 0,
                "ignore_eos": True}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120).json()
    lp = r["choices"][0]["logprobs"]
    tok = Tokenizer.from_metadata(open_bundle(path).metadata)
    assert lp["tokens"] == [tok.token_to_piece(t).decode("utf-8", "replace") for t in want]
