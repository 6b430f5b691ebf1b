// AVX2 helpers shared by the kernels.
//
// The kernel headers (this one, driver.h, the decoders and the families) are compiled once per
// instruction set: by default for the AVX2 baseline, and again by isa_avxvnni.cpp and
// isa_avx512vnni.cpp under a target pragma, with PM_ISA naming the set. Everything they define lives
// in namespace pocketmoe::PM_ISA, so no inline function compiled for a wider set can be merged by
// the linker into the AVX2 path of a CPU that lacks it.
#pragma once

#ifndef PM_ISA
#define PM_ISA avx2
#endif
// 1 where the set has VPDPBUSD / VPDPWSSD (PM_DPBUSD / PM_DPWSSD name the 256-bit intrinsics).
#ifndef PM_VNNI
#define PM_VNNI 0
#endif
// 1 where the set has AVX-512 F/BW/DQ/VL: the repacked (prefill) tiles then use 512-bit vectors.
#ifndef PM_AVX512
#define PM_AVX512 0
#endif

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#define PM_INLINE inline __attribute__((always_inline))

namespace pocketmoe::PM_ISA::simd {

// Whether this build of the kernels has the VNNI dot-product instructions.
constexpr bool kVnni = PM_VNNI != 0;

template <class F, int... I>
PM_INLINE void static_for_impl(F& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}

// f(std::integral_constant<int, i>) for i = 0..N-1, unrolled; i is a compile-time constant.
template <int N, class F>
PM_INLINE void static_for(F&& f) {
  static_for_impl(f, std::make_integer_sequence<int, N>{});
}

PM_INLINE uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

PM_INLINE uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// One IEEE half / bfloat16 value, given as its bits, as a float.
PM_INLINE float f16_value(uint16_t bits) { return _cvtsh_ss(bits); }
PM_INLINE float bf16_value(uint16_t bits) {
  const uint32_t wide = uint32_t{bits} << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

PM_INLINE float fp16(const uint8_t* p) { return f16_value(load_u16(p)); }

// 8 IEEE halves / 8 bfloat16 values at p as floats (a bfloat16 is the high 16 bits of its float).
PM_INLINE __m256 load8_f16(const void* p) { return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p))); }
PM_INLINE __m256 load8_bf16(const void* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

PM_INLINE __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
PM_INLINE __m128i load128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
PM_INLINE void store256(void* p, __m256i v) { _mm256_storeu_si256(static_cast<__m256i*>(p), v); }

// 16 bytes at p: low nibbles in the low half, high nibbles in the high half (one variable shift:
// 0 bits in the low half, 4 in the high half; cheaper than shift + blend).
PM_INLINE __m256i load_nibbles(const uint8_t* p) {
  const __m256i x = _mm256_broadcastsi128_si256(load128(p));
  return _mm256_and_si256(_mm256_srlv_epi32(x, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0F));
}

// v: 8 int16 in each 128-bit half; returns element G of each half across that half.
template <int G>
PM_INLINE __m256i broadcast_i16(__m256i v) {
  return _mm256_shuffle_epi8(v, _mm256_set1_epi16(static_cast<int16_t>(((2 * G + 1) << 8) | (2 * G))));
}

// 16 int8 scales (one per 16 weights) as int16, even-indexed ones in the low half and odd-indexed
// ones in the high half, so that broadcast_i16<G> yields scale 2G for weights 0-15 of group G and
// scale 2G+1 for weights 16-31.
PM_INLINE __m256i split_scales_i16(__m128i s8) {
  return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(s8, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)));
}

// v: 8 int16 (one per 32 values); returns 16 int16 with each value twice, matching 16 bsums.
PM_INLINE __m256i duplicate_i16(__m128i v) {
  return _mm256_set_m128i(_mm_unpackhi_epi16(v, v), _mm_unpacklo_epi16(v, v));
}

// Bit B of every byte moved to bit TO; all other bits cleared.
template <int B, int TO>
PM_INLINE __m256i move_bit(__m256i x) {
  const __m256i mask = _mm256_set1_epi8(static_cast<char>(1 << TO));
  if constexpr (B == TO) {
    return _mm256_and_si256(x, mask);
  } else if constexpr (B < TO) {
    return _mm256_and_si256(_mm256_slli_epi16(x, TO - B), mask);
  } else {
    return _mm256_and_si256(_mm256_srli_epi16(x, B - TO), mask);
  }
}

// Raw weights stream from DRAM once per call and the hardware prefetcher alone falls behind, so
// the 256-value kernels ask for the bytes this far ahead (the 32-value ones: see lfamily.h).
constexpr int kPrefetchBytes = 2048;

PM_INLINE void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }
PM_INLINE void prefetch_l2(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }

// An empty asm the value must pass through in a vector register: a barrier to the compiler's
// reassociation of integer sums across it (it emits no instruction). "v": any vector register,
// ymm16-31 included where the build has AVX-512.
PM_INLINE void keep_in_register(__m256i& v) { asm("" : "+v"(v)); }
#if PM_AVX512_EMULATED
PM_INLINE void keep_in_register(__m512i& v) { asm("" : "+m"(v)); }   // SIMDe's type is no register
#elif PM_AVX512
PM_INLINE void keep_in_register(__m512i& v) { asm("" : "+v"(v)); }
#endif

// Sum of 8 float lanes in one fixed order.
PM_INLINE float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The sums of the eight int32 lanes of a, b, c and d (exact integers, wrapping like vpaddd), as
// lanes 0-3.
PM_INLINE __m128i hsum4_epi32(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
  return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

PM_INLINE float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// [a, b, c, d]: the four table entries of an IQ group. AVX-512 builds take them as four broadcast loads, three
// masked, instead of two vmovq, two vpinsrq and a vinserti128 (Zen 4 bench_kernels GEMV 1536 x 3072, one thread:
// IQ2_XXS 250 -> 242 us, IQ2_S 274 -> 268; IQ2_XS, IQ1_S and IQ1_M within 1%).
PM_INLINE __m256i set_u64x4(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
#if PM_AVX512 && !defined(PM_AVX512_EMULATED)
  __m256i v = _mm256_set1_epi64x(static_cast<int64_t>(a));
  v = _mm256_mask_set1_epi64(v, 0x2, static_cast<int64_t>(b));
  v = _mm256_mask_set1_epi64(v, 0x4, static_cast<int64_t>(c));
  return _mm256_mask_set1_epi64(v, 0x8, static_cast<int64_t>(d));
#else
  return _mm256_set_epi64x(static_cast<int64_t>(d), static_cast<int64_t>(c), static_cast<int64_t>(b),
                           static_cast<int64_t>(a));
#endif
}

#if PM_VNNI
// acc + the sums of four u8 x s8 products per int32 lane (exact, wrapping like vpaddd).
PM_INLINE __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return PM_DPBUSD(acc, u, s); }
// acc + the sums of two int16 x int16 products per int32 lane: vpmaddwd then vpaddd, in one step.
PM_INLINE __m256i dpwssd(__m256i acc, __m256i a, __m256i b) { return PM_DPWSSD(acc, a, b); }
#endif

}  // namespace pocketmoe::PM_ISA::simd

// The AVX2 build's helpers, for the code compiled only once (activation quantizers, the graph).
namespace pocketmoe {
namespace simd = PM_ISA::simd;
}
