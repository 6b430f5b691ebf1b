// DeepSeek-V2 forward on the native kernels (see pocketmoe/deepseek2_graph.h).
//
// Legend: n tokens in the chunk, D hidden, H heads, N qk_nope, R qk_rope, V v_head, C kv_lora,
// W = C + R cached values per token, E experts, K experts per token, S keys a query sees.
#include "pocketmoe/deepseek2_graph.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include "pocketmoe/matmul.h"
#include "pocketmoe/silu.h"
#include "pocketmoe/types.h"
#include "simd.h"
#include "workspace.h"

namespace pocketmoe {
namespace {

using simd::hsum;

// Smallest normal fp16: llama.cpp clamps the sum of the top-k weights to it before dividing.
constexpr float kWeightSumMin = 6.103515625e-5f;
// Attention of fewer multiply-adds than this runs on the caller alone (waking the pool costs more).
constexpr size_t kInlineAttention = size_t{1} << 16;

float* grow(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// y = x * (1 / sqrt(mean(x^2) + eps)) * w over one row of d values. The squares are summed in double,
// as llama.cpp does: the norm feeds the activation quantizers, and a different float sum would put a
// value on the other side of a rounding step now and then.
void rms_norm_row(const float* x, const float* w, int d, float eps, float* y) {
  double ss = 0.0;
  for (int i = 0; i < d; ++i) ss += static_cast<double>(x[i] * x[i]);
  const float mean = static_cast<float>(ss / d);
  const float scale = 1.0f / std::sqrt(mean + eps);
  for (int j = 0; j < d; ++j) y[j] = x[j] * scale * w[j];
}

// rms_norm_row over n rows of d values (x and y may be the same rows).
void rms_norm_rows(const float* x, const float* w, int n, int d, float eps, float* y) {
  for (int t = 0; t < n; ++t) rms_norm_row(x + static_cast<size_t>(t) * d, w, d, eps, y + static_cast<size_t>(t) * d);
}

// x[i] += y[i] for i < n (the residual adds).
void add_into(float* x, const float* y, size_t n) {
  for (size_t i = 0; i < n; ++i) x[i] += y[i];
}

// Rotary embedding on interleaved pairs with tables as Rotary.span builds them:
// (x0, x1) -> (x0 * cos2[2i] + x1 * sin2[2i], x1 * cos2[2i+1] + x0 * sin2[2i+1]).
void rope_row(const float* x, const float* cos2, const float* sin2, int r, float* y) {
  for (int i = 0; i < r; i += 2) {
    const float x0 = x[i], x1 = x[i + 1];
    y[i] = x0 * cos2[i] + x1 * sin2[i];
    y[i + 1] = x1 * cos2[i + 1] + x0 * sin2[i + 1];
  }
}

void check_linear(const char* what, const GraphLinear& w, int heads, int rows, int cols) {
  if (!w.present()) throw std::invalid_argument(std::string("deepseek2 graph: ") + what + " is missing");
  const size_t want = weight_row_bytes(type_info(w.ggml_type), cols);
  if (w.heads != heads || w.rows != rows || w.cols != cols || w.row_bytes != want)
    throw std::invalid_argument(std::string("deepseek2 graph: ") + what + " is [" + std::to_string(w.heads) + ", " +
                                std::to_string(w.rows) + ", " + std::to_string(w.cols) + "] in rows of " +
                                std::to_string(w.row_bytes) + " bytes; expected [" + std::to_string(heads) + ", " +
                                std::to_string(rows) + ", " + std::to_string(cols) + "] in rows of " +
                                std::to_string(want));
}

void check_ffn(const char* what, const GraphFFN& f, int hidden) {
  check_linear(what, f.gate, 1, f.gate.rows, hidden);
  check_linear(what, f.up, 1, f.gate.rows, hidden);
  check_linear(what, f.down, 1, hidden, f.gate.rows);
}

void linear(Engine& e, const GraphLinear& w, const float* x, int n, float* y) {
  gemm(e, w.data, w.rows, w.row_bytes, w.ggml_type, x, n, w.cols, y);
}

}  // namespace

const char* GraphProfile::name(int op) {
  static const char* const names[kCount] = {"embed",  "norms",   "q_kv_a",  "rope_cache", "k_b",    "attention", "v_b",
                                            "attn_output", "router", "experts", "shared",     "dense_ffn", "head"};
  return op >= 0 && op < kCount ? names[op] : "?";
}

Deepseek2Graph::Deepseek2Graph(const Deepseek2Params& params, std::vector<Deepseek2Layer> layers, GraphLinear embed,
                               const float* output_norm, GraphLinear head, float* cache, int n_ctx)
    : p_(params),
      layers_(std::move(layers)),
      embed_(embed),
      head_(head),
      output_norm_(output_norm),
      cache_(cache),
      n_ctx_(n_ctx),
      width_(params.kv_lora + params.qk_rope) {
  const Deepseek2Params& p = p_;
  if (p.hidden <= 0 || p.n_head <= 0 || p.qk_nope <= 0 || p.qk_rope <= 0 || p.qk_rope % 2 || p.v_head <= 0 ||
      p.kv_lora <= 0 || p.kv_lora % 8 || p.qk_rope % 8 || n_ctx <= 0 || cache == nullptr || output_norm == nullptr)
    throw std::invalid_argument("deepseek2 graph: bad hyperparameters or missing cache / output norm");
  check_linear("token_embd", embed_, 1, embed_.rows, p.hidden);
  check_linear("output", head_, 1, head_.rows, p.hidden);
  const int qw = p.n_head * (p.qk_nope + p.qk_rope);
  const bool any_moe = std::any_of(layers_.begin(), layers_.end(), [](const Deepseek2Layer& l) { return !l.dense.present(); });
  if (any_moe && (p.n_experts <= 0 || p.top_k <= 0 || p.top_k > p.n_experts || p.n_groups <= 0 ||
                  p.n_experts % p.n_groups || p.groups_used <= 0 || p.groups_used > p.n_groups ||
                  p.groups_used * (p.n_experts / p.n_groups) < p.top_k))
    throw std::invalid_argument("deepseek2 graph: bad expert routing parameters (" + std::to_string(p.n_experts) +
                                " experts, top-" + std::to_string(p.top_k) + ", " + std::to_string(p.groups_used) +
                                " of " + std::to_string(p.n_groups) + " groups)");
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Deepseek2Layer& l = layers_[i];
    if (!l.attn_norm || !l.kv_a_norm || !l.ffn_norm)
      throw std::invalid_argument("deepseek2 graph: layer " + std::to_string(i) + " lacks a norm weight");
    if (l.wq.present()) {
      check_linear("attn_q", l.wq, 1, qw, p.hidden);
    } else {
      if (!l.q_a_norm) throw std::invalid_argument("deepseek2 graph: q LoRA without attn_q_a_norm");
      check_linear("attn_q_a", l.wq_a, 1, p.q_lora, p.hidden);
      check_linear("attn_q_b", l.wq_b, 1, qw, p.q_lora);
    }
    check_linear("attn_kv_a_mqa", l.wkv_a, 1, width_, p.hidden);
    check_linear("attn_k_b", l.k_b, p.n_head, p.kv_lora, p.qk_nope);
    check_linear("attn_v_b", l.v_b, p.n_head, p.v_head, p.kv_lora);
    check_linear("attn_output", l.wo, 1, p.hidden, p.n_head * p.v_head);
    if (l.dense.present()) {
      check_ffn("dense ffn", l.dense, p.hidden);
      continue;
    }
    check_linear("ffn_gate_inp", l.router, 1, p.n_experts, p.hidden);
    if (l.expert_ffn <= 0) throw std::invalid_argument("deepseek2 graph: expert ffn width must be > 0");
    if (l.shared.present()) check_ffn("shared expert", l.shared, p.hidden);
  }
}

void Deepseek2Graph::forward(const int32_t* tokens, int n, int start, const float* cos2, const float* sin2,
                             bool last_only, float* logits) {
  if (n <= 0) throw std::invalid_argument("deepseek2 graph: forward needs at least one token");
  if (start < 0 || start + n > n_ctx_)
    throw std::invalid_argument("deepseek2 graph: positions " + std::to_string(start) + ".." +
                                std::to_string(start + n - 1) + " do not fit in the context of " +
                                std::to_string(n_ctx_) + " tokens");
  for (int t = 0; t < n; ++t)
    if (tokens[t] < 0 || tokens[t] >= embed_.rows)
      throw std::invalid_argument("deepseek2 graph: token id " + std::to_string(tokens[t]) +
                                  " is outside the vocabulary of " + std::to_string(embed_.rows));

  std::unique_lock<std::mutex> lock;
  Engine& e = acquire_engine(lock);
  Laps laps{profile_};
  ++profile_.calls;
  profile_.tokens += n;
  const int d = p_.hidden;
  float* x = grow(x_, static_cast<size_t>(n) * d);
  for (int t = 0; t < n; ++t)
    dequantize_row(embed_.ggml_type, embed_.data + embed_.row_bytes * tokens[t], d, x + static_cast<size_t>(t) * d);
  laps.lap(GraphProfile::kEmbed);

  const size_t layer_stride = static_cast<size_t>(n_ctx_) * width_;
  for (size_t i = 0; i < layers_.size(); ++i) layer(e, layers_[i], cache_ + i * layer_stride, n, start, cos2, sin2);

  laps.last = std::chrono::steady_clock::now();  // the layers keep laps of their own
  const int first = last_only ? n - 1 : 0;
  float* xn = grow(xn_, static_cast<size_t>(n) * d);
  rms_norm_rows(x + static_cast<size_t>(first) * d, output_norm_, n - first, d, p_.rms_eps, xn);
  laps.lap(GraphProfile::kNorm);
  linear(e, head_, xn, n - first, logits);
  laps.lap(GraphProfile::kHead);
}

void Deepseek2Graph::layer(Engine& e, const Deepseek2Layer& l, float* cache, int n, int start, const float* cos2,
                           const float* sin2) {
  const Deepseek2Params& p = p_;
  const int d = p.hidden, h = p.n_head, nope = p.qk_nope, r = p.qk_rope, c = p.kv_lora, w = width_;
  const int qw = nope + r;
  Laps laps{profile_};
  float* x = x_.data();
  float* xn = grow(xn_, static_cast<size_t>(n) * d);
  rms_norm_rows(x, l.attn_norm, n, d, p.rms_eps, xn);
  laps.lap(GraphProfile::kNorm);

  // q [n, H*(N+R)] (directly, or q_a for the LoRA pair) and the cache rows' inputs [n, W], in one dispatch.
  float* q = grow(q_, static_cast<size_t>(n) * h * qw);
  float* kv = grow(kv_, static_cast<size_t>(n) * w);
  const GraphLinear& first = l.wq.present() ? l.wq : l.wq_a;
  float* first_out = l.wq.present() ? q : grow(qa_, static_cast<size_t>(n) * p.q_lora);
  const GemmOp ops[2] = {{first.data, first.rows, first.row_bytes, first.ggml_type, first_out},
                         {l.wkv_a.data, l.wkv_a.rows, l.wkv_a.row_bytes, l.wkv_a.ggml_type, kv}};
  gemm_multi(e, ops, 2, xn, n, d);
  if (!l.wq.present()) {
    float* qa = qa_.data();
    rms_norm_rows(qa, l.q_a_norm, n, p.q_lora, p.rms_eps, qa);
    linear(e, l.wq_b, qa, n, q);
  }
  laps.lap(GraphProfile::kQKV);

  // Cache rows of these positions: normed c_kv, then roped k_pe.
  for (int t = 0; t < n; ++t) {
    const float* src = kv + static_cast<size_t>(t) * w;
    float* dst = cache + static_cast<size_t>(start + t) * w;
    rms_norm_row(src, l.kv_a_norm, c, p.rms_eps, dst);
    rope_row(src + c, cos2 + static_cast<size_t>(t) * r, sin2 + static_cast<size_t>(t) * r, r, dst + c);
  }

  // Per head and token: q_nope [H, n, N] for k_b; the attention query [H, n, W] = (q_nope k_b, roped q_pe).
  float* qn = grow(qn_, static_cast<size_t>(h) * n * nope);
  float* qc = grow(qc_, static_cast<size_t>(h) * n * w);
  for (int hh = 0; hh < h; ++hh)
    for (int t = 0; t < n; ++t) {
      const float* src = q + (static_cast<size_t>(t) * h + hh) * qw;
      const size_t ht = static_cast<size_t>(hh) * n + t;
      std::copy(src, src + nope, qn + ht * nope);
      rope_row(src + nope, cos2 + static_cast<size_t>(t) * r, sin2 + static_cast<size_t>(t) * r, r, qc + ht * w + c);
    }
  laps.lap(GraphProfile::kRopeCache);
  float* qlat = grow(qlat_, static_cast<size_t>(h) * n * c);
  gemm_batched(e, l.k_b.data, h, c, l.k_b.row_bytes, l.k_b.ggml_type, qn, n, nope, qlat);
  for (size_t ht = 0; ht < static_cast<size_t>(h) * n; ++ht) std::copy(qlat + ht * c, qlat + (ht + 1) * c, qc + ht * w);
  laps.lap(GraphProfile::kKB);

  attention(e, cache, n, start);
  laps.lap(GraphProfile::kAttention);

  // o_lat [H, n, C] -> per head v [H, n, V] -> [n, H*V] -> attn_output.
  const int v = p.v_head;
  float* ov = grow(ov_, static_cast<size_t>(h) * n * v);
  gemm_batched(e, l.v_b.data, h, v, l.v_b.row_bytes, l.v_b.ggml_type, olat_.data(), n, c, ov);
  float* oc = grow(oc_, static_cast<size_t>(n) * h * v);
  for (int t = 0; t < n; ++t)
    for (int hh = 0; hh < h; ++hh) {
      const float* src = ov + (static_cast<size_t>(hh) * n + t) * v;
      std::copy(src, src + v, oc + (static_cast<size_t>(t) * h + hh) * v);
    }
  laps.lap(GraphProfile::kVB);
  float* y = grow(t0_, static_cast<size_t>(n) * d);
  linear(e, l.wo, oc, n, y);
  add_into(x, y, static_cast<size_t>(n) * d);
  laps.lap(GraphProfile::kAttnOut);

  rms_norm_rows(x, l.ffn_norm, n, d, p.rms_eps, xn);
  laps.lap(GraphProfile::kNorm);
  if (l.dense.present()) {
    ffn(e, l.dense, xn, n, y);
    add_into(x, y, static_cast<size_t>(n) * d);
    laps.lap(GraphProfile::kDense);
    return;
  }
  linear(e, l.router, xn, n, grow(rl_, static_cast<size_t>(n) * p.n_experts));
  route(n, l.router_bias);
  laps.lap(GraphProfile::kRouter);
  moe_forward(e, xn, n, d, ids_.data(), ew_.data(), p.top_k, l.experts_gate, l.experts_up, l.experts_down,
              p.n_experts, l.expert_ffn, y);
  laps.lap(GraphProfile::kExperts);
  if (l.shared.present()) {
    float* ys = grow(t1_, static_cast<size_t>(n) * d);
    ffn(e, l.shared, xn, n, ys);
    add_into(y, ys, static_cast<size_t>(n) * d);
  }
  add_into(x, y, static_cast<size_t>(n) * d);
  laps.lap(GraphProfile::kShared);
}

// Attention of one query for G heads (G <= 4) over `keys` cache rows of w values (c_kv: the first c):
// scores, softmax, and the probability-weighted sum of c_kv. Each head's arithmetic is the same for
// any G and any chunk the query came in, so it never depends on how the work was grouped.
// q[j]: w values (q_lat, then roped q_pe); sc[j]: room for `keys` scores; o[j]: c outputs.
template <int G>
void attend(const float* cache, int keys, int w, int c, float scale, const float* const* q, float* const* sc,
            float* const* o) {
  // Two accumulators per head (even / odd groups of 8): the FMA chains are half as long.
  for (int s = 0; s < keys; ++s) {
    const float* row = cache + static_cast<size_t>(s) * w;
    __m256 a[G][2];
    for (int j = 0; j < G; ++j) a[j][0] = a[j][1] = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= w; i += 16) {
      const __m256 r0 = _mm256_loadu_ps(row + i), r1 = _mm256_loadu_ps(row + i + 8);
      for (int j = 0; j < G; ++j) {
        a[j][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q[j] + i), r0, a[j][0]);
        a[j][1] = _mm256_fmadd_ps(_mm256_loadu_ps(q[j] + i + 8), r1, a[j][1]);
      }
    }
    if (i < w) {
      const __m256 r0 = _mm256_loadu_ps(row + i);
      for (int j = 0; j < G; ++j) a[j][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q[j] + i), r0, a[j][0]);
    }
    for (int j = 0; j < G; ++j) sc[j][s] = hsum(_mm256_add_ps(a[j][0], a[j][1])) * scale;
  }
  float inv[G];
  for (int j = 0; j < G; ++j) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int s = 0; s < keys; ++s) mx = std::max(mx, sc[j][s]);
    inv[j] = 1.0f / exp_shifted(sc[j], keys, mx);
  }
  // o[j] = sum_s p[j][s] * c_kv[s] / sum_j, 16 outputs of every head at a time (kept in registers).
  for (int i0 = 0; i0 < c; i0 += 16) {
    const int nv = c - i0 >= 16 ? 2 : 1;
    __m256 acc[G][2];
    for (int j = 0; j < G; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    for (int s = 0; s < keys; ++s) {
      const float* row = cache + static_cast<size_t>(s) * w + i0;
      const __m256 r0 = _mm256_loadu_ps(row);
      const __m256 r1 = nv == 2 ? _mm256_loadu_ps(row + 8) : _mm256_setzero_ps();
      for (int j = 0; j < G; ++j) {
        const __m256 p = _mm256_broadcast_ss(sc[j] + s);
        acc[j][0] = _mm256_fmadd_ps(p, r0, acc[j][0]);
        acc[j][1] = _mm256_fmadd_ps(p, r1, acc[j][1]);
      }
    }
    for (int j = 0; j < G; ++j) {
      const __m256 iv = _mm256_set1_ps(inv[j]);
      _mm256_storeu_ps(o[j] + i0, _mm256_mul_ps(acc[j][0], iv));
      if (nv == 2) _mm256_storeu_ps(o[j] + i0 + 8, _mm256_mul_ps(acc[j][1], iv));
    }
  }
}

