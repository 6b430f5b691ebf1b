// Block decoders for Q2_K..Q6_K (layouts: SPECS.md section 4), in the form kfamily.h expects.
#pragma once

#include "simd.h"

namespace pocketmoe::decode {

using namespace simd;

struct KHead {
  float d;
  float dmin;
  __m256i corr;   // int16 x16, one per 16 weights (see kfamily.h)
  __m256i sc;     // int16 scales as broadcast_i16 reads them (see split_scales_i16)
};

// The 8 six-bit scales and 8 six-bit mins of Q4_K / Q5_K, as 8 int16 each.
PM_INLINE void scale_min_k4(const uint8_t* s, __m128i& sc, __m128i& mn) {
  const uint32_t u0 = load_u32(s), u1 = load_u32(s + 4), u2 = load_u32(s + 8);
  const uint32_t sc_lo = u0 & 0x3f3f3f3fu;
  const uint32_t sc_hi = (u2 & 0x0f0f0f0fu) | ((u0 >> 2) & 0x30303030u);
  const uint32_t mn_lo = u1 & 0x3f3f3f3fu;
  const uint32_t mn_hi = ((u2 >> 4) & 0x0f0f0f0fu) | ((u1 >> 2) & 0x30303030u);
  sc = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>((uint64_t{sc_hi} << 32) | sc_lo)));
  mn = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>((uint64_t{mn_hi} << 32) | mn_lo)));
}

// Q4_K, 144 bytes: d, dmin, scales[12], qs[128]; w = d*sc*q - dmin*m, q in 0..15.
struct Q4K {
  static constexpr int kBytes = 144;
  static constexpr bool kCanonical = false;
  static constexpr bool kSigned = false, kOffset = false, kMin = true;
  using Head = KHead;
  static PM_INLINE Head head(const uint8_t* b) {
    __m128i sc, mn;
    scale_min_k4(b + 4, sc, mn);
    return {fp16(b), -fp16(b + 2), duplicate_i16(mn), _mm256_broadcastsi128_si256(sc)};
  }
  template <int G>
  static PM_INLINE __m256i quants(const uint8_t* b, const Head&) {
    const __m256i x = load256(b + 16 + 32 * (G / 2));
    const __m256i m = _mm256_set1_epi8(0x0F);
    return G % 2 == 0 ? _mm256_and_si256(x, m) : _mm256_and_si256(_mm256_srli_epi16(x, 4), m);
  }
  template <int G>
  static PM_INLINE __m256i scales(const uint8_t*, const Head& h) {
    return broadcast_i16<G>(h.sc);
  }
};

// Q5_K, 176 bytes: d, dmin, scales[12], qh[32], qs[128]; bit G of qh[l] is bit 4 of weight 32G+l.
struct Q5K {
  static constexpr int kBytes = 176;
  static constexpr bool kCanonical = false;
  static constexpr bool kSigned = false, kOffset = false, kMin = true;
  using Head = KHead;
  static PM_INLINE Head head(const uint8_t* b) { return Q4K::head(b); }
  template <int G>
  static PM_INLINE __m256i quants(const uint8_t* b, const Head&) {
    const __m256i x = load256(b + 48 + 32 * (G / 2));
    const __m256i m = _mm256_set1_epi8(0x0F);
    const __m256i lo = G % 2 == 0 ? _mm256_and_si256(x, m) : _mm256_and_si256(_mm256_srli_epi16(x, 4), m);
    return _mm256_or_si256(lo, move_bit<G, 4>(load256(b + 16)));
  }
  template <int G>
  static PM_INLINE __m256i scales(const uint8_t*, const Head& h) {
    return broadcast_i16<G>(h.sc);
  }
};

