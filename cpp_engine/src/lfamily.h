// Integer dot products of 32-value block weights (Q4_0, Q5_0, Q8_0, MXFP4) with Q8_0 activations.
//
// Rows are handled eight at a time, one float lane per row. For each block the exact integer dot
// of a row with a token is formed first, then acc = fma(float(dot), dw * da, acc), block after
// block. The fused path (few tokens) reduces per-row vectors to those dots with a fixed add tree;
// the batched path repacks eight rows interleaved, four bytes per row, so one maddubs covers eight
// rows. Both give the same integers and the same float steps, so results never depend on batch.
//
// A decoder Dec gives a block's 32 weights as q + kOffset (unsigned, kOffset > 0) or as signed
// int8 (kOffset == 0), its scale, and the scales of eight blocks as one vector.
#pragma once

#include <cstddef>
#include <cstdint>

#include "pocketmoe/matmul.h"
#include "simd.h"

namespace pocketmoe::lfamily {

using namespace simd;

struct ActQ8_0 {
  const int8_t* qs;
  const float* d;
  const int16_t* sums;   // sum of the 32 q of each block
};

PM_INLINE ActQ8_0 act_view(const uint8_t* row, int cols) {
  const int nb = cols / 32;
  return {reinterpret_cast<const int8_t*>(row), reinterpret_cast<const float*>(row + cols),
          reinterpret_cast<const int16_t*>(row + cols + 4 * nb)};
}

// Eight rows of one block, interleaved: q[s] holds values 4s..4s+3 of rows 0..7 in turn.
struct alignas(32) CanonX8 {
  uint8_t q[8][32];
  float d[8];
};
static_assert(sizeof(CanonX8) == 288);

// Lane r of the result = sum of the 8 int32 lanes of v[r].
PM_INLINE __m256i reduce8(const __m256i (&v)[8]) {
  const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31));
}

template <class Dec>
PM_INLINE __m256i int_dot(const uint8_t* blk, const int8_t* a) {
  const __m256i q = Dec::quants(blk);
  const __m256i av = load256(a);
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (Dec::kOffset > 0) return _mm256_madd_epi16(_mm256_maddubs_epi16(q, av), ones);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(av, q)), ones);
}

PM_INLINE void store_rows(float* out, __m256 v, int n_rows) {
  if (n_rows == 8) {
    _mm256_storeu_ps(out, v);
  } else {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, v);
    for (int r = 0; r < n_rows; ++r) out[r] = tmp[r];
  }
}

// Eight raw rows (pointers; repeat one to pad) x up to 4 tokens, decoding blocks on the fly.
// Raw rows stream from DRAM once; each read asks for the same block eight rows further on.
template <class Dec>
PM_INLINE void prefetch_next_group(const uint8_t* blk, int b, size_t row_bytes) {
  constexpr int every = Dec::kBytes < 64 ? 64 / Dec::kBytes : 1;   // about one request per cache line
  if (b % every == 0) prefetch(blk + 8 * row_bytes);
}

template <class Dec>
__attribute__((noinline)) void fused8(const uint8_t* const (&w)[8], size_t row_bytes, const ActQ8_0* a, int n_tok,
                                      int cols, float* out, ptrdiff_t out_stride, int n_rows) {
  const int nb = cols / 32;
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk[8];
    for (int r = 0; r < 8; ++r) {
      blk[r] = w[r] + static_cast<size_t>(b) * Dec::kBytes;
      prefetch_next_group<Dec>(blk[r], b, row_bytes);
    }
    const __m256 dw = Dec::scales8(blk);
    for (int c = 0; c < n_tok; ++c) {
      __m256i v[8];
      for (int r = 0; r < 8; ++r) v[r] = int_dot<Dec>(blk[r], a[c].qs + 32 * b);
      __m256i dot = reduce8(v);
      if constexpr (Dec::kOffset > 0) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(Dec::kOffset * a[c].sums[b]));
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, _mm256_set1_ps(a[c].d[b])), acc[c]);
    }
  }
  for (int c = 0; c < n_tok; ++c) store_rows(out + c * out_stride, acc[c], n_rows);
}