// Every (query, group of up to 4 heads) is one work item; a query at position start + t sees keys
// 0..start+t.
void Deepseek2Graph::attention(Engine& e, const float* cache, int n, int start) {
  constexpr int kGroup = 4;
  const int h = p_.n_head, c = p_.kv_lora, w = width_;
  const int groups = (h + kGroup - 1) / kGroup;
  float* olat = grow(olat_, static_cast<size_t>(h) * n * c);
  const float* qc = qc_.data();
  ThreadPool& pool = *e.pool;
  if (scores_.size() < static_cast<size_t>(pool.size())) scores_.resize(pool.size());
  for (auto& s : scores_) grow(s, static_cast<size_t>(kGroup) * (start + n));

  const auto one = [&](int item, int thread) {
    const int t = item / groups, h0 = (item % groups) * kGroup, g = std::min(kGroup, h - h0);
    const int keys = start + t + 1;
    const float* q[kGroup];
    float* sc[kGroup];
    float* o[kGroup];
    for (int j = 0; j < g; ++j) {
      const size_t ht = static_cast<size_t>(h0 + j) * n + t;
      q[j] = qc + ht * w;
      sc[j] = scores_[thread].data() + static_cast<size_t>(j) * keys;
      o[j] = olat + ht * c;
    }
    switch (g) {
      case 4: attend<4>(cache, keys, w, c, p_.attn_scale, q, sc, o); break;
      case 3: attend<3>(cache, keys, w, c, p_.attn_scale, q, sc, o); break;
      case 2: attend<2>(cache, keys, w, c, p_.attn_scale, q, sc, o); break;
      default: attend<1>(cache, keys, w, c, p_.attn_scale, q, sc, o); break;
    }
  };
  const int items = n * groups;
  const size_t work = static_cast<size_t>(h) * n * (start + n) * w;
  if (work < kInlineAttention) {
    for (int item = 0; item < items; ++item) one(item, 0);
  } else {
    pool.parallel_for(items, [&](int item, int thread) { one(item, thread); });
  }
}

