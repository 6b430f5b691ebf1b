// Norms and the residual updates around them (pocketmoe/ops.h).
#include <cmath>

#include "pocketmoe/ops.h"

namespace pocketmoe {
namespace {

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

}  // namespace

void rms_norm(const float* x, const float* w, int n_rows, int d, float eps, float* y) {
  for (int t = 0; t < n_rows; ++t) rms_norm_row(x + static_cast<size_t>(t) * d, w, d, eps, y + static_cast<size_t>(t) * d);
}

void add_rms_norm(float* x, const float* add, const float* w, int n_rows, int d, float eps, float* y) {
  const size_t n = static_cast<size_t>(n_rows) * d;
  for (size_t i = 0; i < n; ++i) x[i] += add[i];
  rms_norm(x, w, n_rows, d, eps, y);
}

void finalize(float* x, const float* a, const float* b, const float* norm_w, int n_rows, int d, float eps, float* y) {
  const size_t n = static_cast<size_t>(n_rows) * d;
  if (b != nullptr) {
    for (size_t i = 0; i < n; ++i) x[i] += a[i] + b[i];
  } else {
    for (size_t i = 0; i < n; ++i) x[i] += a[i];
  }
  if (norm_w != nullptr) rms_norm(x, norm_w, n_rows, d, eps, y);
}

}  // namespace pocketmoe
