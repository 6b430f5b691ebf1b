// Integer dot products of 32-value block weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, IQ4_NL) with Q8_0
// activations.
//
// Rows are handled eight at a time, one float lane per row. For each block the exact integer dot
// of a row with a token is formed first, then acc = fma(float(dot), dw * da, acc), block after
// block. The fused path (few tokens) reduces per-row vectors to those dots with a fixed add tree;
// the batched path repacks eight rows interleaved, four bytes per row, so one maddubs covers eight
// rows (one vpdpbusd with VNNI). Both paths, in every instruction set, give the same integers and
// the same float steps, so results never depend on the batch or the CPU's VNNI.
//
// A decoder Dec gives a block's 32 weights as q + kOffset (unsigned, kOffset > 0) or as signed
// int8 (kOffset == 0), its scale, and the scales of eight blocks as one vector. A type with a min
// (kMin: w = d*q + m, q unsigned below 2 * kOffset) keeps its dot unsigned and, after the block's
// scale step, adds acc = fma(m, s, acc) with the activation block's s = fp16(fp32 d * sum of q), as
// llama.cpp's Q8_1 activations have it; the CUDA kernels take the same two steps.
//
// A block may hold several 32-value pieces (kPieces; NVFP4: 2 per 64-value block, Q1_0: 4 per 128); the
// decoder then takes the piece index. With kHalfScales a piece has a scale per 16 values, and each half gets its
// own float step (first half, then second), from the same integer dots split by 128-bit lane.
#pragma once

#include <cstddef>
#include <cstdint>

#include "pocketmoe/matmul.h"
#include "simd.h"

namespace pocketmoe::PM_ISA::lfamily {

using namespace simd;

struct ActQ8_0 {
  const int8_t* qs;
  const float* d;
  const float* s;        // per block, fp16(fp32 d * sum of q): what the min of a kMin type multiplies
  const int16_t* sums;   // sum of the 32 q of each block
  const int16_t* half_sums;   // sums of its first and its last 16 q
};

PM_INLINE ActQ8_0 act_view(const uint8_t* row, int cols) {
  const int nb = cols / 32;
  return {reinterpret_cast<const int8_t*>(row), reinterpret_cast<const float*>(row + cols),
          reinterpret_cast<const float*>(row + cols + 4 * nb), reinterpret_cast<const int16_t*>(row + cols + 8 * nb),
          reinterpret_cast<const int16_t*>(row + cols + 10 * nb)};
}

// Eight rows of one block, interleaved: q[s] holds values 4s..4s+3 of rows 0..7 in turn.
struct alignas(32) CanonX8 {
  uint8_t q[8][32];
  float d[8];   // the scales (of the first half with kHalfScales)
  float m[8];   // the mins of kMin types, or the second half's scales with kHalfScales
};
static_assert(sizeof(CanonX8) == 320);

// What the exact dot subtracts per activation sum: the offset of unsigned weights without a min.
template <class Dec>
constexpr int kSubtract = Dec::kMin ? 0 : Dec::kOffset;

// Block i of a row, and the 32 weights of its piece P.
template <class Dec>
PM_INLINE const uint8_t* block_of(const uint8_t* row, int i) {
  return row + static_cast<size_t>(i) * Dec::kBytes;
}

template <class Dec, int P>
PM_INLINE __m256i quants_of(const uint8_t* blk) {
  if constexpr (Dec::kPieces == 1) {
    return Dec::quants(blk);
  } else {
    return Dec::quants(blk, P);
  }
}

// Eight rows' scales of one block, converted once for all its pieces: for piece p, lo[p] (the whole
// piece's, or its first half's with kHalfScales) and hi[p] (the second half's; the min with kMin).
template <class Dec>
struct BlockScales {
  __m256 lo[Dec::kPieces], hi[Dec::kPieces];
};

template <class Dec>
PM_INLINE BlockScales<Dec> scales_of(const uint8_t* const* blk) {
  BlockScales<Dec> s;
  if constexpr (Dec::kHalfScales) {
    Dec::scales8(blk, s.lo, s.hi);
  } else {
    s.lo[0] = Dec::scales8(blk);
    if constexpr (Dec::kMin) {
      s.hi[0] = Dec::mins8(blk);
    } else {
      s.hi[0] = _mm256_setzero_ps();
    }
    for (int p = 1; p < Dec::kPieces; ++p) s.lo[p] = s.lo[0], s.hi[p] = s.hi[0];   // one scale per block (Q1_0)
  }
  return s;
}

// The exact dots of piece b of eight rows with one token, from the unsigned ones: lo (the piece's, or its first
// half's with kHalfScales) and hi (the second half's) lose the offset times the token's sum over their values.
template <class Dec>
PM_INLINE void take_offset(__m256i& lo, __m256i& hi, const ActQ8_0& a, int b) {
  if constexpr (kSubtract<Dec> > 0 && Dec::kHalfScales) {
    lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(kSubtract<Dec> * a.half_sums[2 * b]));
    hi = _mm256_sub_epi32(hi, _mm256_set1_epi32(kSubtract<Dec> * a.half_sums[2 * b + 1]));
  } else if constexpr (kSubtract<Dec> > 0) {
    lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(kSubtract<Dec> * a.sums[b]));
  }
}

