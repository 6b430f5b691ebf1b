// Block decoders for IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M and IQ4_XS (layouts: SPECS.md
// section 4), as kfamily.h expects.
#pragma once

#include "decode_kquants.h"
#include "decode_legacy.h"
#include "iq_tables.h"
#include "simd.h"

namespace pocketmoe::PM_ISA::decode {

// The head of a type with a scale 2s+1 per 32 weights (s: 8 int16) whose weights are stored + 2^Shift:
// corr takes the offset back out, -(2s+1) << Shift per 16 weights.
template <int Shift>
PM_INLINE KHead odd_scale_head(float d, __m128i s) {
  const __m128i sc = _mm_add_epi16(_mm_add_epi16(s, s), _mm_set1_epi16(1));
  const __m256i corr = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(duplicate_i16(sc), Shift));
  return {d, 0.0f, corr, _mm256_broadcastsi128_si256(sc)};
}

// A block's sign bytes, one per 8 weights (bit j set: weight j negative), formed for the whole block by the
// head of IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S with vector ops (instead of 4 lookups per group: 15-17%
// off the IQ2_XXS and IQ2_XS GEMV on Zen 3), then applied per group by signed_plus<G> in one of two forms:
// broadcast by halves and spread over the group's 32 weights with byte ops (AVX2), or (AVX-512) as the
// group's 32-bit mask of a masked subtraction, three instructions fewer a group (Zen 4 bench_kernels GEMV
// 1536 x 3072, one thread: IQ2_XXS 269 -> 249 us, IQ2_XS 266 -> 249, IQ2_S 306 -> 274, IQ3_XXS 364 -> 339,
// IQ3_S 431 -> 395).
struct SignHead : KHead {
  __m256i signs[2];   // sign bytes of groups 0-3, then of groups 4-7, in both 128-bit lanes
};
struct MaskSignHead : KHead {
  uint32_t masks[8];   // group g's 32 sign bits, bit i for weight i (byte k of the u32 is the block's byte 4g + k)
};
using FastSignHead = std::conditional_t<PM_AVX512 != 0, MaskSignHead, SignHead>;

PM_INLINE FastSignHead with_signs(const KHead& k, __m256i bytes) {
  FastSignHead h;
  static_cast<KHead&>(h) = k;
#if PM_AVX512
  store256(h.masks, bytes);
#else
  h.signs[0] = _mm256_permute2x128_si256(bytes, bytes, 0x00);
  h.signs[1] = _mm256_permute2x128_si256(bytes, bytes, 0x11);
#endif
  return h;
}

// The sign bytes of 32 seven-bit indices into ggml's ksigns table (bytes, bit 7 clear): the 7 bits and
// their parity as bit 7, from two 16-entry shuffles.
PM_INLINE __m256i ksigns(__m256i f) {
  const __m256i odd = _mm256_setr_epi8(0, -128, -128, 0, -128, 0, 0, -128, -128, 0, 0, -128, 0, -128, -128, 0, 0,
                                       -128, -128, 0, -128, 0, 0, -128, -128, 0, 0, -128, 0, -128, -128, 0);
  const __m256i nib = _mm256_set1_epi8(0x0F);
  return _mm256_or_si256(f, _mm256_xor_si256(_mm256_shuffle_epi8(odd, _mm256_and_si256(f, nib)),
                                             _mm256_shuffle_epi8(odd, _mm256_and_si256(_mm256_srli_epi16(f, 4), nib))));
}

