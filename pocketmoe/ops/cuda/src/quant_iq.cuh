// Decoders of the IQ super-blocks (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, IQ4_XS); the interface
// is described in quant.cuh.
#pragma once

// Included by quant.cuh (after its helpers), not on its own.
#include "iq_tables.cuh"

namespace pmq {

// The 8 sign bits of a 7-bit sign index s (IQ2_XXS, IQ2_XS, IQ3_XXS): the 8th makes the count of minus signs
// even.
__device__ __forceinline__ uint32_t signs8(uint32_t s) {
  uint32_t parity = s ^ (s >> 4);
  parity ^= parity >> 2;
  parity ^= parity >> 1;
  return s | ((parity & 1) << 7);
}

// The same for sign index l of an IQ2_XXS / IQ3_XXS sign word (four 7-bit indices).
__device__ __forceinline__ uint32_t full_signs(uint32_t word, int l) { return signs8((word >> (7 * l)) & 127); }

// Eight IQ2 grid bytes (8, 25, 43) with the signs of the 8 bits of s as the two words q[0], q[1].
__device__ __forceinline__ void signed_row(uint64_t row, uint32_t s, int& q0, int& q1) {
  q0 = apply_signs(static_cast<uint32_t>(row), s & 15);
  q1 = apply_signs(static_cast<uint32_t>(row >> 32), s >> 4);
}

// The two 4-bit scales s of IQ2_XS / IQ2_S group (low nibble: weights 0-15) as 2s + 1.
__device__ __forceinline__ void nibble_scales(uint32_t byte, int (&sc)[2]) {
  sc[0] = 2 * static_cast<int>(byte & 15) + 1;
  sc[1] = 2 * static_cast<int>(byte >> 4) + 1;
}

// IQ2_XS, 74 bytes: d, qs[32] (u16: a 9-bit grid index and a 7-bit sign index per 8 weights), scales[8] (a
// 4-bit s per 16 weights, low nibble first); w = d * (2s + 1) / 8 * grid * sign.
struct IQ2XS {
  static constexpr int kValues = 256;
  static constexpr int kBytes = 74;
  static constexpr bool kMin = false;
  static __device__ __forceinline__ void head(const uint8_t* b, float& d, float& dmin) {
    d = 0.125f * ld_fp16(b);
    dmin = 0.0f;
  }
  static __device__ __forceinline__ void group(const uint8_t* b, int g, int (&q)[8], int (&sc)[2], int (&mn)[2]) {
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const uint32_t v = ld_u16(b + 2 + 8 * g + 2 * l);
      signed_row(kIq2xsGrid[v & 511], signs8(v >> 9), q[2 * l], q[2 * l + 1]);
    }
    nibble_scales(b[66 + g], sc);
    mn[0] = mn[1] = 0;
  }
};

// IQ2_S, 82 bytes: d, qs[32] (low 8 bits of a 10-bit grid index per 8 weights), signs[32] (a byte per 8
// weights), qh[8] (the indices' top 2 bits, four per group), scales[8] (as IQ2_XS).
struct IQ2S {
  static constexpr int kValues = 256;
  static constexpr int kBytes = 82;
  static constexpr bool kMin = false;
  static __device__ __forceinline__ void head(const uint8_t* b, float& d, float& dmin) {
    d = 0.125f * ld_fp16(b);
    dmin = 0.0f;
  }
  static __device__ __forceinline__ void group(const uint8_t* b, int g, int (&q)[8], int (&sc)[2], int (&mn)[2]) {
    const uint32_t qh = b[66 + g];
#pragma unroll
    for (int l = 0; l < 4; ++l)
      signed_row(kIq2sGrid[b[2 + 4 * g + l] | (((qh >> (2 * l)) & 3) << 8)], b[34 + 4 * g + l], q[2 * l], q[2 * l + 1]);
    nibble_scales(b[74 + g], sc);
    mn[0] = mn[1] = 0;
  }
};

