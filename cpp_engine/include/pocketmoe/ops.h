// The model ops on the native kernels: coarse enough that a decode layer is a handful of calls, with no
// architecture in them. Every op is batch-aware: the rows of one call may belong to several sequences,
// each with its own positions and KV cache rows, and every row's result is bitwise what it would be
// alone (norms, rope and routing are per row; the GEMMs and the MoE op are batch-invariant; attention
// computes each (query, head) over its own sequence's keys in one fixed order).
//
// Legend: T rows (tokens) of the call, D hidden, H heads, N qk_nope, R rope dims, V v_head, C kv_lora,
// W = C + R cached values per token, E experts, K experts per token, S sequences of the call.
#pragma once

#include <cstddef>
#include <cstdint>

#include "pocketmoe/runtime.h"

namespace pocketmoe {

// One weight as the kernels read it: [heads,] rows x cols values in rows of row_bytes bytes of GGUF blocks.
struct Weight {
  const uint8_t* data = nullptr;
  int ggml_type = -1;
  int heads = 1;
  int rows = 0;
  int cols = 0;
  size_t row_bytes = 0;
};

// Throws std::invalid_argument naming `what` unless w is [heads, rows, cols] with rows of the type's size.
void check_weight(const char* what, const Weight& w, int heads, int rows, int cols);

// y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w over T rows of d values (x and y may be the same rows).
void rms_norm(const float* x, const float* w, int n_rows, int d, float eps, float* y);

// x[t] += add[t] (the residual stream), then y[t] = rms_norm(x[t]).
void add_rms_norm(float* x, const float* add, const float* w, int n_rows, int d, float eps, float* y);

// The residual update closing a sublayer: x[t] += (a[t] + b[t]) (b may be null), then, with a norm
// weight, y[t] = rms_norm(x[t]). a and b are summed first: routed + shared, then the residual.
void finalize(float* x, const float* a, const float* b, const float* norm_w, int n_rows, int d, float eps, float* y);

// Rotary embedding in place on `heads` heads of head_dim values per row, rotating the first `rot` dims of
// each head with tables cos2 / sin2 [T, rot] (cos per pair twice; -sin, +sin per pair): pairs are
// (2i, 2i+1) (ggml NORM mode) or (i, i + rot/2) (NeoX). Row t of x starts at x + t * row_stride.
void rope(float* x, int n_rows, size_t row_stride, int heads, int head_dim, int rot, bool neox, const float* cos2,
          const float* sin2);

// The values a KV cache stores: float32, IEEE half (llama.cpp's default) or bfloat16. An entry is computed in
// float32 and rounded to the nearest even value of the type (as torch's .to(dtype)); the attention reads
// it back exactly and computes in float32.
enum class KVType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

// Where each row's keys are: row t belongs to sequence seq[t] and sees that sequence's positions
// 0..keys[t]-1; position p of sequence s sits in cache row table[s * table_width + p / page] * page + p % page.
struct KVLayout {
  const int32_t* seq;          // [T]
  const int32_t* keys;         // [T]
  const int32_t* write_rows;   // [T]: the cache row each row's own entry goes to
  const int32_t* table;        // [S, table_width]
  int n_seqs = 0;
  int table_width = 0;
  int page = 0;
  int cache_rows = 0;          // rows the cache holds (bounds check)
  KVType type = KVType::kF32;  // the cache's values
};

// DeepSeek MLA attention over a latent cache [cache_rows, W] of kv_layout.type, weights absorbed (k_b [H, C, N],
// v_b [H, V, C]): writes each row's cache entry (normed c_kv, roped k_pe from kv [T, W]), ropes q_pe, maps q_nope
// through k_b, attends in latent space and maps the result through v_b. q: [T, H*(N+R)]; out: [T, H*V].
struct MLAShape {
  int n_head, qk_nope, qk_rope, v_head, kv_lora;
  float scale, eps;
};
void mla_attention(const MLAShape& s, const float* q, const float* kv, const float* kv_norm, const Weight& k_b,
                   const Weight& v_b, const float* cos2, const float* sin2, void* cache, const KVLayout& kv_layout,
                   int n_rows, float* out);

// Grouped-query attention over a cache [cache_rows, n_head_kv * (head_dim + v_dim)] of kv_layout.type whose row
// holds a token's roped K of every KV head, then its V: writes each row's entry (k [T, G*Dh] roped, v [T, G*Dv]),
// ropes a copy of q [T, H*Dh] into q_work (the first `rot` dims of each head; NeoX or normal pairs), and attends
// query head j over KV head j / (H / G). out: [T, H*Dv].
struct GQAShape {
  int n_head, n_head_kv, head_dim, v_dim, rot;
  bool neox;
  float scale;
};
void gqa_attention(const GQAShape& s, const float* q, const float* k, const float* v, const float* cos2,
                   const float* sin2, void* cache, const KVLayout& kv_layout, int n_rows, float* q_work, float* out);

// Router: logits = x @ gate^T, probabilities by softmax (gating 1) or sigmoid (gating 2), selection
// scores = probabilities + bias, the best `groups_used` of `n_groups` expert groups (group score: its two
// best selection scores), top-k by selection in descending order (ties: the lower id), weights = the
// probabilities of the chosen, divided by max(their sum, weight_sum_min) with `norm`, times `scale`
// unless it is 0 or 1. ids, weights: [T, K]. The caller has checked the parameters (layers/moe.py).
struct RouteParams {
  int n_experts, top_k, gating, n_groups, groups_used;
  bool norm;
  float scale, weight_sum_min;
  int gating_softmax, gating_sigmoid;  // the ids of the two gating functions, as the caller names them
};
void route(const RouteParams& p, const float* x, int n_rows, const Weight& gate, const float* bias, int32_t* ids,
           float* weights);

// ys[i] = x @ weights[i]^T for up to 4 2-D weights sharing the input x [T, cols], in one pool dispatch with x
// quantized once per activation format; each bitwise what gemm gives for that weight alone.
void linear_multi(const Weight* const* weights, int n_weights, const float* x, int n_rows, float* const* ys);

// y = down(silu(gate x) * up x): the dense FFN and shared experts. x: [T, D], y: [T, D].
void gated_ffn(const Weight& gate, const Weight& up, const Weight& down, const float* x, int n_rows, float* y);

// Dequantized rows of an embedding table: y[t] = table[tokens[t]] (D values).
void embed(const Weight& table, const int32_t* tokens, int n_rows, float* y);

// ---- Sublayers: the ops above composed in the order a residual block runs them, so a decode layer is two
// calls. Each ends in the residual update that closes a sublayer: x[t] += out[t] (the sublayer's output),
// then next[t] = rms_norm(x[t]) with the next sublayer's norm weight (none: no next). Bitwise what the
// separate ops give.
struct Residual {
  float* x = nullptr;             // [T, D], the residual stream, updated in place
  const float* norm_w = nullptr;  // the next sublayer's norm weight, or null
  float eps = 0.0f;
  float* next = nullptr;          // [T, D]: rms_norm(x) * norm_w (unused without norm_w)
};

// MLA attention sublayer on normed rows xn [T, D]: q = xn wq^T (or through the q LoRA pair wq_a, q_a_norm,
// wq_b) and kv = xn wkv_a^T in one dispatch, mla_attention, o wo^T, then the residual update.
struct MLAWeights {
  const Weight* wq = nullptr;  // null: the q LoRA pair
  const Weight* wq_a = nullptr;
  const float* q_a_norm = nullptr;
  const Weight* wq_b = nullptr;
  const Weight* wkv_a = nullptr;
  const float* kv_a_norm = nullptr;
  const Weight* k_b = nullptr;
  const Weight* v_b = nullptr;
  const Weight* wo = nullptr;
};
void mla_sublayer(const MLAShape& s, const MLAWeights& w, const float* xn, const float* cos2, const float* sin2,
                  void* cache, const KVLayout& kv_layout, int n_rows, const Residual& res);

// GQA attention sublayer on normed rows xn [T, D]: q, k, v = xn (wq, wk, wv)^T in one dispatch, the q and k
// norms over the whole projections (when given), gqa_attention, o wo^T, then the residual update.
struct GQAWeights {
  const Weight* wq = nullptr;
  const Weight* wk = nullptr;
  const Weight* wv = nullptr;
  const Weight* wo = nullptr;
  const float* q_norm = nullptr;  // [H*Dh] or null
  const float* k_norm = nullptr;  // [G*Dh] or null
  float eps = 0.0f;
};
void gqa_sublayer(const GQAShape& s, const GQAWeights& w, const float* xn, const float* cos2, const float* sin2,
                  void* cache, const KVLayout& kv_layout, int n_rows, const Residual& res);

// Gated FFN sublayer (a dense FFN): gated_ffn(xn), then the residual update.
void ffn_sublayer(const Weight& gate, const Weight& up, const Weight& down, const float* xn, int n_rows,
                  const Residual& res);

// MoE sublayer: route(xn), the routed experts (moe_forward), the shared experts (gated_ffn, when given) and
// the residual update x += routed + shared.
struct MoEParts {
  RouteParams route;
  const Weight* gate_inp = nullptr;
  const float* bias = nullptr;  // selection bias [E] or null
  MoEWeights gate, up, down;
  int ffn = 0;                  // routed expert width
  const Weight* shared_gate = nullptr;  // null: no shared experts
  const Weight* shared_up = nullptr;
  const Weight* shared_down = nullptr;
};
void moe_sublayer(const MoEParts& m, const float* xn, int n_rows, int hidden, const Residual& res);

// DeepSeek-V4 attention (one shared K = V head): per query t, heads [t, H, d] over its own keys, the d values at
// value offsets key_offsets[starts[t] .. starts[t + 1]) of the cache (window rows and visible compressed entries,
// already masked; cache_values values of `type`), a softmax with each head's sink logit (its mass dropped),
// scaled by `scale`. out [t, H, d].
void dsv4_attention(const float* q, int n, int n_head, int d, float scale, const float* sinks, const void* cache,
                    KVType type, size_t cache_values, const int64_t* key_offsets, const int32_t* starts, float* out);

// DeepSeek-V4's hyper-connections (mHC) over n residual streams, each in the op order of the torch reference
// (pocketmoe/ops/reference_v4.py), element by element, no fused multiply-adds: bitwise its results.
// comb [T, n, n], holding the row softmax: + eps, columns (over axis 1) normalised, then iters - 1 times the
// rows (axis 2) and the columns; each sum in index order.
void hc_sinkhorn(float* comb, int n_rows, int n, int iters, float eps);
// y [T, D] = sum_i w[t, i] * x[t, i, :] in stream order; x [T, n, D], w [T, n].
void hc_mix(const float* x, const float* w, int n_rows, int n, int d, float* y);
// y [T, n, D]: stream j = out * post[t, j] + sum_i x[t, i] * comb[t, i, j], i in order.
void hc_post(const float* out, const float* x, const float* post, const float* comb, int n_rows, int n, int d,
             float* y);

}  // namespace pocketmoe