// Group G's unsigned grid bytes g with the head's signs applied, stored + Offset.
template <int G, int Offset>
PM_INLINE __m256i signed_plus(__m256i g, const SignHead& h) {
  constexpr char b = 4 * (G % 4);
  const __m256i spread = _mm256_setr_epi8(b, b, b, b, b, b, b, b, b + 1, b + 1, b + 1, b + 1, b + 1, b + 1, b + 1, b + 1,
                                          b + 2, b + 2, b + 2, b + 2, b + 2, b + 2, b + 2, b + 2, b + 3, b + 3, b + 3,
                                          b + 3, b + 3, b + 3, b + 3, b + 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i x = _mm256_and_si256(_mm256_shuffle_epi8(h.signs[G / 4], spread), bit);
  const __m256i sign = _mm256_or_si256(_mm256_cmpeq_epi8(x, bit), _mm256_set1_epi8(1));
  return _mm256_add_epi8(_mm256_sign_epi8(g, sign), _mm256_set1_epi8(Offset));
}
#if PM_AVX512
template <int G, int Offset>
PM_INLINE __m256i signed_plus(__m256i g, const MaskSignHead& h) {
  // Offset - g where the weight's sign bit is set, else Offset + g.
  const __m256i offset = _mm256_set1_epi8(Offset);
  return _mm256_mask_sub_epi8(_mm256_add_epi8(g, offset), h.masks[G], offset, g);
}
#endif

// The head of IQ2_XXS / IQ3_XXS from their eight sign words w (a u32 per 32 weights, in order): four 7-bit
// sign indices in bits 0-27 (index k of word g goes to byte 4g + k) and the 4-bit scale s in bits 28-31;
// weights stored + 64.
PM_INLINE FastSignHead xxs_head(float d, __m256i w) {
  const auto field = [&](int k) { return _mm256_and_si256(_mm256_slli_epi32(w, k), _mm256_set1_epi32(0x7F << (8 * k))); };
  const __m256i s = _mm256_srli_epi32(w, 28);
  const __m256i fields = _mm256_or_si256(_mm256_or_si256(field(0), field(1)), _mm256_or_si256(field(2), field(3)));
  return with_signs(odd_scale_head<6>(d, _mm_packs_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1))),
                    ksigns(fields));
}

// IQ2_XXS, 66 bytes: d, then per 32 weights two u32: four grid indices (bytes), and four 7-bit sign indices
// plus a 4-bit scale s in the top bits; w = d * (2s+1)/8 * grid * sign. Weights are stored + 64.
struct IQ2XXS {
  static constexpr int kBytes = 66;
  static constexpr bool kCanonical = false;
  static constexpr bool kSigned = false, kOffset = true, kMin = false;
  static constexpr int kGemvRows = PM_AVX512 ? 2 : 1;   // driver.h; GEMV 284 -> 264-268 us on Zen 4
  using Head = FastSignHead;
  static PM_INLINE Head head(const uint8_t* b) {
    // The sign words are the odd u32 of bytes 2-65: [g0 g1 g4 g5 | g2 g3 g6 g7], then in order.
    const __m256 w = _mm256_shuffle_ps(_mm256_castsi256_ps(load256(b + 2)), _mm256_castsi256_ps(load256(b + 34)),
                                       _MM_SHUFFLE(3, 1, 3, 1));
    return xxs_head(0.125f * fp16(b), _mm256_permute4x64_epi64(_mm256_castps_si256(w), _MM_SHUFFLE(3, 1, 2, 0)));
  }
  template <int G>
  static PM_INLINE __m256i quants(const uint8_t* b, const Head& h) {
    const uint8_t* q = b + 2 + 8 * G;
    const uint64_t* t = tables::kIq2xxs;
    return signed_plus<G, 64>(set_u64x4(t[q[0]], t[q[1]], t[q[2]], t[q[3]]), h);
  }
  template <int G>
  static PM_INLINE __m256i scales(const uint8_t*, const Head& h) {
    return broadcast_i16<G>(h.sc);
  }
};

// The nibbles of x's low 8 bytes in order, each byte's low nibble then its high nibble: 16 bytes.
PM_INLINE __m128i split_nibbles(__m128i x) {
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm_unpacklo_epi8(_mm_and_si128(x, m), _mm_and_si128(_mm_srli_epi16(x, 4), m));
}

// The head of IQ2_XS / IQ2_S: 8 scale bytes at s, a 4-bit scale per 16 weights (low nibble: weights 0-15 of
// group g, high: 16-31), w = d * (2s+1)/8 * grid; weights stored + 64.
PM_INLINE KHead iq2_nibble_head(const uint8_t* b, const uint8_t* s) {
  const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s));
  const __m128i raw = split_nibbles(x);
  const __m128i ls = _mm_add_epi8(_mm_add_epi8(raw, raw), _mm_set1_epi8(1));   // 16 scales in order
  const __m256i corr = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(_mm256_cvtepu8_epi16(ls), 6));
  return {0.125f * fp16(b), 0.0f, corr, split_scales_i16(ls)};
}

