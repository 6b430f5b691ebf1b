// Expert routing (pocketmoe/ops.h): router GEMV, gating, selection bias, group limit, top-k, weights.
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "pocketmoe/ops.h"
#include "../workspace.h"

namespace pocketmoe {

void route(const RouteParams& p, const float* x, int n, const Weight& gate, const float* bias, int32_t* ids,
           float* weights) {
  const int ne = p.n_experts, k = p.top_k;
  // Memory safety only; the meaning of the parameters is checked where they are made (RouterConfig).
  if (ne <= 0 || k <= 0 || k > ne || p.n_groups <= 0 || ne % p.n_groups ||
      (p.n_groups > 1 && (p.groups_used <= 0 || p.groups_used > p.n_groups)))
    throw std::invalid_argument("route: " + std::to_string(ne) + " experts, top-" + std::to_string(k) + ", " +
                                std::to_string(p.groups_used) + " of " + std::to_string(p.n_groups) + " groups");
  check_weight("ffn_gate_inp", gate, 1, ne, gate.cols);
  if (n <= 0) return;
  static thread_local std::vector<float> logits_, scratch_;
  if (logits_.size() < static_cast<size_t>(n) * ne) logits_.resize(static_cast<size_t>(n) * ne);
  {
    std::unique_lock<std::mutex> lock;
    gemm(acquire_runtime(lock), gate.data, ne, gate.row_bytes, gate.ggml_type, x, n, gate.cols, logits_.data());
  }
  if (scratch_.size() < static_cast<size_t>(2 * ne + p.n_groups)) scratch_.resize(2 * ne + p.n_groups);
  float* probs = scratch_.data();
  float* select = probs + ne;
  float* group_score = select + ne;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float pos_inf = std::numeric_limits<float>::infinity();
  for (int t = 0; t < n; ++t) {
    const float* lg = logits_.data() + static_cast<size_t>(t) * ne;
    if (p.gating == p.gating_sigmoid) {
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
          if (group_score[g] != pos_inf && (best < 0 || group_score[g] > group_score[best])) best = g;
        group_score[best] = pos_inf;
      }
      for (int g = 0; g < p.n_groups; ++g)
        if (group_score[g] != pos_inf) std::fill(select + g * per, select + (g + 1) * per, neg_inf);
    }
    int32_t* id = ids + static_cast<size_t>(t) * k;
    float* wt = weights + static_cast<size_t>(t) * k;
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
    if (p.norm) {
      const float div = std::max(wsum, p.weight_sum_min);
      for (int j = 0; j < k; ++j) wt[j] /= div;
    }
    if (p.scale != 0.0f && p.scale != 1.0f)
      for (int j = 0; j < k; ++j) wt[j] *= p.scale;
  }
}

}  // namespace pocketmoe