// One block's scale step for eight rows x one token: the integer dots of the piece's two halves (or
// lo_dot alone: the whole piece), the weights' scales as scales_of gives them for the piece, the token's
// scale and s.
template <class Dec>
PM_INLINE __m256 scale_step(__m256 acc, __m256i lo_dot, __m256i hi_dot, __m256 lo, __m256 hi, float d, float s) {
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo_dot), _mm256_mul_ps(lo, _mm256_set1_ps(d)), acc);
  if constexpr (Dec::kHalfScales)
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi_dot), _mm256_mul_ps(hi, _mm256_set1_ps(d)), acc);
  if constexpr (Dec::kMin) acc = _mm256_fmadd_ps(hi, _mm256_set1_ps(s), acc);
  return acc;
}

// The fused path's exact add tree over eight rows, from unpacks and adds (cheaper than hadd). It
// starts from each row's products p (below); fold_pair(p_r, p_r+1) and fold_quad of two such pairs
// leave, per 128-bit half, [r, r+1, r+2, r+3] int32 partial sums. Without VNNI, p is maddubs's 16
// int16 sums of 2 products: unsigned weights (kOffset > 0) are below 32, so 8 products stay below
// 8 * 31 * 127 < 2^15 and the first two levels can add int16 lanes, while signed Q8_0 (|product
// pair| up to 32512) widens first. With VNNI, p is vpdpbusd's 8 int32 sums of 4 products, the same
// integers as the widened maddubs (no maddubs pair here can saturate), and the tree is all int32.
template <class Dec>
constexpr bool kFoldInt16 = !kVnni && Dec::kOffset > 0;

template <class Dec>
PM_INLINE __m256i fold_pair(__m256i x, __m256i y) {
  if constexpr (kFoldInt16<Dec>) {
    static_assert(Dec::kOffset <= 16, "int16 folds need weights below 32");
    return _mm256_add_epi16(_mm256_unpacklo_epi32(x, y), _mm256_unpackhi_epi32(x, y));   // int16 [r r r+1 r+1 ..]
  } else {
    if constexpr (!kVnni) {
      const __m256i ones = _mm256_set1_epi16(1);
      x = _mm256_madd_epi16(x, ones);
      y = _mm256_madd_epi16(y, ones);
    }
    return _mm256_add_epi32(_mm256_unpacklo_epi32(x, y), _mm256_unpackhi_epi32(x, y));   // int32 [r r+1 r r+1]
  }
}

template <class Dec>
PM_INLINE __m256i fold_quad(__m256i x, __m256i y) {
  if constexpr (kFoldInt16<Dec>) {
    const __m256i s16 = _mm256_add_epi16(_mm256_unpacklo_epi64(x, y), _mm256_unpackhi_epi64(x, y));
    return _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
  } else {
    return _mm256_add_epi32(_mm256_unpacklo_epi64(x, y), _mm256_unpackhi_epi64(x, y));
  }
}

// The operands of one decoded block q against 32 activations a as (unsigned, signed) bytes: signed
// weights move their signs onto the activations.
template <class Dec>
PM_INLINE void operands(__m256i q, __m256i a, __m256i& u, __m256i& s) {
  if constexpr (Dec::kOffset > 0) {
    u = q;
    s = a;
  } else {
    u = _mm256_abs_epi8(q);
    s = _mm256_sign_epi8(a, q);
  }
}

