"""MiniMax-M2 generation (models/minimax_m2.py) against llama.cpp on the same GGUF files.

F32 fixtures: max |dlogit| <= 1e-4 at every position and the same greedy tokens, on both backends (the
reference attention in torch, the native linears and experts). Quantized fixtures: the native kernels
quantize activations as llama.cpp does, so logits agree to float noise at every row that no activation
rounding tie reaches (each row's first difference must be at a tie: docs/fidelity.md), and the greedy
tokens match.
Also: several sequences in one step give each its solo logits, and the server runs the architecture.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import llama_parity
import numpy as np
import pytest
import torch
from batch_check import assert_batched_step_is_solo
from kv_check import KV_DTYPES, close_caches

from pocketmoe import native
from pocketmoe.engine import ModelRunner, RunnerConfig, SeqChunk, Step
from pocketmoe.gguf import open_bundle
from pocketmoe.testing.synth import write_fixture

PROMPT = [1, 17, 42, 99, 250, 7, 300, 5, 8, 9, 100, 200, 311, 400, 2, 3, 50, 60, 70]
GEN = 16
F32_TOL = 1e-4
BACKENDS = ["reference"] + (["native"] if native.available() else [])


def fixture(tmp_path_factory: pytest.TempPathFactory, quant: str, seed: int = 3) -> Path:
    return write_fixture("minimax-m2", "tiny", quant, tmp_path_factory.mktemp("mm2") / f"{quant}.gguf", seed=seed)[0]


def llama_run(path: Path, prompt: list[int], gen: int) -> tuple[np.ndarray, list[int]]:
    return llama_parity.llama_run(path, prompt, gen, 64)


@pytest.mark.parity
@pytest.mark.parametrize("backend", BACKENDS)
def test_f32_matches_llama_cpp(tmp_path_factory: pytest.TempPathFactory, backend: str) -> None:
    path = fixture(tmp_path_factory, "F32")
    theirs, their_tokens = llama_run(path, PROMPT, GEN)
    runner = ModelRunner(open_bundle(path), RunnerConfig(n_ctx=64, backend=backend, chunk_size=7))
    ours = runner.forward(PROMPT, 0).numpy()
    assert float(np.abs(ours - theirs).max()) <= F32_TOL
    assert runner.generate_greedy(PROMPT, GEN) == their_tokens


@pytest.mark.parity
@pytest.mark.skipif(not native.available(), reason="native kernels")
@pytest.mark.parametrize("quant", ["Q4_K_M", "IQ2_XXS", "Q8_0"])
def test_quantized_matches_llama_cpp(tmp_path_factory: pytest.TempPathFactory, quant: str) -> None:
    """Logits to float noise (1e-5 of their spread) at every row no rounding tie reaches, and the same greedy tokens.
    Both sides quantize activations alike but sum in other float orders (docs/fidelity.md), so a value on a
    tie may round the other way: each row whose activations first differ must do so at a tie."""
    path = fixture(tmp_path_factory, quant)
    theirs, their_tokens = llama_run(path, PROMPT, GEN)
    runner = ModelRunner(open_bundle(path), RunnerConfig(n_ctx=64, backend="native"))
    ours = runner.forward(PROMPT, 0).numpy()
    reached = rows_reached_by_ties(path)
    assert (~reached).sum() >= len(PROMPT) // 2, f"ties reach rows {np.nonzero(reached)[0]}: too few to compare"
    spread = float(theirs.max() - theirs.min())
    assert float(np.abs(ours - theirs)[~reached].max()) <= 1e-5 * spread  # measured: 1.4e-7 at most (x86, AMX and AVX2)
    assert runner.generate_greedy(PROMPT, GEN) == their_tokens


def rows_reached_by_ties(path: Path) -> np.ndarray:
    """llama_parity.rows_reached_by_ties over every quantizer input of the prompt's forward: each layer's
    attention input (q, k, v; k and v feed later rows), attention output (kqv_out) and routed experts' input,
    then the head's. Ours from an op-by-op attention (so kqv_out shows), which gives the fused logits bitwise.
    The experts' own down-projection input stays inside the native expert kernel and is not compared."""
    bundle = open_bundle(path)
    runner = ModelRunner(bundle, RunnerConfig(n_ctx=64, backend="native"))
    fused = runner.forward(PROMPT, 0).numpy()
    runner = ModelRunner(bundle, RunnerConfig(n_ctx=64, backend="native"))
    ops, mine = runner.ops, {}
    moe_sublayer = ops.moe_sublayer
    for block in runner.model.blocks:
        block.attn.native_sublayer = False

    def keep(name: str, x: torch.Tensor) -> None:
        if x.shape[0] == len(PROMPT):
            mine.setdefault(name, x.numpy().copy())

    def hook_moe(block, x, residual):  # noqa: ANN001, ANN202
        keep(block.router.gate.name.replace("ffn_gate_inp", "ffn_gate_exps"), x)
        return moe_sublayer(block, x, residual)

    llama_parity.record_linear_inputs(ops, keep)
    ops.moe_sublayer = hook_moe
    assert np.array_equal(runner.forward(PROMPT, 0).numpy(), fused)
    n_layer = len(runner.model.blocks)
    sites = {f"attn_norm-{i}": ([f"blk.{i}.attn_{w}.weight" for w in "qkv"], True) for i in range(n_layer)}
    for i in range(n_layer):
        sites[f"kqv_out-{i}"] = ([f"blk.{i}.attn_output.weight"], False)
        sites[f"ffn_norm-{i}"] = ([f"blk.{i}.ffn_{w}_exps.weight" for w in ("gate", "up")], False)
    sites["result_norm"] = (["output.weight"], False)
    _, theirs = llama_parity.llama_tensors(path, PROMPT, set(sites))
    order = sorted(sites, key=lambda s: (int(s.rsplit("-", 1)[1]) if "-" in s else n_layer,
                                         ("attn_norm", "kqv_out", "ffn_norm", "result_norm").index(s.split("-")[0])))
    return llama_parity.rows_reached_by_ties([
        (s, mine[sites[s][0][0]], theirs[s].reshape(len(PROMPT), -1),
         {b for w in sites[s][0] if (b := llama_parity.activation_block(bundle.info(w).ggml_type))}, sites[s][1])
        for s in order])


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_step_gives_each_sequence_its_solo_logits(tmp_path_factory: pytest.TempPathFactory,
                                                          backend: str) -> None:
    path = fixture(tmp_path_factory, "Q4_K_M", seed=4)
    cfg = RunnerConfig(n_ctx=64, backend=backend, max_seqs=3)
    prompts = {"a": PROMPT, "b": PROMPT[3:10], "c": [9, 8, 7]}
    assert_batched_step_is_solo(lambda: ModelRunner(open_bundle(path), cfg), prompts)


