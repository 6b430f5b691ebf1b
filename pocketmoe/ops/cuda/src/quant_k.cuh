// Decoders of the k-quant super-blocks (Q2_K..Q6_K) and of the ternary ones (TQ2_0, TQ1_0: one scale per
// super-block, read as sc = 1 per 16); the interface is described in quant.cuh.
#pragma once

// Included by quant.cuh (after its helpers), not on its own.

namespace pmq {

// The 8 words of a group's 32 quants, four to a word: word k of lo (at 4k), shifted right by lo_shift and masked
// with kLoMask, ORed with kHiBits (0, 1 or 2) high bits from word k of hi shifted right by hi_shift, placed at bit
// kHiPos of each byte; then, with kOff, biased to signed bytes (to_signed). kA2: the words are only 2-byte aligned.
template <bool kA2, uint32_t kLoMask, int kHiBits = 0, int kHiPos = 0, uint32_t kOff = 0>
__device__ __forceinline__ void unpack_group(const uint8_t* lo, int lo_shift, const uint8_t* hi, int hi_shift,
                                             int (&q)[8]) {
  constexpr uint32_t kHiMask = kHiBits == 1 ? 0x01010101u : 0x03030303u;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    uint32_t v = ((kA2 ? ld_u32_a2(lo + 4 * k) : ld_u32(lo + 4 * k)) >> lo_shift) & kLoMask;
    if constexpr (kHiBits > 0)
      v |= (((kA2 ? ld_u32_a2(hi + 4 * k) : ld_u32(hi + 4 * k)) >> hi_shift) & kHiMask) << kHiPos;
    q[k] = kOff ? to_signed(v, kOff) : static_cast<int>(v);
  }
}

// Q2_K, 84 bytes: scales[16] (low nibble scale, high nibble min), qs[64], d, dmin; q in 0..3.
struct Q2K {
  static constexpr int kValues = 256;
  static constexpr int kBytes = 84;
  static constexpr bool kMin = true;
  static __device__ __forceinline__ void head(const uint8_t* b, float& d, float& dmin) {
    d = ld_fp16(b + 80);
    dmin = -ld_fp16(b + 82);
  }
  static __device__ __forceinline__ void group(const uint8_t* b, int g, int (&q)[8], int (&sc)[2], int (&mn)[2]) {
    unpack_group<false, 0x03030303u>(b + 16 + 32 * (g / 4), 2 * (g % 4), nullptr, 0, q);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      sc[h] = b[2 * g + h] & 15;
      mn[h] = b[2 * g + h] >> 4;
    }
  }
};

// Q3_K, 110 bytes: hmask[32], qs[64], scales[12] (16 six-bit, minus 32), d; w = d * sc * (q - 4), q in 0..7
// (bit 2 of weight l of group g is bit g of hmask[l]).
struct Q3K {
  static constexpr int kValues = 256;
  static constexpr int kBytes = 110;
  static constexpr bool kMin = false;
  static __device__ __forceinline__ void head(const uint8_t* b, float& d, float& dmin) {
    d = ld_fp16(b + 108);
    dmin = 0.0f;
  }
  static __device__ __forceinline__ int scale6(const uint8_t* b, int i) {
    const int r = i % 4, quarter = i / 4;
    const int lo = b[96 + r + 4 * (quarter & 1)];
    const int low4 = quarter < 2 ? lo & 15 : lo >> 4;
    return (low4 | (((b[104 + r] >> (2 * quarter)) & 3) << 4)) - 32;
  }
  static __device__ __forceinline__ void group(const uint8_t* b, int g, int (&q)[8], int (&sc)[2], int (&mn)[2]) {
    unpack_group<true, 0x03030303u, 1, 2, 4>(b + 32 + 32 * (g / 4), 2 * (g % 4), b, g, q);
    sc[0] = scale6(b, 2 * g);
    sc[1] = scale6(b, 2 * g + 1);
    mn[0] = mn[1] = 0;
  }
};

