// Block decoders for 32-value types (layouts: SPECS.md section 4), as lfamily.h expects, and the
// float weight loaders for ffamily.h.
#pragma once

#include "simd.h"

namespace pocketmoe::PM_ISA::decode {

using namespace simd;

// Byte i of the result is 0xFF when bit i of the 32 bits at p is set, else 0.
PM_INLINE __m256i expand_bits(const uint8_t* p) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(load_u32(p))),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
}

// Byte i of the result is `value` when bit i of the 32 bits at p is set, else 0. AVX-512 builds move the bits
// into a mask register and select with it: two micro-ops instead of expand_bits' five and an AND.
PM_INLINE __m256i bits_to_bytes(const uint8_t* p, char value) {
#if PM_AVX512 && !defined(PM_AVX512_EMULATED)
  return _mm256_maskz_mov_epi8(_cvtu32_mask32(load_u32(p)), _mm256_set1_epi8(value));
#else
  return _mm256_and_si256(expand_bits(p), _mm256_set1_epi8(value));
#endif
}

// The fp16 at byte `at` of each of 8 blocks, as floats: 32-bit loads and an unpack tree (fewer
// micro-ops than building the vector with 7 inserts).
PM_INLINE __m256 fp16_scales8(const uint8_t* const* blk, int at = 0) {
  __m128i v[8];
  for (int r = 0; r < 8; ++r) v[r] = _mm_loadu_si32(blk[r] + at);
  const __m128i d01 = _mm_unpacklo_epi16(v[0], v[1]), d23 = _mm_unpacklo_epi16(v[2], v[3]);
  const __m128i d45 = _mm_unpacklo_epi16(v[4], v[5]), d67 = _mm_unpacklo_epi16(v[6], v[7]);
  return _mm256_cvtph_ps(_mm_unpacklo_epi64(_mm_unpacklo_epi32(d01, d23), _mm_unpacklo_epi32(d45, d67)));
}

// The 16 non-linear IQ4_NL values (int8) at 32 nibble indices; IQ4_XS uses them too.
PM_INLINE __m256i iq4nl_values(__m256i nibbles) {
  const __m256i values = _mm256_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
                                          -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
  return _mm256_shuffle_epi8(values, nibbles);
}

// What lfamily.h reads of a plain 32-value block type: one block per 32 values, one scale per block.
struct Block32 {
  static constexpr int kPieces = 1;
  static constexpr bool kHalfScales = false;
};

// Doubled e2m1 values plus 12 (0..24) at 32 nibble indices: MXFP4's and NVFP4's weights.
PM_INLINE __m256i e2m1_plus12(__m256i nibbles) {
  const __m256i table = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                         12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
  return _mm256_shuffle_epi8(table, nibbles);
}

// Q4_0, 18 bytes: d, qs[16] (low nibbles = weights 0-15, high = 16-31); w = d*(q - 8).
struct Q4_0 : Block32 {
  static constexpr int kBytes = 18;
  static constexpr int kOffset = 8;
  static constexpr bool kMin = false;
  static PM_INLINE float scale(const uint8_t* b) { return fp16(b); }
  static PM_INLINE __m256 scales8(const uint8_t* const* blk) { return fp16_scales8(blk); }
  static PM_INLINE __m256i quants(const uint8_t* b) { return load_nibbles(b + 2); }
};

// Q5_0, 22 bytes: d, qh (bit i = bit 4 of weight i), qs[16]; w = d*(q - 16).
struct Q5_0 : Block32 {
  static constexpr int kBytes = 22;
  static constexpr int kOffset = 16;
  static constexpr bool kMin = false;
  static PM_INLINE float scale(const uint8_t* b) { return fp16(b); }
  static PM_INLINE __m256 scales8(const uint8_t* const* blk) { return fp16_scales8(blk); }
  static PM_INLINE __m256i quants(const uint8_t* b) {
    return _mm256_or_si256(load_nibbles(b + 6), bits_to_bytes(b + 2, 0x10));
  }
};