// The products of one decoded block q with 32 activations a, as fold_pair takes them.
template <class Dec>
PM_INLINE __m256i products(__m256i q, const int8_t* a) {
  __m256i u, s;
  operands<Dec>(q, load256(a), u, s);
#if PM_VNNI
  return dpbusd(_mm256_setzero_si256(), u, s);
#else
  return _mm256_maddubs_epi16(u, s);
#endif
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

// Raw rows stream from DRAM once. While eight rows are read block by block (eight interleaved
// streams), the next eight, which follow in memory, are requested as one sequential run: at block b
// the b-th share of them (8 * kBytes per piece). The prefetchers follow that far better than eight streams.
// The run goes to L1 while a group is small and to L2 once it is not (the two groups then crowd L1) or
// for Q8_0, a byte per weight. Zen 4, 2 threads, GEMV from DRAM, L1 / L2: Q4_0 and Q5_0 with 1408
// columns (6-8 KiB groups) 65 / 80 and 78 / 96 us, MXFP4 2048 columns 92 / 113; Q4_0 4096 columns
// 190 / 170, Q5_0 and Q4_0 10944 columns 720 / 570 and 550 / 415; Q8_0 1024 and 1408 columns
// 90 / 78 and 138 / 104, 10944 columns 1000 / 580.
constexpr size_t kL1GroupBytes = 10 << 10;

template <class Dec>
PM_INLINE void prefetch_next_group(const uint8_t* group, int b, size_t row_bytes) {
  constexpr int kShare = 8 * Dec::kBytes / Dec::kPieces;
  const uint8_t* p = group + 8 * row_bytes + static_cast<size_t>(b) * kShare;
  if (kShare < 8 * 32 && 8 * row_bytes <= kL1GroupBytes) {
    for (int off = 0; off < kShare; off += 64) prefetch(p + off);
  } else {
    for (int off = 0; off < kShare; off += 64) prefetch_l2(p + off);
  }
}

// Eight raw rows (pointers; repeat one to pad) x C tokens, decoding blocks on the fly. Each row's
// block is decoded once and dotted with every token at once, and the per-row vectors are folded
// pairwise as soon as they exist, so few vectors are live at a time.
template <class Dec, int C>
__attribute__((noinline)) void fused8(const uint8_t* const (&w)[8], size_t row_bytes, const ActQ8_0* a, int cols,
                                      float* out, ptrdiff_t out_stride, int n_rows) {
  const int nb = cols / 32;
  __m256 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  for (int i = 0; i < nb / Dec::kPieces; ++i) {
    const uint8_t* blk[8];
    for (int r = 0; r < 8; ++r) blk[r] = block_of<Dec>(w[r], i);
    BlockScales<Dec> sc;
    static_for<Dec::kPieces>([&](auto pc) {
      constexpr int piece = decltype(pc)::value;
      const int b = i * Dec::kPieces + piece;
      prefetch_next_group<Dec>(w[0], b, row_bytes);
      __m256i pair[4][C];
      static_for<4>([&](auto rc) {
        constexpr int p = decltype(rc)::value;
        const __m256i q0 = quants_of<Dec, piece>(blk[2 * p]), q1 = quants_of<Dec, piece>(blk[2 * p + 1]);
        for (int c = 0; c < C; ++c) {
          const int8_t* ac = a[c].qs + 32 * b;
          pair[p][c] = fold_pair<Dec>(products<Dec>(q0, ac), products<Dec>(q1, ac));
        }
      });
      // Once per block, after the first piece's weights (before them, MXFP4 and Q4_0 lost 6-8% on Zen 3).
      if constexpr (piece == 0) sc = scales_of<Dec>(blk);
      for (int c = 0; c < C; ++c) {
        const __m256i h0 = fold_quad<Dec>(pair[0][c], pair[1][c]);
        const __m256i h1 = fold_quad<Dec>(pair[2][c], pair[3][c]);
        // Rows 0-7 over the piece's first 16 values, then over its last 16.
        const __m256i first = _mm256_permute2x128_si256(h0, h1, 0x20);
        const __m256i second = _mm256_permute2x128_si256(h0, h1, 0x31);
        __m256i dot = Dec::kHalfScales ? first : _mm256_add_epi32(first, second), dot2 = second;
        take_offset<Dec>(dot, dot2, a[c], b);
        acc[c] = scale_step<Dec>(acc[c], dot, dot2, sc.lo[piece], sc.hi[piece], a[c].d[b], a[c].s[b]);
      }
    });
  }
  for (int c = 0; c < C; ++c) store_rows(out + c * out_stride, acc[c], n_rows);
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
  for (int i = 0; i < nb / Dec::kPieces; ++i) {
    const uint8_t* blk[8];
    for (int r = 0; r < 8; ++r) blk[r] = block_of<Dec>(w[r], i);
    const BlockScales<Dec> sc = scales_of<Dec>(blk);
    static_for<Dec::kPieces>([&](auto pc) {
      constexpr int piece = decltype(pc)::value;
      const int b = i * Dec::kPieces + piece;
      prefetch_next_group<Dec>(w[0], b, row_bytes);
      __m256i v[8];
      for (int r = 0; r < 8; ++r) v[r] = quants_of<Dec, piece>(blk[r]);
      transpose8x8(v);
      for (int s = 0; s < 8; ++s) _mm256_store_si256(reinterpret_cast<__m256i*>(dst[b].q[s]), v[s]);
      _mm256_store_ps(dst[b].d, sc.lo[piece]);
      _mm256_store_ps(dst[b].m, sc.hi[piece]);
    });
  }
}

// Eight repacked rows x C tokens.
template <class Dec, int C>
__attribute__((noinline)) void tile8(const CanonX8* w, const ActQ8_0* a, int nb, float* out, ptrdiff_t out_stride,
                                     int n_rows) {
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    __m256i dot[C];
    [[maybe_unused]] __m256i part[C], first[C];
    for (int c = 0; c < C; ++c) dot[c] = _mm256_setzero_si256();
    static_for<8>([&](auto sc) {
      constexpr int s = decltype(sc)::value;
      const __m256i q = _mm256_load_si256(reinterpret_cast<const __m256i*>(w[b].q[s]));
      for (int c = 0; c < C; ++c) {
        const auto* a4 = reinterpret_cast<const uint8_t*>(a[c].qs + 32 * b + 4 * s);
        __m256i u, av;
        operands<Dec>(q, _mm256_set1_epi32(static_cast<int>(load_u32(a4))), u, av);
#if PM_VNNI
        dot[c] = dpbusd(dot[c], u, av);
#else
        const __m256i m = _mm256_maddubs_epi16(u, av);
        if constexpr (Dec::kOffset > 0) {
          // Unsigned q < 2 * kOffset: four steps' int16 lanes (8 products) stay below 2^15, so they are
          // added as int16 and widened once.
          static_assert(Dec::kOffset > 0 && 8 * (2 * Dec::kOffset - 1) * 128 < 32768);
          part[c] = s % 4 == 0 ? m : _mm256_add_epi16(part[c], m);
          if (s % 4 == 3) dot[c] = _mm256_add_epi32(dot[c], _mm256_madd_epi16(part[c], ones));
        } else {
          dot[c] = _mm256_add_epi32(dot[c], _mm256_madd_epi16(m, ones));
        }
#endif
        // A running sum: left free, GCC turns the steps into a tree and spills them (see kfamily.h).
        keep_in_register(dot[c]);
        if constexpr (Dec::kHalfScales && s == 3) {   // values 0-15 done: the first half's dot
          first[c] = dot[c];
          dot[c] = _mm256_setzero_si256();
        }
      }
    });
    const __m256 lo = _mm256_load_ps(w[b].d), hi = _mm256_load_ps(w[b].m);
    for (int c = 0; c < C; ++c) {
      __m256i& lo_dot = Dec::kHalfScales ? first[c] : dot[c];   // the first half's dot, or the whole block's
      take_offset<Dec>(lo_dot, dot[c], a[c], b);
      acc[c] = scale_step<Dec>(acc[c], lo_dot, dot[c], lo, hi, a[c].d[b], a[c].s[b]);
    }
  }
  for (int c = 0; c < C; ++c) store_rows(out + c * out_stride, acc[c], n_rows);
}

}  // namespace pocketmoe::PM_ISA::lfamily

