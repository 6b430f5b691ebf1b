// Block decoders of the GGUF weight types (layouts: SPECS.md section 4, ggml-common.h), read straight from raw
// blocks in device memory; nothing is ever expanded to a float weight.
//
// The integer types give 32 weights at a time as 8 words of packed signed int8 (weight i in byte i % 4 of
// word i / 4), the form __dp4a takes. Offsets (Q4_0's -8, Q6_K's -32, ...) are applied to the weights here,
// so a dot with int8 activations is the exact integer the CPU kernels form (they subtract the offset from
// activation sums instead: the same integer). Families:
//   32-value blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4): scale(b), quants(b, q); w = scale * q, and
//     where the type has a min (kMin: Q4_1, Q5_1), min(b): w = scale * q + min (q unsigned); the kernels add
//     min * s, s the activation block's fp16-rounded scaled sum (llama.cpp's Q8_1 s; matmul.cu).
//   64-value blocks with a scale per 16 (NVFP4), read in 32-value halves h (0, 1) under Q8_0 activations:
//     scales(b, h, d) gives the scales of the half's two 16s, quants(b, h, q) its 32 weights; w = d[k] * q.
//   128-value blocks with one scale (Q1_0), read in 32-value pieces p (0..3) under Q8_0 activations:
//     scale(b), quants(b, p, q); w = scale * q.
//   256-value super-blocks (k-quants, IQ types, TQ2_0 / TQ1_0): head(b, d, dmin), group(b, g, q, sc, mn) for
//     the 32 weights of group g (0..7), one scale per 16 weights (sc[0], sc[1]) and, where the type has mins
//     (kMin), one min per 16 (mn[]); w = d * sc * q + dmin * mn (dmin holds the negated min scale, as in
//     kfamily.h).
//   Float rows (F32, F16, BF16): load(row, i).
// Alignment: rows of Q4_1, Q5_1, NVFP4, Q4_K, Q5_K, Q2_K, IQ1_M, IQ4_XS and F32 start 4-byte aligned; every
// other type but MXFP4 (any alignment) needs 2 bytes. Row starts of [rows, row_bytes] matrices keep that by
// construction.
#pragma once

#include "common.cuh"

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
  static constexpr bool kMin = false;
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

// Q4_1, 20 bytes: d, m, qs[16] (nibbles as Q4_0); w = d * q + m.
struct Q4_1 {
  static constexpr int kValues = 32;
  static constexpr int kBytes = 20;
  static constexpr bool kMin = true;
  static __device__ __forceinline__ float scale(const uint8_t* b) { return ld_fp16(b); }
  static __device__ __forceinline__ float min(const uint8_t* b) { return ld_fp16(b + 2); }
  static __device__ __forceinline__ void quants(const uint8_t* b, int (&q)[8]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t v = ld_u32(b + 4 + 4 * k);
      q[k] = static_cast<int>(v & 0x0F0F0F0Fu);
      q[k + 4] = static_cast<int>((v >> 4) & 0x0F0F0F0Fu);
    }
  }
};

// IQ4_NL, 18 bytes: d, qs[16] (nibbles as Q4_0); w = d * kIq4nlValues[nibble].
struct IQ4NL {
  static constexpr int kValues = 32;
  static constexpr int kBytes = 18;
  static constexpr bool kMin = false;
  static __device__ __forceinline__ float scale(const uint8_t* b) { return ld_fp16(b); }
  static __device__ __forceinline__ void quants(const uint8_t* b, int (&q)[8]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t v = ld_u32_a2(b + 2 + 4 * k);
      q[k] = lookup4(kIq4nlValues, v, 0);
      q[k + 4] = lookup4(kIq4nlValues, v, 4);
    }
  }
};