// Q4_1, 20 bytes: d, m, qs[16] (nibbles as Q4_0); w = d*q + m with q unsigned (kMin: no offset
// is taken out; the min adds m times the activation sum instead).
struct Q4_1 : Block32 {
  static constexpr int kBytes = 20;
  static constexpr int kOffset = 8;
  static constexpr bool kMin = true;
  static PM_INLINE float scale(const uint8_t* b) { return fp16(b); }
  static PM_INLINE __m256 scales8(const uint8_t* const* blk) { return fp16_scales8(blk); }
  static PM_INLINE __m256 mins8(const uint8_t* const* blk) { return fp16_scales8(blk, 2); }
  static PM_INLINE __m256i quants(const uint8_t* b) { return load_nibbles(b + 4); }
};

// Q5_1, 24 bytes: d, m, qh (bit i = bit 4 of weight i), qs[16]; w = d*q + m, q unsigned (kMin).
struct Q5_1 : Block32 {
  static constexpr int kBytes = 24;
  static constexpr int kOffset = 16;
  static constexpr bool kMin = true;
  static PM_INLINE float scale(const uint8_t* b) { return fp16(b); }
  static PM_INLINE __m256 scales8(const uint8_t* const* blk) { return fp16_scales8(blk); }
  static PM_INLINE __m256 mins8(const uint8_t* const* blk) { return fp16_scales8(blk, 2); }
  static PM_INLINE __m256i quants(const uint8_t* b) {
    return _mm256_or_si256(load_nibbles(b + 8), bits_to_bytes(b + 4, 0x10));
  }
};

// Q8_0, 34 bytes: d, int8 qs[32].
struct Q8_0 : Block32 {
  static constexpr int kBytes = 34;
  static constexpr int kOffset = 0;
  static constexpr bool kMin = false;
  static PM_INLINE float scale(const uint8_t* b) { return fp16(b); }
  static PM_INLINE __m256 scales8(const uint8_t* const* blk) { return fp16_scales8(blk); }
  static PM_INLINE __m256i quants(const uint8_t* b) { return load256(b + 2); }
};

// MXFP4, 17 bytes: E8M0 exponent e, qs[16] (weight j low nibble, j+16 high); w = e2m1[q] * 2^(e-127).
// The table holds doubled e2m1 values plus 12 (0..24), so the scale is 2^(e-128) and the offset 12.
struct MXFP4 : Block32 {
  static constexpr int kBytes = 17;
  static constexpr int kOffset = 12;
  static constexpr bool kMin = false;
  static PM_INLINE float scale(const uint8_t* b) {
    const uint32_t e = b[0];
    const uint32_t bits = e < 2 ? 0x00200000u << e : (e - 1) << 23;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  static PM_INLINE __m256 scales8(const uint8_t* const* blk) {
    const __m256i e = _mm256_setr_epi32(blk[0][0], blk[1][0], blk[2][0], blk[3][0], blk[4][0], blk[5][0], blk[6][0],
                                        blk[7][0]);
    const __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i is_small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, small, is_small));
  }
  static PM_INLINE __m256i quants(const uint8_t* b) { return e2m1_plus12(load_nibbles(b + 1)); }
};

// IQ4_NL, 18 bytes: d, qs[16] (low nibbles = weights 0-15, high = 16-31); w = d * values[q], signed.
struct IQ4_NL : Block32 {
  static constexpr int kBytes = 18;
  static constexpr int kOffset = 0;
  static constexpr bool kMin = false;
  static PM_INLINE float scale(const uint8_t* b) { return fp16(b); }
  static PM_INLINE __m256 scales8(const uint8_t* const* blk) { return fp16_scales8(blk); }
  static PM_INLINE __m256i quants(const uint8_t* b) { return iq4nl_values(load_nibbles(b + 2)); }
};

