// DeepSeek-V4's hyper-connection mixing (pocketmoe/ops.h, dsv4.h): small per-token arithmetic that costs a Python
// backend tens of tiny tensor ops a layer. Every product and sum is rounded on its own, in the reference's
// order, so hc_sinkhorn, hc_mix and hc_post are bitwise those of reference_v4.py; hc_pre and hc_head add the
// mixes (the flat norm's squares summed in double over fixed lanes) and a softmax on std::exp, within float
// rounding of it. A row's results never depend on the others'.
#pragma GCC optimize("fp-contract=off")

#include <immintrin.h>

#include <cmath>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

#include "dsv4_parts.h"
#include "pocketmoe/dsv4.h"
#include "pocketmoe/ops.h"

namespace pocketmoe {
namespace {

float* grow(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// y[k] = x[k] * a, 8 lanes at a time (each product rounded on its own, as one by one).
void scaled(const float* x, float a, int d, float* y) {
  const __m256 av = _mm256_set1_ps(a);
  int k = 0;
  for (; k + 8 <= d; k += 8) _mm256_storeu_ps(y + k, _mm256_mul_ps(_mm256_loadu_ps(x + k), av));
  for (; k < d; ++k) y[k] = x[k] * a;
}

// y[k] = y[k] + x[k] * a: the product rounded, then the sum (no fused multiply-add).
void add_scaled(const float* x, float a, int d, float* y) {
  const __m256 av = _mm256_set1_ps(a);
  int k = 0;
  for (; k + 8 <= d; k += 8)
    _mm256_storeu_ps(y + k, _mm256_add_ps(_mm256_loadu_ps(y + k), _mm256_mul_ps(_mm256_loadu_ps(x + k), av)));
  for (; k < d; ++k) {
    const float p = x[k] * a;
    y[k] = y[k] + p;
  }
}

// sigmoid in double, rounded to float (the reference's rowwise(torch.sigmoid, .)).
float sigmoid_d(float z) { return static_cast<float>(1.0 / (1.0 + std::exp(-static_cast<double>(z)))); }

// m [T, rows of fn] = fn . (x / sqrt(mean(x^2) + eps)) over the flattened streams x [T, n*D]; the squares summed
// in double, as rms_norm does.
const float* hc_mixes(const HCSite& s, const float* x, int n_rows, int d) {
  const int f = s.n * d;
  check_weight("hyper-connection fn", *s.fn, 1, s.fn->rows, f);
  static thread_local std::vector<float> normed_, m_;
  float* normed = grow(normed_, static_cast<size_t>(n_rows) * f);
  float* m = grow(m_, static_cast<size_t>(n_rows) * s.fn->rows);
  for (int t = 0; t < n_rows; ++t) {
    const float* xt = x + static_cast<size_t>(t) * f;
    float* yt = normed + static_cast<size_t>(t) * f;
    const double ss = dsv4::sum_squares(xt, f);
    const float scale = 1.0f / std::sqrt(static_cast<float>(ss / f) + s.rms_eps);
    for (int i = 0; i < f; ++i) yt[i] = xt[i] * scale;
  }
  const Weight* ws[1] = {s.fn};
  float* ys[1] = {m};
  linear_multi(ws, 1, normed, n_rows, ys);
  return m;
}

}  // namespace

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
    scaled(xt, wt[0], d, yt);
    for (int i = 1; i < n; ++i) add_scaled(xt + static_cast<size_t>(i) * d, wt[i], d, yt);
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
      scaled(ot, post[static_cast<size_t>(t) * n + j], d, yj);
      for (int i = 0; i < n; ++i)
        add_scaled(xt + static_cast<size_t>(i) * d, ct[static_cast<size_t>(i) * n + j], d, yj);
    }
  }
}

void hc_pre(const HCSite& s, const float* x, int n_rows, int d, float* y, float* post, float* comb) {
  if (n_rows <= 0) return;
  const int n = s.n, rows = (2 + n) * n;
  if (s.fn->rows != rows) throw std::invalid_argument("hc_pre: fn has " + std::to_string(s.fn->rows) +
                                                      " rows, " + std::to_string(n) + " streams need " +
                                                      std::to_string(rows));
  const float* m = hc_mixes(s, x, n_rows, d);
  static thread_local std::vector<float> pre_;
  float* pre = grow(pre_, static_cast<size_t>(n_rows) * n);
  const float* b = s.base;
  for (int t = 0; t < n_rows; ++t) {
    const float* mt = m + static_cast<size_t>(t) * rows;
    for (int i = 0; i < n; ++i) {
      const float zp = mt[i] * s.scale[0] + b[i];
      pre[static_cast<size_t>(t) * n + i] = sigmoid_d(zp) + s.eps;
      const float zq = mt[n + i] * s.scale[1] + b[n + i];
      post[static_cast<size_t>(t) * n + i] = 2.0f * sigmoid_d(zq);
    }
    float* ct = comb + static_cast<size_t>(t) * n * n;
    for (int i = 0; i < n; ++i) {  // softmax over dst of row i
      float* r = ct + static_cast<size_t>(i) * n;
      float mx = -INFINITY;
      for (int j = 0; j < n; ++j) {
        r[j] = mt[2 * n + i * n + j] * s.scale[2] + b[2 * n + i * n + j];
        mx = r[j] > mx ? r[j] : mx;
      }
      float sum = 0.0f;
      for (int j = 0; j < n; ++j) sum = sum + (r[j] = std::exp(r[j] - mx));
      for (int j = 0; j < n; ++j) r[j] = r[j] / sum;
    }
  }
  hc_sinkhorn(comb, n_rows, n, s.iters, s.eps);
  hc_mix(x, pre, n_rows, n, d, y);
}

void hc_head(const HCSite& s, const float* x, int n_rows, int d, float* y) {
  if (n_rows <= 0) return;
  const int n = s.n;
  if (s.fn->rows != n)
    throw std::invalid_argument("hc_head: fn has " + std::to_string(s.fn->rows) + " rows for " + std::to_string(n) +
                                " streams");
  const float* m = hc_mixes(s, x, n_rows, d);
  static thread_local std::vector<float> pre_;
  float* pre = grow(pre_, static_cast<size_t>(n_rows) * n);
  for (size_t i = 0; i < static_cast<size_t>(n_rows) * n; ++i)
    pre[i] = sigmoid_d(m[i] * s.scale[0] + s.base[i % n]) + s.eps;
  hc_mix(x, pre, n_rows, n, d, y);
}

}  // namespace pocketmoe
