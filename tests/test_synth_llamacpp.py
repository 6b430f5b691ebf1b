"""Fixtures load and run in llama.cpp (llama-cpp-python); HF DeepseekV2 -> GGUF matches it. Skipped
when llama_cpp is not importable."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pocketmoe.testing.presets import PRESETS
from pocketmoe.testing.state_dict import write_from_state_dict
from pocketmoe.testing.synth import write_fixture

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.parity

TOKENS = [1, 17, 42, 99, 250, 7, 300, 5]


def llama_logits(path: Path, tokens: list[int] = TOKENS) -> np.ndarray:
    """[len(tokens), n_vocab] logits of every position."""
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, verbose=False, logits_all=True, n_threads=2,
                          n_threads_batch=2, type_k=0, type_v=0)  # F32 KV cache
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)], dtype=np.float32)
    finally:
        llm.close()


@pytest.mark.parametrize("quant", ["F32", "Q4_K_M"])
def test_tiny_deepseek2_runs_single_and_sharded(tmp_path: Path, quant: str) -> None:
    (single,) = write_fixture("deepseek2", "tiny", quant, tmp_path / "one.gguf", seed=5)
    shards = write_fixture("deepseek2", "tiny", quant, tmp_path / "three.gguf", shards=3, seed=5)
    a = llama_logits(single)
    assert a.shape == (len(TOKENS), PRESETS["deepseek2"]["tiny"].n_vocab)
    assert np.isfinite(a).all() and float(a.std()) > 0
    b = llama_logits(shards[0])
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch,preset,quant", [
    ("deepseek2", "tiny-legacy", "Q4_K_M"), ("deepseek2", "tiny-qlora", "Q8_0"),
    ("deepseek2", "tiny", "IQ2_XXS"), ("minimax-m2", "tiny", "Q4_K_M"), ("deepseek4", "tiny", "MXFP4_MOE")])
def test_other_tiny_fixtures_run(tmp_path: Path, arch: str, preset: str, quant: str) -> None:
    (path,) = write_fixture(arch, preset, quant, tmp_path / "m.gguf")
    logits = llama_logits(path)
    assert logits.shape == (len(TOKENS), PRESETS[arch][preset].n_vocab)
    assert np.isfinite(logits).all() and float(logits.std()) > 0


@pytest.mark.parametrize("preset", ["tiny", "tiny-legacy", "tiny-qlora"])
def test_hf_deepseek2_f32_gguf_matches_llamacpp(tmp_path: Path, preset: str) -> None:
    transformers = pytest.importorskip("transformers")
    from pocketmoe.testing.hf_map import hf_deepseek2_config, hf_deepseek2_to_gguf_state_dict

    config = PRESETS["deepseek2"][preset]
    torch.manual_seed(0)
    model = transformers.DeepseekV2ForCausalLM(hf_deepseek2_config(config)).eval()
    with torch.no_grad():  # distinct router logits and norms, so top-k has no ties and norms matter
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p) / config.n_embd ** 0.5)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
        ref = model(torch.tensor([TOKENS])).logits[0].float().numpy()
    sd = hf_deepseek2_to_gguf_state_dict(model, config)
    (path,) = write_from_state_dict("deepseek2", config, sd, tmp_path / "hf.gguf")
    got = llama_logits(path)
    scale = float(np.abs(ref).max())
    assert float(np.abs(got - ref).max()) < 2e-5 * max(scale, 1.0), (np.abs(got - ref).max(), scale)
