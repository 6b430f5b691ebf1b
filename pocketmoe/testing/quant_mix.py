"""Per-tensor type choice for a --quant name, following llama.cpp's quantizer (src/llama-quant.cpp).

Single-type names ("Q4_K", "IQ2_XXS", ...) behave like `llama-quantize --pure`: every quantizable
weight gets that type. Mix names ("Q4_K_M", "Q5_K_M", "MXFP4_MOE") follow llama.cpp's mixes.
Rows whose length is not a multiple of the block size fall back exactly as llama.cpp does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from pocketmoe.errors import PocketMoEError

T = GGMLQuantizationType
F = LlamaFileType


class QuantNameError(PocketMoEError):
    """An unknown --quant name."""


@dataclass(frozen=True)
class QuantMix:
    name: str
    default_type: int
    file_type: int
    mix: str = "pure"  # "pure" | "k_m" | "mxfp4_moe"

    @property
    def is_quantized(self) -> bool:
        return self.default_type not in (T.F32, T.F16, T.BF16)


_PURE_FTYPES: dict[str, int] = {
    "F32": F.ALL_F32, "F16": F.MOSTLY_F16, "BF16": F.MOSTLY_BF16,
    "Q4_0": F.MOSTLY_Q4_0, "Q4_1": F.MOSTLY_Q4_1, "Q5_0": F.MOSTLY_Q5_0, "Q5_1": F.MOSTLY_Q5_1,
    "Q8_0": F.MOSTLY_Q8_0, "Q2_K": F.MOSTLY_Q2_K, "Q3_K": F.MOSTLY_Q3_K_S, "Q4_K": F.MOSTLY_Q4_K_S,
    "Q5_K": F.MOSTLY_Q5_K_S, "Q6_K": F.MOSTLY_Q6_K, "IQ2_XXS": F.MOSTLY_IQ2_XXS,
    "IQ2_XS": F.MOSTLY_IQ2_XS, "IQ2_S": F.MOSTLY_IQ2_S, "IQ3_XXS": F.MOSTLY_IQ3_XXS,
    "IQ3_S": F.MOSTLY_IQ3_S, "IQ1_S": F.MOSTLY_IQ1_S, "IQ1_M": F.MOSTLY_IQ1_M,
    "IQ4_NL": F.MOSTLY_IQ4_NL, "IQ4_XS": F.MOSTLY_IQ4_XS, "TQ1_0": F.MOSTLY_TQ1_0,
    "TQ2_0": F.MOSTLY_TQ2_0, "MXFP4": F.MOSTLY_MXFP4_MOE, "NVFP4": F.MOSTLY_NVFP4,
}
_MIXES: dict[str, QuantMix] = {
    "Q4_K_M": QuantMix("Q4_K_M", T.Q4_K, F.MOSTLY_Q4_K_M, "k_m"),
    "Q5_K_M": QuantMix("Q5_K_M", T.Q5_K, F.MOSTLY_Q5_K_M, "k_m"),
    "MXFP4_MOE": QuantMix("MXFP4_MOE", T.MXFP4, F.MOSTLY_MXFP4_MOE, "mxfp4_moe"),
}
QUANT_NAMES: tuple[str, ...] = (*_PURE_FTYPES, *_MIXES)

# llama.cpp tensor_type_fallback: type -> type used when ne[0] is not a multiple of the block size
_FALLBACK: dict[int, int] = {
    **dict.fromkeys((T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_XS), T.IQ4_NL),
    **dict.fromkeys((T.Q2_K, T.Q3_K, T.TQ1_0, T.TQ2_0), T.Q4_0),
    T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0,
}
_NOT_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight")
_LAYER = re.compile(r"^blk\.(\d+)\.")


def quant_mix(name: str) -> QuantMix:
    key = name.upper()
    if key in _MIXES:
        return _MIXES[key]
    if key in _PURE_FTYPES:
        return QuantMix(key, T[key], _PURE_FTYPES[key])
    raise QuantNameError(f"unknown quant name {name!r}; choose one of {', '.join(QUANT_NAMES)}.")


def block_size(ggml_type: int) -> int:
    return GGML_QUANT_SIZES[T(ggml_type)][0]


def tensor_nbytes(ggml_type: int, shape: Sequence[int]) -> int:
    """Bytes of a tensor of torch-order `shape` stored as `ggml_type`."""
    bs, ts = GGML_QUANT_SIZES[T(ggml_type)]
    n = 1
    for d in shape:
        n *= d
    return n // bs * ts


def allows_quantization(name: str, shape: Sequence[int]) -> bool:
    """llama.cpp tensor_allows_quantization for the tensors our architectures have."""
    return len(shape) >= 2 and name.endswith("weight") and not any(s in name for s in _NOT_QUANTIZED)


def fallback(ggml_type: int, row: int) -> int:
    """The type llama.cpp uses for a row of `row` values when `ggml_type` does not fit it."""
    if row % block_size(ggml_type) == 0:
        return ggml_type
    new = _FALLBACK.get(ggml_type, T.F16)
    return new if row % block_size(new) == 0 else T.F16


def _use_more_bits(i: int, n: int) -> bool:
    # C++ integer semantics: n/8 truncates; (i - n/8) % 3 only reached when i >= n/8
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _layer_of(name: str) -> int:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else -1


def _mixed_type(mix: QuantMix, name: str, ne: Sequence[int], n_layers: int, n_experts: int,
                i_attn_v: int, n_attn_v: int, has_output: bool) -> int:
    is_output = name == "output.weight" or (not has_output and name == "token_embd.weight")
    if is_output:
        if mix.mix == "mxfp4_moe" or ne[0] % block_size(mix.default_type) != 0:
            return T.Q8_0
        return T.Q6_K
    if mix.mix == "mxfp4_moe":
        return T.MXFP4 if len(ne) > 2 and ne[2] > 1 else T.Q8_0
    if name == "token_embd.weight":
        return mix.default_type
    attn_v_like = any(s in name for s in ("attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight"))
    if attn_v_like and "attn_qkv.weight" in name:
        return T.Q5_K if mix.name == "Q4_K_M" else T.Q6_K
    if attn_v_like:
        if n_experts == 8:
            return T.Q8_0
        return T.Q6_K if _use_more_bits(i_attn_v, n_attn_v) else mix.default_type
    if "attn_k.weight" in name and n_experts == 8:
        return T.Q8_0
    if "attn_output.weight" in name and n_experts == 8 and mix.name == "Q4_K_M":
        return T.Q5_K
    if "ffn_down" in name:
        layer = _layer_of(name)
        if layer >= 0 and _use_more_bits(layer, n_layers):
            return T.Q6_K
    return mix.default_type


def choose_types(mix: QuantMix | str, tensors: Iterable[tuple[str, Sequence[int], bool]],
                 n_layers: int, n_experts: int) -> dict[str, int]:
    """Type of every tensor, given (name, torch shape, float_only) in file order.

    Tensors that llama.cpp never quantizes (1-D, norms, routers, float_only in the spec) are F32.
    """
    if isinstance(mix, str):
        mix = quant_mix(mix)
    items = list(tensors)
    names = {name for name, _, _ in items}
    has_output = "output.weight" in names
    is_v = [any(s in n for s in ("attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight")) for n, _, _ in items]
    n_attn_v, i_attn_v = sum(is_v), 0
    out: dict[str, int] = {}
    for (name, shape, float_only), v in zip(items, is_v, strict=True):
        if float_only or not allows_quantization(name, shape):
            out[name] = T.F32
            continue
        ne = tuple(reversed(shape))
        if mix.mix == "pure":
            new = mix.default_type
        else:
            new = _mixed_type(mix, name, ne, n_layers, n_experts, i_attn_v, n_attn_v, has_output)
            i_attn_v += v
        out[name] = fallback(new, ne[0]) if new not in (T.F32, T.F16, T.BF16) else new
    return out
