"""write_from_state_dict and the HF DeepseekV2 -> GGUF name map, checked with gguf's reader and quants."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

from pocketmoe.testing.presets import PRESETS
from pocketmoe.testing.state_dict import StateDictError, write_from_state_dict
from pocketmoe.testing.synth import fixture_tensors, spec_for

T = GGMLQuantizationType
CONFIG = PRESETS["deepseek2"]["tiny"]


def _random_state_dict(config=CONFIG, arch: str = "deepseek2") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {t.name: torch.randn(t.shape, generator=g) * 0.05 for t in fixture_tensors(spec_for(arch, config))}


def _tensors(path: Path) -> dict[str, object]:
    return {t.name: t for t in GGUFReader(path).tensors}


def test_f32_round_trip_is_exact(tmp_path: Path) -> None:
    sd = _random_state_dict()
    (path,) = write_from_state_dict("deepseek2", CONFIG, sd, tmp_path / "f32.gguf")
    got = _tensors(path)
    assert list(got) == list(sd)
    for name, w in sd.items():
        assert np.array_equal(np.asarray(got[name].data), w.numpy()), name


def test_types_map_matches_gguf_quantize(tmp_path: Path) -> None:
    sd = _random_state_dict()
    types = {"blk.1.ffn_up_exps.weight": "Q8_0", "blk.1.attn_q.weight": int(T.Q4_0),
             "token_embd.weight": "F16", "blk.2.ffn_gate_exps.weight": "MXFP4"}
    paths = write_from_state_dict("deepseek2", CONFIG, sd, tmp_path / "mixed.gguf", types=types, shards=2)
    assert [p.name for p in paths] == ["mixed-00001-of-00002.gguf", "mixed-00002-of-00002.gguf"]
    got = {**_tensors(paths[0]), **_tensors(paths[1])}
    for name, t in types.items():
        qt = T[t] if isinstance(t, str) else T(t)
        assert got[name].tensor_type == qt
        expected = quantize(sd[name].numpy(), qt)
        assert np.array_equal(np.asarray(got[name].data).reshape(-1).view(np.uint8),
                              expected.reshape(-1).view(np.uint8)), name
    assert got["blk.0.attn_norm.weight"].tensor_type == T.F32


def test_q4_k_m_mix_is_close_to_the_floats(tmp_path: Path) -> None:
    sd = _random_state_dict()
    (path,) = write_from_state_dict("deepseek2", CONFIG, sd, tmp_path / "q4km.gguf", types="Q4_K_M")
    got = _tensors(path)
    assert got["blk.1.ffn_gate_exps.weight"].tensor_type == T.Q4_K
    assert got["output.weight"].tensor_type == T.Q6_K
    for name, w in sd.items():
        t = got[name]
        values = dequantize(np.asarray(t.data), t.tensor_type).reshape(w.shape)
        err = float(np.abs(values - w.numpy()).max())
        assert err < 0.25 * float(w.abs().max()), (name, t.tensor_type.name, err)


def test_bad_state_dicts_are_clear_errors(tmp_path: Path) -> None:
    sd = _random_state_dict()
    missing = {k: v for k, v in sd.items() if k != "blk.1.ffn_down_exps.weight"}
    with pytest.raises(StateDictError, match="missing: blk.1.ffn_down_exps.weight"):
        write_from_state_dict("deepseek2", CONFIG, missing, tmp_path / "x.gguf")
    with pytest.raises(StateDictError, match="wrong shape"):
        write_from_state_dict("deepseek2", CONFIG, {**sd, "output_norm.weight": torch.ones(3)}, tmp_path / "x.gguf")
    with pytest.raises(StateDictError, match="must be stored as F32/F16/BF16"):
        write_from_state_dict("deepseek2", CONFIG, sd, tmp_path / "x.gguf", types={"output_norm.weight": "Q8_0"})
    with pytest.raises(StateDictError, match="no quantizer for IQ2_XXS"):
        write_from_state_dict("deepseek2", CONFIG, sd, tmp_path / "x.gguf", types="IQ2_XXS")
    assert not list(tmp_path.glob("*.gguf"))


@pytest.mark.parametrize("preset", ["tiny", "tiny-legacy", "tiny-qlora"])
def test_hf_deepseek2_names_and_mla_split(preset: str) -> None:
    transformers = pytest.importorskip("transformers")
    from pocketmoe.testing.hf_map import hf_deepseek2_config, hf_deepseek2_to_gguf_state_dict

    config = PRESETS["deepseek2"][preset]
    torch.manual_seed(0)
    model = transformers.DeepseekV2ForCausalLM(hf_deepseek2_config(config)).eval()
    sd = hf_deepseek2_to_gguf_state_dict(model, config)
    expected = {t.name: t.shape for t in fixture_tensors(spec_for("deepseek2", config))}
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected
    attn = model.model.layers[1].self_attn
    c = config
    if c.mla_layout == "absorbed":
        # k_b[h] maps q_nope (nope) -> latent (kv_lora); v_b[h] maps latent -> v: kv_b_proj rows per head
        kv = attn.kv_b_proj.weight.detach().view(c.n_head, c.qk_nope_head_dim + c.v_head_dim, -1)
        assert torch.equal(sd["blk.1.attn_k_b.weight"].transpose(1, 2), kv[:, :c.qk_nope_head_dim])
        assert torch.equal(sd["blk.1.attn_v_b.weight"], kv[:, c.qk_nope_head_dim:])
    else:
        assert torch.equal(sd["blk.1.attn_kv_b.weight"], attn.kv_b_proj.weight.detach())
    experts = model.model.layers[1].mlp.experts
    x = torch.randn(3, c.n_embd)
    for e in range(c.n_expert):
        gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[e].detach()).chunk(2, dim=-1)
        assert torch.allclose(gate, x @ sd["blk.1.ffn_gate_exps.weight"][e].T)
        assert torch.allclose(up, x @ sd["blk.1.ffn_up_exps.weight"][e].T)
    assert torch.equal(sd["blk.1.ffn_down_exps.weight"], experts.down_proj.detach())
