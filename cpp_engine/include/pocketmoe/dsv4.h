// DeepSeek-V4's coarse ops: one call per mHC site, per attention sublayer and per MoE sublayer, so a decode
// layer is a handful of native calls. Their definition is the torch reference (pocketmoe/ops/reference_v4.py);
// the linears, norms and the attention core are the native ops of ops.h. Batch-aware like every op there: the
// rows of one call may belong to several sequences, and a row's results never depend on the others'.
//
// Legend: T rows, n streams, D hidden, M = (2 + n) * n mixing values, H heads, d head dims, R rope dims,
// r compress ratio, c compressor width, P cache rows, W values per cache row, E experts, K experts per token.
#pragma once

#include <cstddef>
#include <cstdint>

#include "pocketmoe/ops.h"
#include "pocketmoe/runtime.h"

namespace pocketmoe {

// ---- mHC (hyper-connections) -------------------------------------------------------------------------------
// One mixing site: fn [M, n*D] (the head's: [n, n*D]), scale [3] ([1]), base [M] ([n]).
struct HCSite {
  const Weight* fn = nullptr;
  const float* scale = nullptr;
  const float* base = nullptr;
  int n = 0;
  int iters = 0;
  float eps = 0.0f;       // hyper_connection.epsilon
  float rms_eps = 0.0f;   // of the unweighted RMSNorm over the flattened streams
};

// Before a sublayer: m = fn . rmsnorm(flat x) [T, M]; pre = sigmoid(m[:n] s0 + b) + eps, post = 2 sigmoid(m[n:2n]
// s1 + b), comb = hc_sinkhorn(softmax over dst of (m[2n:] s2 + b) as [n src, n dst]); y = sum_i pre_i x_i.
// x [T, n, D]; y [T, D]; post [T, n]; comb [T, n, n]. The sigmoids run in double (as the reference does).
void hc_pre(const HCSite& s, const float* x, int n_rows, int d, float* y, float* post, float* comb);

// The head: y = sum_i pre_i x_i with pre = sigmoid(fn . rmsnorm(flat x) * scale[0] + base) + eps.
void hc_head(const HCSite& s, const float* x, int n_rows, int d, float* y);

// ---- Attention ---------------------------------------------------------------------------------------------
// A compressor: each token's state (kv = wkv x, score = wgate x + ape[pos % r]) goes into its cache row; the
// block of r tokens that a row completes is pooled (softmax over the block's tokens per channel; with ratio 4
// the first `dim` channels come from the previous block), RMSNormed, roped at the block's first position, and
// written into the row of its last token.
struct DSV4Compressor {
  const Weight* wkv = nullptr;   // [c, D]
  const Weight* wgate = nullptr; // [c, D]
  const float* ape = nullptr;    // [r, c]
  const float* norm = nullptr;   // [dim]
  int ratio = 0;
  int dim = 0;                   // entry dims; c = 2 * dim with ratio 4 (overlapping windows), else dim
  float eps = 0.0f;
  int kv = 0, score = 0, entry = 0;  // value offsets in the cache row
};

// The lightning indexer of a ratio-4 layer: per query, score_s = sum_h w_h relu(q_h . k_s) over its compressor's
// entries, w = proj x * w_scale; the query keeps its top_k visible entries (exact ties as std::partial_sort).
struct DSV4Indexer {
  const Weight* wq_b = nullptr;  // [h * hd, q_lora]
  const Weight* proj = nullptr;  // [h, D]
  DSV4Compressor comp;
  int n_head = 0, head_dim = 0, top_k = 0;
  float w_scale = 0.0f;
};

struct DSV4Attention {
  int n_head = 0, head_dim = 0, n_rot = 0, o_groups = 0, window = 0, ratio = 0;
  float eps = 0.0f, scale = 0.0f;
  int kv = 0;                        // value offset of the token's kv in the cache row
  const Weight* wq_a = nullptr;      // [q_lora, D]
  const Weight* wq_b = nullptr;      // [H * d, q_lora]
  const Weight* wkv = nullptr;       // [d, D]
  const Weight* wo_a = nullptr;      // [G, o_lora, H * d / G]
  const Weight* wo_b = nullptr;      // [D, G * o_lora]
  const float* q_a_norm = nullptr;
  const float* kv_norm = nullptr;
  const float* sinks = nullptr;      // [H]
  const DSV4Compressor* comp = nullptr;  // null: a window-only layer
  const DSV4Indexer* idx = nullptr;      // ratio 4 only
};

// One step's rows: positions [T] and the cache layout (ops.h KVLayout; a sequence's rows are consecutive in the
// step, at consecutive positions); the layer's rope tables by position: cos2, sin2 [rope_rows, R].
struct DSV4Step {
  const int32_t* positions = nullptr;
  KVLayout kv;
  const float* cos2 = nullptr;
  const float* sin2 = nullptr;
  int rope_rows = 0;
};

// The attention sublayer on normed rows x [T, D] -> out [T, D]: q LoRA (q_a, its norm, q_b, an unweighted norm
// per head, rope on the last R dims), kv (its norm, rope) into the cache, the compressors' states and entries,
// the indexer's choice, dsv4_attention over each query's window rows and entries, the inverse rope, the grouped
// output LoRA (wo_a per group, wo_b). cache: this layer's rows [P, W] of step.kv.type; a value written to it is
// rounded to that type, and every later read sees the rounded value.
void dsv4_attention_sublayer(const DSV4Attention& a, const float* x, int n_rows, void* cache, int width,
                             const DSV4Step& step, float* out);

// ---- MoE ---------------------------------------------------------------------------------------------------
// probs = sqrt(softplus(gate x)) (softplus in double); expert ids from tid2eid[token] or the top-k of probs + bias
// (ties: the lower id); weights = probs[ids], divided by max(their sum, weight_sum_min) with `norm`, times
// `scale` unless it is 0 or 1; routed experts by moe_forward (SwiGLU clamped at `limit`), plus the shared
// expert with its own clamp: down(silu(min(g, L)) * clamp(u, -L, L)) (silu in double).
struct DSV4MoE {
  const Weight* gate = nullptr;      // [E, D]
  const int32_t* tid2eid = nullptr;  // [vocab, K] or null
  int vocab = 0;
  const float* bias = nullptr;       // [E] or null (then tid2eid)
  int n_experts = 0, top_k = 0;
  bool norm = false;
  float scale = 1.0f, weight_sum_min = 0.0f;
  MoEWeights up, gate_e, down;
  int ffn = 0;
  float limit = 0.0f;                // routed experts' clamp (0: none)
  const Weight* shared_gate = nullptr;  // null: no shared expert
  const Weight* shared_up = nullptr;
  const Weight* shared_down = nullptr;
  float shared_limit = 0.0f;
};

// x [T, D] (normed), tokens [T] -> y [T, D] = routed + shared.
void dsv4_moe(const DSV4MoE& m, const float* x, const int64_t* tokens, int n_rows, float* y);

}  // namespace pocketmoe