// Q4_K / Q5_K: the 6-bit scale and min of group g from scales[12] at s, for both halves of the group.
__device__ __forceinline__ void scale_min_k4(const uint8_t* s, int g, int (&sc)[2], int (&mn)[2]) {
  int c, m;
  if (g < 4) {
    c = s[g] & 63;
    m = s[g + 4] & 63;
  } else {
    c = (s[g + 4] & 15) | ((s[g - 4] >> 6) << 4);
    m = (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
  }
  sc[0] = sc[1] = c;
  mn[0] = mn[1] = m;
}

// Q4_K, 144 bytes: d, dmin, scales[12], qs[128]; w = d * sc * q - dmin * m, q in 0..15.
struct Q4K {
  static constexpr int kValues = 256;
  static constexpr int kBytes = 144;
  static constexpr bool kMin = true;
  static __device__ __forceinline__ void head(const uint8_t* b, float& d, float& dmin) {
    d = ld_fp16(b);
    dmin = -ld_fp16(b + 2);
  }
  static __device__ __forceinline__ void group(const uint8_t* b, int g, int (&q)[8], int (&sc)[2], int (&mn)[2]) {
    unpack_group<false, 0x0F0F0F0Fu>(b + 16 + 32 * (g / 2), 4 * (g % 2), nullptr, 0, q);
    scale_min_k4(b + 4, g, sc, mn);
  }
};

// Q5_K, 176 bytes: d, dmin, scales[12], qh[32], qs[128]; bit g of qh[l] is bit 4 of weight 32g + l.
struct Q5K {
  static constexpr int kValues = 256;
  static constexpr int kBytes = 176;
  static constexpr bool kMin = true;
  static __device__ __forceinline__ void head(const uint8_t* b, float& d, float& dmin) { Q4K::head(b, d, dmin); }
  static __device__ __forceinline__ void group(const uint8_t* b, int g, int (&q)[8], int (&sc)[2], int (&mn)[2]) {
    unpack_group<false, 0x0F0F0F0Fu, 1, 4>(b + 48 + 32 * (g / 2), 4 * (g % 2), b + 16, g, q);
    scale_min_k4(b + 4, g, sc, mn);
  }
};

// Q6_K, 210 bytes: ql[128], qh[64], int8 scales[16], d; w = d * sc * (q - 32), q in 0..63.
struct Q6K {
  static constexpr int kValues = 256;
  static constexpr int kBytes = 210;
  static constexpr bool kMin = false;
  static __device__ __forceinline__ void head(const uint8_t* b, float& d, float& dmin) {
    d = ld_fp16(b + 208);
    dmin = 0.0f;
  }
  static __device__ __forceinline__ void group(const uint8_t* b, int g, int (&q)[8], int (&sc)[2], int (&mn)[2]) {
    const int half = g / 4, sub = g % 4;
    unpack_group<true, 0x0F0F0F0Fu, 2, 4, 32>(b + 64 * half + 32 * (sub % 2), 4 * (sub / 2), b + 128 + 32 * half,
                                              2 * sub, q);
    const int8_t* s = reinterpret_cast<const int8_t*>(b + 192 + 8 * half + 2 * sub);
    sc[0] = s[0];
    sc[1] = s[1];
    mn[0] = mn[1] = 0;
  }
};

// ---- ternary super-blocks: w = d * (t - 1), t in 0..2; d in the block's last two bytes ----

template <int Bytes>
struct Ternary {
  static constexpr int kValues = 256;
  static constexpr int kBytes = Bytes;
  static constexpr bool kMin = false;
  static __device__ __forceinline__ void head(const uint8_t* b, float& d, float& dmin) {
    d = ld_fp16(b + Bytes - 2);
    dmin = 0.0f;
  }
  // One scale per super-block: both 16s of every group at 1, no mins.
  static __device__ __forceinline__ void unit_scales(int (&sc)[2], int (&mn)[2]) {
    sc[0] = sc[1] = 1;
    mn[0] = mn[1] = 0;
  }
};

// TQ2_0, 66 bytes: qs[64], d; t in bits 2j of qs[32h + l] for weight 128h + 32j + l (t = 3 reads as 2, as gguf
// and llama.cpp read it).
struct TQ20 : Ternary<66> {
  static __device__ __forceinline__ void group(const uint8_t* b, int g, int (&q)[8], int (&sc)[2], int (&mn)[2]) {
    unpack_group<true, 0x03030303u, 0, 0, 1>(b + 32 * (g / 4), 2 * (g % 4), nullptr, 0, q);
    unit_scales(sc, mn);
  }
};

// Base-3 digit n of each byte of x, t = (uint8(x * 3^n) * 3) >> 8 (as ggml dequantizes TQ1_0), biased to t - 1 as
// signed bytes. Even and odd bytes go through the multiplies in 16-bit lanes (255 * 81 * 3 < 2^16: no lane carries
// into the next).
__device__ __forceinline__ int ternary_digits(uint32_t x, int n) {
  const uint32_t p = n == 0 ? 1u : n == 1 ? 3u : n == 2 ? 9u : n == 3 ? 27u : 81u;
  const uint32_t even = ((x & 0x00FF00FFu) * p) & 0x00FF00FFu, odd = (((x >> 8) & 0x00FF00FFu) * p) & 0x00FF00FFu;
  return to_signed((((even * 3) >> 8) & 0x00030003u) | ((odd * 3) & 0x03000300u), 1);
}

// TQ1_0, 54 bytes: qs[48], qh[4], d; five base-3 digits per qs byte, four per qh byte, digit n of qs[l] (l < 32)
// is weight 32n + l, of qs[32 + l] (l < 16) weight 160 + 16n + l, of qh[j] weight 240 + 4n + j.
struct TQ10 : Ternary<54> {
  // Groups 0-4: digit g of qs[0..31]; 5, 6: digits 2g - 10 and 2g - 9 of qs[32..47]; 7: digit 4 of qs[32..47],
  // then digits 0-3 of qh.
  static __device__ __forceinline__ void group(const uint8_t* b, int g, int (&q)[8], int (&sc)[2], int (&mn)[2]) {
    if (g < 5) {
#pragma unroll
      for (int k = 0; k < 8; ++k) q[k] = ternary_digits(ld_u32_a2(b + 4 * k), g);
    } else {
      const int n = g < 7 ? 2 * g - 10 : 4;
#pragma unroll
      for (int k = 0; k < 4; ++k) q[k] = ternary_digits(ld_u32_a2(b + 32 + 4 * k), n);
      const uint32_t qh = ld_u32_a2(b + 48);
#pragma unroll
      for (int k = 4; k < 8; ++k)
        q[k] = ternary_digits(g < 7 ? ld_u32_a2(b + 32 + 4 * (k - 4)) : qh, g < 7 ? n + 1 : k - 4);
    }
    unit_scales(sc, mn);
  }
};

}  // namespace pmq
