// Block decoders of the GGUF weight types (layouts: SPECS.md section 4, ggml-common.h), read straight from raw
// blocks in device memory; nothing is ever expanded to a float weight.
//
// The integer types give 32 weights at a time as 8 words of packed signed int8 (weight i in byte i % 4 of
// word i / 4), the form __dp4a takes. Offsets (Q4_0's -8, Q6_K's -32, ...) are applied to the weights here,
// so a dot with int8 activations is the exact integer the CPU kernels form (they subtract the offset from
// activation sums instead: the same integer). Families:
//   32-value blocks (Q4_0, Q5_0, Q8_0, MXFP4): scale(b), quants(b, q); w = scale * q.
//   256-value super-blocks (k-quants, IQ types): head(b, d, dmin), group(b, g, q, sc, mn) for the 32 weights
//     of group g (0..7), one scale per 16 weights (sc[0], sc[1]) and, where the type has mins (kMin), one
//     min per 16 (mn[]); w = d * sc * q + dmin * mn (dmin holds the negated min scale, as in kfamily.h).
//   Float rows (F32, F16, BF16): load(row, i).
// Alignment: rows of Q4_K, Q5_K, Q2_K, IQ1_M, IQ4_XS and F32 start 4-byte aligned; every other type but
// MXFP4 (any alignment) needs 2 bytes. Row starts of [rows, row_bytes] matrices keep that by construction.
#pragma once

#include "common.cuh"
#include "iq_tables.cuh"

namespace pmq {

__device__ __forceinline__ uint32_t ld_u16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }

__device__ __forceinline__ uint32_t ld_u32(const uint8_t* p) { return *reinterpret_cast<const uint32_t*>(p); }

// Four bytes from a 2-byte aligned address.
__device__ __forceinline__ uint32_t ld_u32_a2(const uint8_t* p) { return ld_u16(p) | (ld_u16(p + 2) << 16); }

__device__ __forceinline__ float fp16_bits(uint32_t bits) {
  __half_raw r;
  r.x = static_cast<unsigned short>(bits);
  return __half2float(__half(r));
}

__device__ __forceinline__ float ld_fp16(const uint8_t* p) { return fp16_bits(ld_u16(p)); }

// Bytes of x (each below 128 + off) minus off, as signed int8: no byte carries into the next.
__device__ __forceinline__ int to_signed(uint32_t x, uint32_t off) {
  return static_cast<int>((x + (128u - off) * 0x01010101u) ^ 0x80808080u);
}

// Bit j of the 4-bit x into bit 0 of byte j (the four shifted copies do not overlap, so nothing carries).
__device__ __forceinline__ uint32_t spread4(uint32_t x) { return (x * 0x00204081u) & 0x01010101u; }

// Bytes 0..3 of v negated where bit j of s4 is set (bytes are never 0, so +1 never carries).
__device__ __forceinline__ int apply_signs(uint32_t v, uint32_t s4) {
  const uint32_t m = spread4(s4) * 0xFFu;
  return static_cast<int>((v ^ m) + (m & 0x01010101u));
}

// Four table entries (int8) indexed by the nibbles (shift 0 or 4) of the four bytes of x, packed as a word.
__device__ __forceinline__ int lookup4(const int8_t* table, uint32_t x, int shift) {
  uint32_t out = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) out |= static_cast<uint32_t>(static_cast<uint8_t>(table[(x >> (8 * j + shift)) & 15])) << (8 * j);
  return static_cast<int>(out);
}

static __device__ const int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static __device__ const int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                   1,    13,   25,  38,  53,  69,  89,  113};

// ---- 32-value blocks (Q8_0 activations) ----

