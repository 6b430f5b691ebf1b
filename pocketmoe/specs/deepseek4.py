"""`deepseek4` (DeepSeek-V4-Flash): mHC residual streams, compressed sparse attention, hash + routed MoE."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pocketmoe.specs.base import (
    I32,
    KV,
    MetadataReader,
    ModelSpec,
    Role,
    RopeScaling,
    SpecError,
    TensorSpec,
    check_positive,
    f32,
    normalize_floats,
    shared_expert_specs,
)
from pocketmoe.specs.metadata import token_kvs

ARCH = "deepseek4"
SQRTSOFTPLUS = 4
COMPRESS_RATIOS = (0, 4, 128)


@dataclass(frozen=True)
class DeepSeek4Config:
    """Hyperparameters of a `deepseek4` GGUF (SPECS.md 3.2). One shared K=V head of `head_dim`.

    `n_layer` counts the layers the engine runs; `n_nextn` MTP layers follow them (block_count is
    the sum). compress_ratios[i] is layer i's ratio: 0 sliding window only, 4 CSA + indexer, 128 HCA.
    """

    n_vocab: int
    n_ctx: int
    n_embd: int
    n_layer: int
    n_head: int
    head_dim: int
    n_rot: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    n_indexer_head: int
    indexer_head_dim: int
    indexer_top_k: int
    n_expert: int
    n_expert_used: int
    n_expert_shared: int
    n_ff_exp: int
    expert_weights_scale: float = 1.0
    expert_weights_norm: bool = False
    gating_func: int = SQRTSOFTPLUS
    swiglu_clamp_exp: tuple[float, ...] = ()
    swiglu_clamp_shexp: tuple[float, ...] = ()
    n_hash_layers: int = 0
    hc_count: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    n_embd_out: int = 0            # embedding_length_out; 0 = hc_count * n_embd
    n_nextn: int = 0
    rms_eps: float = 1e-6
    rope_freq_base: float = 10000.0
    compress_rope_freq_base: float = 160000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        check_positive("DeepSeek4Config", n_vocab=self.n_vocab, n_ctx=self.n_ctx, n_embd=self.n_embd,
                       n_layer=self.n_layer, n_head=self.n_head, head_dim=self.head_dim, n_rot=self.n_rot,
                       q_lora_rank=self.q_lora_rank, o_groups=self.o_groups, o_lora_rank=self.o_lora_rank,
                       n_indexer_head=self.n_indexer_head, indexer_head_dim=self.indexer_head_dim,
                       indexer_top_k=self.indexer_top_k, n_expert=self.n_expert,
                       n_expert_used=self.n_expert_used, n_ff_exp=self.n_ff_exp,
                       hc_sinkhorn_iters=self.hc_sinkhorn_iters)
        object.__setattr__(self, "compress_ratios", tuple(int(x) for x in self.compress_ratios))
        object.__setattr__(self, "swiglu_clamp_exp", tuple(f32(x) for x in self.swiglu_clamp_exp))
        object.__setattr__(self, "swiglu_clamp_shexp", tuple(f32(x) for x in self.swiglu_clamp_shexp))
        n_blocks = self.n_layer + self.n_nextn
        p = []  # llama.cpp's load-time constraints (SPECS.md section 5) and shape consistency
        if self.hc_count != 4:
            p.append(f"hyper_connection.count is {self.hc_count} but llama.cpp requires 4")
        if self.gating_func != SQRTSOFTPLUS:
            p.append(f"expert_gating_func is {self.gating_func} but deepseek4 requires 4 (sqrtsoftplus)")
        if len(self.compress_ratios) < n_blocks:
            p.append(f"compress_ratios has {len(self.compress_ratios)} entries but block_count is {n_blocks}")
        if any(r not in COMPRESS_RATIOS for r in self.compress_ratios):
            p.append(f"compress_ratios {sorted(set(self.compress_ratios))} may only hold 0, 4 or 128")
        if self.indexer_head_dim % 64:
            p.append(f"indexer head dim {self.indexer_head_dim} is not a multiple of 64")
        for name in ("swiglu_clamp_exp", "swiglu_clamp_shexp"):
            if getattr(self, name) and len(getattr(self, name)) < self.n_layer:
                p.append(f"{name} has {len(getattr(self, name))} entries but there are {self.n_layer} layers")
        if self.n_rot > self.head_dim or self.n_rot % 2:
            p.append(f"n_rot {self.n_rot} must be even and <= head_dim {self.head_dim}")
        if (self.n_head * self.head_dim) % self.o_groups:
            p.append(f"n_head*head_dim {self.n_head * self.head_dim} is not divisible by o_groups {self.o_groups}")
        if self.n_expert_used > self.n_expert or not 0 <= self.n_hash_layers <= self.n_layer:
            p.append(f"n_expert_used {self.n_expert_used} must be <= n_expert {self.n_expert} and "
                     f"n_hash_layers {self.n_hash_layers} within 0..{self.n_layer}")
        if self.n_expert_shared < 0 or self.sliding_window < 0 or self.n_nextn < 0 or self.n_embd_out < 0:
            p.append("n_expert_shared, sliding_window, n_nextn and n_embd_out must be >= 0")
        if p:
            raise SpecError(f"invalid deepseek4 config: {'; '.join(p)}; fix the config or the file's metadata.")
        normalize_floats(self, "expert_weights_scale", "hc_eps", "rms_eps", "rope_freq_base",
                         "compress_rope_freq_base")
        if self.n_embd_out == 0:
            object.__setattr__(self, "n_embd_out", self.hc_count * self.n_embd)
        if self.rope_scaling.orig_ctx == 0:
            object.__setattr__(self, "rope_scaling", replace(self.rope_scaling, orig_ctx=self.n_ctx))

    @property
    def hc_mix(self) -> int:
        """Rows of an mHC mixing projection: pre (hc) + post (hc) + hc*hc combine."""
        return (2 + self.hc_count) * self.hc_count

    @property
    def n_ff_shexp(self) -> int:
        return self.n_ff_exp * self.n_expert_shared

    def compress_ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    @staticmethod
    def flash() -> DeepSeek4Config:
        """DeepSeek-V4-Flash as llama.cpp converts it (SPECS.md 3.1-3.2), without the MTP layer."""
        return DeepSeek4Config(
            n_vocab=129280, n_ctx=1048576, n_embd=4096, n_layer=43, n_head=64, head_dim=512, n_rot=64,
            q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128,
            compress_ratios=(0, 0) + (4, 128) * 20 + (4, 0), n_indexer_head=64, indexer_head_dim=128,
            indexer_top_k=512, n_expert=256, n_expert_used=6, n_expert_shared=1, n_ff_exp=2048,
            expert_weights_scale=1.5, expert_weights_norm=True, gating_func=SQRTSOFTPLUS,
            swiglu_clamp_exp=(10.0,) * 43, swiglu_clamp_shexp=(10.0,) * 43, n_hash_layers=3,
            hc_count=4, hc_sinkhorn_iters=20, hc_eps=1e-6, n_embd_out=16384, rms_eps=1e-6,
            rope_freq_base=10000.0, compress_rope_freq_base=160000.0,
            rope_scaling=RopeScaling("yarn", 16.0, 65536, 32.0, 1.0), bos_token_id=0, eos_token_id=1)

    @staticmethod
    def from_metadata(metadata: Mapping[str, Any], n_vocab_hint: int | None = None) -> DeepSeek4Config:
        r = MetadataReader(metadata, ARCH)
        head_dim = r.get_int("attention.key_length")
        for key, want in (("attention.head_count_kv", 1), ("attention.value_length", head_dim)):
            got = r.get_opt_int(key)
            if got is not None and got != want:
                raise SpecError(f"GGUF metadata key {r.key(key)!r} is {got} but deepseek4 needs {want} "
                                f"(one shared K=V head); re-convert the model with llama.cpp.")
        n_nextn = r.get_int("nextn_predict_layers", 0)
        n_blocks = r.get_int("block_count")
        if n_nextn >= n_blocks:
            raise SpecError(f"{r.key('nextn_predict_layers')!r} is {n_nextn} but block_count is only "
                            f"{n_blocks}: this looks like an MTP-only file; open the main model file.")
        bos, eos = r.token_ids()
        return DeepSeek4Config(
            n_vocab=r.vocab_size(n_vocab_hint), n_ctx=r.get_int("context_length"),
            n_embd=r.get_int("embedding_length"), n_layer=n_blocks - n_nextn,
            n_head=r.get_int("attention.head_count"), head_dim=head_dim,
            n_rot=r.get_int("rope.dimension_count"), q_lora_rank=r.get_int("attention.q_lora_rank"),
            o_groups=r.get_int("attention.output_group_count"),
            o_lora_rank=r.get_int("attention.output_lora_rank"),
            sliding_window=r.get_int("attention.sliding_window"),
            compress_ratios=r.get_ints("attention.compress_ratios"),
            n_indexer_head=r.get_int("attention.indexer.head_count"),
            indexer_head_dim=r.get_int("attention.indexer.key_length"),
            indexer_top_k=r.get_int("attention.indexer.top_k"),
            n_expert=r.get_int("expert_count"), n_expert_used=r.get_int("expert_used_count"),
            n_expert_shared=r.get_int("expert_shared_count", 0),
            n_ff_exp=r.get_int("expert_feed_forward_length"),
            expert_weights_scale=r.get_float("expert_weights_scale", 0.0) or 1.0,
            expert_weights_norm=r.get_bool("expert_weights_norm", False),
            gating_func=r.get_int("expert_gating_func", 0),
            swiglu_clamp_exp=r.get_floats("swiglu_clamp_exp", ()),
            swiglu_clamp_shexp=r.get_floats("swiglu_clamp_shexp", ()),
            n_hash_layers=r.get_int("hash_layer_count", 0),
            hc_count=r.get_int("hyper_connection.count"),
            hc_sinkhorn_iters=r.get_int("hyper_connection.sinkhorn_iterations"),
            hc_eps=r.get_float("hyper_connection.epsilon"), n_embd_out=r.get_int("embedding_length_out", 0),
            n_nextn=n_nextn, rms_eps=r.get_float("attention.layer_norm_rms_epsilon"),
            rope_freq_base=r.get_float("rope.freq_base", 10000.0),
            compress_rope_freq_base=r.get_float("attention.compress_rope_freq_base"),
            rope_scaling=RopeScaling.read(r), bos_token_id=bos, eos_token_id=eos)

    def to_metadata(self) -> dict[str, KV]:
        u, f, p = KV.u32, KV.f32, f"{ARCH}."
        kv = {
            "general.architecture": KV.string(ARCH),
            p + "block_count": u(self.n_layer + self.n_nextn), p + "context_length": u(self.n_ctx),
            p + "embedding_length": u(self.n_embd), p + "vocab_size": u(self.n_vocab),
            p + "attention.head_count": u(self.n_head), p + "attention.head_count_kv": u(1),
            p + "attention.key_length": u(self.head_dim), p + "attention.value_length": u(self.head_dim),
            p + "rope.freq_base": f(self.rope_freq_base), **self.rope_scaling.kvs(ARCH),
            p + "expert_count": u(self.n_expert), p + "expert_used_count": u(self.n_expert_used),
            p + "expert_gating_func": u(self.gating_func),
            p + "attention.layer_norm_rms_epsilon": f(self.rms_eps),
            p + "rope.dimension_count": u(self.n_rot), p + "attention.q_lora_rank": u(self.q_lora_rank),
            p + "attention.sliding_window": u(self.sliding_window),
            p + "expert_feed_forward_length": u(self.n_ff_exp),
            p + "expert_shared_count": u(self.n_expert_shared),
            p + "expert_weights_scale": f(self.expert_weights_scale),
            p + "expert_weights_norm": KV.boolean(self.expert_weights_norm),
            p + "attention.indexer.head_count": u(self.n_indexer_head),
            p + "attention.indexer.key_length": u(self.indexer_head_dim),
            p + "attention.indexer.top_k": u(self.indexer_top_k),
            p + "attention.output_group_count": u(self.o_groups),
            p + "attention.output_lora_rank": u(self.o_lora_rank),
            p + "attention.compress_ratios": KV.i32_array(self.compress_ratios),
            p + "attention.compress_rope_freq_base": f(self.compress_rope_freq_base),
            p + "hyper_connection.count": u(self.hc_count),
            p + "hyper_connection.sinkhorn_iterations": u(self.hc_sinkhorn_iters),
            p + "hyper_connection.epsilon": f(self.hc_eps),
            p + "hash_layer_count": u(self.n_hash_layers), p + "embedding_length_out": u(self.n_embd_out),
        }
        for name in ("swiglu_clamp_exp", "swiglu_clamp_shexp"):
            if getattr(self, name):
                kv[p + name] = KV.f32_array(getattr(self, name))
        if self.n_nextn:
            kv[p + "nextn_predict_layers"] = u(self.n_nextn)
        return kv | token_kvs(self.bos_token_id, self.eos_token_id)


def _f(name: str, shape: tuple[int, ...], role: Role, layer: int | None) -> TensorSpec:
    return TensorSpec(name, shape, role, layer, float_only=True)


class DeepSeek4Spec(ModelSpec):
    architecture = ARCH
    config_cls = DeepSeek4Config
    config: DeepSeek4Config

    def moe_layers(self) -> list[int]:
        return list(range(self.config.n_layer))

    def kv_values_per_token(self) -> int:
        """The engine's cache row per position and layer (layers/dsv4_attention.py RowLayout): the token's kv, its
        compressor states and, in a block's last row, the block's entries; the widest layer's row."""
        from pocketmoe.layers.dsv4_attention import cache_width

        c = self.config
        return cache_width(c.compress_ratios[:c.n_layer], c.head_dim, c.indexer_head_dim)

    def attention_flops_per_token(self, context_length: int) -> int:
        """Per layer, every head over its keys (K = V, head_dim values each): the sliding window, then the
        compressed entries: the indexer's top-k of ctx/4 on ratio-4 layers (plus the indexer's own scores over
        all ctx/4 of them), every one of ctx/128 on ratio-128 layers."""
        c, n = self.config, context_length
        flops = 0
        for r in c.compress_ratios[:c.n_layer]:
            keys = min(c.sliding_window, n) + (min(c.indexer_top_k, n // r) if r == 4 else n // r if r else 0)
            flops += 2 * c.n_head * keys * 2 * c.head_dim
            if r == 4:
                flops += 2 * c.n_indexer_head * (n // r) * c.indexer_head_dim
        return flops

    def _tensors(self, present: frozenset[str] | None) -> list[TensorSpec]:
        c, D, hc = self.config, self.config.n_embd, self.config.hc_count
        out = [TensorSpec("token_embd.weight", (c.n_vocab, D), Role.EMBEDDING, None),
               TensorSpec("output.weight", (c.n_vocab, D), Role.HEAD, None),
               _f("output_norm.weight", (D,), Role.NORM, None),
               _f("output_hc_fn.weight", (hc, hc * D), Role.OTHER, None),
               _f("output_hc_base.weight", (hc,), Role.OTHER, None),
               _f("output_hc_scale.weight", (1,), Role.OTHER, None)]
        for i in range(c.n_layer):
            out += self._attention(i) + self._compressor(i) + self._ffn(i)
        return out

    def _attention(self, i: int) -> list[TensorSpec]:
        c, b, A, D = self.config, f"blk.{i}.", Role.ATTENTION, self.config.n_embd
        og = c.o_groups * c.o_lora_rank
        out = [_f(b + "attn_norm.weight", (D,), Role.NORM, i),
               _f(b + "attn_sinks.weight", (c.n_head,), A, i),
               TensorSpec(b + "attn_q_a.weight", (c.q_lora_rank, D), A, i),
               _f(b + "attn_q_a_norm.weight", (c.q_lora_rank,), Role.NORM, i),
               TensorSpec(b + "attn_q_b.weight", (c.n_head * c.head_dim, c.q_lora_rank), A, i),
               TensorSpec(b + "attn_kv.weight", (c.head_dim, D), A, i),
               _f(b + "attn_kv_a_norm.weight", (c.head_dim,), Role.NORM, i),
               # stored 2-D; llama.cpp views it as [o_groups, o_lora_rank, n_head*head_dim/o_groups]
               TensorSpec(b + "attn_output_a.weight", (og, c.n_head * c.head_dim // c.o_groups), A, i),
               TensorSpec(b + "attn_output_b.weight", (D, og), A, i)]
        for site in ("attn", "ffn"):
            out += [_f(b + f"hc_{site}_fn.weight", (c.hc_mix, c.hc_count * D), Role.OTHER, i),
                    _f(b + f"hc_{site}_base.weight", (c.hc_mix,), Role.OTHER, i),
                    _f(b + f"hc_{site}_scale.weight", (3,), Role.OTHER, i)]
        return out

    def _compressor(self, i: int) -> list[TensorSpec]:
        c, b, A, D = self.config, f"blk.{i}.", Role.ATTENTION, self.config.n_embd
        ratio = c.compress_ratio(i)
        if ratio == 0:
            return []
        w = (2 if ratio == 4 else 1) * c.head_dim  # ratio 4 pools overlapping windows of 2r tokens
        out = [TensorSpec(b + "attn_compressor_kv.weight", (w, D), A, i),
               TensorSpec(b + "attn_compressor_gate.weight", (w, D), A, i),
               TensorSpec(b + "attn_compressor_ape.weight", (ratio, w), A, i),
               _f(b + "attn_compressor_norm.weight", (c.head_dim,), Role.NORM, i)]
        if ratio == 4:
            wi = 2 * c.indexer_head_dim
            out += [TensorSpec(b + "indexer.proj.weight", (c.n_indexer_head, D), A, i),
                    TensorSpec(b + "indexer.attn_q_b.weight",
                               (c.n_indexer_head * c.indexer_head_dim, c.q_lora_rank), A, i),
                    TensorSpec(b + "indexer_compressor_kv.weight", (wi, D), A, i),
                    TensorSpec(b + "indexer_compressor_gate.weight", (wi, D), A, i),
                    TensorSpec(b + "indexer_compressor_ape.weight", (ratio, wi), A, i),
                    _f(b + "indexer_compressor_norm.weight", (c.indexer_head_dim,), Role.NORM, i)]
        return out

    def _ffn(self, i: int) -> list[TensorSpec]:
        c, b, D = self.config, f"blk.{i}.", self.config.n_embd
        E, ff, X = c.n_expert, c.n_ff_exp, Role.ROUTED_EXPERT
        out = [_f(b + "ffn_norm.weight", (D,), Role.NORM, i),
               _f(b + "ffn_gate_inp.weight", (E, D), Role.ROUTER, i)]
        if i < c.n_hash_layers:  # hash routing: token id -> expert ids, stored as I32
            out.append(TensorSpec(b + "ffn_gate_tid2eid.weight", (c.n_vocab, c.n_expert_used), Role.ROUTER,
                                  i, allowed_types=(I32,)))
        else:
            out.append(_f(b + "exp_probs_b.bias", (E,), Role.ROUTER, i))
        out += [TensorSpec(b + "ffn_gate_exps.weight", (E, ff, D), X, i),
                TensorSpec(b + "ffn_up_exps.weight", (E, ff, D), X, i),
                TensorSpec(b + "ffn_down_exps.weight", (E, D, ff), X, i)]
        if c.n_expert_shared:
            out += shared_expert_specs(b, i, D, c.n_ff_shexp)
        return out

    def capability_details(self) -> dict[str, Any]:
        c = self.config
        kinds = {0: "sliding", 4: "csa", 128: "hca"}
        return {"generate": True, "reason": "", "attention": "swa+csa+hca", "gating": "sqrtsoftplus",
                "hash_layers": c.n_hash_layers,
                "layer_kinds": [kinds[c.compress_ratio(i)] for i in range(c.n_layer)],
                "hyper_connections": c.hc_count, "mtp_layers": c.n_nextn}