// Router logits rl_ [n, E] -> ids_ and ew_ [n, K]: gating, bias and group limit for selection, top-k
// in descending selection score (ties: lower expert id first), weights from the gating probabilities.
void Deepseek2Graph::route(int n, const float* bias) {
  const Deepseek2Params& p = p_;
  const int ne = p.n_experts, k = p.top_k;
  if (ids_.size() < static_cast<size_t>(n) * k) ids_.resize(static_cast<size_t>(n) * k);
  float* ew = grow(ew_, static_cast<size_t>(n) * k);
  float* probs = grow(t2_, static_cast<size_t>(ne));
  float* select = grow(t3_, static_cast<size_t>(ne) + p.n_groups);
  float* group_score = select + ne;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int t = 0; t < n; ++t) {
    const float* lg = rl_.data() + static_cast<size_t>(t) * ne;
    if (p.gating == 2) {
      for (int i = 0; i < ne; ++i) probs[i] = 1.0f / (1.0f + std::exp(-lg[i]));
    } else {
      float mx = neg_inf, sum = 0.0f;
      for (int i = 0; i < ne; ++i) mx = std::max(mx, lg[i]);
      for (int i = 0; i < ne; ++i) sum += probs[i] = std::exp(lg[i] - mx);
      for (int i = 0; i < ne; ++i) probs[i] /= sum;
    }
    for (int i = 0; i < ne; ++i) select[i] = bias ? probs[i] + bias[i] : probs[i];
    if (p.n_groups > 1) {
      const int per = ne / p.n_groups;
      for (int g = 0; g < p.n_groups; ++g) {  // group score: its two best selection scores
        float a = neg_inf, b = neg_inf;
        for (int i = g * per; i < (g + 1) * per; ++i) {
          if (select[i] > a) {
            b = a;
            a = select[i];
          } else if (select[i] > b) {
            b = select[i];
          }
        }
        group_score[g] = per >= 2 ? a + b : a;
      }
      for (int kept = 0; kept < p.groups_used; ++kept) {  // mark the best groups with +inf
        int best = -1;
        for (int g = 0; g < p.n_groups; ++g)
          if (group_score[g] != std::numeric_limits<float>::infinity() && (best < 0 || group_score[g] > group_score[best]))
            best = g;
        group_score[best] = std::numeric_limits<float>::infinity();
      }
      for (int g = 0; g < p.n_groups; ++g)
        if (group_score[g] != std::numeric_limits<float>::infinity())
          std::fill(select + g * per, select + (g + 1) * per, neg_inf);
    }
    int32_t* id = ids_.data() + static_cast<size_t>(t) * k;
    float* wt = ew + static_cast<size_t>(t) * k;
    float wsum = 0.0f;
    for (int j = 0; j < k; ++j) {
      int best = -1;
      for (int i = 0; i < ne; ++i) {
        bool taken = false;
        for (int m = 0; m < j; ++m) taken |= id[m] == i;
        if (!taken && (best < 0 || select[i] > select[best])) best = i;
      }
      id[j] = best;
      wt[j] = probs[best];
      wsum += wt[j];
    }
    if (p.weight_norm) {
      const float div = std::max(wsum, kWeightSumMin);
      for (int j = 0; j < k; ++j) wt[j] /= div;
    }
    if (p.weight_scale != 0.0f && p.weight_scale != 1.0f)
      for (int j = 0; j < k; ++j) wt[j] *= p.weight_scale;
  }
}

void Deepseek2Graph::ffn(Engine& e, const GraphFFN& f, const float* x, int n, float* y) {
  const size_t width = static_cast<size_t>(n) * f.gate.rows;
  float* g = grow(t2_, width);
  float* u = grow(t3_, width);
  const GemmOp ops[2] = {{f.gate.data, f.gate.rows, f.gate.row_bytes, f.gate.ggml_type, g},
                         {f.up.data, f.up.rows, f.up.row_bytes, f.up.ggml_type, u}};
  gemm_multi(e, ops, 2, x, n, f.gate.cols);
  silu_mul(g, u, static_cast<int>(width));
  linear(e, f.down, g, n, y);
}

}  // namespace pocketmoe
