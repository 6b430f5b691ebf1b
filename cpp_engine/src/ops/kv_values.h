// KV cache values as they are stored (ops.h KVType): float, IEEE half or bfloat16, read as floats and written
// rounded to the nearest even value of the type, as torch's .to(float16) / .to(bfloat16) round. Shared by the
// attention core (attention.cpp) and DeepSeek-V4's cache rows (dsv4_*.cpp).
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "pocketmoe/ops.h"
#include "../simd.h"

namespace pocketmoe::kv {

struct Half { uint16_t bits; };
struct BHalf { uint16_t bits; };

// 8 values at p as floats.
PM_INLINE __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
PM_INLINE __m256 load8(const Half* p) { return simd::load8_f16(p); }
PM_INLINE __m256 load8(const BHalf* p) { return simd::load8_bf16(p); }

// One value as a float.
inline float value(float v) { return v; }
inline float value(Half v) { return simd::f16_value(v.bits); }
inline float value(BHalf v) { return simd::bf16_value(v.bits); }

inline Half half_of(float v) { return {_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline BHalf bhalf_of(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return {std::isnan(v) ? uint16_t{0x7FC0} : static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16)};
}

// dst = n values of src, rounded to the cache's type (a NaN becomes bfloat16's quiet NaN).
inline void store_values(const float* src, int n, float* dst) { std::memcpy(dst, src, sizeof(float) * n); }
inline void store_values(const float* src, int n, Half* dst) {
  int i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) dst[i] = half_of(src[i]);
}
inline void store_values(const float* src, int n, BHalf* dst) {
  for (int i = 0; i < n; ++i) dst[i] = bhalf_of(src[i]);
}

// dst = n values of src as floats.
template <class T>
void load_values(const T* src, int n, float* dst) {
  for (int i = 0; i < n; ++i) dst[i] = value(src[i]);
}

inline size_t value_bytes(KVType type) {
  switch (type) {
    case KVType::kF32: return sizeof(float);
    case KVType::kF16:
    case KVType::kBF16: return sizeof(uint16_t);
  }
  throw std::invalid_argument("KV cache type " + std::to_string(static_cast<int>(type)) +
                              " is not float32 (0), float16 (1) or bfloat16 (2)");
}

// f(values) with the cache's values as the type they are stored in, const where the cache is (Void is void or
// const void).
template <class Void, class F>
void typed(KVType type, Void* cache, const F& f) {
  constexpr bool kConst = std::is_const_v<Void>;
  switch (type) {
    case KVType::kF32: f(static_cast<std::conditional_t<kConst, const float, float>*>(cache)); return;
    case KVType::kF16: f(static_cast<std::conditional_t<kConst, const Half, Half>*>(cache)); return;
    case KVType::kBF16: f(static_cast<std::conditional_t<kConst, const BHalf, BHalf>*>(cache)); return;
  }
  value_bytes(type);  // throws
}

// A layer's cache rows of `width` values each, as stored: row r's values start at value r * width.
struct Rows {
  void* data = nullptr;
  KVType type = KVType::kF32;
  int width = 0;

  // dst = n values of row r from value offset off, as floats.
  void read(int64_t r, int off, int n, float* dst) const {
    typed(type, data, [&](auto* v) { load_values(v + r * width + off, n, dst); });
  }
  // n values of row r from value offset off = src, rounded to the cache's type.
  void write(int64_t r, int off, const float* src, int n) const {
    typed(type, data, [&](auto* v) { store_values(src, n, v + r * width + off); });
  }
  // Row r's n values from off as floats: the cache itself when it holds floats, else converted into scratch.
  const float* floats(int64_t r, int off, int n, float* scratch) const {
    if (type == KVType::kF32) return static_cast<const float*>(data) + r * width + off;
    read(r, off, n, scratch);
    return scratch;
  }
};

}  // namespace pocketmoe::kv
