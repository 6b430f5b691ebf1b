// DeepSeek-V4's MoE sublayer (dsv4.h) in one call: sqrt(softplus) routing by the token's hash row or the biased
// top-k, the routed experts (moe_forward, clamped SwiGLU) and the clamped shared expert. The gating and the shared
// expert's SiLU run in double and round to float, as the reference's rowwise ops do.
#pragma GCC optimize("fp-contract=off")

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "pocketmoe/dsv4.h"
#include "../workspace.h"

namespace pocketmoe {
namespace {

float* grow(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

[[noreturn]] void fail(const std::string& what) { throw std::invalid_argument("dsv4 moe: " + what); }

// torch.nn.functional.softplus (beta 1, threshold 20) in double.
double softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }

// The router's ids [T, K] and weights [T, K] from its logits [T, E] (made the probabilities in place).
void route(const DSV4MoE& m, float* probs, const int64_t* tokens, int n, int32_t* ids, float* wts) {
  const int ne = m.n_experts, k = m.top_k;
  static thread_local std::vector<float> select_;
  for (size_t i = 0; i < static_cast<size_t>(n) * ne; ++i)
    probs[i] = std::sqrt(static_cast<float>(softplus(static_cast<double>(probs[i]))));
  float* select = grow(select_, ne);
  for (int t = 0; t < n; ++t) {
    const float* pt = probs + static_cast<size_t>(t) * ne;
    int32_t* id = ids + static_cast<size_t>(t) * k;
    float* wt = wts + static_cast<size_t>(t) * k;
    if (m.tid2eid != nullptr) {
      std::copy(m.tid2eid + tokens[t] * k, m.tid2eid + (tokens[t] + 1) * k, id);
    } else {
      for (int i = 0; i < ne; ++i) select[i] = pt[i] + m.bias[i];
      for (int j = 0; j < k; ++j) {  // descending; ties: the lower id
        int best = -1;
        for (int i = 0; i < ne; ++i) {
          bool taken = false;
          for (int c = 0; c < j; ++c) taken |= id[c] == i;
          if (!taken && (best < 0 || select[i] > select[best])) best = i;
        }
        id[j] = best;
      }
    }
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) sum = sum + (wt[j] = pt[id[j]]);
    if (m.norm) {
      const float div = std::max(sum, m.weight_sum_min);
      for (int j = 0; j < k; ++j) wt[j] = wt[j] / div;
    }
    if (m.scale != 0.0f && m.scale != 1.0f)
      for (int j = 0; j < k; ++j) wt[j] = wt[j] * m.scale;
  }
}

}  // namespace

void dsv4_moe(const DSV4MoE& m, const float* x, const int64_t* tokens, int n, float* y) {
  const int ne = m.n_experts, k = m.top_k, dm = m.gate->cols;
  if (ne <= 0 || k <= 0 || k > ne) fail(std::to_string(ne) + " experts, top-" + std::to_string(k));
  check_weight("ffn_gate_inp", *m.gate, 1, ne, dm);
  if ((m.tid2eid == nullptr) == (m.bias == nullptr)) fail("a layer routes by its tid2eid table or its bias, not both");
  if (n <= 0) return;
  if (m.tid2eid != nullptr)
    for (int t = 0; t < n; ++t) {
      if (tokens[t] < 0 || tokens[t] >= m.vocab)
        fail("token id " + std::to_string(tokens[t]) + " is outside the hash table of " + std::to_string(m.vocab));
      for (int j = 0; j < k; ++j)
        if (m.tid2eid[tokens[t] * k + j] < 0 || m.tid2eid[tokens[t] * k + j] >= ne)
          fail("the hash table sends token " + std::to_string(tokens[t]) + " to a missing expert");
    }
  const int f = m.shared_gate ? m.shared_gate->rows : 0;
  if (m.shared_gate != nullptr) {
    check_weight("ffn_up_shexp", *m.shared_up, 1, f, dm);
    check_weight("ffn_down_shexp", *m.shared_down, 1, dm, f);
  }
  static thread_local std::vector<int32_t> ids_;
  static thread_local std::vector<float> logits_, wts_, gate_, up_;
  const size_t nk = static_cast<size_t>(n) * k;
  if (ids_.size() < nk) ids_.resize(nk);
  float* wts = grow(wts_, nk);
  float* logits = grow(logits_, static_cast<size_t>(n) * ne);
  float* g = grow(gate_, static_cast<size_t>(n) * f);
  float* u = grow(up_, static_cast<size_t>(n) * std::max(f, dm));
  {  // one dispatch for what reads x: the router and the shared expert's gate and up
    const Weight* ws[3] = {m.gate, m.shared_gate, m.shared_up};
    float* ys[3] = {logits, g, u};
    linear_multi(ws, m.shared_gate ? 3 : 1, x, n, ys);
  }
  route(m, logits, tokens, n, ids_.data(), wts);
  const float lim = m.shared_limit;
  for (size_t i = 0; m.shared_gate != nullptr && i < static_cast<size_t>(n) * f; ++i) {
    float a = g[i], b = u[i];
    if (lim > 0.0f) a = std::min(a, lim), b = std::min(std::max(b, -lim), lim);
    const double ad = a;
    g[i] = static_cast<float>(ad / (1.0 + std::exp(-ad))) * b;
  }
  // The shared expert's down runs inside the routed experts' down dispatch, into u.
  SharedFFN shared{nullptr, nullptr, m.shared_down, u, g};
  {
    std::unique_lock<std::mutex> lock;
    moe_forward(acquire_runtime(lock), x, n, dm, ids_.data(), wts, k, m.gate_e, m.up, m.down, ne, m.ffn, y, m.limit,
                m.shared_gate != nullptr ? &shared : nullptr);
  }
  if (m.shared_gate == nullptr) return;
  for (size_t i = 0; i < static_cast<size_t>(n) * dm; ++i) y[i] = y[i] + u[i];
}

}  // namespace pocketmoe
