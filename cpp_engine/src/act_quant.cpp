#include "pocketmoe/act_quant.h"

#include <cmath>
#include <cstring>

#include "simd.h"

namespace pocketmoe {
namespace {

using namespace simd;

// Rounds n (a multiple of 32) values x * inv_d to int8 (|q| <= 127 since |x| * inv_d <= 127).
void round_to_int8(const float* x, int n, float inv_d, int8_t* q) {
  const __m256 id = _mm256_set1_ps(inv_d);
  for (int i = 0; i < n; i += 32) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), id));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), id));
    const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 16), id));
    const __m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 24), id));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    store256(q + i, _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
}

float abs_max(const float* x, int n) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  return hmax(m);
}

// One block of n values: returns its scale d and writes q.
float quantize_block(const float* x, int n, int8_t* q) {
  const float amax = abs_max(x, n);
  if (!(amax > 0.0f)) {
    std::memset(q, 0, n);
    return 0.0f;
  }
  round_to_int8(x, n, 127.0f / amax, q);
  return amax / 127.0f;
}

// The sum of 16 quantized values: Q8_K stores one per 16, Q8_0 one per 16 and one per block of 32.
int16_t sum16(const int8_t* q) {
  int s = 0;
  for (int j = 0; j < 16; ++j) s += q[j];
  return static_cast<int16_t>(s);
}

}  // namespace

void quantize_act_blocks(ActFormat format, const float* src, int cols, int block_begin, int block_end,
                         uint8_t* row) {
  const int bv = act_block_values(format);
  if (format == ActFormat::kF32) {
    std::memcpy(reinterpret_cast<float*>(row) + block_begin, src, 4 * static_cast<size_t>(block_end - block_begin));
    return;
  }
  const int nb = cols / bv;
  auto* qs = reinterpret_cast<int8_t*>(row);
  auto* d = reinterpret_cast<float*>(row + cols);
  auto* scaled_sums = reinterpret_cast<float*>(row + cols + 4 * nb);   // Q8_0 only
  auto* sums = reinterpret_cast<int16_t*>(row + cols + (format == ActFormat::kQ8_0 ? 8 : 4) * nb);
  auto* half_sums = reinterpret_cast<int16_t*>(row + cols + 10 * nb);   // Q8_0 only: per 16 values
  for (int b = block_begin; b < block_end; ++b) {
    const float* x = src + static_cast<ptrdiff_t>(b - block_begin) * bv;
    int8_t* q = qs + static_cast<ptrdiff_t>(b) * bv;
    const float d32 = quantize_block(x, bv, q);
    d[b] = d32;
    if (format == ActFormat::kQ8_K) {
      for (int i = 0; i < bv / 16; ++i) sums[b * (bv / 16) + i] = sum16(q + 16 * i);
      continue;
    }
    // llama.cpp's block_q8_0 stores its scale as fp16 (the values are rounded with the fp32 one): the dot
    // products then multiply by that fp16 value, and so do ours. Its block_q8_1 (the activations of Q4_1 /
    // Q5_1) also stores s = fp16(d32 * sum of q), which the min terms multiply; ours keeps the fp32 product
    // where fp16 would overflow to inf.
    d[b] = _cvtsh_ss(_cvtss_sh(d32, _MM_FROUND_TO_NEAREST_INT));
    half_sums[2 * b] = sum16(q);
    half_sums[2 * b + 1] = sum16(q + 16);
    sums[b] = static_cast<int16_t>(half_sums[2 * b] + half_sums[2 * b + 1]);
    const float s = d32 * static_cast<float>(sums[b]);
    scaled_sums[b] = std::fabs(s) > 65504.0f ? s : _cvtsh_ss(_cvtss_sh(s, _MM_FROUND_TO_NEAREST_INT));
  }
}

void dequantize_act_row(ActFormat format, const uint8_t* row, int cols, float* dst) {
  if (format == ActFormat::kF32) {
    std::memcpy(dst, row, 4 * static_cast<size_t>(cols));
    return;
  }
  const int bv = act_block_values(format);
  const auto* qs = reinterpret_cast<const int8_t*>(row);
  const auto* d = reinterpret_cast<const float*>(row + cols);
  for (int i = 0; i < cols; ++i) dst[i] = d[i / bv] * qs[i];
}

}  // namespace pocketmoe