// IQ3_S, 110 bytes: d, qs[64] (low 8 bits of a 9-bit grid index per 4 weights), qh[8] (the indices' top bits,
// eight per group), signs[32] (a byte per 8 weights), scales[4] (a 4-bit s per group, low nibble first);
// w = d * (2s + 1) * grid * sign, grid bytes odd 1..15.
struct IQ3S {
  static constexpr int kValues = 256;
  static constexpr int kBytes = 110;
  static constexpr bool kMin = false;
  static __device__ __forceinline__ void head(const uint8_t* b, float& d, float& dmin) {
    d = ld_fp16(b);
    dmin = 0.0f;
  }
  static __device__ __forceinline__ void group(const uint8_t* b, int g, int (&q)[8], int (&sc)[2], int (&mn)[2]) {
    const uint8_t* qs = b + 2 + 8 * g;
    const uint32_t qh = b[66 + g];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t s = b[74 + 4 * g + k / 2] >> (4 * (k % 2));
      q[k] = apply_signs(kIq3sGrid[qs[k] | (((qh >> k) & 1) << 8)], s & 15);
    }
    sc[0] = sc[1] = 2 * static_cast<int>((b[106 + g / 2] >> (4 * (g % 2))) & 15) + 1;
    mn[0] = mn[1] = 0;
  }
};

// IQ2_XXS, 66 bytes: d, then per group two u32: four grid indices, and four 7-bit sign indices plus a 4-bit
// scale s in the top bits; w = d * (2s + 1) / 8 * grid * sign (the 8th sign bit makes the count of minus
// signs even).
struct IQ2XXS {
  static constexpr int kValues = 256;
  static constexpr int kBytes = 66;
  static constexpr bool kMin = false;
  static __device__ __forceinline__ void head(const uint8_t* b, float& d, float& dmin) {
    d = 0.125f * ld_fp16(b);
    dmin = 0.0f;
  }
  static __device__ __forceinline__ void group(const uint8_t* b, int g, int (&q)[8], int (&sc)[2], int (&mn)[2]) {
    const uint32_t grid = ld_u32_a2(b + 2 + 8 * g), signs = ld_u32_a2(b + 6 + 8 * g);
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      signed_row(kIq2xxsGrid[(grid >> (8 * l)) & 255], full_signs(signs, l), q[2 * l], q[2 * l + 1]);
    }
    sc[0] = sc[1] = 2 * static_cast<int>(signs >> 28) + 1;
    mn[0] = mn[1] = 0;
  }
};

// IQ3_XXS, 98 bytes: d, qs[64] (one grid index per 4 weights, grid bytes 4..62), then per group a u32 of four
// 7-bit sign indices and a 4-bit scale s in the top bits; w = d * (2s + 1) / 4 * grid * sign.
struct IQ3XXS {
  static constexpr int kValues = 256;
  static constexpr int kBytes = 98;
  static constexpr bool kMin = false;
  static __device__ __forceinline__ void head(const uint8_t* b, float& d, float& dmin) {
    d = 0.25f * ld_fp16(b);
    dmin = 0.0f;
  }
  static __device__ __forceinline__ void group(const uint8_t* b, int g, int (&q)[8], int (&sc)[2], int (&mn)[2]) {
    const uint8_t* qs = b + 2 + 8 * g;
    const uint32_t signs = ld_u32_a2(b + 66 + 4 * g);
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const uint32_t s = full_signs(signs, l);
      q[2 * l] = apply_signs(kIq3xxsGrid[qs[2 * l]], s & 15);
      q[2 * l + 1] = apply_signs(kIq3xxsGrid[qs[2 * l + 1]], s >> 4);
    }
    sc[0] = sc[1] = 2 * static_cast<int>(signs >> 28) + 1;
    mn[0] = mn[1] = 0;
  }
};

// Four IQ1 grid bytes (-1, 0, 1) g as 8 * g + delta (delta = +-1), signed int8.
__device__ __forceinline__ int iq1_values(uint32_t v, bool minus) {
  const uint32_t low = v & 0x01010101u, neg = (v >> 7) & 0x01010101u;
  const uint32_t g1 = (0x01010101u + low) - (neg << 1);   // g + 1 per byte: 0, 1, 2
  return to_signed(g1 << 3, minus ? 9 : 7);
}