// IQ2_XS, 74 bytes: d, qs[32] (u16: a 9-bit grid index and a 7-bit sign index per 8 weights), scales[8].
struct IQ2XS {
  static constexpr int kBytes = 74;
  static constexpr bool kCanonical = false;
  static constexpr bool kSigned = false, kOffset = true, kMin = false;
  using Head = FastSignHead;
  static PM_INLINE Head head(const uint8_t* b) {
    // The sign indices are the top 7 bits of the 32 u16: packed to bytes, with packus's lane order undone.
    const __m256i lo = _mm256_srli_epi16(load256(b + 2), 9), hi = _mm256_srli_epi16(load256(b + 34), 9);
    const __m256i f = _mm256_permute4x64_epi64(_mm256_packus_epi16(lo, hi), _MM_SHUFFLE(3, 1, 2, 0));
    return with_signs(iq2_nibble_head(b, b + 66), ksigns(f));
  }
  template <int G>
  static PM_INLINE __m256i quants(const uint8_t* b, const Head& h) {
    const uint8_t* q = b + 2 + 8 * G;
    const uint64_t* t = tables::kIq2xs;
    return signed_plus<G, 64>(set_u64x4(t[load_u16(q) & 511], t[load_u16(q + 2) & 511], t[load_u16(q + 4) & 511],
                                        t[load_u16(q + 6) & 511]), h);
  }
  template <int G>
  static PM_INLINE __m256i scales(const uint8_t*, const Head& h) {
    return broadcast_i16<G>(h.sc);
  }
};

// IQ2_S, 82 bytes: d, qs[32] (low 8 bits of a 10-bit grid index per 8 weights), signs[32] (a byte per 8
// weights), qh[8] (the indices' top 2 bits, four per group), scales[8] (as IQ2_XS).
struct IQ2S {
  static constexpr int kBytes = 82;
  static constexpr bool kCanonical = false;
  static constexpr bool kSigned = false, kOffset = true, kMin = false;
  using Head = FastSignHead;
  static PM_INLINE Head head(const uint8_t* b) { return with_signs(iq2_nibble_head(b, b + 74), load256(b + 34)); }
  template <int G>
  static PM_INLINE __m256i quants(const uint8_t* b, const Head& h) {
    const uint8_t* qs = b + 2 + 4 * G;
    const uint32_t qh = b[66 + G];
    const uint64_t* t = tables::kIq2s;
    const __m256i g = set_u64x4(t[qs[0] | ((qh << 8) & 0x300)], t[qs[1] | ((qh << 6) & 0x300)],
                                t[qs[2] | ((qh << 4) & 0x300)], t[qs[3] | ((qh << 2) & 0x300)]);
    return signed_plus<G, 64>(g, h);
  }
  template <int G>
  static PM_INLINE __m256i scales(const uint8_t*, const Head& h) {
    return broadcast_i16<G>(h.sc);
  }
};

