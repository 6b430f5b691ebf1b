// Decoders of the k-quant super-blocks (Q2_K..Q6_K); the interface is described in quant.cuh.
#pragma once

// Included by quant.cuh (after its helpers), not on its own.

namespace pmq {

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

}  // namespace pmq
