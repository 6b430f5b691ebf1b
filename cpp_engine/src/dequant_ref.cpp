// Plain scalar dequantization, written from the block layouts alone (no SIMD, no shared decoders):
// the reference the C++ tests hold the kernels to, and a debugging aid from Python.
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "iq_tables.h"
#include "pocketmoe/matmul.h"
#include "pocketmoe/types.h"

namespace pocketmoe {
namespace {

float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(man), -24);
  } else if (exp == 31) {
    v = man ? NAN : INFINITY;
  } else {
    v = std::ldexp(static_cast<float>(man | 0x400), static_cast<int>(exp) - 25);
  }
  return sign ? -v : v;
}

uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

uint16_t u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

int grid_value(uint64_t row, int j) { return static_cast<int8_t>((row >> (8 * j)) & 0xFF); }

void k4_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

void q4_0(const uint8_t* b, float* y) {
  const float d = half(b);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * ((b[2 + j] & 0x0F) - 8);
    y[j + 16] = d * ((b[2 + j] >> 4) - 8);
  }
}

void q5_0(const uint8_t* b, float* y) {
  const float d = half(b);
  const uint32_t qh = u32(b + 2);
  for (int j = 0; j < 16; ++j) {
    const int h0 = static_cast<int>((qh >> j) & 1), h1 = static_cast<int>((qh >> (j + 16)) & 1);
    y[j] = d * (((b[6 + j] & 0x0F) | (h0 << 4)) - 16);
    y[j + 16] = d * (((b[6 + j] >> 4) | (h1 << 4)) - 16);
  }
}

void q4_1(const uint8_t* b, float* y) {
  const float d = half(b), m = half(b + 2);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * (b[4 + j] & 0x0F) + m;
    y[j + 16] = d * (b[4 + j] >> 4) + m;
  }
}

void q5_1(const uint8_t* b, float* y) {
  const float d = half(b), m = half(b + 2);
  const uint32_t qh = u32(b + 4);
  for (int j = 0; j < 16; ++j) {
    const int h0 = static_cast<int>((qh >> j) & 1), h1 = static_cast<int>((qh >> (j + 16)) & 1);
    y[j] = d * ((b[8 + j] & 0x0F) | (h0 << 4)) + m;
    y[j + 16] = d * ((b[8 + j] >> 4) | (h1 << 4)) + m;
  }
}

void q8_0(const uint8_t* b, float* y) {
  const float d = half(b);
  for (int j = 0; j < 32; ++j) y[j] = d * static_cast<int8_t>(b[2 + j]);
}

void mxfp4(const uint8_t* b, float* y) {
  static const float kE2m1[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, 0, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  const float d = std::ldexp(1.0f, static_cast<int>(b[0]) - 127);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * kE2m1[b[1 + j] & 0x0F];
    y[j + 16] = d * kE2m1[b[1 + j] >> 4];
  }
}

