"""Per-tensor type choice: llama.cpp's Q4_K_M mix, pure types and block-size fallbacks."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType

from pocketmoe.testing.quant_mix import QuantNameError, choose_types, fallback, quant_mix

T = GGMLQuantizationType


def _down(n_layers: int, n_experts: int = 64, row: int = 1536) -> dict[int, int]:
    tensors = [(f"blk.{i}.ffn_down_exps.weight", (n_experts, 2048, row), False) for i in range(n_layers)]
    types = choose_types("Q4_K_M", tensors, n_layers, n_experts)
    return {i: types[f"blk.{i}.ffn_down_exps.weight"] for i in range(n_layers)}


def test_q4_k_m_use_more_bits_layers() -> None:
    got = {i for i, t in _down(27).items() if t == T.Q6_K}
    # llama.cpp use_more_bits(i, 27): i < 3, i >= 23, or (i - 3) % 3 == 2
    assert got == {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26}
    assert set(_down(27).values()) == {T.Q4_K, T.Q6_K}
    assert {t for t in _down(27, row=1408).values()} == {T.Q5_0, T.Q8_0}  # rows of 1408 fall back


def test_q4_k_m_special_tensors() -> None:
    tensors = [("token_embd.weight", (1000, 512), False), ("output.weight", (1000, 512), False),
               ("output_norm.weight", (512,), True), ("blk.0.ffn_gate_inp.weight", (8, 512), False),
               ("blk.0.attn_kv_b.weight", (512, 256), False), ("blk.0.attn_output.weight", (512, 512), False),
               ("blk.0.attn_k_b.weight", (4, 256, 64), False), ("blk.0.exp_probs_b.bias", (8,), False)]
    eight = choose_types("Q4_K_M", tensors, 1, 8)
    assert eight["token_embd.weight"] == T.Q4_K and eight["output.weight"] == T.Q6_K
    assert eight["output_norm.weight"] == eight["blk.0.ffn_gate_inp.weight"] == T.F32
    assert eight["blk.0.exp_probs_b.bias"] == T.F32
    assert eight["blk.0.attn_kv_b.weight"] == T.Q8_0  # llama.cpp: n_expert == 8 bumps attn_v-like to Q8_0
    assert eight["blk.0.attn_output.weight"] == T.Q5_K
    assert eight["blk.0.attn_k_b.weight"] == T.Q5_0  # 64-value rows cannot be Q4_K
    many = choose_types("Q4_K_M", tensors, 1, 64)
    assert many["blk.0.attn_kv_b.weight"] == T.Q6_K and many["blk.0.attn_output.weight"] == T.Q4_K
    tied = choose_types("Q4_K_M", [t for t in tensors if t[0] != "output.weight"], 1, 64)
    assert tied["token_embd.weight"] == T.Q6_K


def test_pure_and_mxfp4_moe() -> None:
    tensors = [("token_embd.weight", (1000, 512), False), ("output.weight", (1000, 512), False),
               ("blk.0.ffn_up_exps.weight", (8, 256, 512), False), ("blk.0.attn_q.weight", (512, 512), False),
               ("blk.0.attn_k_b.weight", (4, 256, 64), False)]
    pure = choose_types("IQ2_XXS", tensors, 1, 8)
    assert pure["output.weight"] == pure["token_embd.weight"] == pure["blk.0.ffn_up_exps.weight"] == T.IQ2_XXS
    assert pure["blk.0.attn_k_b.weight"] == T.IQ4_NL
    moe = choose_types("MXFP4_MOE", tensors, 1, 8)
    assert moe["blk.0.ffn_up_exps.weight"] == T.MXFP4
    assert moe["output.weight"] == moe["token_embd.weight"] == moe["blk.0.attn_q.weight"] == T.Q8_0
    assert choose_types("F16", tensors, 1, 8)["blk.0.attn_k_b.weight"] == T.F16


@pytest.mark.parametrize("wanted,row,expected", [
    (T.Q4_K, 1408, T.Q5_0), (T.Q5_K, 128, T.Q5_1), (T.Q6_K, 1408, T.Q8_0), (T.Q2_K, 96, T.Q4_0),
    (T.IQ1_M, 64, T.IQ4_NL), (T.Q4_K, 100, T.F16), (T.Q4_0, 48, T.F16), (T.Q4_K, 512, T.Q4_K)])
def test_fallback_table(wanted: int, row: int, expected: int) -> None:
    assert fallback(wanted, row) == expected


def test_quant_names() -> None:
    assert quant_mix("q4_k_m").file_type == 15 and quant_mix("F32").file_type == 0
    assert not quant_mix("BF16").is_quantized and quant_mix("Q8_0").is_quantized
    with pytest.raises(QuantNameError):
        quant_mix("Q7_K")
