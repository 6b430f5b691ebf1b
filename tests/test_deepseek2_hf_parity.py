"""deepseek2 forward pass vs HF transformers DeepseekV2/V3ForCausalLM holding the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deepseek2_fixture import Tiny, ds2_config, gguf_state_dict, hf_model, quantize_experts, write_gguf
from gguf import GGMLQuantizationType as Q

from pocketmoe.engine import ContextLengthError, ModelRunner, RunnerConfig
from pocketmoe.errors import PocketMoEError
from pocketmoe.gguf import open_bundle

CASES = {
    # YaRN factor 4 (mscale = mscale_all_dim = 0.707), absorbed MLA, full attn_q, one dense block
    "yarn-absorbed": Tiny(yarn_factor=4.0),
    # legacy attn_kv_b, q LoRA, two leading dense blocks, two shared experts
    "legacy-qlora-2dense": Tiny(legacy=True, q_lora=48, layers=3, dense_lead=2, shared=2),
    # V3 routing: sigmoid + exp_probs_b, 4 groups (2 used, top-2 sum), weights norm and scale 2.5
    "sigmoid-groups-norm": Tiny(v3=True, groups=4, groups_used=2, norm_topk=True, scale=2.5, q_lora=48,
                                layers=3, yarn_factor=2.0),
}
PROMPT_LEN, GEN = 24, 32


def prompt_for(t: Tiny) -> torch.Tensor:
    return torch.randint(0, t.vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7))


def hf_greedy(model: torch.nn.Module, prompt: torch.Tensor, n: int) -> list[int]:
    seq = prompt.tolist()
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    t = CASES[request.param]
    model = hf_model(t, seed=3)
    path = write_gguf(tmp_path_factory.mktemp("ds2") / f"{request.param}.gguf", ds2_config(t),
                      gguf_state_dict(model, t))
    return t, model, path


@pytest.mark.parametrize("tile_rows", [8, None], ids=["tiled", "plain"])
def test_logits_every_position(case, tile_rows: int | None) -> None:
    t, model, path = case
    prompt = prompt_for(t)
    runner = ModelRunner(open_bundle(path), RunnerConfig(n_ctx=128, chunk_size=7, tile_rows=tile_rows))
    ours = runner.forward(prompt, 0)
    with torch.no_grad():
        ref = model(prompt[None]).logits[0]
    assert ours.shape == ref.shape == (PROMPT_LEN, t.vocab)
    assert (ours - ref).abs().max().item() <= 1e-4
    again = runner.forward(prompt[-5:], PROMPT_LEN - 5, last_only=True)  # other chunk boundaries
    assert (again - ours[-1:]).abs().max().item() <= 1e-5


def test_greedy_continuation(case) -> None:
    t, model, path = case
    prompt = prompt_for(t)
    runner = ModelRunner(open_bundle(path), RunnerConfig(n_ctx=PROMPT_LEN + GEN, chunk_size=16))
    assert runner.generate_greedy(prompt.tolist(), GEN) == hf_greedy(model, prompt, GEN)


def test_context_length_is_checked(case) -> None:
    t, _, path = case
    runner = ModelRunner(open_bundle(path), RunnerConfig(n_ctx=PROMPT_LEN + 4))
    with pytest.raises(ContextLengthError, match=r"24 tokens and 5 more were requested, 29 in all"):
        runner.generate_greedy(prompt_for(t).tolist(), 5)
    with pytest.raises(ContextLengthError):
        runner.forward([1, 2], PROMPT_LEN + 3)


QUANT_TYPES = [Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.IQ2_XXS]


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=[q.name for q in QUANT_TYPES])
def test_quantized_experts(qtype: Q, tmp_path: Path) -> None:
    t = Tiny(hidden=256, moe_ff=256, experts=4, top_k=2, ff=256, vocab=320, yarn_factor=4.0)
    model = hf_model(t, seed=5)
    blocks, types = quantize_experts(model, t, int(qtype), seed=11)
    path = write_gguf(tmp_path / "q.gguf", ds2_config(t), gguf_state_dict(model, t), blocks, types)
    bundle = open_bundle(path)
    assert all(bundle.tensors[n].ggml_type == int(qtype) for n in blocks)
    prompt = prompt_for(t)
    ours = ModelRunner(bundle, RunnerConfig(n_ctx=64, chunk_size=10)).forward(prompt, 0)
    with torch.no_grad():
        ref = model(prompt[None]).logits[0]
    spread = (ref.max() - ref.min()).item()
    assert (ours - ref).abs().max().item() <= 1e-3 * spread


def test_fused_gate_up_experts_and_tied_head(tmp_path: Path) -> None:
    """`ffn_gate_up_exps` (gate rows first) instead of two tensors; no output.weight (head = token_embd)."""
    t = Tiny(yarn_factor=4.0)
    model = hf_model(t, seed=8)
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    sd = gguf_state_dict(model, t)
    del sd["output.weight"]
    for i in range(t.dense_lead, t.layers):
        b = f"blk.{i}."
        sd[b + "ffn_gate_up_exps.weight"] = torch.cat(
            [sd.pop(b + "ffn_gate_exps.weight"), sd.pop(b + "ffn_up_exps.weight")], dim=1)
    bundle = open_bundle(write_gguf(tmp_path / "fused.gguf", ds2_config(t), sd))
    assert "output.weight" not in bundle.tensors and "blk.1.ffn_gate_up_exps.weight" in bundle.tensors
    prompt = prompt_for(t)
    ours = ModelRunner(bundle, RunnerConfig(n_ctx=64)).forward(prompt, 0)
    with torch.no_grad():
        ref = model(prompt[None]).logits[0]
    assert (ours - ref).abs().max().item() <= 1e-4


def test_missing_tensor_is_a_clear_error(tmp_path: Path) -> None:
    t = Tiny()
    sd = gguf_state_dict(hf_model(t), t)
    del sd["blk.1.attn_kv_a_norm.weight"]
    path = write_gguf(tmp_path / "bad.gguf", ds2_config(t), sd, blocks={})
    with pytest.raises(PocketMoEError, match="'blk.1.attn_kv_a_norm.weight' is required .* missing"):
        ModelRunner(open_bundle(path))
