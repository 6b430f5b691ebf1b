"""Named model configs for synthetic fixtures: PRESETS[arch][name] -> the spec's config dataclass.

Small presets keep every quantizable row (GGUF ne[0]) a multiple of 256 where the real model's is,
so k-quants apply; rows that are not (attn_k_b's qk_nope) fall back like llama.cpp's quantizer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pocketmoe.errors import PocketMoEError
from pocketmoe.specs.base import RopeScaling
from pocketmoe.specs.deepseek2 import DeepSeek2Config
from pocketmoe.specs.deepseek4 import DeepSeek4Config
from pocketmoe.specs.minimax_m2 import MiniMaxM2Config


class PresetError(PocketMoEError):
    """An unknown architecture or preset name."""


_YARN4 = RopeScaling("yarn", 4.0, 1024, 32.0, 1.0)

_DS2_TINY = DeepSeek2Config(
    n_vocab=512, n_ctx=4096, n_embd=256, n_layer=4, n_head=4, n_ff=512, n_expert=8, n_expert_used=2,
    n_expert_shared=1, n_ff_exp=256, n_dense_lead=1, q_lora_rank=0, kv_lora_rank=256,
    qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, mla_layout="absorbed", gating_func=1,
    expert_weights_norm=False, expert_weights_scale=1.0, rms_eps=1e-6, rope_freq_base=10000.0,
    rope_scaling=_YARN4, mscale_all_dim=0.707)

# The 452M bench MoE: V2-Lite's layout at hidden 1024 (head dims halved, one leading dense block).
_DS2_BENCH = replace(_DS2_TINY, n_vocab=32000, n_embd=1024, n_layer=8, n_head=8, n_ff=2816, n_expert=32,
                     n_expert_used=4, n_ff_exp=512)

_MM2_TINY = MiniMaxM2Config(
    n_vocab=512, n_ctx=4096, n_embd=256, n_layer=3, n_head=4, n_head_kv=2, head_dim=64, v_head_dim=64,
    n_rot=32, n_expert=8, n_expert_used=2, n_ff_exp=256, n_ff=256, gating_func=2, rms_eps=1e-6,
    rope_freq_base=5e6)

# DeepSeek-V4-Flash's layout in miniature: one sliding-window, two CSA (ratio 4) and one HCA (128) layer,
# one hash-routed layer, 4 hyper-connection streams (llama.cpp requires 4).
_DS4_TINY = DeepSeek4Config(
    n_vocab=512, n_ctx=4096, n_embd=256, n_layer=4, n_head=4, head_dim=128, n_rot=64, q_lora_rank=256,
    o_groups=2, o_lora_rank=256, sliding_window=32, compress_ratios=(0, 4, 128, 4), n_indexer_head=4,
    indexer_head_dim=64, indexer_top_k=16, n_expert=8, n_expert_used=2, n_expert_shared=1, n_ff_exp=256,
    expert_weights_scale=1.5, expert_weights_norm=True, swiglu_clamp_exp=(10.0,) * 4,
    swiglu_clamp_shexp=(10.0,) * 4, n_hash_layers=1, hc_count=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    rms_eps=1e-6, rope_freq_base=10000.0, compress_rope_freq_base=160000.0, rope_scaling=_YARN4)

# DeepSeek-V3 / R1 (671B) and Kimi-K2 (1T), both `deepseek2` files (their HF configs): 61 layers at hidden 7168,
# 2048-wide routed experts top-8 with one shared, sigmoid routing with weights normalized and scaled; V3 routes in
# 8 groups of which 4 are used, Kimi-K2 over 384 experts with 64 heads. For `--sparse` files and placement
# reports (hundreds of GB when written).
_DS3 = DeepSeek2Config(
    n_vocab=129280, n_ctx=163840, n_embd=7168, n_layer=61, n_head=128, n_ff=18432, n_expert=256, n_expert_used=8,
    n_expert_shared=1, n_ff_exp=2048, n_dense_lead=3, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, mla_layout="absorbed", gating_func=2, expert_weights_norm=True,
    expert_weights_scale=2.5, n_expert_groups=8, n_expert_groups_used=4, rms_eps=1e-6, rope_freq_base=10000.0,
    rope_scaling=RopeScaling("yarn", 40.0, 4096, 32.0, 1.0), mscale_all_dim=1.0, bos_token_id=0, eos_token_id=1)
_KIMI_K2 = replace(_DS3, n_vocab=163840, n_ctx=131072, n_head=64, n_expert=384, n_dense_lead=1,
                   expert_weights_scale=2.827, n_expert_groups=1, n_expert_groups_used=1, rope_freq_base=50000.0,
                   rope_scaling=RopeScaling("yarn", 32.0, 4096, 1.0, 1.0), bos_token_id=163584, eos_token_id=163585)

PRESETS: dict[str, dict[str, Any]] = {
    "deepseek2": {
        "tiny": _DS2_TINY,
        "tiny-legacy": replace(_DS2_TINY, mla_layout="legacy"),
        "tiny-qlora": replace(_DS2_TINY, q_lora_rank=256),
        "bench": _DS2_BENCH,
        "full": DeepSeek2Config.v2_lite(),
        "v3": _DS3,
        "kimi-k2": _KIMI_K2,
    },
    "minimax-m2": {
        "tiny": _MM2_TINY,
        # MiniMax-M2's head layout (128-dim heads, 64 rotated, 6 query heads per KV head) at bench size
        "bench": replace(_MM2_TINY, n_vocab=32000, n_embd=1024, n_layer=8, n_head=12, n_head_kv=2, head_dim=128,
                         v_head_dim=128, n_rot=64, n_expert=32, n_expert_used=4, n_ff_exp=512, n_ff=512),
        "full": MiniMaxM2Config.full(),
    },
    "deepseek4": {
        "tiny": _DS4_TINY,
        # DeepSeek-V4-Flash's layer pattern (two window-only layers, then CSA/HCA pairs; 512-dim heads) at
        # bench size: hidden 1024, 8 layers, 32 experts top-4 (about 0.3 GB as MXFP4_MOE)
        "bench": replace(_DS4_TINY, n_vocab=32000, n_embd=1024, n_layer=8, n_head=8, head_dim=512,
                         q_lora_rank=512, o_groups=4, o_lora_rank=512, sliding_window=128,
                         compress_ratios=(0, 0, 4, 128, 4, 128, 4, 0), n_indexer_head=8, indexer_head_dim=128,
                         indexer_top_k=64, n_expert=32, n_expert_used=4, n_ff_exp=512,
                         swiglu_clamp_exp=(10.0,) * 8, swiglu_clamp_shexp=(10.0,) * 8, n_hash_layers=2),
        "full": DeepSeek4Config.flash(),  # ~160 GB as MXFP4_MOE: writable, never written by tests
    },
}


def preset_config(arch: str, name: str, **overrides: Any) -> Any:
    """The config of preset `name`, with dataclass fields replaced by `overrides`."""
    if arch not in PRESETS:
        raise PresetError(f"no presets for architecture {arch!r}; choose one of {', '.join(PRESETS)}.")
    if name not in PRESETS[arch]:
        raise PresetError(f"no preset {name!r} for {arch}; choose one of {', '.join(PRESETS[arch])}.")
    config = PRESETS[arch][name]
    if not overrides:
        return config
    try:
        return replace(config, **overrides)
    except TypeError as e:
        raise PresetError(f"cannot override {sorted(overrides)} of the {arch} {name} preset: {e}.") from e
