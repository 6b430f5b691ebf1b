"""`deepseek2` (DeepSeek-V2 / V2-Lite / V3 layout): MLA attention, leading dense blocks, routed + shared experts."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pocketmoe.specs.base import (
    KV,
    MetadataReader,
    ModelSpec,
    Role,
    RopeScaling,
    SpecError,
    TensorSpec,
    check_positive,
    normalize_floats,
    shared_expert_specs,
)
from pocketmoe.specs.metadata import canonical_mscale, decode_log_mul, encode_log_mul, token_kvs

ARCH = "deepseek2"
GATING_NAMES = {1: "softmax", 2: "sigmoid"}
MLA_LAYOUTS = ("absorbed", "legacy")


@dataclass(frozen=True)
class DeepSeek2Config:
    """Hyperparameters of a `deepseek2` GGUF. Head dims: q/k = qk_nope + qk_rope, v = v_head_dim.

    mla_layout "absorbed" = attn_k_b/attn_v_b with the `*_mla` keys (llama.cpp since 2025-04);
    "legacy" = one attn_kv_b. q_lora_rank 0 = full attn_q. gating_func: 1 softmax, 2 sigmoid.
    """

    n_vocab: int
    n_ctx: int
    n_embd: int
    n_layer: int
    n_head: int
    n_ff: int                      # width of the leading dense FFN blocks
    n_expert: int
    n_expert_used: int
    n_expert_shared: int
    n_ff_exp: int                  # width of one routed expert
    n_dense_lead: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_layout: str = "absorbed"
    gating_func: int = 1
    expert_weights_norm: bool = False
    expert_weights_scale: float = 1.0
    n_expert_groups: int = 1
    n_expert_groups_used: int = 1
    rms_eps: float = 1e-6
    rope_freq_base: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    mscale_all_dim: float = 0.0
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        check_positive("DeepSeek2Config", n_vocab=self.n_vocab, n_ctx=self.n_ctx, n_embd=self.n_embd,
                       n_layer=self.n_layer, n_head=self.n_head, n_expert=self.n_expert,
                       n_expert_used=self.n_expert_used, n_ff_exp=self.n_ff_exp,
                       kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                       qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
                       n_expert_groups=self.n_expert_groups, n_expert_groups_used=self.n_expert_groups_used)
        problems = []
        if self.n_expert_used > self.n_expert:
            problems.append(f"n_expert_used {self.n_expert_used} exceeds n_expert {self.n_expert}")
        if not 0 <= self.n_dense_lead <= self.n_layer:
            problems.append(f"n_dense_lead {self.n_dense_lead} is not within 0..n_layer {self.n_layer}")
        if self.n_dense_lead > 0 and self.n_ff <= 0:
            problems.append(f"n_ff is {self.n_ff} but {self.n_dense_lead} leading dense blocks need it > 0")
        if self.n_expert_shared < 0 or self.q_lora_rank < 0:
            problems.append("n_expert_shared and q_lora_rank must be >= 0")
        if self.qk_rope_head_dim % 2:
            problems.append(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even")
        if self.mla_layout not in MLA_LAYOUTS:
            problems.append(f"mla_layout {self.mla_layout!r} is not one of {MLA_LAYOUTS}")
        if self.gating_func not in GATING_NAMES:
            problems.append(f"gating_func {self.gating_func} is not 1 (softmax) or 2 (sigmoid)")
        if self.n_expert % self.n_expert_groups or self.n_expert_groups_used > self.n_expert_groups:
            problems.append(f"expert groups {self.n_expert_groups_used}/{self.n_expert_groups} do not "
                            f"divide {self.n_expert} experts")
        if self.expert_weights_scale <= 0 or self.rms_eps <= 0 or self.rope_freq_base <= 0:
            problems.append("expert_weights_scale, rms_eps and rope_freq_base must be positive")
        if problems:
            raise SpecError(f"invalid deepseek2 config: {'; '.join(problems)}; fix the config or the "
                            f"file's metadata.")
        normalize_floats(self, "expert_weights_scale", "rms_eps", "rope_freq_base")
        object.__setattr__(self, "mscale_all_dim", canonical_mscale(self.mscale_all_dim))
        if self.rope_scaling.orig_ctx == 0:
            object.__setattr__(self, "rope_scaling", replace(self.rope_scaling, orig_ctx=self.n_ctx))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_width(self) -> int:
        """Values an MLA layer caches per token: the normed latent c_kv and the roped k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def n_ff_shexp(self) -> int:
        """Width of the shared-expert FFN (all shared experts fused, as llama.cpp loads them)."""
        return self.n_ff_exp * self.n_expert_shared

    @property
    def gating(self) -> str:
        return GATING_NAMES[self.gating_func]

    @property
    def yarn_mscale(self) -> float:
        """0.1 * mscale_all_dim * ln(factor) + 1 under YaRN with factor > 1, else 1."""
        rs = self.rope_scaling
        if rs.kind != "yarn" or rs.factor <= 1.0 or self.mscale_all_dim <= 0:
            return 1.0
        return 0.1 * self.mscale_all_dim * math.log(rs.factor) + 1.0

    @property
    def attn_scale(self) -> float:
        """Softmax scale of q.k: mscale^2 / sqrt(qk_head_dim) (the un-absorbed head dim, also under MLA)."""
        return self.yarn_mscale ** 2 / math.sqrt(self.qk_head_dim)

    @staticmethod
    def v2_lite() -> DeepSeek2Config:
        """DeepSeek-V2-Lite(-Chat) as llama.cpp converts it today (SPECS.md 1.1-1.2)."""
        return DeepSeek2Config(
            n_vocab=102400, n_ctx=163840, n_embd=2048, n_layer=27, n_head=16, n_ff=10944,
            n_expert=64, n_expert_used=6, n_expert_shared=2, n_ff_exp=1408, n_dense_lead=1,
            q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            mla_layout="absorbed", gating_func=1, expert_weights_norm=False, expert_weights_scale=1.0,
            rms_eps=1e-6, rope_freq_base=10000.0,
            rope_scaling=RopeScaling("yarn", 40.0, 4096, 32.0, 1.0), mscale_all_dim=0.707,
            bos_token_id=100000, eos_token_id=100001)

    @staticmethod
    def from_metadata(metadata: Mapping[str, Any], n_vocab_hint: int | None = None) -> DeepSeek2Config:
        r = MetadataReader(metadata, ARCH)
        n_head = r.get_int("attention.head_count")
        n_embd = r.get_int("embedding_length")
        n_rot = r.get_int("rope.dimension_count")
        kv_lora = r.get_int("attention.kv_lora_rank")
        if r.has("attention.key_length_mla") or r.has("attention.value_length_mla"):
            layout, k_len = "absorbed", r.get_int("attention.key_length_mla")
            v_len = r.get_int("attention.value_length_mla")
            for key, want in (("attention.head_count_kv", 1), ("attention.key_length", kv_lora + n_rot),
                              ("attention.value_length", kv_lora)):
                got = r.get_opt_int(key)
                if got is not None and got != want:
                    raise SpecError(f"GGUF metadata key {r.key(key)!r} is {got} but the MLA layout "
                                    f"(key_length_mla present) needs {want}; re-convert the model with "
                                    f"a current llama.cpp.")
        else:
            layout = "legacy"
            k_len = r.get_int("attention.key_length", n_embd // n_head)
            v_len = r.get_int("attention.value_length", k_len)
        if k_len <= n_rot:
            raise SpecError(f"deepseek2 key length {k_len} must exceed rope.dimension_count {n_rot}; "
                            f"fix the file's metadata.")
        bos, eos = r.token_ids()
        return DeepSeek2Config(
            n_vocab=r.vocab_size(n_vocab_hint), n_ctx=r.get_int("context_length"), n_embd=n_embd,
            n_layer=r.get_int("block_count"), n_head=n_head, n_ff=r.get_int("feed_forward_length", 0),
            n_expert=r.get_int("expert_count"), n_expert_used=r.get_int("expert_used_count"),
            n_expert_shared=r.get_int("expert_shared_count"),
            n_ff_exp=r.get_int("expert_feed_forward_length"),
            n_dense_lead=r.get_int("leading_dense_block_count", 0),
            q_lora_rank=r.get_int("attention.q_lora_rank", 0), kv_lora_rank=kv_lora,
            qk_nope_head_dim=k_len - n_rot, qk_rope_head_dim=n_rot, v_head_dim=v_len, mla_layout=layout,
            gating_func=r.get_int("expert_gating_func", 0) or 1,
            expert_weights_norm=r.get_bool("expert_weights_norm", False),
            expert_weights_scale=r.get_float("expert_weights_scale", 0.0) or 1.0,
            n_expert_groups=r.get_int("expert_group_count", 0) or 1,
            n_expert_groups_used=r.get_int("expert_group_used_count", 0) or 1,
            rms_eps=r.get_float("attention.layer_norm_rms_epsilon"),
            rope_freq_base=r.get_float("rope.freq_base", 10000.0),
            rope_scaling=RopeScaling.read(r),
            mscale_all_dim=decode_log_mul(r.get_float("rope.scaling.yarn_log_multiplier", 0.0)),
            bos_token_id=bos, eos_token_id=eos)

    def to_metadata(self) -> dict[str, KV]:
        """The KV pairs llama.cpp's converter writes (plus what llama.cpp needs to load a small model)."""
        u, p = KV.u32, f"{ARCH}."
        absorbed = self.mla_layout == "absorbed"
        kv: dict[str, KV] = {
            "general.architecture": KV.string(ARCH),
            p + "block_count": u(self.n_layer), p + "context_length": u(self.n_ctx),
            p + "embedding_length": u(self.n_embd), p + "feed_forward_length": u(self.n_ff),
            p + "vocab_size": u(self.n_vocab), p + "attention.head_count": u(self.n_head),
            p + "attention.head_count_kv": u(1 if absorbed else self.n_head),
            p + "attention.key_length": u(self.kv_lora_rank + self.qk_rope_head_dim if absorbed
                                          else self.qk_head_dim),
            p + "attention.value_length": u(self.kv_lora_rank if absorbed else self.v_head_dim),
        }
        if absorbed:
            kv[p + "attention.key_length_mla"] = u(self.qk_head_dim)
            kv[p + "attention.value_length_mla"] = u(self.v_head_dim)
        kv |= {
            p + "attention.kv_lora_rank": u(self.kv_lora_rank), p + "attention.q_lora_rank": u(self.q_lora_rank),
            p + "attention.layer_norm_rms_epsilon": KV.f32(self.rms_eps),
            p + "rope.dimension_count": u(self.qk_rope_head_dim), p + "rope.freq_base": KV.f32(self.rope_freq_base),
            **self.rope_scaling.kvs(ARCH),
            p + "leading_dense_block_count": u(self.n_dense_lead),
            p + "expert_count": u(self.n_expert), p + "expert_used_count": u(self.n_expert_used),
            p + "expert_shared_count": u(self.n_expert_shared),
            p + "expert_feed_forward_length": u(self.n_ff_exp),
            p + "expert_group_count": u(self.n_expert_groups),
            p + "expert_group_used_count": u(self.n_expert_groups_used),
            p + "expert_weights_scale": KV.f32(self.expert_weights_scale),
            p + "expert_weights_norm": KV.boolean(self.expert_weights_norm),
            p + "expert_gating_func": u(self.gating_func),
        }
        if self.rope_scaling.kind == "yarn" or self.mscale_all_dim:
            kv[p + "rope.scaling.yarn_log_multiplier"] = KV.f32(encode_log_mul(self.mscale_all_dim))
        return kv | token_kvs(self.bos_token_id, self.eos_token_id)



def _norm(name: str, n: int, layer: int | None) -> TensorSpec:
    return TensorSpec(name, (n,), Role.NORM, layer, float_only=True)


class DeepSeek2Spec(ModelSpec):
    architecture = ARCH
    config_cls = DeepSeek2Config
    config: DeepSeek2Config

    def moe_layers(self) -> list[int]:
        return list(range(self.config.n_dense_lead, self.config.n_layer))

    def kv_values_per_token(self) -> int:
        return self.config.kv_cache_width

    def attention_flops_per_token(self, context_length: int) -> int:
        """Absorbed MLA (the native backends absorb a legacy attn_kv_b at load): every head scores each key's
        whole latent row (kv_lora + rope values) and sums the kv_lora values of each."""
        c = self.config
        return 2 * c.n_layer * c.n_head * context_length * (c.kv_cache_width + c.kv_lora_rank)

    def _tensors(self, present: frozenset[str] | None) -> list[TensorSpec]:
        c = self.config
        out = [TensorSpec("token_embd.weight", (c.n_vocab, c.n_embd), Role.EMBEDDING, None),
               _norm("output_norm.weight", c.n_embd, None),
               # llama.cpp falls back to token_embd when output.weight is absent (tied embeddings)
               TensorSpec("output.weight", (c.n_vocab, c.n_embd), Role.HEAD, None, optional=True)]
        for i in range(c.n_layer):
            out += self._attention(i)
            out += self._ffn(i, present)
        return out

    def _attention(self, i: int) -> list[TensorSpec]:
        c, b, A = self.config, f"blk.{i}.", Role.ATTENTION
        H, D = c.n_head, c.n_embd
        out = [_norm(b + "attn_norm.weight", D, i)]
        if c.q_lora_rank:
            out += [TensorSpec(b + "attn_q_a.weight", (c.q_lora_rank, D), A, i),
                    _norm(b + "attn_q_a_norm.weight", c.q_lora_rank, i),
                    TensorSpec(b + "attn_q_b.weight", (H * c.qk_head_dim, c.q_lora_rank), A, i)]
        else:
            out.append(TensorSpec(b + "attn_q.weight", (H * c.qk_head_dim, D), A, i))
        out += [TensorSpec(b + "attn_kv_a_mqa.weight", (c.kv_lora_rank + c.qk_rope_head_dim, D), A, i),
                _norm(b + "attn_kv_a_norm.weight", c.kv_lora_rank, i)]
        if c.mla_layout == "absorbed":
            out += [TensorSpec(b + "attn_k_b.weight", (H, c.kv_lora_rank, c.qk_nope_head_dim), A, i),
                    TensorSpec(b + "attn_v_b.weight", (H, c.v_head_dim, c.kv_lora_rank), A, i)]
        else:
            out.append(TensorSpec(b + "attn_kv_b.weight",
                                  (H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank), A, i))
        out.append(TensorSpec(b + "attn_output.weight", (D, H * c.v_head_dim), A, i))
        return out

    def _ffn(self, i: int, present: frozenset[str] | None) -> list[TensorSpec]:
        c, b, D = self.config, f"blk.{i}.", self.config.n_embd
        out = [_norm(b + "ffn_norm.weight", D, i)]
        if i < c.n_dense_lead:
            F = Role.DENSE_FFN
            return out + [TensorSpec(b + "ffn_gate.weight", (c.n_ff, D), F, i),
                          TensorSpec(b + "ffn_up.weight", (c.n_ff, D), F, i),
                          TensorSpec(b + "ffn_down.weight", (D, c.n_ff), F, i)]
        E, ff, X = c.n_expert, c.n_ff_exp, Role.ROUTED_EXPERT
        fused = present is not None and b + "ffn_gate_up_exps.weight" in present
        out += [TensorSpec(b + "ffn_gate_inp.weight", (E, D), Role.ROUTER, i, float_only=True),
                TensorSpec(b + "exp_probs_b.bias", (E,), Role.ROUTER, i, optional=True, float_only=True),
                TensorSpec(b + "ffn_gate_exps.weight", (E, ff, D), X, i, optional=fused),
                TensorSpec(b + "ffn_up_exps.weight", (E, ff, D), X, i, optional=fused),
                # --fuse-gate-up-exps: gate rows first, then up rows
                TensorSpec(b + "ffn_gate_up_exps.weight", (E, 2 * ff, D), X, i, optional=not fused),
                TensorSpec(b + "ffn_down_exps.weight", (E, D, ff), X, i)]
        if c.n_expert_shared:
            out += shared_expert_specs(b, i, D, c.n_ff_shexp)
        return out

    def capability_details(self) -> dict[str, Any]:
        c = self.config
        return {"generate": True, "reason": "", "attention": f"mla-{c.mla_layout}",
                "mla_layout": c.mla_layout, "q_lora": c.q_lora_rank > 0, "gating": c.gating,
                "expert_weights_norm": c.expert_weights_norm, "expert_weights_scale": c.expert_weights_scale,
                "group_routing": c.n_expert_groups > 1, "rope_scaling": c.rope_scaling.kind,
                "shared_experts": c.n_expert_shared, "dense_lead_blocks": c.n_dense_lead}