def test_served(tmp_path_factory: pytest.TempPathFactory) -> None:
    from pocketmoe.testing.live_server import LiveServer

    path = fixture(tmp_path_factory, "Q4_K_M")
    want = ModelRunner(open_bundle(path), RunnerConfig(n_ctx=64, backend="auto")).generate_greedy(PROMPT, 6)
    with LiveServer(["--model", str(path), "--served-model-name", "mm2", "--max-model-len", "64", "--threads", "1"]) as srv:
        body = {"model": "mm2", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 0, "ignore_eos": True}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 6
    from pocketmoe.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(open_bundle(path).metadata)
    assert lp["tokens"] == [tok.token_to_piece(t).decode("utf-8", "replace") for t in want]


def hf_state_dict(path: Path, n_layer: int) -> dict[str, torch.Tensor]:
    """The F32 fixture's tensors under HF MiniMaxM2ForCausalLM's names (stacked experts: gate rows, then up)."""
    from pocketmoe.layers.linear import load_float

    b = open_bundle(path)
    sd = {"model.embed_tokens.weight": load_float(b, "token_embd.weight"), "model.norm.weight":
          load_float(b, "output_norm.weight"), "lm_head.weight": load_float(b, "output.weight")}
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
             "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate"}
    for i in range(n_layer):
        for g, h in names.items():
            sd[f"model.layers.{i}.{h}.weight"] = load_float(b, f"blk.{i}.{g}.weight")
        sd[f"model.layers.{i}.mlp.e_score_correction_bias"] = load_float(b, f"blk.{i}.exp_probs_b.bias")
        gate, up, down = (load_float(b, f"blk.{i}.ffn_{w}_exps.weight") for w in ("gate", "up", "down"))
        sd[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        sd[f"model.layers.{i}.mlp.experts.down_proj"] = down
    return {k: v.clone() for k, v in sd.items()}


def test_f32_matches_hf_transformers(tmp_path_factory: pytest.TempPathFactory) -> None:
    transformers = pytest.importorskip("transformers")
    from pocketmoe.testing.presets import PRESETS

    c = PRESETS["minimax-m2"]["tiny"]
    path = fixture(tmp_path_factory, "F32")
    hf_cfg = transformers.MiniMaxM2Config(
        vocab_size=c.n_vocab, hidden_size=c.n_embd, intermediate_size=c.n_ff_exp, num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head, num_key_value_heads=c.n_head_kv, head_dim=c.head_dim, rms_norm_eps=c.rms_eps,
        num_local_experts=c.n_expert, num_experts_per_tok=c.n_expert_used, bos_token_id=None, eos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_freq_base,
                         "partial_rotary_factor": c.n_rot / c.head_dim})
    model = transformers.MiniMaxM2ForCausalLM(hf_cfg).eval()
    model.load_state_dict(hf_state_dict(path, c.n_layer), strict=True)
    with torch.no_grad():
        want = model(torch.tensor([PROMPT])).logits[0].float()
    for backend in BACKENDS:
        ours = ModelRunner(open_bundle(path), RunnerConfig(n_ctx=64, backend=backend)).forward(PROMPT, 0)
        assert (ours - want).abs().max().item() <= F32_TOL, backend


