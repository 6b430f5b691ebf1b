// Integer dot products of 256-value super-block weights (k-quants, IQ types) with Q8_K activations.
//
// A decoder Dec turns one weight block into eight groups of 32 int8 weights q (unsigned, or signed
// when Dec::kSigned), an int16 scale per 16 weights, and a per-block correction vector `corr`
// applied to the activation sums of 16 (bsums):
//   block dot = d * da * (sum_g madd(maddubs(q_g, a_g), scale_g) [+ madd(corr, bsums) if kOffset])
//             [+ dmin * da * madd(corr, bsums) if kMin]
// With VNNI, vpdpwssd does each madd and the add after it in one step, with the same wrapping
// result, so every build gives the same integers. All integer sums are exact; the float steps per
// (row, token) are the same in every tile shape and in the repacked form, so a result never depends
// on the instruction set, tiling, threads or the batch it came in.
#pragma once

#include <cstddef>
#include <cstdint>

#include "pocketmoe/matmul.h"
#include "simd.h"

namespace pocketmoe::PM_ISA::kfamily {

using namespace simd;

struct ActQ8K {
  const int8_t* qs;
  const float* d;
  const int16_t* bsums;
};

PM_INLINE ActQ8K act_view(const uint8_t* row, int cols) {
  const int nb = cols / 256;
  return {reinterpret_cast<const int8_t*>(row), reinterpret_cast<const float*>(row + cols),
          reinterpret_cast<const int16_t*>(row + cols + 4 * nb)};
}

// A block decoded once, for reuse across many tokens (prefill).
struct alignas(32) CanonBlock {
  uint8_t q[8][32];
  int16_t scale[8][16];
  int16_t corr[16];
  float d;
  float dmin;
  uint8_t pad[24];
};
static_assert(sizeof(CanonBlock) == 576);

template <class Dec>
struct Canon {
  static constexpr int kBytes = sizeof(CanonBlock);
  static constexpr bool kCanonical = true;
  static constexpr bool kSigned = Dec::kSigned;
  static constexpr bool kOffset = Dec::kOffset;
  static constexpr bool kMin = Dec::kMin;
  struct Head {
    float d;
    float dmin;
    __m256i corr;
  };
  static PM_INLINE const CanonBlock& block(const uint8_t* p) { return *reinterpret_cast<const CanonBlock*>(p); }
  static PM_INLINE Head head(const uint8_t* p) {
    return {block(p).d, block(p).dmin, _mm256_load_si256(reinterpret_cast<const __m256i*>(block(p).corr))};
  }
  template <int G>
  static PM_INLINE __m256i quants(const uint8_t* p, const Head&) {
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(block(p).q[G]));
  }
  template <int G>
  static PM_INLINE __m256i scales(const uint8_t* p, const Head&) {
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(block(p).scale[G]));
  }
};