#if PM_AVX512
#include "lfamily512.h"
#endif

namespace pocketmoe::PM_ISA::lfamily {

// Up to this many tokens the rows are decoded on the fly; above, repacked once per 8 rows (16 rows
// in 512-bit builds, where 16 remain).
constexpr int kFusedMaxTokens = 4;

// Room for eight rows as CanonX8 or sixteen as CanonX16.
inline size_t scratch_bytes(int cols) { return static_cast<size_t>(cols / 32) * 2 * sizeof(CanonX8); }

template <class Dec>
void matmul(const MatmulTask& t) {
  const int nb = t.cols / 32;
  auto* canon = reinterpret_cast<CanonX8*>(t.scratch);
  int r = t.row_begin;
  // Multi-piece types take the 256-bit paths in every set.
  if constexpr (Dec::kPieces == 1) {
#if PM_AMX
    size_t stride;
    if (t.n_tokens >= kAmxMinTokens && r + 16 <= t.row_end && evenly_spaced(t.acts, t.n_tokens, &stride)) {
      int configured = 0;
      for (; r + 16 <= t.row_end; r += 16)
        amx_rows16<Dec>(t, r, stride, reinterpret_cast<CanonX16*>(t.scratch), &configured);
      PM_TILE_RELEASE();
    }
#endif
#if PM_AVX512
    if (t.n_tokens > kFusedMaxTokens)
      for (; r + 16 <= t.row_end; r += 16) rows16<Dec>(t, r, reinterpret_cast<CanonX16*>(t.scratch));
#endif
  }
  for (; r < t.row_end; r += 8) {
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
        switch (n) {
          case 4: fused8<Dec, 4>(w, t.row_bytes, a, t.cols, o, t.out_stride, n_rows); break;
          case 3: fused8<Dec, 3>(w, t.row_bytes, a, t.cols, o, t.out_stride, n_rows); break;
          case 2: fused8<Dec, 2>(w, t.row_bytes, a, t.cols, o, t.out_stride, n_rows); break;
          default: fused8<Dec, 1>(w, t.row_bytes, a, t.cols, o, t.out_stride, n_rows); break;
        }
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

}  // namespace pocketmoe::PM_ISA::lfamily
