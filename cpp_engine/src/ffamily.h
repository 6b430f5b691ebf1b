// Float dot products of F32 / F16 / BF16 weights with float activations (no activation rounding).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "simd.h"

namespace pocketmoe::PM_ISA::ffamily {

using namespace simd;

struct Family {
  static constexpr int kBlockValues = 1;
  static constexpr bool kRepack = false;
  using Act = const float*;
  struct CanonBlock {};

  static PM_INLINE Act act_view(const uint8_t* row, int) { return reinterpret_cast<const float*>(row); }

  // Sums 8 lanes of fma over the first cols - cols % 8 values, then the rest one by one.
  template <class Dec, int R, int C>
  static __attribute__((noinline)) void dot_tile(const uint8_t* w, size_t w_stride, const Act* a, int cols,
                                                 float* out, ptrdiff_t out_stride) {
    const int n8 = cols - cols % 8;
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int i = 0; i < n8; i += 8) {
      for (int r = 0; r < R; ++r) {
        const __m256 wv = Dec::load8(w + r * w_stride, i);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(a[c] + i), acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) {
        float s = hsum(acc[r][c]);
        for (int i = n8; i < cols; ++i) s = std::fma(Dec::load1(w + r * w_stride, i), a[c][i], s);
        out[c * out_stride + r] = s;
      }
    }
  }
};

}  // namespace pocketmoe::PM_ISA::ffamily