// IQ3_S, 110 bytes: d, qs[64] (low 8 bits of a 9-bit grid index per 4 weights), qh[8] (the indices' top
// bits, eight per group), signs[32] (a byte per 8 weights), scales[4] (a 4-bit s per group);
// w = d * (2s+1) * grid * sign, grid bytes 1..15, stored + 16.
// The head forms all 64 grid indices with a few vector ops; a group reads its eight as two u64 and takes them
// apart in scalar registers (Zen 4 bench_kernels GEMV 1536 x 3072, one thread: 465 -> 431 us, and 395 with the
// AVX-512 sign masks; its AVX2 build 540 -> 438). Read one u16 at a time, they cost an extract or a
// store-forwarded load each, slower than forming them from the block's bytes in the group (464 us).
struct IQ3S {
  static constexpr int kBytes = 110;
  static constexpr bool kCanonical = false;
  static constexpr bool kSigned = false, kOffset = true, kMin = false;
  struct Head : FastSignHead {
    alignas(32) uint16_t idx[64];
  };
  static PM_INLINE Head head(const uint8_t* b) {
    Head h;
    // Index k: qs[k] | bit k % 8 of qh[k / 8] << 8, sixteen at a time (each qh byte over eight lanes).
    const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i qh = _mm256_broadcastsi128_si256(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 66)));
    static_for<4>([&](auto jc) {
      constexpr int J = decltype(jc)::value;
      constexpr char lo = 2 * J, hi = 2 * J + 1;
      const __m256i byte = _mm256_shuffle_epi8(qh, _mm256_setr_epi8(lo, -1, lo, -1, lo, -1, lo, -1, lo, -1, lo, -1,
                                                                    lo, -1, lo, -1, hi, -1, hi, -1, hi, -1, hi, -1,
                                                                    hi, -1, hi, -1, hi, -1, hi, -1));
      const __m256i set = _mm256_cmpeq_epi16(_mm256_and_si256(byte, bit), bit);
      const __m256i top = _mm256_and_si256(set, _mm256_set1_epi16(256));
      store256(h.idx + 16 * J, _mm256_or_si256(_mm256_cvtepu8_epi16(load128(b + 2 + 16 * J)), top));
    });
    const __m128i x = _mm_cvtsi32_si128(static_cast<int>(load_u32(b + 106)));   // group g: nibble g % 2 of byte g / 2
    const __m128i s = _mm_cvtepu8_epi16(split_nibbles(x));
    static_cast<FastSignHead&>(h) = with_signs(odd_scale_head<4>(fp16(b), s), load256(b + 74));
    return h;
  }
  template <int G>
  static PM_INLINE __m256i quants(const uint8_t*, const Head& h) {
    const uint32_t* t = tables::kIq3s;
    uint64_t x[2];
    std::memcpy(x, h.idx + 8 * G, sizeof x);
    const auto entry = [&](int k) { return static_cast<int>(t[(x[k / 4] >> (16 * (k % 4))) & 0xFFFF]); };
    const __m256i g = _mm256_setr_epi32(entry(0), entry(1), entry(2), entry(3), entry(4), entry(5), entry(6), entry(7));
    return signed_plus<G, 16>(g, h);
  }
  template <int G>
  static PM_INLINE __m256i scales(const uint8_t*, const Head& h) {
    return broadcast_i16<G>(h.sc);
  }
};

// IQ3_XXS, 98 bytes: d, qs[64] (one grid index per 4 weights), then per 32 weights a u32 of four 7-bit
// sign indices and a 4-bit scale s in the top bits; w = d * (2s+1)/4 * grid * sign, grid bytes 4..62.
// Weights are stored + 64.
struct IQ3XXS {
  static constexpr int kBytes = 98;
  static constexpr bool kCanonical = false;
  static constexpr bool kSigned = false, kOffset = true, kMin = false;
  using Head = FastSignHead;
  static PM_INLINE Head head(const uint8_t* b) { return xxs_head(0.25f * fp16(b), load256(b + 66)); }
  template <int G>
  static PM_INLINE __m256i quants(const uint8_t* b, const Head& h) {
    const uint8_t* q = b + 2 + 8 * G;
    const uint32_t* t = tables::kIq3xxs;
    const __m256i g = _mm256_setr_epi32(static_cast<int>(t[q[0]]), static_cast<int>(t[q[1]]),
                                        static_cast<int>(t[q[2]]), static_cast<int>(t[q[3]]),
                                        static_cast<int>(t[q[4]]), static_cast<int>(t[q[5]]),
                                        static_cast<int>(t[q[6]]), static_cast<int>(t[q[7]]));
    return signed_plus<G, 64>(g, h);
  }
  template <int G>
  static PM_INLINE __m256i scales(const uint8_t*, const Head& h) {
    return broadcast_i16<G>(h.sc);
  }
};