// NVFP4, 36 bytes per 64 values: d[4] (a UE4M3 scale per 16 values), qs[32] (values 16s + j in the low
// nibble of byte 8s + j, 16s + 8 + j in the high one, j < 8); w = e2m1[q] * d. Two 32-value pieces per
// block, each with a scale per half (kHalfScales): lfamily.h takes a float step per 16 values, as
// llama.cpp's NVFP4 x Q8_0 dot does. Weights are doubled e2m1 values plus 12, scales halved.
struct NVFP4 {
  static constexpr int kBytes = 36;
  static constexpr int kPieces = 2;
  static constexpr bool kHalfScales = true;
  static constexpr int kOffset = 12;
  static constexpr bool kMin = false;
  // UE4M3 bytes (int32 lanes) as half their value: (1 + m/8) 2^(e-8) for e > 0, m 2^-10 for e == 0;
  // 0x7F (NaN) reads as 0 and bit 7 is ignored, as in ggml.
  static PM_INLINE __m256 ue4m3_half(__m256i x) {
    const __m256i y = _mm256_and_si256(x, _mm256_set1_epi32(0x7F));
    const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(y, 20), _mm256_set1_epi32(119 << 23)));
    const __m256 small = _mm256_mul_ps(_mm256_cvtepi32_ps(y), _mm256_set1_ps(1.0f / 1024));
    const __m256 v = _mm256_blendv_ps(normal, small, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), y)));
    return _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(x, _mm256_set1_epi32(0x7F))), v);
  }
  // The four scales of eight blocks, read as one dword per block: piece p's first 16 values' in lo[p],
  // its last 16 values' in hi[p].
  static PM_INLINE void scales8(const uint8_t* const* blk, __m256 (&lo)[2], __m256 (&hi)[2]) {
    const __m256i v = _mm256_setr_epi32(load_u32(blk[0]), load_u32(blk[1]), load_u32(blk[2]), load_u32(blk[3]),
                                        load_u32(blk[4]), load_u32(blk[5]), load_u32(blk[6]), load_u32(blk[7]));
    const __m256i byte = _mm256_set1_epi32(0xFF);
    lo[0] = ue4m3_half(_mm256_and_si256(v, byte));
    hi[0] = ue4m3_half(_mm256_and_si256(_mm256_srli_epi32(v, 8), byte));
    lo[1] = ue4m3_half(_mm256_and_si256(_mm256_srli_epi32(v, 16), byte));
    hi[1] = ue4m3_half(_mm256_srli_epi32(v, 24));
  }
  static PM_INLINE __m256i quants(const uint8_t* b, int p) {
    // Bytes 0-7 into both 64-bit halves of the low lane, bytes 8-15 into the high lane's (an in-lane shuffle of
    // the broadcast 16 bytes); the upper copies give their high nibbles.
    const __m256i x = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(load128(b + 4 + 16 * p)),
                                          _mm256_setr_epi64x(0x0706050403020100, 0x0706050403020100,
                                                             0x0F0E0D0C0B0A0908, 0x0F0E0D0C0B0A0908));
    return e2m1_plus12(_mm256_and_si256(_mm256_srlv_epi64(x, _mm256_setr_epi64x(0, 4, 0, 4)), _mm256_set1_epi8(0x0F)));
  }
};

// Q1_0, 18 bytes per 128 values: d, qs[16] (bit v % 8 of byte v / 8 set: w = d, else -d). Four 32-value
// pieces per block under the one scale, a float step per piece (per Q8_0 activation block), as llama.cpp's
// Q1_0 x Q8_0 dot takes them. Weights are 0 or 2 with offset 1.
struct Q1_0 {
  static constexpr int kBytes = 18;
  static constexpr int kPieces = 4;
  static constexpr bool kHalfScales = false;
  static constexpr int kOffset = 1;
  static constexpr bool kMin = false;
  static PM_INLINE __m256 scales8(const uint8_t* const* blk) { return fp16_scales8(blk); }
  static PM_INLINE __m256i quants(const uint8_t* b, int p) {
    return bits_to_bytes(b + 2 + 4 * p, 2);
  }
};

struct F32 {
  static PM_INLINE __m256 load8(const uint8_t* row, int i) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + i);
  }
  static PM_INLINE float load1(const uint8_t* row, int i) { return reinterpret_cast<const float*>(row)[i]; }
};

struct F16 {
  static PM_INLINE __m256 load8(const uint8_t* row, int i) { return load8_f16(row + 2 * i); }
  static PM_INLINE float load1(const uint8_t* row, int i) { return fp16(row + 2 * i); }
};

struct BF16 {
  static PM_INLINE __m256 load8(const uint8_t* row, int i) { return load8_bf16(row + 2 * i); }
  static PM_INLINE float load1(const uint8_t* row, int i) { return bf16_value(load_u16(row + 2 * i)); }
};

}  // namespace pocketmoe::PM_ISA::decode
