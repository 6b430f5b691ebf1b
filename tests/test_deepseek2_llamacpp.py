"""deepseek2 forward pass vs llama.cpp (llama-cpp-python) on the same GGUF files.

Covers what HF cannot express: softmax routing with expert groups (llama.cpp scores a group by the
sum of its top-2) and expert_weights_norm with softmax gating (HF DeepseekV2 ignores norm_topk_prob).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from deepseek2_fixture import Tiny, ds2_config, gguf_state_dict, hf_model, quantize_experts, write_gguf
from gguf import GGMLQuantizationType as Q

from pocketmoe.engine import ModelRunner, RunnerConfig
from pocketmoe.gguf import open_bundle

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = [pytest.mark.parity, pytest.mark.usefixtures("one_thread")]

CASES = {
    "yarn-absorbed": Tiny(yarn_factor=4.0),
    "legacy-qlora-2dense": Tiny(legacy=True, q_lora=48, layers=3, dense_lead=2, shared=2),
    "sigmoid-groups-norm": Tiny(v3=True, groups=4, groups_used=2, norm_topk=True, scale=2.5, q_lora=48,
                                layers=3, yarn_factor=2.0),
    "softmax-groups": Tiny(groups=4, groups_used=2, top_k=3, layers=3, yarn_factor=4.0),
    "softmax-norm-scale": Tiny(norm_topk=True, scale=1.5, layers=3, dense_lead=0),
}
PROMPT_LEN, GEN = 24, 32
F32_TOL = 1e-4  # max |dlogit| for F32 files (llama.cpp keeps F32 activations and an F32 KV cache here)




def llama(path: Path, n_ctx: int) -> llama_cpp.Llama:
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=1,
                           n_threads_batch=1, logits_all=True, type_k=0, type_v=0, verbose=False)


def llama_logits(llm: llama_cpp.Llama, tokens: list[int]) -> torch.Tensor:
    llm.reset()
    llm.eval(tokens)
    return torch.from_numpy(np.array(llm.scores[:len(tokens)], dtype=np.float32))


def llama_greedy(llm: llama_cpp.Llama, prompt: list[int], n: int) -> list[int]:
    llm.reset()
    llm.eval(prompt)
    out: list[int] = []
    while len(out) < n:
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        if len(out) < n:
            llm.eval(out[-1:])
    return out


def prompt_for(t: Tiny) -> list[int]:
    return torch.randint(0, t.vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(9)).tolist()


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    t = CASES[request.param]
    path = write_gguf(tmp_path_factory.mktemp("ds2cpp") / f"{request.param}.gguf", ds2_config(t),
                      gguf_state_dict(hf_model(t, seed=13), t))
    return t, path, llama(path, PROMPT_LEN + GEN)


def test_logits_every_position(case) -> None:
    t, path, llm = case
    prompt = prompt_for(t)
    ours = ModelRunner(open_bundle(path), RunnerConfig(n_ctx=64, chunk_size=5)).forward(prompt, 0)
    assert (ours - llama_logits(llm, prompt)).abs().max().item() <= F32_TOL


def test_greedy_continuation(case) -> None:
    t, path, llm = case
    prompt = prompt_for(t)
    runner = ModelRunner(open_bundle(path), RunnerConfig(n_ctx=PROMPT_LEN + GEN))
    assert runner.generate_greedy(prompt, GEN) == llama_greedy(llm, prompt, GEN)


QUANT_TYPES = [Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.IQ2_XXS]


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=[q.name for q in QUANT_TYPES])
def test_quantized_experts(qtype: Q, tmp_path: Path) -> None:
    """llama.cpp quantizes activations (Q8_K / Q8_0) for quantized dot products, a float-activation engine
    does not. Measured here: mean |dlogit| <= 5e-4 of the logit spread, max <= 4e-3, same top token everywhere."""
    t = Tiny(hidden=256, moe_ff=256, experts=4, top_k=2, ff=256, vocab=320, yarn_factor=4.0)
    model = hf_model(t, seed=5)
    blocks, types = quantize_experts(model, t, int(qtype), seed=11)
    path = write_gguf(tmp_path / "q.gguf", ds2_config(t), gguf_state_dict(model, t), blocks, types)
    prompt = prompt_for(t)
    ours = ModelRunner(open_bundle(path), RunnerConfig(n_ctx=64)).forward(prompt, 0)
    ref = llama_logits(llama(path, 64), prompt)
    spread = (ref.max() - ref.min()).item()
    diff = (ours - ref).abs()
    assert diff.mean().item() <= 2e-3 * spread
    assert diff.max().item() <= 1e-2 * spread
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9