// Q6_K, 210 bytes: ql[128], qh[64], int8 scales[16], d; w = d*sc*(q - 32), q in 0..63.
struct Q6K {
  static constexpr int kBytes = 210;
  static constexpr bool kCanonical = false;
  static constexpr bool kSigned = false, kOffset = true, kMin = false;
  using Head = KHead;
  static PM_INLINE Head head(const uint8_t* b) {
    const __m128i raw = load128(b + 192);
    const __m256i sc = _mm256_cvtepi8_epi16(raw);
    return {fp16(b + 208), 0.0f, _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(sc, 5)),
            split_scales_i16(raw)};
  }
  template <int G>
  static PM_INLINE __m256i quants(const uint8_t* b, const Head&) {
    constexpr int half = G / 4, sub = G % 4;
    const __m256i x = load256(b + 64 * half + 32 * (sub % 2));
    const __m256i m = _mm256_set1_epi8(0x0F);
    const __m256i lo = sub < 2 ? _mm256_and_si256(x, m) : _mm256_and_si256(_mm256_srli_epi16(x, 4), m);
    const __m256i qh = load256(b + 128 + 32 * half);
    __m256i hi;
    if constexpr (sub < 2) {
      hi = _mm256_slli_epi16(qh, 4 - 2 * sub);
    } else if constexpr (sub == 2) {
      hi = qh;
    } else {
      hi = _mm256_srli_epi16(qh, 2);
    }
    return _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
  }
  template <int G>
  static PM_INLINE __m256i scales(const uint8_t*, const Head& h) {
    return broadcast_i16<G>(h.sc);
  }
};

// Q2_K, 84 bytes: scales[16] (low nibble scale, high nibble min), qs[64], d, dmin; q in 0..3.
struct Q2K {
  static constexpr int kBytes = 84;
  static constexpr bool kCanonical = false;
  static constexpr bool kSigned = false, kOffset = false, kMin = true;
  using Head = KHead;
  static PM_INLINE Head head(const uint8_t* b) {
    const __m128i raw = load128(b);
    const __m128i m = _mm_set1_epi8(0x0F);
    const __m256i mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), m));
    return {fp16(b + 80), -fp16(b + 82), mn, split_scales_i16(_mm_and_si128(raw, m))};
  }
  template <int G>
  static PM_INLINE __m256i quants(const uint8_t* b, const Head&) {
    const __m256i x = load256(b + 16 + 32 * (G / 4));
    return _mm256_and_si256(_mm256_srli_epi16(x, 2 * (G % 4)), _mm256_set1_epi8(3));
  }
  template <int G>
  static PM_INLINE __m256i scales(const uint8_t*, const Head& h) {
    return broadcast_i16<G>(h.sc);
  }
};

// Q3_K, 110 bytes: hmask[32], qs[64], scales[12] (16 six-bit, minus 32), d; w = d*sc*(q - 4), q in 0..7.
struct Q3K {
  static constexpr int kBytes = 110;
  static constexpr bool kCanonical = false;
  static constexpr bool kSigned = false, kOffset = true, kMin = false;
  using Head = KHead;
  static PM_INLINE Head head(const uint8_t* b) {
    const uint32_t u0 = load_u32(b + 96), u1 = load_u32(b + 100), u2 = load_u32(b + 104);
    const uint32_t m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
    const uint32_t s0 = (u0 & m4) | ((u2 & m2) << 4);
    const uint32_t s1 = (u1 & m4) | (((u2 >> 2) & m2) << 4);
    const uint32_t s2 = ((u0 >> 4) & m4) | (((u2 >> 4) & m2) << 4);
    const uint32_t s3 = ((u1 >> 4) & m4) | (((u2 >> 6) & m2) << 4);
    const __m128i s = _mm_sub_epi8(_mm_setr_epi32(static_cast<int>(s0), static_cast<int>(s1),
                                                  static_cast<int>(s2), static_cast<int>(s3)),
                                   _mm_set1_epi8(32));
    const __m256i sc = _mm256_cvtepi8_epi16(s);
    return {fp16(b + 108), 0.0f, _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(sc, 2)),
            split_scales_i16(s)};
  }
  template <int G>
  static PM_INLINE __m256i quants(const uint8_t* b, const Head&) {
    const __m256i x = load256(b + 32 + 32 * (G / 4));
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(x, 2 * (G % 4)), _mm256_set1_epi8(3));
    return _mm256_or_si256(lo, move_bit<G, 2>(load256(b)));
  }
  template <int G>
  static PM_INLINE __m256i scales(const uint8_t*, const Head& h) {
    return broadcast_i16<G>(h.sc);
  }
};

}  // namespace pocketmoe::decode
