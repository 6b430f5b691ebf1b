// Sublayers (pocketmoe/ops.h): the ops composed in the order a residual block runs them, one call each.
#include <vector>

#include "pocketmoe/ops.h"
#include "pocketmoe/silu.h"
#include "../workspace.h"

namespace pocketmoe {
namespace {

float* grow(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

void close_residual(const Residual& res, const float* a, const float* b, int n, int d) {
  finalize(res.x, a, b, res.norm_w, n, d, res.eps, res.next);
}

}  // namespace

void mla_sublayer(const MLAShape& s, const MLAWeights& w, const float* xn, const float* cos2, const float* sin2,
                  void* cache, const KVLayout& layout, int n, const Residual& res) {
  if (n <= 0) return;
  static thread_local std::vector<float> q_, qa_, kv_, o_, y_;
  const int d = w.wkv_a->cols;
  const size_t qw = static_cast<size_t>(s.n_head) * (s.qk_nope + s.qk_rope);
  float* q = grow(q_, n * qw);
  float* kv = grow(kv_, static_cast<size_t>(n) * (s.kv_lora + s.qk_rope));
  if (w.wq != nullptr) {
    const Weight* ws[2] = {w.wq, w.wkv_a};
    float* ys[2] = {q, kv};
    linear_multi(ws, 2, xn, n, ys);
  } else {
    float* qa = grow(qa_, static_cast<size_t>(n) * w.wq_a->rows);
    const Weight* ws[2] = {w.wq_a, w.wkv_a};
    float* ys[2] = {qa, kv};
    linear_multi(ws, 2, xn, n, ys);
    rms_norm(qa, w.q_a_norm, n, w.wq_a->rows, s.eps, qa);
    const Weight* wb[1] = {w.wq_b};
    float* yb[1] = {q};
    linear_multi(wb, 1, qa, n, yb);
  }
  float* o = grow(o_, static_cast<size_t>(n) * s.n_head * s.v_head);
  mla_attention(s, q, kv, w.kv_a_norm, *w.k_b, *w.v_b, cos2, sin2, cache, layout, n, o);
  float* y = grow(y_, static_cast<size_t>(n) * d);
  const Weight* wo[1] = {w.wo};
  float* yo[1] = {y};
  linear_multi(wo, 1, o, n, yo);
  close_residual(res, y, nullptr, n, d);
}

void gqa_sublayer(const GQAShape& s, const GQAWeights& w, const float* xn, const float* cos2, const float* sin2,
                  void* cache, const KVLayout& layout, int n, const Residual& res) {
  if (n <= 0) return;
  static thread_local std::vector<float> q_, k_, v_, qw_, o_, y_;
  const int d = w.wq->cols;
  const size_t nq = static_cast<size_t>(n) * s.n_head * s.head_dim;
  float* q = grow(q_, nq);
  float* k = grow(k_, static_cast<size_t>(n) * s.n_head_kv * s.head_dim);
  float* v = grow(v_, static_cast<size_t>(n) * s.n_head_kv * s.v_dim);
  const Weight* ws[3] = {w.wq, w.wk, w.wv};
  float* ys[3] = {q, k, v};
  linear_multi(ws, 3, xn, n, ys);
  if (w.q_norm != nullptr) rms_norm(q, w.q_norm, n, s.n_head * s.head_dim, w.eps, q);
  if (w.k_norm != nullptr) rms_norm(k, w.k_norm, n, s.n_head_kv * s.head_dim, w.eps, k);
  float* o = grow(o_, static_cast<size_t>(n) * s.n_head * s.v_dim);
  gqa_attention(s, q, k, v, cos2, sin2, cache, layout, n, grow(qw_, nq), o);
  float* y = grow(y_, static_cast<size_t>(n) * d);
  const Weight* wo[1] = {w.wo};
  float* yo[1] = {y};
  linear_multi(wo, 1, o, n, yo);
  close_residual(res, y, nullptr, n, d);
}

void ffn_sublayer(const Weight& gate, const Weight& up, const Weight& down, const float* xn, int n,
                  const Residual& res) {
  if (n <= 0) return;
  static thread_local std::vector<float> y_;
  float* y = grow(y_, static_cast<size_t>(n) * down.rows);
  gated_ffn(gate, up, down, xn, n, y);
  close_residual(res, y, nullptr, n, down.rows);
}

void moe_sublayer(const MoEParts& m, const float* xn, int n, int hidden, const Residual& res) {
  if (n <= 0) return;
  static thread_local std::vector<int32_t> ids_;
  static thread_local std::vector<float> weights_, routed_, shared_;
  const size_t nk = static_cast<size_t>(n) * m.route.top_k;
  if (ids_.size() < nk) ids_.resize(nk);
  float* wts = grow(weights_, nk);
  route(m.route, xn, n, *m.gate_inp, m.bias, ids_.data(), wts);
  float* routed = grow(routed_, static_cast<size_t>(n) * hidden);
  // The shared experts run inside the routed experts' two dispatches.
  float* shared = m.shared_gate != nullptr ? grow(shared_, static_cast<size_t>(n) * hidden) : nullptr;
  const SharedFFN sh{m.shared_gate, m.shared_up, m.shared_down, shared};
  {
    std::unique_lock<std::mutex> lock;
    moe_forward(acquire_runtime(lock), xn, n, hidden, ids_.data(), wts, m.route.top_k, m.gate, m.up, m.down,
                m.route.n_experts, m.ffn, routed, 0.0f, shared != nullptr ? &sh : nullptr);
  }
  close_residual(res, routed, shared, n, hidden);
}

}  // namespace pocketmoe