// IQ1_S, 50 bytes: d, qs[32], qh[8] (a u16 per group: four 3-bit high grid-index bits, a 3-bit scale s, the
// delta sign in bit 15); per 8 weights an 11-bit index into the IQ1 grid. w = d * (2s + 1) * (grid +- 1/8),
// taken as d / 8 * (2s + 1) * (8 * grid + delta).
struct IQ1S {
  static constexpr int kValues = 256;
  static constexpr int kBytes = 50;
  static constexpr bool kMin = false;
  static __device__ __forceinline__ void head(const uint8_t* b, float& d, float& dmin) {
    d = 0.125f * ld_fp16(b);
    dmin = 0.0f;
  }
  static __device__ __forceinline__ void group(const uint8_t* b, int g, int (&q)[8], int (&sc)[2], int (&mn)[2]) {
    const uint8_t* qs = b + 2 + 4 * g;
    const uint32_t qh = ld_u16(b + 34 + 2 * g);
    const bool minus = (qh & 0x8000u) != 0;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const uint64_t row = kIq1sGrid[qs[l] | (((qh >> (3 * l)) & 7) << 8)];
      q[2 * l] = iq1_values(static_cast<uint32_t>(row), minus);
      q[2 * l + 1] = iq1_values(static_cast<uint32_t>(row >> 32), minus);
    }
    sc[0] = sc[1] = 2 * static_cast<int>((qh >> 12) & 7) + 1;
    mn[0] = mn[1] = 0;
  }
};

// IQ1_M, 56 bytes: qs[32], qh[16], scales[8]; per 8 weights an 11-bit grid index and a delta sign, per 16
// weights a 3-bit scale s; the fp16 d sits in the top nibbles of the four u16 scale words.
// w = d * (2s + 1) * (grid + delta / 8), taken as d / 8 * (2s + 1) * (8 * grid + delta).
struct IQ1M {
  static constexpr int kValues = 256;
  static constexpr int kBytes = 56;
  static constexpr bool kMin = false;
  static __device__ __forceinline__ void head(const uint8_t* b, float& d, float& dmin) {
    const uint32_t s0 = ld_u16(b + 48), s1 = ld_u16(b + 50), s2 = ld_u16(b + 52), s3 = ld_u16(b + 54);
    d = 0.125f * fp16_bits((s0 >> 12) | ((s1 >> 8) & 0x00F0u) | ((s2 >> 4) & 0x0F00u) | (s3 & 0xF000u));
    dmin = 0.0f;
  }
  static __device__ __forceinline__ void group(const uint8_t* b, int g, int (&q)[8], int (&sc)[2], int (&mn)[2]) {
    const uint8_t* qs = b + 4 * g;
    const uint32_t h0 = b[32 + 2 * g], h1 = b[33 + 2 * g];
    const uint32_t idx[4] = {qs[0] | ((h0 & 7) << 8), qs[1] | (((h0 >> 4) & 7) << 8), qs[2] | ((h1 & 7) << 8),
                             qs[3] | (((h1 >> 4) & 7) << 8)};
    const bool minus[4] = {(h0 & 0x08) != 0, (h0 & 0x80) != 0, (h1 & 0x08) != 0, (h1 & 0x80) != 0};
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const uint64_t row = kIq1sGrid[idx[l]];
      q[2 * l] = iq1_values(static_cast<uint32_t>(row), minus[l]);
      q[2 * l + 1] = iq1_values(static_cast<uint32_t>(row >> 32), minus[l]);
    }
    const uint32_t w = ld_u16(b + 48 + 2 * (g / 2)) >> (6 * (g % 2));
    sc[0] = 2 * static_cast<int>(w & 7) + 1;
    sc[1] = 2 * static_cast<int>((w >> 3) & 7) + 1;
    mn[0] = mn[1] = 0;
  }
};

// IQ4_XS, 136 bytes: d, scales_h (u16), scales_l[4], qs[128]; per group a 6-bit scale minus 32; weights are
// the 16 non-linear IQ4_NL values indexed by nibbles (16 low nibbles, then 16 high).
struct IQ4XS {
  static constexpr int kValues = 256;
  static constexpr int kBytes = 136;
  static constexpr bool kMin = false;
  static __device__ __forceinline__ void head(const uint8_t* b, float& d, float& dmin) {
    d = ld_fp16(b);
    dmin = 0.0f;
  }
  static __device__ __forceinline__ void group(const uint8_t* b, int g, int (&q)[8], int (&sc)[2], int (&mn)[2]) {
    const uint8_t* qs = b + 8 + 16 * g;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t v = ld_u32(qs + 4 * k);
      q[k] = lookup4(kIq4nlValues, v, 0);
      q[k + 4] = lookup4(kIq4nlValues, v, 4);
    }
    const int ls = ((b[4 + g / 2] >> (4 * (g % 2))) & 15) | (((ld_u16(b + 2) >> (2 * g)) & 3) << 4);
    sc[0] = sc[1] = ls - 32;
    mn[0] = mn[1] = 0;
  }
};

}  // namespace pmq