// NVFP4: a UE4M3 scale per 16 values (unsigned: 4 exponent bits, bias 7, 3 mantissa bits; 0x7F reads as 0).
void nvfp4(const uint8_t* b, float* y) {
  static const float kE2m1[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, 0, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (int s = 0; s < 4; ++s) {
    const int x = b[s], e = (x >> 3) & 15, m = x & 7;
    const float d = x == 0x7F ? 0.0f : e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
    for (int j = 0; j < 8; ++j) {
      y[16 * s + j] = d * kE2m1[b[4 + 8 * s + j] & 0x0F];
      y[16 * s + 8 + j] = d * kE2m1[b[4 + 8 * s + j] >> 4];
    }
  }
}

// Q1_0: d, qs[16]; bit v % 8 of qs[v / 8] set: w = d, else -d.
void q1_0(const uint8_t* b, float* y) {
  const float d = half(b);
  for (int v = 0; v < 128; ++v) y[v] = (b[2 + v / 8] >> (v % 8)) & 1 ? d : -d;
}

void q2_k(const uint8_t* b, float* y) {
  const float d = half(b + 80), dmin = half(b + 82);
  for (int v = 0; v < 256; ++v) {
    const int half_ = v / 128, shift = (v % 128) / 32, l = v % 32;
    const int q = (b[16 + 32 * half_ + l] >> (2 * shift)) & 3;
    const uint8_t s = b[v / 16];
    y[v] = d * (s & 0x0F) * q - dmin * (s >> 4);
  }
}

// TQ2_0: qs[64] (a 2-bit q per weight, laid out as Q2_K's), d; w = d * (q - 1).
void tq2_0(const uint8_t* b, float* y) {
  const float d = half(b + 64);
  for (int v = 0; v < 256; ++v) {
    const int half_ = v / 128, shift = (v % 128) / 32, l = v % 32;
    y[v] = d * (((b[32 * half_ + l] >> (2 * shift)) & 3) - 1);
  }
}

// TQ1_0: qs[48], qh[4], d. Digit n of byte x (a base-3 fixed-point fraction) is (3 * (x * 3^n mod 256)) >> 8;
// values 0-159 are digit v / 32 of qs[v % 32], 160-239 digit (v - 160) / 16 of qs[32 + v % 16], 240-255 digit
// (v - 240) / 4 of qh[v % 4]; w = d * (digit - 1).
void tq1_0(const uint8_t* b, float* y) {
  const float d = half(b + 52);
  const int pow3[5] = {1, 3, 9, 27, 81};
  for (int v = 0; v < 256; ++v) {
    int x, n;
    if (v < 160) {
      x = b[v % 32], n = v / 32;
    } else if (v < 240) {
      x = b[32 + (v - 160) % 16], n = (v - 160) / 16;
    } else {
      x = b[48 + (v - 240) % 4], n = (v - 240) / 4;
    }
    const int digit = (3 * ((x * pow3[n]) & 0xFF)) >> 8;
    y[v] = d * (digit - 1);
  }
}

void q3_k(const uint8_t* b, float* y) {
  const float d = half(b + 108);
  const uint8_t* s = b + 96;
  for (int v = 0; v < 256; ++v) {
    const int i = v / 16;
    const int low = i < 8 ? s[i] & 0x0F : s[i - 8] >> 4;
    const int high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    const int scale = (low | (high << 4)) - 32;
    const int half_ = v / 128, shift = (v % 128) / 32, l = v % 32;
    const int ql = (b[32 + 32 * half_ + l] >> (2 * shift)) & 3;
    const int hbit = (b[l] >> (v / 32)) & 1;
    y[v] = d * scale * (ql - (hbit ? 0 : 4));
  }
}

void q4_k(const uint8_t* b, float* y) {
  const float d = half(b), dmin = half(b + 2);
  for (int v = 0; v < 256; ++v) {
    const int j = v / 32, l = v % 32;
    int sc, mn;
    k4_scale_min(b + 4, j, sc, mn);
    const int q = j % 2 == 0 ? b[16 + 32 * (j / 2) + l] & 0x0F : b[16 + 32 * (j / 2) + l] >> 4;
    y[v] = d * sc * q - dmin * mn;
  }
}

void q5_k(const uint8_t* b, float* y) {
  const float d = half(b), dmin = half(b + 2);
  for (int v = 0; v < 256; ++v) {
    const int j = v / 32, l = v % 32;
    int sc, mn;
    k4_scale_min(b + 4, j, sc, mn);
    const int lo = j % 2 == 0 ? b[48 + 32 * (j / 2) + l] & 0x0F : b[48 + 32 * (j / 2) + l] >> 4;
    const int q = lo | (((b[16 + l] >> j) & 1) << 4);
    y[v] = d * sc * q - dmin * mn;
  }
}

void q6_k(const uint8_t* b, float* y) {
  const float d = half(b + 208);
  for (int v = 0; v < 256; ++v) {
    const int n = v / 128, s = (v % 128) / 32, l = v % 32;
    const uint8_t ql = b[64 * n + 32 * (s % 2) + l];
    const int lo = s < 2 ? ql & 0x0F : ql >> 4;
    const int hi = (b[128 + 32 * n + l] >> (2 * s)) & 3;
    y[v] = d * static_cast<int8_t>(b[192 + v / 16]) * ((lo | (hi << 4)) - 32);
  }
}

// Sign j (bit j of s8) as +1 / -1.
float sign_of(uint32_t s8, int j) { return (s8 >> j) & 1 ? -1.0f : 1.0f; }

// A 7-bit sign index widened to the 8 signs it stands for: bit 7 makes the count of negatives even.
uint32_t signs8(uint32_t s7) { return s7 | ((__builtin_popcount(s7) & 1) << 7); }

void iq2_xxs(const uint8_t* b, float* y) {
  const float d = half(b);
  for (int g = 0; g < 8; ++g) {
    const uint32_t grid = u32(b + 2 + 8 * g), signs = u32(b + 6 + 8 * g);
    const float db = d * (0.5f + static_cast<float>(signs >> 28)) * 0.25f;
    for (int l = 0; l < 4; ++l) {
      const uint64_t row = tables::kIq2xxs[(grid >> (8 * l)) & 0xFF];
      const uint32_t s8 = signs8((signs >> (7 * l)) & 127);
      for (int j = 0; j < 8; ++j) y[32 * g + 8 * l + j] = db * grid_value(row, j) * sign_of(s8, j);
    }
  }
}

void iq1_m(const uint8_t* b, float* y) {
  uint16_t s[4];
  for (int i = 0; i < 4; ++i) s[i] = u16(b + 48 + 2 * i);
  uint8_t dh[2];
  const uint16_t dbits = static_cast<uint16_t>((s[0] >> 12) | ((s[1] >> 8) & 0xF0) | ((s[2] >> 4) & 0xF00) | (s[3] & 0xF000));
  std::memcpy(dh, &dbits, 2);
  const float d = half(dh);
  for (int k = 0; k < 32; ++k) {
    const int nib = (b[32 + k / 2] >> (4 * (k % 2))) & 0x0F;
    const uint64_t row = tables::kIq1Grid[b[k] | ((nib & 7) << 8)];
    const float delta = nib & 8 ? -0.125f : 0.125f;
    const int i = k / 2;
    const float dl = d * static_cast<float>(2 * ((s[i / 4] >> (3 * (i % 4))) & 7) + 1);
    for (int j = 0; j < 8; ++j) y[8 * k + j] = dl * (grid_value(row, j) + delta);
  }
}

void iq3_xxs(const uint8_t* b, float* y) {
  const float d = half(b);
  for (int g = 0; g < 8; ++g) {
    const uint32_t signs = u32(b + 66 + 4 * g);
    const float db = d * (0.5f + static_cast<float>(signs >> 28)) * 0.5f;
    for (int l = 0; l < 4; ++l) {
      const uint32_t s8 = signs8((signs >> (7 * l)) & 127);
      for (int j = 0; j < 8; ++j) {
        const uint32_t row = tables::kIq3xxs[b[2 + 8 * g + 2 * l + j / 4]];
        const int v = static_cast<int>((row >> (8 * (j % 4))) & 0xFF);
        y[32 * g + 8 * l + j] = db * v * sign_of(s8, j);
      }
    }
  }
}

void iq2_xs(const uint8_t* b, float* y) {
  const float d = half(b);
  for (int k = 0; k < 32; ++k) {
    const uint32_t v = u16(b + 2 + 2 * k);
    const float dl = d * (0.5f + static_cast<float>((b[66 + k / 4] >> (4 * (k % 4 / 2))) & 15)) * 0.25f;
    const uint32_t s8 = signs8(v >> 9);
    for (int j = 0; j < 8; ++j) y[8 * k + j] = dl * grid_value(tables::kIq2xs[v & 511], j) * sign_of(s8, j);
  }
}

void iq2_s(const uint8_t* b, float* y) {
  const float d = half(b);
  for (int k = 0; k < 32; ++k) {
    const int g = k / 4, l = k % 4;
    const float dl = d * (0.5f + static_cast<float>((b[74 + g] >> (4 * (l / 2))) & 15)) * 0.25f;
    const uint64_t row = tables::kIq2s[b[2 + k] | (((b[66 + g] >> (2 * l)) & 3) << 8)];
    for (int j = 0; j < 8; ++j) y[8 * k + j] = dl * grid_value(row, j) * sign_of(b[34 + k], j);
  }
}

void iq3_s(const uint8_t* b, float* y) {
  const float d = half(b);
  for (int k = 0; k < 64; ++k) {
    const int g = k / 8;
    const float dl = d * static_cast<float>(1 + 2 * ((b[106 + g / 2] >> (4 * (g % 2))) & 15));
    const uint32_t row = tables::kIq3s[b[2 + k] | (((b[66 + g] >> (k % 8)) & 1) << 8)];
    for (int j = 0; j < 4; ++j)
      y[4 * k + j] = dl * static_cast<float>((row >> (8 * j)) & 0xFF) * sign_of(b[74 + k / 2], 4 * (k % 2) + j);
  }
}

void iq1_s(const uint8_t* b, float* y) {
  const float d = half(b);
  for (int g = 0; g < 8; ++g) {
    const uint32_t qh = u16(b + 34 + 2 * g);
    const float dl = d * static_cast<float>(2 * ((qh >> 12) & 7) + 1);
    const float delta = qh & 0x8000 ? -0.125f : 0.125f;
    for (int l = 0; l < 4; ++l) {
      const uint64_t row = tables::kIq1Grid[b[2 + 4 * g + l] | (((qh >> (3 * l)) & 7) << 8)];
      for (int j = 0; j < 8; ++j) y[32 * g + 8 * l + j] = dl * (grid_value(row, j) + delta);
    }
  }
}

const int kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

void iq4_nl(const uint8_t* b, float* y) {
  const float d = half(b);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * kIq4nlValues[b[2 + j] & 0x0F];
    y[j + 16] = d * kIq4nlValues[b[2 + j] >> 4];
  }
}

