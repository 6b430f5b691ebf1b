// Block decoders for Q2_K..Q6_K (layouts: SPECS.md section 4), in the form kfamily.h expects.
#pragma once

#include "simd.h"

namespace pocketmoe::PM_ISA::decode {

using namespace simd;

struct KHead {
  float d;
  float dmin;
  __m256i corr;   // int16 x16, one per 16 weights (see kfamily.h)
  __m256i sc;     // scales as the decoder reads them: int16 for broadcast_i16, or bytes for byte_to_i16
};

// The 8 six-bit scales (bytes 0-7) and 8 six-bit mins (bytes 8-15) of Q4_K / Q5_K from the 12
// packed bytes at s (16 are read, the last 4 ignored): a few shuffles instead of scalar unpacking.
PM_INLINE __m128i scale_min_k4(const uint8_t* s) {
  const __m128i x = load128(s);
  const __m128i x4 = _mm_srli_epi16(x, 4);   // low nibble of each byte = its high nibble
  // Low bits: sc0-3 = s0-3 & 63, sc4-7 = s8-11 & 15, mn0-3 = s4-7 & 63, mn4-7 = s8-11 >> 4.
  const __m128i lo = _mm_and_si128(
      _mm_or_si128(_mm_shuffle_epi8(x, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, -1, -1, -1, -1)),
                   _mm_shuffle_epi8(x4, _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 8, 9, 10, 11))),
      _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15));
  // Bits 4-5 of sc4-7 are bits 6-7 of s0-3; those of mn4-7 are bits 6-7 of s4-7.
  const __m128i hi = _mm_shuffle_epi8(x, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  return _mm_or_si128(lo, _mm_and_si128(_mm_srli_epi16(hi, 2), _mm_set1_epi8(0x30)));
}

// Byte G of each 128-bit half of v, zero-extended to all 8 int16 of that half.
template <int G>
PM_INLINE __m256i byte_to_i16(__m256i v) {
  return _mm256_shuffle_epi8(v, _mm256_set1_epi16(static_cast<int16_t>(0x8000 | G)));
}

// Q4_K, 144 bytes: d, dmin, scales[12], qs[128]; w = d*sc*q - dmin*m, q in 0..15.
struct Q4K {
  static constexpr int kBytes = 144;
  static constexpr bool kCanonical = false;
  static constexpr bool kSigned = false, kOffset = false, kMin = true;
  using Head = KHead;
  // sc: the scale_min_k4 bytes in both halves; corr: each min twice, as int16, shuffled out of them.
  static PM_INLINE Head head(const uint8_t* b) {
    const __m256i sc = _mm256_broadcastsi128_si256(scale_min_k4(b + 4));
    const __m256i mins = _mm256_shuffle_epi8(
        sc, _mm256_setr_epi8(8, -1, 8, -1, 9, -1, 9, -1, 10, -1, 10, -1, 11, -1, 11, -1, 12, -1, 12, -1, 13, -1, 13, -1,
                             14, -1, 14, -1, 15, -1, 15, -1));
    const __m128 dd = _mm_cvtph_ps(_mm_loadu_si32(b));   // d, dmin in one conversion
    return {_mm_cvtss_f32(dd), -_mm_cvtss_f32(_mm_movehdup_ps(dd)), mins, sc};
  }
  template <int G>
  static PM_INLINE __m256i quants(const uint8_t* b, const Head&) {
    const __m256i x = load256(b + 16 + 32 * (G / 2));
    const __m256i m = _mm256_set1_epi8(0x0F);
    return G % 2 == 0 ? _mm256_and_si256(x, m) : _mm256_and_si256(_mm256_srli_epi16(x, 4), m);
  }
  template <int G>
  static PM_INLINE __m256i scales(const uint8_t*, const Head& h) {
    return byte_to_i16<G>(h.sc);
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
    return byte_to_i16<G>(h.sc);
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

// Group G's 2-bit fields of the 64 bytes at qs, as Q2_K, Q3_K (low bits) and TQ2_0 lay them out: weight
// 32G + l is bits 2(G % 4) of byte 32(G / 4) + l.
template <int G>
PM_INLINE __m256i crumbs(const uint8_t* qs) {
  return _mm256_and_si256(_mm256_srli_epi16(load256(qs + 32 * (G / 4)), 2 * (G % 4)), _mm256_set1_epi8(3));
}

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
    return crumbs<G>(b + 16);
  }
  template <int G>
  static PM_INLINE __m256i scales(const uint8_t*, const Head& h) {
    return broadcast_i16<G>(h.sc);
  }
};

