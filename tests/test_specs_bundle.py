"""Specs against real files: gguf's own writer makes a tiny model, pocketmoe.gguf opens it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from pocketmoe.specs import (
    DeepSeek2Config,
    DeepSeek4Config,
    MiniMaxM2Config,
    metadata_from_config,
    spec_class,
    spec_from_bundle,
)

open_bundle = pytest.importorskip("pocketmoe.gguf").open_bundle

DS2 = DeepSeek2Config(n_vocab=96, n_ctx=256, n_embd=64, n_layer=3, n_head=4, n_ff=96, n_expert=8,
                      n_expert_used=2, n_expert_shared=1, n_ff_exp=32, n_dense_lead=1, kv_lora_rank=32,
                      qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
MM2 = MiniMaxM2Config(n_vocab=96, n_ctx=256, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, head_dim=32,
                      v_head_dim=32, n_rot=16, n_expert=4, n_expert_used=2, n_ff_exp=32)
DS4 = replace(DeepSeek4Config.flash(), n_vocab=96, n_ctx=512, n_embd=64, n_layer=4, n_head=4, head_dim=64,
              n_rot=16, q_lora_rank=32, o_groups=2, o_lora_rank=32, sliding_window=8,
              compress_ratios=(0, 4, 128, 4), n_indexer_head=2, indexer_head_dim=64, indexer_top_k=8,
              n_expert=4, n_expert_used=2, n_ff_exp=32, swiglu_clamp_exp=(10.0,) * 4,
              swiglu_clamp_shexp=(10.0,) * 4, n_hash_layers=1, n_embd_out=0)


def write(path, arch, cfg, drop=(), q8=True, skip_key=None):
    """A GGUF of `cfg` with the spec's tensors: norms/routers F32, other 2-D+ weights Q8_0 when q8."""
    spec = spec_class(arch)(cfg)
    w = GGUFWriter(str(path), arch)
    for key, kv in metadata_from_config(arch, cfg).items():
        if key not in ("general.architecture", skip_key):
            w.add_key_value(key, kv.value, kv.type, sub_type=kv.item_type)
    rng = np.random.default_rng(0)
    for t in spec.tensors():
        if (t.optional and t.name != "output.weight") or t.name in drop:
            continue
        if t.allowed_types:
            w.add_tensor(t.name, rng.integers(0, cfg.n_expert, t.shape, dtype=np.int32))
            continue
        data = rng.standard_normal(t.shape).astype(np.float32)
        if q8 and not t.float_only and t.shape[-1] % 32 == 0:
            w.add_tensor(t.name, quantize(data, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return spec


@pytest.mark.parametrize("arch,cfg", [("deepseek2", DS2), ("deepseek2", replace(DS2, mla_layout="legacy")),
                                      ("minimax-m2", MM2), ("deepseek4", DS4)],
                         ids=["deepseek2", "deepseek2-legacy", "minimax-m2", "deepseek4"])
def test_written_file_validates(tmp_path, arch, cfg):
    expected = write(tmp_path / "m.gguf", arch, cfg)
    bundle = open_bundle(tmp_path / "m.gguf")
    try:
        spec = spec_from_bundle(bundle)
        assert spec.config == expected.config
        report = spec.validate(bundle)
        assert report.ok, report.errors()
    finally:
        bundle.close()


def test_vocab_from_token_embd_and_missing_tensor(tmp_path):
    write(tmp_path / "m.gguf", "deepseek2", DS2, drop={"blk.2.attn_k_b.weight"}, skip_key="deepseek2.vocab_size")
    bundle = open_bundle(tmp_path / "m.gguf")
    try:
        spec = spec_from_bundle(bundle)
        assert spec.config.n_vocab == 96
        report = spec.validate(bundle)
        assert report.missing == ["blk.2.attn_k_b.weight"] and not report.ok
    finally:
        bundle.close()