// Transposes 8 x 8 dwords in place: v[i] dword j <-> v[j] dword i.
PM_INLINE void transpose8x8(__m256i (&v)[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
    v[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
  }
}

template <class Dec>
void repack8(const uint8_t* const (&w)[8], size_t row_bytes, int nb, CanonX8* dst) {
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk[8];
    __m256i v[8];
    for (int r = 0; r < 8; ++r) {
      blk[r] = w[r] + static_cast<size_t>(b) * Dec::kBytes;
      prefetch_next_group<Dec>(blk[r], b, row_bytes);
      v[r] = Dec::quants(blk[r]);
    }
    transpose8x8(v);
    for (int s = 0; s < 8; ++s) _mm256_store_si256(reinterpret_cast<__m256i*>(dst[b].q[s]), v[s]);
    _mm256_store_ps(dst[b].d, Dec::scales8(blk));
  }
}

// Eight repacked rows x C tokens.
template <class Dec, int C>
__attribute__((noinline)) void tile8(const CanonX8* w, const ActQ8_0* a, int nb, float* out, ptrdiff_t out_stride,
                                     int n_rows) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    __m256i dot[C];
    for (int c = 0; c < C; ++c) dot[c] = _mm256_setzero_si256();
    static_for<8>([&](auto sc) {
      constexpr int s = decltype(sc)::value;
      const __m256i q = _mm256_load_si256(reinterpret_cast<const __m256i*>(w[b].q[s]));
      const __m256i qu = Dec::kOffset > 0 ? q : _mm256_abs_epi8(q);
      for (int c = 0; c < C; ++c) {
        __m256i av = _mm256_set1_epi32(static_cast<int>(load_u32(reinterpret_cast<const uint8_t*>(a[c].qs + 32 * b + 4 * s))));
        if constexpr (Dec::kOffset == 0) av = _mm256_sign_epi8(av, q);
        dot[c] = _mm256_add_epi32(dot[c], _mm256_madd_epi16(_mm256_maddubs_epi16(qu, av), ones));
      }
    });
    const __m256 dw = _mm256_load_ps(w[b].d);
    for (int c = 0; c < C; ++c) {
      if constexpr (Dec::kOffset > 0) dot[c] = _mm256_sub_epi32(dot[c], _mm256_set1_epi32(Dec::kOffset * a[c].sums[b]));
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[c]), _mm256_mul_ps(dw, _mm256_set1_ps(a[c].d[b])), acc[c]);
    }
  }
  for (int c = 0; c < C; ++c) store_rows(out + c * out_stride, acc[c], n_rows);
}

// Up to this many tokens the rows are decoded on the fly; above, repacked once per 8 rows.
constexpr int kFusedMaxTokens = 4;

inline size_t scratch_bytes(int cols) { return static_cast<size_t>(cols / 32) * sizeof(CanonX8); }

template <class Dec>
void matmul(const MatmulTask& t) {
  const int nb = t.cols / 32;
  auto* canon = reinterpret_cast<CanonX8*>(t.scratch);
  for (int r = t.row_begin; r < t.row_end; r += 8) {
    const int n_rows = t.row_end - r < 8 ? t.row_end - r : 8;
    const uint8_t* w[8];
    for (int i = 0; i < 8; ++i) w[i] = t.weight + static_cast<size_t>(r + (i < n_rows ? i : n_rows - 1)) * t.row_bytes;
    float* out = t.out + (r - t.row_begin);
    ActQ8_0 a[4];
    const bool repack = t.n_tokens > kFusedMaxTokens && n_rows == 8;
    if (repack) repack8<Dec>(w, t.row_bytes, nb, canon);
    int tk = 0;
    for (; tk < t.n_tokens; tk += 4) {
      const int n = t.n_tokens - tk < 4 ? t.n_tokens - tk : 4;
      for (int i = 0; i < n; ++i) a[i] = act_view(t.acts[tk + i], t.cols);
      float* o = out + tk * t.out_stride;
      if (!repack) {
        fused8<Dec>(w, t.row_bytes, a, n, t.cols, o, t.out_stride, n_rows);
        continue;
      }
      switch (n) {
        case 4: tile8<Dec, 4>(canon, a, nb, o, t.out_stride, 8); break;
        case 3: tile8<Dec, 3>(canon, a, nb, o, t.out_stride, 8); break;
        case 2: tile8<Dec, 2>(canon, a, nb, o, t.out_stride, 8); break;
        default: tile8<Dec, 1>(canon, a, nb, o, t.out_stride, 8); break;
      }
    }
  }
}

}  // namespace pocketmoe::lfamily