// The ternary types, w = d * (t - 1) with t in 0..2 and the fp16 d at byte D after the block's digits:
// weights stored + 1, scale 1 throughout, and corr takes the 1 back out per 16 weights.
template <int D>
struct Ternary {
  static constexpr int kBytes = D + 2;
  static constexpr bool kCanonical = false;
  static constexpr bool kSigned = false, kOffset = true, kMin = false;
  static constexpr bool kUnitScale = true;
  using Head = KHead;
  static PM_INLINE Head head(const uint8_t* b) {
    return {fp16(b + D), 0.0f, _mm256_set1_epi16(-1), _mm256_set1_epi16(1)};
  }
  template <int G>
  static PM_INLINE __m256i scales(const uint8_t*, const Head& h) {
    return h.sc;
  }
};

// TQ2_0, 66 bytes: qs[64] (a 2-bit t per weight, laid out as Q2_K's), d; t = 3 reads as 2, as in ggml.
struct TQ2_0 : Ternary<64> {
  template <int G>
  static PM_INLINE __m256i quants(const uint8_t* b, const Head&) {
    return crumbs<G>(b);
  }
};

// TQ1_0, 54 bytes: qs[48], qh[4] (base-3 digits t, five per qs byte, four per qh byte), d.
// A byte holds its digits as a fixed-point fraction: digit n of byte x is (3 * (x * 3^n mod 256)) >> 8.
// Group G < 5 is digit G of qs[0..31]; groups 5 and 6 are digits 0, 1 and 2, 3 of qs[32..47] (16
// weights each); group 7 is digit 4 of qs[32..47], then digit n of qh[j] as weight 240 + 4n + j.
struct TQ1_0 : Ternary<52> {
  static constexpr int kGemvRows = PM_AVX512 ? 2 : 1;   // driver.h; GEMV 112.5 -> 102 us on Zen 4 (TQ2_0 slower)
  template <int G>
  static PM_INLINE __m256i quants(const uint8_t* b, const Head&) {
    if constexpr (G < 5) {
      return top_digit(times3<G>(load256(b)));
    } else if constexpr (G < 7) {   // digits 2G - 10 and 2G - 9 of qs[32..47], one per 128-bit lane
      const __m256i z = _mm256_broadcastsi128_si256(load128(b + 32));
      return top_digit(_mm256_blend_epi32(times3<2 * G - 10>(z), times3<2 * G - 9>(z), 0xF0));
    } else {   // digit 4 of qs[32..47]; then qh (a dword) with digit n in dword n of the high lane
      const __m256i z = _mm256_setr_m128i(load128(b + 32), _mm_set1_epi32(static_cast<int>(load_u32(b + 48))));
      __m256i y = _mm256_blend_epi32(times3<4>(z), z, 0x10);
      y = _mm256_blend_epi32(y, times3<1>(z), 0x20);
      y = _mm256_blend_epi32(y, times3<2>(z), 0x40);
      return top_digit(_mm256_blend_epi32(y, times3<3>(z), 0x80));
    }
  }

 private:
  // x * 3^N mod 256 per byte, as N steps of y + 2y (shared between groups once inlined).
  template <int N>
  static PM_INLINE __m256i times3(__m256i y) {
    for (int n = 0; n < N; ++n) y = _mm256_add_epi8(_mm256_add_epi8(y, y), y);
    return y;
  }
  // (3y) >> 8 per byte: [y >= 86] + [y >= 171], each as min(y -sat k, 1).
  static PM_INLINE __m256i top_digit(__m256i y) {
    const __m256i one = _mm256_set1_epi8(1);
    return _mm256_add_epi8(_mm256_min_epu8(_mm256_subs_epu8(y, _mm256_set1_epi8(85)), one),
                           _mm256_min_epu8(_mm256_subs_epu8(y, _mm256_set1_epi8(static_cast<char>(170))), one));
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
    return _mm256_or_si256(crumbs<G>(b + 32), move_bit<G, 2>(load256(b)));
  }
  template <int G>
  static PM_INLINE __m256i scales(const uint8_t*, const Head& h) {
    return broadcast_i16<G>(h.sc);
  }
};

}  // namespace pocketmoe::PM_ISA::decode