// IQ1_S, 50 bytes: d, qs[32], qh[8] (u16 per 32 weights: four 3-bit high grid-index bits, a 3-bit scale s,
// the delta sign in bit 15); per 8 weights an 11-bit index into the IQ1 grid. w = d * (2s+1) * (grid +-
// 1/8), stored as 8*grid + delta + 16 with d/8 as the block scale (IQ1_M's table). The head forms the 32
// table indices (with the delta bit) in two vector passes; a group reads its four as one u64 and takes them
// apart in scalar registers (as IQ3_S: Zen 4 GEMV 280 -> 240 us, AVX2 build 315 -> 286).
struct IQ1S {
  static constexpr int kBytes = 50;
  static constexpr bool kCanonical = false;
  static constexpr bool kSigned = false, kOffset = true, kMin = false;
  static constexpr int kGemvRows = PM_AVX512 ? 2 : 1;   // driver.h; GEMV 296 -> 280 us on Zen 4
  struct Head : KHead {
    alignas(32) uint16_t idx[32];
  };
  // Indices 16H .. 16H+15 (groups 4H .. 4H+3): qs bytes | the group's word's 3-bit field l << 8 | its bit 15
  // >> 4. The field moves to bits 9-11 by a multiply (2^(9-3l)), then down one.
  template <int H>
  static PM_INLINE __m256i indices(const uint8_t* b, __m256i qh) {
    const __m256i q = _mm256_cvtepu8_epi16(load128(b + 2 + 16 * H));
    constexpr char w0 = 8 * H, w1 = 8 * H + 2, w2 = 8 * H + 4, w3 = 8 * H + 6;
    const __m256i w = _mm256_shuffle_epi8(
        qh, _mm256_setr_epi8(w0, w0 + 1, w0, w0 + 1, w0, w0 + 1, w0, w0 + 1, w1, w1 + 1, w1, w1 + 1, w1, w1 + 1, w1,
                             w1 + 1, w2, w2 + 1, w2, w2 + 1, w2, w2 + 1, w2, w2 + 1, w3, w3 + 1, w3, w3 + 1, w3, w3 + 1,
                             w3, w3 + 1));
    const __m256i field = _mm256_and_si256(
        _mm256_mullo_epi16(w, _mm256_setr_epi16(512, 64, 8, 1, 512, 64, 8, 1, 512, 64, 8, 1, 512, 64, 8, 1)),
        _mm256_set1_epi16(0x0E00));
    const __m256i delta = _mm256_srli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(static_cast<int16_t>(0x8000))), 4);
    return _mm256_or_si256(q, _mm256_or_si256(_mm256_srli_epi16(field, 1), delta));
  }
  static PM_INLINE Head head(const uint8_t* b) {
    Head h;
    const __m128i qh = load128(b + 34);
    const __m256i qh2 = _mm256_broadcastsi128_si256(qh);
    store256(h.idx, indices<0>(b, qh2));
    store256(h.idx + 16, indices<1>(b, qh2));
    const __m128i s = _mm_and_si128(_mm_srli_epi16(qh, 12), _mm_set1_epi16(7));
    static_cast<KHead&>(h) = odd_scale_head<4>(0.125f * fp16(b), s);
    return h;
  }
  template <int G>
  static PM_INLINE __m256i quants(const uint8_t*, const Head& h) {
    const uint64_t* t = tables::kIq1m;
    uint64_t x;
    std::memcpy(&x, h.idx + 4 * G, sizeof x);
    return set_u64x4(t[x & 0xFFFF], t[(x >> 16) & 0xFFFF], t[(x >> 32) & 0xFFFF], t[x >> 48]);
  }
  template <int G>
  static PM_INLINE __m256i scales(const uint8_t*, const Head& h) {
    return broadcast_i16<G>(h.sc);
  }
};

