// Integer dot products of 256-value super-block weights (k-quants, IQ types) with Q8_K activations.
//
// A decoder Dec turns one weight block into eight groups of 32 int8 weights q (unsigned, or signed
// when Dec::kSigned), an int16 scale per pair of weights (in practice one per 16 or 32 weights), and
// a per-block correction vector `corr` applied to the activation sums of 16 (bsums):
//   I    = sum_g madd(maddubs(q_g, a_g), scale_g) [+ madd(corr, bsums) if kOffset]   (all lanes)
//   Imin = madd(corr, bsums)                                                         (if kMin)
//   acc  = fma(float(I), d * da, acc), then [acc = fma(float(Imin), dmin * da, acc)]
// per block, in block order. With VNNI, vpdpwssd does each madd and the add after it in one step,
// with the same wrapping result; I and Imin are exact integers however they are summed (the AMX
// tiles form them another way), and the float steps per (row, token) are the same in every tile
// shape and form, so a result never depends on the instruction set, tiling, threads or the batch it
// came in.
#pragma once

#include <cstddef>
#include <cstdint>

#include "pocketmoe/matmul.h"
#include "simd.h"

namespace pocketmoe::PM_ISA::kfamily {

using namespace simd;

// Scratch bytes per block of a row that the AMX set's tiles use (kfamily_amx.h: sixteen repacked rows
// and 64 laid-out tokens), which the scratch area of every build makes room for.
constexpr size_t kAmxScratchPerBlock = 27520;

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

// Whether a decoder's scales are 1 throughout (Dec::kUnitScale, the ternary types): with VNNI the GEMV then
// sums its u8 x s8 products with one VPDPBUSD instead of VPMADDUBSW and VPDPWSSD by 1 (the same integers:
// q <= 2 keeps every pair of products far from int16 saturation).
template <class Dec, class = void>
constexpr bool kUnitScale = false;
template <class Dec>
constexpr bool kUnitScale<Dec, std::void_t<decltype(Dec::kUnitScale)>> = Dec::kUnitScale;

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

// One block's float steps for R rows x C tokens (C <= 4): is[r][c] holds the exact integer dot of
// row r and token c spread over eight lanes (before kOffset's correction), and acc[r] the C tokens'
// sums in lanes 0..C-1.
template <class Dec, int R, int C>
PM_INLINE void block_step(__m256i (&is)[R][C], const ActQ8K* a, int b, const float (&d)[R], const float (&dmin)[R],
                          const __m256i (&corr)[R], __m128 (&acc)[R]) {
  static_assert(C >= 1 && C <= 4);
  const __m128 da = _mm_setr_ps(a[0].d[b], a[C > 1 ? 1 : 0].d[b], a[C > 2 ? 2 : 0].d[b], a[C > 3 ? 3 : 0].d[b]);
  __m256i bs[C];
  for (int c = 0; c < C; ++c) bs[c] = load256(a[c].bsums + 16 * b);
  const auto total = [](const __m256i(&v)[C]) {
    return _mm_cvtepi32_ps(hsum4_epi32(v[0], v[C > 1 ? 1 : 0], v[C > 2 ? 2 : 0], v[C > 3 ? 3 : 0]));
  };
  for (int r = 0; r < R; ++r) {
    if constexpr (Dec::kOffset) {
      for (int c = 0; c < C; ++c) {
#if PM_VNNI
        is[r][c] = dpwssd(is[r][c], corr[r], bs[c]);
#else
        is[r][c] = _mm256_add_epi32(is[r][c], _mm256_madd_epi16(corr[r], bs[c]));
#endif
      }
    }
    const __m128 sd = _mm_mul_ps(_mm_set1_ps(d[r]), da);
    if constexpr (!Dec::kMin) {
      if constexpr (C == 1) {
        __m128i v = _mm_add_epi32(_mm256_castsi256_si128(is[r][0]), _mm256_extracti128_si256(is[r][0], 1));
        v = _mm_add_epi32(v, _mm_unpackhi_epi64(v, v));
        v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 1));
        acc[r] = _mm_fmadd_ss(_mm_cvtepi32_ps(v), sd, acc[r]);
      } else {
        acc[r] = _mm_fmadd_ps(total(is[r]), sd, acc[r]);
      }
    } else {
      __m256i m[C];
      for (int c = 0; c < C; ++c) m[c] = _mm256_madd_epi16(corr[r], bs[c]);
      const __m128 smin = _mm_mul_ps(_mm_set1_ps(dmin[r]), da);
      if constexpr (C == 1) {
        // [I, Imin, I, Imin] in three steps.
        const __m256i x = _mm256_hadd_epi32(is[r][0], m[0]);
        const __m128i y = _mm_add_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
        const __m128 f = _mm_cvtepi32_ps(_mm_hadd_epi32(y, y));
        acc[r] = _mm_fmadd_ss(_mm_movehdup_ps(f), smin, _mm_fmadd_ss(f, sd, acc[r]));
      } else if constexpr (C == 2) {
        // [I0, I1, Imin0, Imin1] in one sum.
        const __m128 f = _mm_cvtepi32_ps(hsum4_epi32(is[r][0], is[r][1], m[0], m[1]));
        acc[r] = _mm_fmadd_ps(_mm_movehl_ps(f, f), smin, _mm_fmadd_ps(f, sd, acc[r]));
      } else {
        acc[r] = _mm_fmadd_ps(total(m), smin, _mm_fmadd_ps(total(is[r]), sd, acc[r]));
      }
    }
  }
}