#if PM_AVX512
// The repacked tile on 512-bit vectors: groups 2P and 2P+1 of a block side by side in one register,
// so each maddubs / vpdpwssd does twice the work. The low and high halves of a sum then add (exact
// integers) into the same eight int32 lanes the 256-bit tile forms, and the float steps are the
// 256-bit tile's, two tokens per register: results are bitwise those of every other build.
template <class Dec, int R, int C>
__attribute__((noinline)) void dot_tile_zmm(const uint8_t* w, size_t w_stride, const ActQ8K* a, int cols, float* out,
                                            ptrdiff_t out_stride) {
  static_assert(Dec::kCanonical, "the 512-bit tile reads repacked blocks");
  constexpr int CP = (C + 1) / 2;   // token pairs
  const int nb = cols / 256;
  __m512 acc[R][CP];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < CP; ++p) acc[r][p] = _mm512_setzero_ps();

  for (int b = 0; b < nb; ++b) {
    const CanonBlock* blk[R];
    for (int r = 0; r < R; ++r)
      blk[r] = reinterpret_cast<const CanonBlock*>(w + r * w_stride + static_cast<size_t>(b) * sizeof(CanonBlock));
    __m512i isum[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) isum[r][c] = _mm512_setzero_si512();

    static_for<4>([&](auto pc) {
      constexpr int P = decltype(pc)::value;
      for (int r = 0; r < R; ++r) {
        const __m512i q = _mm512_loadu_si512(blk[r]->q[2 * P]);
        const __m512i s = _mm512_loadu_si512(blk[r]->scale[2 * P]);
        const __m512i qu = Dec::kSigned ? _mm512_abs_epi8(q) : q;
        [[maybe_unused]] const __mmask64 neg = Dec::kSigned ? _mm512_movepi8_mask(q) : 0;
        for (int c = 0; c < C; ++c) {
          __m512i av = _mm512_loadu_si512(a[c].qs + 256 * b + 64 * P);
          // sign(a, q): a negated where q < 0 (where q == 0 the product is 0 either way).
          if constexpr (Dec::kSigned) av = _mm512_mask_sub_epi8(av, neg, _mm512_setzero_si512(), av);
          isum[r][c] = _mm512_dpwssd_epi32(isum[r][c], _mm512_maddubs_epi16(qu, av), s);
          keep_in_register(isum[r][c]);
        }
      }
    });

    for (int p = 0; p < CP; ++p) {
      const int c0 = 2 * p, c1 = c0 + 1 < C ? c0 + 1 : c0;
      const __m512i bs = _mm512_inserti64x4(_mm512_broadcast_i64x4(load256(a[c0].bsums + 16 * b)),
                                            load256(a[c1].bsums + 16 * b), 1);
      const __m512 da = _mm512_insertf32x8(_mm512_set1_ps(a[c0].d[b]), _mm256_set1_ps(a[c1].d[b]), 1);
      for (int r = 0; r < R; ++r) {
        // [sum of c0's halves | sum of c1's halves]: the 256-bit tile's lanes for both tokens.
        const __m512i x = isum[r][c0], y = isum[r][c1];
        __m512i is = _mm512_add_epi32(_mm512_shuffle_i64x2(x, y, 0x44), _mm512_shuffle_i64x2(x, y, 0xEE));
        const __m512i corr = _mm512_broadcast_i64x4(_mm256_load_si256(reinterpret_cast<const __m256i*>(blk[r]->corr)));
        if constexpr (Dec::kOffset) is = _mm512_dpwssd_epi32(is, corr, bs);
        acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(_mm512_set1_ps(blk[r]->d), da), acc[r][p]);
        if constexpr (Dec::kMin) {
          const __m512i m = _mm512_madd_epi16(corr, bs);
          acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(m), _mm512_mul_ps(_mm512_set1_ps(blk[r]->dmin), da), acc[r][p]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const __m512 v = acc[r][c / 2];
      const __m256 half = c % 2 == 0 ? _mm512_castps512_ps256(v)
                                     : _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
      out[c * out_stride + r] = hsum(half);
    }
}
#endif

struct Family {
  static constexpr int kBlockValues = 256;
  static constexpr bool kRepack = true;
  using Act = ActQ8K;
  using CanonBlock = kfamily::CanonBlock;
  template <class Dec>
  using Canon = kfamily::Canon<Dec>;

  static PM_INLINE Act act_view(const uint8_t* row, int cols) { return kfamily::act_view(row, cols); }

  template <class Dec>
  static void repack_row(const uint8_t* row, int nb, CanonBlock* dst) {
    for (int b = 0; b < nb; ++b) {
      const uint8_t* blk = row + static_cast<size_t>(b) * Dec::kBytes;
      for (int off = 0; off < Dec::kBytes; off += 64) prefetch(blk + kPrefetchBytes + off);
      const auto h = Dec::head(blk);
      CanonBlock& c = dst[b];
      static_for<8>([&](auto gc) {
        constexpr int G = decltype(gc)::value;
        store256(c.q[G], Dec::template quants<G>(blk, h));
        store256(c.scale[G], Dec::template scales<G>(blk, h));
      });
      store256(c.corr, h.corr);
      c.d = h.d;
      c.dmin = h.dmin;
    }
  }

  // out[c * out_stride + r] = dot(row r, token c) for an R x C tile; rows are w_stride bytes apart.
  template <class Dec, int R, int C>
  static __attribute__((noinline)) void dot_tile(const uint8_t* w, size_t w_stride, const Act* a, int cols,
                                                 float* out, ptrdiff_t out_stride) {
#if PM_AVX512
    if constexpr (Dec::kCanonical) return dot_tile_zmm<Dec, R, C>(w, w_stride, a, cols, out, out_stride);
#endif
    const int nb = cols / 256;
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();

    for (int b = 0; b < nb; ++b) {
      const uint8_t* blk[R];
      typename Dec::Head h[R];
      for (int r = 0; r < R; ++r) {
        blk[r] = w + r * w_stride + static_cast<size_t>(b) * Dec::kBytes;
        if constexpr (!Dec::kCanonical)
          for (int off = 0; off < Dec::kBytes; off += 64) prefetch(blk[r] + kPrefetchBytes + off);
        h[r] = Dec::head(blk[r]);
      }
      __m256i isum[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) isum[r][c] = _mm256_setzero_si256();

      static_for<8>([&](auto gc) {
        constexpr int G = decltype(gc)::value;
        for (int r = 0; r < R; ++r) {
          const __m256i q = Dec::template quants<G>(blk[r], h[r]);
          const __m256i s = Dec::template scales<G>(blk[r], h[r]);
          const __m256i qu = Dec::kSigned ? _mm256_abs_epi8(q) : q;
          for (int c = 0; c < C; ++c) {
            __m256i av = load256(a[c].qs + 256 * b + 32 * G);
            if constexpr (Dec::kSigned) av = _mm256_sign_epi8(av, q);
            const __m256i m = _mm256_maddubs_epi16(qu, av);
#if PM_VNNI
            isum[r][c] = dpwssd(isum[r][c], m, s);
#else
            isum[r][c] = _mm256_add_epi32(isum[r][c], _mm256_madd_epi16(m, s));
#endif
            // Keep the sum a running one: left free, GCC reassociates the eight groups' integer adds of
            // a repacked tile into a tree and spills every product to the stack (GEMM 15-25% slower).
            if constexpr (Dec::kCanonical) keep_in_register(isum[r][c]);
          }
        }
      });

      for (int c = 0; c < C; ++c) {
        const __m256i bs = load256(a[c].bsums + 16 * b);
        const float da = a[c].d[b];
        for (int r = 0; r < R; ++r) {
          __m256i is = isum[r][c];
          if constexpr (Dec::kOffset) {
#if PM_VNNI
            is = dpwssd(is, h[r].corr, bs);
#else
            is = _mm256_add_epi32(is, _mm256_madd_epi16(h[r].corr, bs));
#endif
          }
          acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_set1_ps(h[r].d * da), acc[r][c]);
          if constexpr (Dec::kMin) {
            const __m256i m = _mm256_madd_epi16(h[r].corr, bs);
            acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(h[r].dmin * da), acc[r][c]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) out[c * out_stride + r] = hsum(acc[r][c]);
  }
};

}  // namespace pocketmoe::PM_ISA::kfamily
