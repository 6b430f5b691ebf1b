// SIMDe's portable AVX-512 (https://github.com/simd-everywhere/simde) under the Intel names, for the
// test builds of the 512-bit kernels on CPUs without AVX-512 (isa_avx512_emu.cpp, isa_amx_emu.cpp),
// with the few intrinsics Debian's SIMDe 0.7 lacks or misdeclares filled in.
#pragma once

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
// Debian's SIMDe 0.7 defines this alias with four parameters; the intrinsic has two.
#undef _mm512_madd_epi16
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16(a, b)
// ... and has no vcvtdq2ps on 512 bits: the same conversion, lane by lane, on two 256-bit halves.
inline simde__m512 pm_cvtepi32_ps(simde__m512i v) {
  const __m256 lo = _mm256_cvtepi32_ps(simde_mm512_castsi512_si256(v));
  const __m256 hi = _mm256_cvtepi32_ps(simde_mm512_extracti64x4_epi64(v, 1));
  return simde_mm512_insertf32x8(simde_mm512_castps256_ps512(lo), hi, 1);
}
#define _mm512_cvtepi32_ps(v) pm_cvtepi32_ps(v)
// ... nor vshufi64x2 on 512 bits: 128-bit lanes 0-1 of the result from a, 2-3 from b, each chosen by
// two bits of imm (Intel SDM).
inline simde__m512i pm_shuffle_i64x2(simde__m512i a, simde__m512i b, int imm) {
  alignas(64) uint64_t x[8], y[8], r[8];
  simde_mm512_store_si512(x, a);
  simde_mm512_store_si512(y, b);
  for (int i = 0; i < 4; ++i) {
    const uint64_t* src = i < 2 ? x : y;
    const int lane = (imm >> (2 * i)) & 3;
    r[2 * i] = src[2 * lane];
    r[2 * i + 1] = src[2 * lane + 1];
  }
  return simde_mm512_load_si512(r);
}
#define _mm512_shuffle_i64x2(a, b, imm) pm_shuffle_i64x2(a, b, imm)
// ... nor vpmovzxbw on 512 bits: sign extension with the high bytes masked off is the same.
#define _mm512_cvtepu8_epi16(v) simde_mm512_and_si512(simde_mm512_cvtepi8_epi16(v), simde_mm512_set1_epi16(0xFF))
// ... nor the masked byte subtraction on 256 bits: lane i is a - b where bit i of k is set, else src's.
inline __m256i pm_mask_sub_epi8(__m256i src, uint32_t k, __m256i a, __m256i b) {
  alignas(32) uint8_t r[32], x[32], y[32];
  _mm256_store_si256(reinterpret_cast<__m256i*>(r), src);
  _mm256_store_si256(reinterpret_cast<__m256i*>(x), a);
  _mm256_store_si256(reinterpret_cast<__m256i*>(y), b);
  for (int i = 0; i < 32; ++i)
    if ((k >> i) & 1) r[i] = static_cast<uint8_t>(x[i] - y[i]);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(r));
}
#define _mm256_mask_sub_epi8(src, k, a, b) pm_mask_sub_epi8(src, k, a, b)