// IQ1_M, 56 bytes: qs[32], qh[16], scales[8]; per 8 weights an 11-bit grid index and a delta sign,
// per 16 weights a 3-bit scale s; the fp16 d sits in the top nibbles of the four u16 scale words.
// w = d * (2s+1) * (grid + delta/8), stored as 8*grid + delta + 16 with d/8 as the block scale.
struct IQ1M {
  static constexpr int kBytes = 56;
  static constexpr bool kCanonical = false;
  static constexpr bool kSigned = false, kOffset = true, kMin = false;
  using Head = KHead;
  static PM_INLINE Head head(const uint8_t* b) {
    uint16_t s[4];
    for (int i = 0; i < 4; ++i) s[i] = load_u16(b + 48 + 2 * i);
    const uint16_t dbits = static_cast<uint16_t>((s[0] >> 12) | ((s[1] >> 8) & 0x00F0) | ((s[2] >> 4) & 0x0F00) |
                                                 (s[3] & 0xF000));
    // Scale i is bits 3(i%4)..+2 of word i/4: each word is spread over four int16 lanes, shifted left
    // by 9 - 3(i%4) (a multiply), and bits 9..11 taken; then 2s + 1.
    const __m256i packed = _mm256_broadcastq_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 48)));
    const __m256i words = _mm256_shuffle_epi8(packed, _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3,
                                                                       4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6, 7, 6, 7));
    const __m256i fields = _mm256_and_si256(
        _mm256_srli_epi16(_mm256_mullo_epi16(words, _mm256_setr_epi16(512, 64, 8, 1, 512, 64, 8, 1, 512, 64, 8, 1,
                                                                        512, 64, 8, 1)), 9),
        _mm256_set1_epi16(7));
    const __m256i ls = _mm256_add_epi16(_mm256_add_epi16(fields, fields), _mm256_set1_epi16(1));   // int16, in order
    const __m128i raw = _mm_packs_epi16(_mm256_castsi256_si128(ls), _mm256_extracti128_si256(ls, 1));
    const __m256i corr = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(ls, 4));
    return {0.125f * _cvtsh_ss(dbits), 0.0f, corr, split_scales_i16(raw)};
  }
  template <int G>
  static PM_INLINE __m256i quants(const uint8_t* b, const Head&) {
    const uint8_t* qs = b + 4 * G;
    const uint32_t h0 = b[32 + 2 * G], h1 = b[33 + 2 * G];
    const uint64_t* t = tables::kIq1m;
    return set_u64x4(t[qs[0] | ((h0 & 0x0F) << 8)], t[qs[1] | ((h0 >> 4) << 8)], t[qs[2] | ((h1 & 0x0F) << 8)],
                     t[qs[3] | ((h1 >> 4) << 8)]);
  }
  template <int G>
  static PM_INLINE __m256i scales(const uint8_t*, const Head& h) {
    return broadcast_i16<G>(h.sc);
  }
};

// IQ4_XS, 136 bytes: d, scales_h (u16), scales_l[4], qs[128]; per 32 weights a 6-bit scale minus 32;
// weights are the 16 non-linear IQ4_NL values indexed by nibbles (16 low nibbles, then 16 high).
struct IQ4XS {
  static constexpr int kBytes = 136;
  static constexpr bool kCanonical = false;
  static constexpr bool kSigned = true, kOffset = false, kMin = false;
  using Head = KHead;
  static PM_INLINE Head head(const uint8_t* b) {
    // Scale j: nibble j % 2 of scales_l[j / 2] | bits 2j, 2j+1 of scales_h << 4, minus 32; the two bits
    // move to bits 14-15 of lane j by a multiply (2^(14-2j)), then down to 4-5.
    const __m128i l = _mm_cvtsi32_si128(static_cast<int>(load_u32(b + 4)));
    const __m128i low = _mm_cvtepu8_epi16(split_nibbles(l));
    const __m128i sh = _mm_set1_epi16(static_cast<int16_t>(load_u16(b + 2)));
    const __m128i top = _mm_srli_epi16(
        _mm_mullo_epi16(sh, _mm_setr_epi16(1 << 14, 1 << 12, 1 << 10, 1 << 8, 1 << 6, 1 << 4, 1 << 2, 1)), 14);
    const __m128i sc = _mm_sub_epi16(_mm_or_si128(low, _mm_slli_epi16(top, 4)), _mm_set1_epi16(32));
    return {fp16(b), 0.0f, _mm256_setzero_si256(), _mm256_broadcastsi128_si256(sc)};
  }
  template <int G>
  static PM_INLINE __m256i quants(const uint8_t* b, const Head&) {
    return iq4nl_values(load_nibbles(b + 8 + 16 * G));
  }
  template <int G>
  static PM_INLINE __m256i scales(const uint8_t*, const Head& h) {
    return broadcast_i16<G>(h.sc);
  }
};

}  // namespace pocketmoe::PM_ISA::decode
