#include "pocketmoe/silu.h"

#include <immintrin.h>

#include "simd.h"

namespace pocketmoe {
namespace {

// exp(x) = 2^n * e^r with n = round(x / ln 2), r = x - n ln 2 (ln 2 split in two for precision),
// e^r from its Taylor-like minimax polynomial on [-ln2/2, ln2/2].
__m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2n));
}

__m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

}  // namespace

void silu_mul(float* g, const float* u, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(g + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
  if (i < n) {
    float gt[8] = {}, ut[8] = {};
    for (int j = i; j < n; ++j) gt[j - i] = g[j], ut[j - i] = u[j];
    _mm256_storeu_ps(gt, silu_mul8(_mm256_loadu_ps(gt), _mm256_loadu_ps(ut)));
    for (int j = i; j < n; ++j) g[j] = gt[j - i];
  }
}

float exp_shifted(float* x, int n, float shift) {
  const __m256 sh = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), sh));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = simd::hsum(acc);
  if (i < n) {
    float t[8] = {};
    for (int j = i; j < n; ++j) t[j - i] = x[j];
    _mm256_storeu_ps(t, exp8(_mm256_sub_ps(_mm256_loadu_ps(t), sh)));
    for (int j = i; j < n; ++j) sum += x[j] = t[j - i];
  }
  return sum;
}

}  // namespace pocketmoe
