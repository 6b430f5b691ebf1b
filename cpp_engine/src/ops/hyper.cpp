// DeepSeek-V4's hyper-connection mixing (pocketmoe/ops.h): small per-token arithmetic that costs a Python
// backend tens of tiny tensor ops a layer. Every product and sum is rounded on its own, in the reference's
// order, so the results are bitwise those of reference_v4.py (and a row's never depend on the others').
#pragma GCC optimize("fp-contract=off")

#include <cstddef>

#include "pocketmoe/ops.h"

namespace pocketmoe {

void hc_sinkhorn(float* comb, int n_rows, int n, int iters, float eps) {
  const size_t nn = static_cast<size_t>(n) * n;
  auto columns = [&](float* c) {  // c[i, j] /= sum_i c[i, j] + eps
    for (int j = 0; j < n; ++j) {
      float s = c[j];
      for (int i = 1; i < n; ++i) s = s + c[static_cast<size_t>(i) * n + j];
      const float den = s + eps;
      for (int i = 0; i < n; ++i) c[static_cast<size_t>(i) * n + j] = c[static_cast<size_t>(i) * n + j] / den;
    }
  };
  auto rows = [&](float* c) {  // c[i, j] /= sum_j c[i, j] + eps
    for (int i = 0; i < n; ++i) {
      float* r = c + static_cast<size_t>(i) * n;
      float s = r[0];
      for (int j = 1; j < n; ++j) s = s + r[j];
      const float den = s + eps;
      for (int j = 0; j < n; ++j) r[j] = r[j] / den;
    }
  };
  for (int t = 0; t < n_rows; ++t) {
    float* c = comb + static_cast<size_t>(t) * nn;
    for (size_t k = 0; k < nn; ++k) c[k] = c[k] + eps;
    columns(c);
    for (int it = 1; it < iters; ++it) {
      rows(c);
      columns(c);
    }
  }
}

void hc_mix(const float* x, const float* w, int n_rows, int n, int d, float* y) {
  for (int t = 0; t < n_rows; ++t) {
    const float* xt = x + static_cast<size_t>(t) * n * d;
    const float* wt = w + static_cast<size_t>(t) * n;
    float* yt = y + static_cast<size_t>(t) * d;
    for (int k = 0; k < d; ++k) yt[k] = xt[k] * wt[0];
    for (int i = 1; i < n; ++i) {
      const float* xi = xt + static_cast<size_t>(i) * d;
      for (int k = 0; k < d; ++k) {
        const float p = xi[k] * wt[i];
        yt[k] = yt[k] + p;
      }
    }
  }
}

void hc_post(const float* out, const float* x, const float* post, const float* comb, int n_rows, int n, int d,
             float* y) {
  for (int t = 0; t < n_rows; ++t) {
    const float* ot = out + static_cast<size_t>(t) * d;
    const float* xt = x + static_cast<size_t>(t) * n * d;
    const float* ct = comb + static_cast<size_t>(t) * n * n;
    for (int j = 0; j < n; ++j) {
      float* yj = y + (static_cast<size_t>(t) * n + j) * d;
      const float pj = post[static_cast<size_t>(t) * n + j];
      for (int k = 0; k < d; ++k) yj[k] = ot[k] * pj;
      for (int i = 0; i < n; ++i) {
        const float* xi = xt + static_cast<size_t>(i) * d;
        const float cij = ct[static_cast<size_t>(i) * n + j];
        for (int k = 0; k < d; ++k) {
          const float p = xi[k] * cij;
          yj[k] = yj[k] + p;
        }
      }
    }
  }
}

}  // namespace pocketmoe
