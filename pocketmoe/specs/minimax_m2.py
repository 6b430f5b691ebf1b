"""`minimax-m2`: GQA attention with whole-projection q/k RMSNorm, partial NEOX rope, sigmoid-routed experts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pocketmoe.specs.base import (
    KV,
    MetadataReader,
    ModelSpec,
    Role,
    SpecError,
    TensorSpec,
    check_positive,
    normalize_floats,
)
from pocketmoe.specs.metadata import token_kvs

ARCH = "minimax-m2"
GATING_NAMES = {1: "softmax", 2: "sigmoid"}


@dataclass(frozen=True)
class MiniMaxM2Config:
    """Hyperparameters of a `minimax-m2` GGUF (SPECS.md 2.2). Expert weights are always renormalized
    over the top-k (llama.cpp hard-codes it) and there is no shared expert and no weights scale."""

    n_vocab: int
    n_ctx: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int                  # key_length
    v_head_dim: int                # value_length
    n_rot: int                     # rope.dimension_count (partial rotary)
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff: int = 0                  # feed_forward_length: the converter writes n_ff_exp (0 = that)
    gating_func: int = 2
    rms_eps: float = 1e-6
    rope_freq_base: float = 5e6
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        check_positive("MiniMaxM2Config", n_vocab=self.n_vocab, n_ctx=self.n_ctx, n_embd=self.n_embd,
                       n_layer=self.n_layer, n_head=self.n_head, n_head_kv=self.n_head_kv,
                       head_dim=self.head_dim, v_head_dim=self.v_head_dim, n_rot=self.n_rot,
                       n_expert=self.n_expert, n_expert_used=self.n_expert_used, n_ff_exp=self.n_ff_exp)
        problems = []
        if self.n_head % self.n_head_kv:
            problems.append(f"n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}")
        if self.n_rot > self.head_dim or self.n_rot % 2:
            problems.append(f"n_rot {self.n_rot} must be even and <= head_dim {self.head_dim}")
        if self.n_expert_used > self.n_expert:
            problems.append(f"n_expert_used {self.n_expert_used} exceeds n_expert {self.n_expert}")
        if self.gating_func not in GATING_NAMES:
            problems.append(f"gating_func {self.gating_func} is not 1 (softmax) or 2 (sigmoid)")
        if self.n_ff < 0 or self.rms_eps <= 0 or self.rope_freq_base <= 0:
            problems.append("n_ff must be >= 0 and rms_eps, rope_freq_base positive")
        if problems:
            raise SpecError(f"invalid minimax-m2 config: {'; '.join(problems)}; fix the config or the "
                            f"file's metadata.")
        normalize_floats(self, "rms_eps", "rope_freq_base")
        if self.n_ff == 0:
            object.__setattr__(self, "n_ff", self.n_ff_exp)

    @property
    def gating(self) -> str:
        return GATING_NAMES[self.gating_func]

    @staticmethod
    def full() -> MiniMaxM2Config:
        """MiniMax-M2 as llama.cpp converts it (SPECS.md 2.1-2.2)."""
        return MiniMaxM2Config(
            n_vocab=200064, n_ctx=196608, n_embd=3072, n_layer=62, n_head=48, n_head_kv=8, head_dim=128,
            v_head_dim=128, n_rot=64, n_expert=256, n_expert_used=8, n_ff_exp=1536, n_ff=1536,
            gating_func=2, rms_eps=1e-6, rope_freq_base=5e6, bos_token_id=200034, eos_token_id=200020)

    @staticmethod
    def from_metadata(metadata: Mapping[str, Any], n_vocab_hint: int | None = None) -> MiniMaxM2Config:
        r = MetadataReader(metadata, ARCH)
        n_embd, n_head = r.get_int("embedding_length"), r.get_int("attention.head_count")
        if not r.has("expert_gating_func"):
            raise SpecError(f"GGUF metadata key {r.key('expert_gating_func')!r} is missing; llama.cpp "
                            f"aborts without it, so write 2 (sigmoid) with gguf_set_metadata or re-convert.")
        head_dim = r.get_int("attention.key_length", n_embd // n_head)
        bos, eos = r.token_ids()
        return MiniMaxM2Config(
            n_vocab=r.vocab_size(n_vocab_hint), n_ctx=r.get_int("context_length"), n_embd=n_embd,
            n_layer=r.get_int("block_count"), n_head=n_head,
            n_head_kv=r.get_int("attention.head_count_kv", n_head), head_dim=head_dim,
            v_head_dim=r.get_int("attention.value_length", head_dim),
            n_rot=r.get_int("rope.dimension_count", head_dim),
            n_expert=r.get_int("expert_count"), n_expert_used=r.get_int("expert_used_count"),
            n_ff_exp=r.get_int("expert_feed_forward_length"), n_ff=r.get_int("feed_forward_length", 0),
            gating_func=r.get_int("expert_gating_func"),
            rms_eps=r.get_float("attention.layer_norm_rms_epsilon"),
            rope_freq_base=r.get_float("rope.freq_base", 10000.0), bos_token_id=bos, eos_token_id=eos)

    def to_metadata(self) -> dict[str, KV]:
        u, p = KV.u32, f"{ARCH}."
        kv = {
            "general.architecture": KV.string(ARCH),
            p + "block_count": u(self.n_layer), p + "context_length": u(self.n_ctx),
            p + "embedding_length": u(self.n_embd), p + "feed_forward_length": u(self.n_ff),
            p + "vocab_size": u(self.n_vocab),
            p + "attention.head_count": u(self.n_head), p + "attention.head_count_kv": u(self.n_head_kv),
            p + "attention.key_length": u(self.head_dim), p + "attention.value_length": u(self.v_head_dim),
            p + "attention.layer_norm_rms_epsilon": KV.f32(self.rms_eps),
            p + "rope.freq_base": KV.f32(self.rope_freq_base), p + "rope.dimension_count": u(self.n_rot),
            p + "expert_count": u(self.n_expert), p + "expert_used_count": u(self.n_expert_used),
            p + "expert_feed_forward_length": u(self.n_ff_exp),
            p + "expert_gating_func": u(self.gating_func),
        }
        return kv | token_kvs(self.bos_token_id, self.eos_token_id)


class MiniMaxM2Spec(ModelSpec):
    architecture = ARCH
    config_cls = MiniMaxM2Config
    config: MiniMaxM2Config

    def moe_layers(self) -> list[int]:
        return list(range(self.config.n_layer))

    def kv_values_per_token(self) -> int:
        """GQA: K and V of every KV head, per token and layer."""
        c = self.config
        return c.n_head_kv * (c.head_dim + c.v_head_dim)

    def attention_flops_per_token(self, context_length: int) -> int:
        """Every query head scores each key (head_dim) and sums each value (v_head_dim), in every layer."""
        c = self.config
        return 2 * c.n_layer * c.n_head * context_length * (c.head_dim + c.v_head_dim)

    def _tensors(self, present: frozenset[str] | None) -> list[TensorSpec]:
        c, D, A = self.config, self.config.n_embd, Role.ATTENTION
        q, k, v = c.n_head * c.head_dim, c.n_head_kv * c.head_dim, c.n_head_kv * c.v_head_dim
        E, ff, X = c.n_expert, c.n_ff_exp, Role.ROUTED_EXPERT
        out = [TensorSpec("token_embd.weight", (c.n_vocab, D), Role.EMBEDDING, None),
               TensorSpec("output_norm.weight", (D,), Role.NORM, None, float_only=True),
               TensorSpec("output.weight", (c.n_vocab, D), Role.HEAD, None)]
        for i in range(c.n_layer):
            b = f"blk.{i}."
            out += [
                TensorSpec(b + "attn_norm.weight", (D,), Role.NORM, i, float_only=True),
                TensorSpec(b + "attn_q.weight", (q, D), A, i),
                TensorSpec(b + "attn_k.weight", (k, D), A, i),
                TensorSpec(b + "attn_v.weight", (v, D), A, i),
                TensorSpec(b + "attn_output.weight", (D, c.n_head * c.v_head_dim), A, i),
                # q/k norms span the whole projection, not one head
                TensorSpec(b + "attn_q_norm.weight", (q,), Role.NORM, i, float_only=True),
                TensorSpec(b + "attn_k_norm.weight", (k,), Role.NORM, i, float_only=True),
                TensorSpec(b + "ffn_norm.weight", (D,), Role.NORM, i, float_only=True),
                TensorSpec(b + "ffn_gate_inp.weight", (E, D), Role.ROUTER, i, float_only=True),
                TensorSpec(b + "exp_probs_b.bias", (E,), Role.ROUTER, i, float_only=True),
                TensorSpec(b + "ffn_gate_exps.weight", (E, ff, D), X, i),
                TensorSpec(b + "ffn_up_exps.weight", (E, ff, D), X, i),
                TensorSpec(b + "ffn_down_exps.weight", (E, D, ff), X, i),
            ]
        return out

    def capability_details(self) -> dict[str, Any]:
        c = self.config
        return {"generate": True, "reason": "", "attention": "gqa", "qk_norm": "whole-projection", "rope": "neox-partial",
                "gating": c.gating, "expert_weights_norm": True, "shared_experts": 0}