// out[c * out_stride + r] = lane c of acc[r].
template <int R, int C>
PM_INLINE void store_tile(const __m128 (&acc)[R], float* out, ptrdiff_t out_stride) {
  for (int r = 0; r < R; ++r) {
    alignas(16) float v[4];
    _mm_store_ps(v, acc[r]);
    for (int c = 0; c < C; ++c) out[c * out_stride + r] = v[c];
  }
}

#if PM_AVX512
// The repacked tile on 512-bit vectors: groups 2P and 2P+1 of a block side by side in one register,
// so each maddubs / vpdpwssd does twice the work. The low and high halves of a sum then add (exact
// integers) into the same eight int32 lanes the 256-bit tile forms, and the float steps are the
// 256-bit tile's, two tokens per register: results are bitwise those of every other build.
template <class Dec, int R, int C>
__attribute__((noinline)) void dot_tile_zmm(const uint8_t* w, size_t w_stride, const ActQ8K* a, int cols, float* out,
                                            ptrdiff_t out_stride) {
  static_assert(Dec::kCanonical, "the 512-bit tile reads repacked blocks");
  const int nb = cols / 256;
  __m128 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm_setzero_ps();

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

    __m256i is[R][C];
    float d[R], dmin[R];
    __m256i corr[R];
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c)
        is[r][c] = _mm256_add_epi32(_mm512_castsi512_si256(isum[r][c]), _mm512_extracti64x4_epi64(isum[r][c], 1));
      d[r] = blk[r]->d;
      dmin[r] = blk[r]->dmin;
      corr[r] = _mm256_load_si256(reinterpret_cast<const __m256i*>(blk[r]->corr));
    }
    block_step<Dec, R, C>(is, a, b, d, dmin, corr, acc);
  }
  store_tile<R, C>(acc, out, out_stride);
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
    __m128 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm_setzero_ps();

    for (int b = 0; b < nb; ++b) {
      const uint8_t* blk[R];
      typename Dec::Head h[R];
      for (int r = 0; r < R; ++r) {
        blk[r] = w + r * w_stride + static_cast<size_t>(b) * Dec::kBytes;
        if constexpr (!Dec::kCanonical)
          for (int off = 0; off < Dec::kBytes; off += 64) prefetch(blk[r] + kPrefetchBytes + off);
        h[r] = Dec::head(blk[r]);
      }
      // Two running sums, even and odd groups (exact integers, added after the last group): half as long
      // a chain of multiply-adds per block.
      __m256i isum[R][C], odd[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) isum[r][c] = odd[r][c] = _mm256_setzero_si256();

      static_for<8>([&](auto gc) {
        constexpr int G = decltype(gc)::value;
        for (int r = 0; r < R; ++r) {
          const __m256i q = Dec::template quants<G>(blk[r], h[r]);
          const __m256i s = Dec::template scales<G>(blk[r], h[r]);
          const __m256i qu = Dec::kSigned ? _mm256_abs_epi8(q) : q;
          for (int c = 0; c < C; ++c) {
            __m256i av = load256(a[c].qs + 256 * b + 32 * G);
            if constexpr (Dec::kSigned) av = _mm256_sign_epi8(av, q);
            __m256i& sum = G % 2 ? odd[r][c] : isum[r][c];
#if PM_VNNI
            if constexpr (kUnitScale<Dec>) {
              sum = dpbusd(sum, qu, av);   // the same four products per lane, without the multiply by 1
            } else {
              sum = dpwssd(sum, _mm256_maddubs_epi16(qu, av), s);
            }
#else
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(qu, av), s));
#endif
            // Keep the sum a running one: left free, GCC reassociates the eight groups' integer adds of
            // a repacked tile into a tree and spills every product to the stack (GEMM 15-25% slower).
            if constexpr (Dec::kCanonical) keep_in_register(sum);
          }
        }
      });
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) isum[r][c] = _mm256_add_epi32(isum[r][c], odd[r][c]);

      float d[R], dmin[R];
      __m256i corr[R];
      for (int r = 0; r < R; ++r) {
        d[r] = h[r].d;
        dmin[r] = h[r].dmin;
        corr[r] = h[r].corr;
      }
      block_step<Dec, R, C>(isum, a, b, d, dmin, corr, acc);
    }
    store_tile<R, C>(acc, out, out_stride);
  }
};

}  // namespace pocketmoe::PM_ISA::kfamily