// Q5_0, 22 bytes: d, qh (bit i = bit 4 of weight i), qs[16]; w = d * (q - 16).
struct Q5_0 {
  static constexpr int kValues = 32;
  static constexpr int kBytes = 22;
  static constexpr bool kMin = false;
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

// Q5_1, 24 bytes: d, m, qh (bit i = bit 4 of weight i), qs[16]; w = d * q + m.
struct Q5_1 {
  static constexpr int kValues = 32;
  static constexpr int kBytes = 24;
  static constexpr bool kMin = true;
  static __device__ __forceinline__ float scale(const uint8_t* b) { return ld_fp16(b); }
  static __device__ __forceinline__ float min(const uint8_t* b) { return ld_fp16(b + 2); }
  static __device__ __forceinline__ void quants(const uint8_t* b, int (&q)[8]) {
    const uint32_t qh = ld_u32(b + 4);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t v = ld_u32(b + 8 + 4 * k);
      q[k] = static_cast<int>((v & 0x0F0F0F0Fu) | (spread4((qh >> (4 * k)) & 15) << 4));
      q[k + 4] = static_cast<int>(((v >> 4) & 0x0F0F0F0Fu) | (spread4((qh >> (16 + 4 * k)) & 15) << 4));
    }
  }
};

// Q8_0, 34 bytes: d, int8 qs[32].
struct Q8_0 {
  static constexpr int kValues = 32;
  static constexpr int kBytes = 34;
  static constexpr bool kMin = false;
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
  static constexpr bool kMin = false;
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

// ---- 64-value blocks, a scale per 16 (Q8_0 activations) ----

// NVFP4, 36 bytes: UE4M3 scales d[4] (one per 16 weights), qs[32] (16-weight sub-block s in bytes 8s..8s+7:
// byte j low nibble = weight 16s + j, high = 16s + 8 + j); w = e2m1[q] * d_s, taken as doubled e2m1 values
// times half of d_s, as the CPU kernel does.
struct NVFP4 {
  static constexpr int kValues = 64;
  static constexpr int kBytes = 36;
  static constexpr bool kMin = false;
  // Half of UE4M3 byte x (bit 7 ignored; 0x7F, its NaN, gives 0): m * 2^-10 for exponent field 0, else the
  // 7 bits as a float's exponent and top mantissa bits, rebiased by 127 - 8.
  static __device__ __forceinline__ float ue4m3_half(uint32_t x) {
    const uint32_t e = x & 0x7F;
    if (x == 0x7F) return 0.0f;
    if (e < 8) return static_cast<float>(e) * 0x1p-10f;
    return __int_as_float(static_cast<int>((e << 20) + (119u << 23)));
  }
  static __device__ __forceinline__ void scales(const uint8_t* b, int h, float (&d)[2]) {
    d[0] = ue4m3_half(b[2 * h]);
    d[1] = ue4m3_half(b[2 * h + 1]);
  }
  // Weights 32h..32h+31: sub-blocks 2h and 2h + 1, each its 8 low nibbles then its 8 high ones.
  static __device__ __forceinline__ void quants(const uint8_t* b, int h, int (&q)[8]) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const uint32_t v = ld_u32(b + 4 + 16 * h + 8 * s + 4 * k);
        q[4 * s + k] = lookup4(kMxfp4Values, v, 0);
        q[4 * s + k + 2] = lookup4(kMxfp4Values, v, 4);
      }
    }
  }
};

// ---- 128-value blocks, one scale (Q8_0 activations) ----

// Q1_0, 18 bytes: d, qs[16] (bit v % 8 of byte v / 8 set: w = d, else -d), read in 32-value pieces p (0..3),
// the float step per piece.
struct Q1_0 {
  static constexpr int kValues = 128;
  static constexpr int kBytes = 18;
  static constexpr bool kMin = false;
  static __device__ __forceinline__ float scale(const uint8_t* b) { return ld_fp16(b); }
  // Weights 32p..32p+31: bit i of the piece's word as byte i % 4 of word i / 4, +1 or -1.
  static __device__ __forceinline__ void quants(const uint8_t* b, int p, int (&q)[8]) {
    const uint32_t bits = ld_u32_a2(b + 2 + 4 * p);
#pragma unroll
    for (int k = 0; k < 8; ++k) q[k] = to_signed(2 * spread4((bits >> (4 * k)) & 15), 1);
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

#include "quant_k.cuh"
#include "quant_iq.cuh"