// Q4_0, 18 bytes: d, qs[16] (low nibbles = weights 0-15, high = 16-31); w = d * (q - 8).
struct Q4_0 {
  static constexpr int kValues = 32;
  static constexpr int kBytes = 18;
  static __device__ __forceinline__ float scale(const uint8_t* b) { return ld_fp16(b); }
  static __device__ __forceinline__ void quants(const uint8_t* b, int (&q)[8]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t v = ld_u32_a2(b + 2 + 4 * k);
      q[k] = to_signed(v & 0x0F0F0F0Fu, 8);
      q[k + 4] = to_signed((v >> 4) & 0x0F0F0F0Fu, 8);
    }
  }
};

// Q5_0, 22 bytes: d, qh (bit i = bit 4 of weight i), qs[16]; w = d * (q - 16).
struct Q5_0 {
  static constexpr int kValues = 32;
  static constexpr int kBytes = 22;
  static __device__ __forceinline__ float scale(const uint8_t* b) { return ld_fp16(b); }
  static __device__ __forceinline__ void quants(const uint8_t* b, int (&q)[8]) {
    const uint32_t qh = ld_u32_a2(b + 2);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t v = ld_u32_a2(b + 6 + 4 * k);
      q[k] = to_signed((v & 0x0F0F0F0Fu) | (spread4((qh >> (4 * k)) & 15) << 4), 16);
      q[k + 4] = to_signed(((v >> 4) & 0x0F0F0F0Fu) | (spread4((qh >> (16 + 4 * k)) & 15) << 4), 16);
    }
  }
};

// Q8_0, 34 bytes: d, int8 qs[32].
struct Q8_0 {
  static constexpr int kValues = 32;
  static constexpr int kBytes = 34;
  static __device__ __forceinline__ float scale(const uint8_t* b) { return ld_fp16(b); }
  static __device__ __forceinline__ void quants(const uint8_t* b, int (&q)[8]) {
#pragma unroll
    for (int k = 0; k < 8; ++k) q[k] = static_cast<int>(ld_u32_a2(b + 2 + 4 * k));
  }
};

// MXFP4, 17 bytes: E8M0 exponent e, qs[16] (weight j low nibble, j + 16 high); w = e2m1[q] * 2^(e - 127),
// taken as doubled e2m1 values times 2^(e - 128), as the CPU kernel does.
struct MXFP4 {
  static constexpr int kValues = 32;
  static constexpr int kBytes = 17;
  static __device__ __forceinline__ float scale(const uint8_t* b) {
    const uint32_t e = b[0];
    return __int_as_float(static_cast<int>(e < 2 ? 0x00200000u << e : (e - 1) << 23));
  }
  static __device__ __forceinline__ void quants(const uint8_t* b, int (&q)[8]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint8_t* p = b + 1 + 4 * k;
      const uint32_t v = p[0] | (p[1] << 8) | (p[2] << 16) | (static_cast<uint32_t>(p[3]) << 24);
      q[k] = lookup4(kMxfp4Values, v, 0);
      q[k + 4] = lookup4(kMxfp4Values, v, 4);
    }
  }
};

// ---- 256-value super-blocks (Q8_K activations) ----

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
    const uint8_t* qs = b + 16 + 32 * (g / 4);
    const int shift = 2 * (g % 4);
#pragma unroll
    for (int k = 0; k < 8; ++k) q[k] = static_cast<int>((ld_u32(qs + 4 * k) >> shift) & 0x03030303u);
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
    const uint8_t* qs = b + 32 + 32 * (g / 4);
    const int shift = 2 * (g % 4);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t lo = (ld_u32_a2(qs + 4 * k) >> shift) & 0x03030303u;
      const uint32_t hi = (ld_u32_a2(b + 4 * k) >> g) & 0x01010101u;
      q[k] = to_signed(lo | (hi << 2), 4);
    }
    sc[0] = scale6(b, 2 * g);
    sc[1] = scale6(b, 2 * g + 1);
    mn[0] = mn[1] = 0;
  }
};