@pytest.mark.skipif(not native.available(), reason="native kernels")
@pytest.mark.parametrize("neox,heads,cached,kv", [(True, (12, 2), 5, "f32"), (False, (4, 4), 5, "f32"),
                                                  (True, (10, 2), 5, "f32"), (True, (12, 2), 130, "f32"),
                                                  (True, (12, 2), 130, "f16"), (False, (4, 4), 5, "bf16")])
def test_native_gqa_attention_is_the_reference(neox: bool, heads: tuple[int, int], cached: int, kv: str) -> None:
    """The C++ op against the torch one over a step of two sequences (one prefilling 20 tokens after `cached`,
    130 taking its keys past two chunks of 64; one decoding): outputs and written cache rows, at float rounding
    (rows of a half-type cache at most one rounding step apart)."""
    from pocketmoe.engine.kv_cache import PagedKVCache
    from pocketmoe.engine.step import StepContext
    from pocketmoe.layers.gqa import GQAConfig, GQAttention
    from pocketmoe.layers.rotary import RopeConfig, Rotary
    from pocketmoe.ops import make_ops

    h, g = heads
    cfg = GQAConfig(n_head=h, n_head_kv=g, head_dim=64, v_dim=32, n_rot=32, neox=neox, scale=0.125)
    gen = torch.Generator().manual_seed(1)
    rot = Rotary(RopeConfig(dim=32, base=10000.0, neox=neox))
    results = []
    for ops in (make_ops("reference", 1, None), make_ops("native", 2, None)):
        attn = GQAttention(cfg, ops, wq=None, wk=None, wv=None, wo=None)  # type: ignore[arg-type]
        cache = PagedKVCache(1, cfg.kv_width, 16, 256, dtype=KV_DTYPES[kv][0])
        gen.manual_seed(1)
        cache.data.normal_(generator=gen)
        outs = []
        for step in (Step([SeqChunk("a", list(range(cached)), 0, "all"), SeqChunk("b", [1], 0)]),
                     Step([SeqChunk("a", list(range(20)), cached, "all"), SeqChunk("b", [2], 1)])):
            ctx = StepContext.build(step, cache, 1000)
            ctx.cos2, ctx.sin2 = rot.at(ctx.positions)
            t = ctx.n_tokens
            q, k, v = (torch.randn(t, n, generator=gen) for n in (h * 64, g * 64, g * 32))
            outs.append(ops.gqa_attention(attn, q, k, v, ctx, 0))
        results.append((outs, cache.data.clone()))
    (ref, ref_cache), (nat, nat_cache) = results
    for a, b in zip(ref, nat, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    close_caches(nat_cache, ref_cache)


@pytest.mark.skipif(not native.available(), reason="native kernels")
def test_native_gqa_sublayer_is_its_ops_in_order(tmp_path_factory: pytest.TempPathFactory) -> None:
    """One native call per attention sublayer gives bitwise what the native ops give one at a time."""
    path = fixture(tmp_path_factory, "Q4_K_M", seed=6)
    runs = []
    for whole in (True, False):
        r = ModelRunner(open_bundle(path), RunnerConfig(n_ctx=64, backend="native"))
        if not whole:
            for b in r.model.blocks:
                b.attn.native_sublayer = False
        logits = [r.forward(PROMPT, 0)] + [r.decode(t, len(PROMPT) + i) for i, t in enumerate((5, 6, 7))]
        runs.append((logits, r))
    (a, ra), (b, _) = runs
    assert all(type(blk.attn.native_sublayer).__name__ == "GQASublayer" for blk in ra.model.blocks)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