void iq4_xs(const uint8_t* b, float* y) {
  const float d = half(b);
  const uint32_t sh = u16(b + 2);
  for (int j = 0; j < 8; ++j) {
    const int ls = (((b[4 + j / 2] >> (4 * (j % 2))) & 0x0F) | (((sh >> (2 * j)) & 3) << 4)) - 32;
    const float dl = d * ls;
    for (int l = 0; l < 16; ++l) {
      y[32 * j + l] = dl * kIq4nlValues[b[8 + 16 * j + l] & 0x0F];
      y[32 * j + 16 + l] = dl * kIq4nlValues[b[8 + 16 * j + l] >> 4];
    }
  }
}

}  // namespace

void dequantize_row(int ggml_type, const uint8_t* src, int n, float* dst) {
  const TypeInfo& t = type_info(ggml_type);
  if (n % t.block_values != 0) throw std::invalid_argument("dequantize_row: n is not a multiple of the block size");
  if (t.block_values == 1) {
    for (int i = 0; i < n; ++i) {
      if (ggml_type == kF32) {
        std::memcpy(dst + i, src + 4 * i, 4);
      } else if (ggml_type == kF16) {
        dst[i] = half(src + 2 * i);
      } else {
        const uint32_t bits = uint32_t{u16(src + 2 * i)} << 16;
        std::memcpy(dst + i, &bits, 4);
      }
    }
    return;
  }
  void (*block)(const uint8_t*, float*) = nullptr;
  switch (ggml_type) {
    case kQ4_0: block = q4_0; break;
    case kQ5_0: block = q5_0; break;
    case kQ4_1: block = q4_1; break;
    case kQ5_1: block = q5_1; break;
    case kQ8_0: block = q8_0; break;
    case kMXFP4: block = mxfp4; break;
    case kNVFP4: block = nvfp4; break;
    case kQ1_0: block = q1_0; break;
    case kQ2_K: block = q2_k; break;
    case kQ3_K: block = q3_k; break;
    case kTQ1_0: block = tq1_0; break;
    case kTQ2_0: block = tq2_0; break;
    case kQ4_K: block = q4_k; break;
    case kQ5_K: block = q5_k; break;
    case kQ6_K: block = q6_k; break;
    case kIQ2_XXS: block = iq2_xxs; break;
    case kIQ1_M: block = iq1_m; break;
    case kIQ3_XXS: block = iq3_xxs; break;
    case kIQ1_S: block = iq1_s; break;
    case kIQ2_XS: block = iq2_xs; break;
    case kIQ2_S: block = iq2_s; break;
    case kIQ3_S: block = iq3_s; break;
    case kIQ4_XS: block = iq4_xs; break;
    case kIQ4_NL: block = iq4_nl; break;
    default: throw std::invalid_argument("dequantize_row: no reference for this type");
  }
  for (int i = 0; i < n / t.block_values; ++i) block(src + static_cast<size_t>(i) * t.block_bytes, dst + i * t.block_values);
}

}  // namespace pocketmoe
