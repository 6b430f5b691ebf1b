// Row-range driver shared by the kernel families: picks tiles, repacks blocks for long batches.
#pragma once

#include <cstddef>
#include <cstdint>

#include "pocketmoe/matmul.h"
#include "simd.h"

namespace pocketmoe::PM_ISA::driver {

// Up to this many tokens, blocks are decoded on the fly, one row at a time; above, two rows at a
// time are decoded once into the family's canonical form and reused for every token.
constexpr int kFusedMaxTokens = 4;

// Rows decoded together for the repacked tiles: 2 on 256-bit vectors, 4 on 512-bit ones (twice the
// registers); the scratch area holds the most any build uses.
constexpr int kRepackRows = PM_AVX512 ? 4 : 2;
constexpr int kMaxRepackRows = 4;

template <class Fam, class Dec, int R>
PM_INLINE void dot_rows(const uint8_t* w, size_t w_stride, const uint8_t* const* acts, int n_tok, int cols,
                        float* out, ptrdiff_t out_stride) {
  typename Fam::Act a[4];
  int t = 0;
  for (; t + 4 <= n_tok; t += 4) {
    for (int i = 0; i < 4; ++i) a[i] = Fam::act_view(acts[t + i], cols);
    Fam::template dot_tile<Dec, R, 4>(w, w_stride, a, cols, out + t * out_stride, out_stride);
  }
  const int rest = n_tok - t;
  for (int i = 0; i < rest; ++i) a[i] = Fam::act_view(acts[t + i], cols);
  float* o = out + t * out_stride;
  switch (rest) {
    case 3: Fam::template dot_tile<Dec, R, 3>(w, w_stride, a, cols, o, out_stride); break;
    case 2: Fam::template dot_tile<Dec, R, 2>(w, w_stride, a, cols, o, out_stride); break;
    case 1: Fam::template dot_tile<Dec, R, 1>(w, w_stride, a, cols, o, out_stride); break;
    default: break;
  }
}

template <class Fam>
size_t scratch_bytes(int cols) {
  if constexpr (Fam::kRepack) {
    return kMaxRepackRows * static_cast<size_t>(cols / Fam::kBlockValues) * sizeof(typename Fam::CanonBlock);
  } else {
    return 0;
  }
}

// Rows per GEMV tile: Dec::kGemvRows where a decoder says (default 1).
template <class Dec, class = void>
constexpr int kGemvRows = 1;
template <class Dec>
constexpr int kGemvRows<Dec, std::void_t<decltype(Dec::kGemvRows)>> = Dec::kGemvRows;

template <class Fam, class Dec>
void matmul(const MatmulTask& t) {
  int r = t.row_begin;
  if (Fam::kRepack && t.n_tokens <= kFusedMaxTokens) {
    // One row at a time: the weights then stream from DRAM as one sequential run per thread, which
    // the prefetchers follow much better than two interleaved rows (measured 1.2-1.6x faster cold).
    // A type whose decoding, not DRAM, is the limit may take two (Dec::kGemvRows).
    if constexpr (kGemvRows<Dec> == 2)
      for (; r + 2 <= t.row_end; r += 2)
        dot_rows<Fam, Dec, 2>(t.weight + r * t.row_bytes, t.row_bytes, t.acts, t.n_tokens, t.cols,
                              t.out + (r - t.row_begin), t.out_stride);
    for (; r < t.row_end; ++r)
      dot_rows<Fam, Dec, 1>(t.weight + r * t.row_bytes, t.row_bytes, t.acts, t.n_tokens, t.cols,
                            t.out + (r - t.row_begin), t.out_stride);
    return;
  }
  if constexpr (!Fam::kRepack) {
    // Float weights: two rows per tile halve the activation loads per weight (and measured faster
    // than one row here, decode included).
    for (; r + 2 <= t.row_end; r += 2)
      dot_rows<Fam, Dec, 2>(t.weight + r * t.row_bytes, t.row_bytes, t.acts, t.n_tokens, t.cols,
                            t.out + (r - t.row_begin), t.out_stride);
    if (r < t.row_end)
      dot_rows<Fam, Dec, 1>(t.weight + r * t.row_bytes, t.row_bytes, t.acts, t.n_tokens, t.cols,
                            t.out + (r - t.row_begin), t.out_stride);
  } else {
    using Canon = typename Fam::template Canon<Dec>;
    const int nb = t.cols / Fam::kBlockValues;
    auto* canon = reinterpret_cast<typename Fam::CanonBlock*>(t.scratch);
    const auto* cw = reinterpret_cast<const uint8_t*>(canon);
    const size_t canon_stride = static_cast<size_t>(nb) * sizeof(typename Fam::CanonBlock);
    for (; r < t.row_end; r += kRepackRows) {
      const int n_rows = t.row_end - r >= kRepackRows ? kRepackRows : t.row_end - r;
      for (int i = 0; i < n_rows; ++i)
        Fam::template repack_row<Dec>(t.weight + (r + i) * t.row_bytes, nb, canon + i * nb);
      float* out = t.out + (r - t.row_begin);
      simd::static_for<kRepackRows>([&](auto rc) {
        constexpr int R = decltype(rc)::value + 1;
        if (n_rows == R) dot_rows<Fam, Canon, R>(cw, canon_stride, t.acts, t.n_tokens, t.cols, out, t.out_stride);
      });
    }
  }
}

}  // namespace pocketmoe::PM_ISA::driver
