#include "pocketmoe/samples.h"

#include <immintrin.h>

#include <cstring>

#include "pocketmoe/types.h"

namespace pocketmoe::samples {
namespace {

uint16_t half_bits(float v) { return _cvtss_sh(v, 0); }

void put_u16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }

}  // namespace

std::vector<float> random_floats(size_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& f : v) f = dist(rng);
  return v;
}

std::vector<uint8_t> random_weight(int ggml_type, int rows, int cols, std::mt19937& rng) {
  const TypeInfo& t = type_info(ggml_type);
  const size_t n_blocks = static_cast<size_t>(rows) * (cols / t.block_values);
  std::vector<uint8_t> w(n_blocks * t.block_bytes);
  if (t.block_values == 1) {
    const std::vector<float> v = random_floats(static_cast<size_t>(rows) * cols, rng);
    for (size_t i = 0; i < v.size(); ++i) {
      if (ggml_type == kF32) {
        std::memcpy(&w[4 * i], &v[i], 4);
      } else if (ggml_type == kF16) {
        put_u16(&w[2 * i], half_bits(v[i]));
      } else {
        uint32_t bits;
        std::memcpy(&bits, &v[i], 4);
        put_u16(&w[2 * i], static_cast<uint16_t>(bits >> 16));
      }
    }
    return w;
  }
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(0.005f, 0.015f);
  for (uint8_t& b : w) b = static_cast<uint8_t>(byte(rng));
  for (size_t i = 0; i < n_blocks; ++i) {
    uint8_t* b = &w[i * t.block_bytes];
    switch (ggml_type) {
      case kQ4_0: case kQ5_0: case kQ8_0: case kQ1_0: case kIQ2_XXS: case kIQ2_XS: case kIQ2_S: case kIQ3_XXS: case kIQ3_S: case kIQ1_S: case kIQ4_XS: case kIQ4_NL:
        put_u16(b, half_bits(scale(rng)));
        break;
      case kQ4_1: case kQ5_1:
        put_u16(b, half_bits(scale(rng)));
        put_u16(b + 2, half_bits(-16 * scale(rng)));
        break;
      case kQ4_K: case kQ5_K:
        put_u16(b, half_bits(scale(rng)));
        put_u16(b + 2, half_bits(scale(rng)));
        break;
      case kQ2_K:
        put_u16(b + 80, half_bits(scale(rng)));
        put_u16(b + 82, half_bits(scale(rng)));
        break;
      case kQ3_K: put_u16(b + 108, half_bits(scale(rng))); break;
      case kTQ1_0: put_u16(b + 52, half_bits(scale(rng))); break;
      case kTQ2_0: put_u16(b + 64, half_bits(scale(rng))); break;
      case kQ6_K: put_u16(b + 208, half_bits(scale(rng))); break;
      case kMXFP4: b[0] = static_cast<uint8_t>(118 + byte(rng) % 6); break;
      case kNVFP4:   // exponents 1..3 (half scales 2^-7 .. 2^-5 times 1 + m/8); now and then a subnormal or 0x7F
        for (int s = 0; s < 4; ++s) {
          const int r = byte(rng);
          b[s] = static_cast<uint8_t>(r < 8 ? (r == 0 ? 0x7F : r) : ((1 + r % 3) << 3) | (r >> 5));
        }
        break;
      case kIQ1_M: {
        const uint16_t d = half_bits(scale(rng));
        for (int k = 0; k < 4; ++k) {
          uint16_t s;
          std::memcpy(&s, b + 48 + 2 * k, 2);
          s = static_cast<uint16_t>((s & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12));
          put_u16(b + 48 + 2 * k, s);
        }
        break;
      }
      default: break;
    }
  }
  return w;
}

}  // namespace pocketmoe::samples