// Q4_K / Q5_K: the 6-bit scale and min of group g from scales[12] at s.
__device__ __forceinline__ void scale_min_k4(const uint8_t* s, int g, int& sc, int& m) {
  if (g < 4) {
    sc = s[g] & 63;
    m = s[g + 4] & 63;
  } else {
    sc = (s[g + 4] & 15) | ((s[g - 4] >> 6) << 4);
    m = (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
  }
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
    const uint8_t* qs = b + 16 + 32 * (g / 2);
    const int shift = 4 * (g % 2);
#pragma unroll
    for (int k = 0; k < 8; ++k) q[k] = static_cast<int>((ld_u32(qs + 4 * k) >> shift) & 0x0F0F0F0Fu);
    int s, m;
    scale_min_k4(b + 4, g, s, m);
    sc[0] = sc[1] = s;
    mn[0] = mn[1] = m;
  }
};

// Q5_K, 176 bytes: d, dmin, scales[12], qh[32], qs[128]; bit g of qh[l] is bit 4 of weight 32g + l.
struct Q5K {
  static constexpr int kValues = 256;
  static constexpr int kBytes = 176;
  static constexpr bool kMin = true;
  static __device__ __forceinline__ void head(const uint8_t* b, float& d, float& dmin) { Q4K::head(b, d, dmin); }
  static __device__ __forceinline__ void group(const uint8_t* b, int g, int (&q)[8], int (&sc)[2], int (&mn)[2]) {
    const uint8_t* qs = b + 48 + 32 * (g / 2);
    const int shift = 4 * (g % 2);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t lo = (ld_u32(qs + 4 * k) >> shift) & 0x0F0F0F0Fu;
      const uint32_t hi = (ld_u32(b + 16 + 4 * k) >> g) & 0x01010101u;
      q[k] = static_cast<int>(lo | (hi << 4));
    }
    int s, m;
    scale_min_k4(b + 4, g, s, m);
    sc[0] = sc[1] = s;
    mn[0] = mn[1] = m;
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
    const uint8_t* ql = b + 64 * half + 32 * (sub % 2);
    const uint8_t* qh = b + 128 + 32 * half;
    const int shift = 4 * (sub / 2);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t lo = (ld_u32_a2(ql + 4 * k) >> shift) & 0x0F0F0F0Fu;
      const uint32_t hi = ((ld_u32_a2(qh + 4 * k) >> (2 * sub)) & 0x03030303u) << 4;
      q[k] = to_signed(lo | hi, 32);
    }
    const int8_t* s = reinterpret_cast<const int8_t*>(b + 192 + 8 * half + 2 * sub);
    sc[0] = s[0];
    sc[1] = s[1];
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
      const uint64_t row = kIq2xxsGrid[(grid >> (8 * l)) & 255];
      uint32_t s = (signs >> (7 * l)) & 127;
      uint32_t parity = s ^ (s >> 4);
      parity ^= parity >> 2;
      parity ^= parity >> 1;
      s |= (parity & 1) << 7;
      q[2 * l] = apply_signs(static_cast<uint32_t>(row), s & 15);
      q[2 * l + 1] = apply_signs(static_cast<uint32_t>(row >> 32), s >> 4);
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

// ---- float rows (float activations) ----

struct F32 {
  static constexpr int kValues = 1;
  static constexpr int kBytes = 4;
  static __device__ __forceinline__ float load(const uint8_t* row, int i) {
    return reinterpret_cast<const float*>(row)[i];
  }
};

struct F16 {
  static constexpr int kValues = 1;
  static constexpr int kBytes = 2;
  static __device__ __forceinline__ float load(const uint8_t* row, int i) { return ld_fp16(row + 2 * i); }
};

struct BF16 {
  static constexpr int kValues = 1;
  static constexpr int kBytes = 2;
  static __device__ __forceinline__ float load(const uint8_t* row, int i) {
    return __int_as_float(static_cast<int>(ld_u16(row + 2 * i) << 16));
  }
};

}  // namespace pmq
