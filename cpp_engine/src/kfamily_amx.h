// The 256-value types (k-quants, IQ types) through AMX tiles, in builds with PM_AMX (included by
// amx_kernels.inc after lfamily.h, whose tile helpers it shares).
//
// Each weight is folded with its scale into one exact int16, w = q * scale (+ corr for kOffset
// types), and split as w = 256 * hi + lo, hi signed and lo unsigned. A block's integer dot of a row
// with a token is then 256 * TDPBSSD(hi, a) + TDPBUSD(lo, a) over its 256 values: the same integer
// I that kfamily's vector tiles form group by group, and kMin types add Imin = corr . bsums, so the
// float steps after them (kfamily.h) give bitwise those tiles' results.
//
// The weights are the tiles' A operand (sixteen rows of 64 bytes, as repacked); the tokens, B, so
// their activations are laid out four bytes per token per tile row once per call. A tile's int32
// results are then rows x tokens.
#pragma once

namespace pocketmoe::PM_ISA::kamx {

using namespace simd;
using lfamily::TileConfig;

// Sixteen rows of one block: the byte planes of their weights in value order, then d, dmin and the
// decoders' corr (int16 x 16 per row, read as 8 pairs).
struct alignas(64) Weights16 {
  int8_t hi[16][256];
  uint8_t lo[16][256];
  float d[16];
  float dmin[16];
  int32_t corr[16][8];
};

// Sixteen tokens of one block as B operands: q[c][k] holds values 64c + 4k .. 64c + 4k + 3 of
// tokens 0..15 in turn; bsums[j][token] the token's bsums 2j and 2j + 1; d[token] its scale.
struct alignas(64) Acts16 {
  int8_t q[4][16][64];
  int32_t bsums[8][16];
  float d[16];
};

// Tokens per pass: their activations are laid out once, then every 16 rows are repacked and run.
constexpr int kPassTokens = 64;
static_assert(sizeof(Weights16) + kPassTokens / 16 * sizeof(Acts16) == kfamily::kAmxScratchPerBlock);

// Group G of one row as its int16 weights, byte planes lo (w & 255) and hi (w >> 8) in value order.
// The decoders' scales repeat over 16 values and fit a byte; maddubs against the scale bytes of the
// even and odd values in turn gives each product as a whole int16.
template <class Dec, int G>
PM_INLINE void split_group(const uint8_t* blk, const typename Dec::Head& h, [[maybe_unused]] __m256i corr_split,
                           uint8_t* lo, int8_t* hi) {
  const __m256i q = Dec::template quants<G>(blk, h);
  const __m256i s16 = Dec::template scales<G>(blk, h);
  __m256i sb = _mm256_packs_epi16(s16, s16);   // bytes 0-15: values 0-15's scale; 16-31: 16-31's
  __m256i qu = q;
  if constexpr (Dec::kSigned) {
    sb = _mm256_sign_epi8(sb, q);
    qu = _mm256_abs_epi8(q);
  }
  const __m256i even = _mm256_set1_epi16(0x00FF);
  __m256i we = _mm256_maddubs_epi16(qu, _mm256_and_si256(sb, even));     // w of values 2i
  __m256i wo = _mm256_maddubs_epi16(qu, _mm256_andnot_si256(even, sb));  // w of values 2i + 1
  if constexpr (Dec::kOffset) {
    const __m256i c = broadcast_i16<G>(corr_split);   // corr 2G for values 0-15, 2G + 1 for 16-31
    we = _mm256_add_epi16(we, c);
    wo = _mm256_add_epi16(wo, c);
  }
  store256(lo, _mm256_or_si256(_mm256_and_si256(we, even), _mm256_slli_epi16(wo, 8)));
  store256(hi, _mm256_or_si256(_mm256_srli_epi16(we, 8), _mm256_andnot_si256(even, wo)));
}

template <class Dec>
void repack16(const uint8_t* w0, size_t row_bytes, int nb, Weights16* dst) {
  for (int b = 0; b < nb; ++b) {
    Weights16& c = dst[b];
    for (int r = 0; r < 16; ++r) {
      const uint8_t* blk = w0 + r * row_bytes + static_cast<size_t>(b) * Dec::kBytes;
      for (int off = 0; off < Dec::kBytes; off += 64) prefetch(blk + Dec::kBytes + off);
      const auto h = Dec::head(blk);
      // corr with its even-indexed entries in the low half and odd ones in the high half.
      const __m256i cs = _mm256_permute4x64_epi64(
          _mm256_shuffle_epi8(h.corr, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5,
                                                       8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15)),
          0xD8);
      static_for<8>([&](auto gc) {
        constexpr int G = decltype(gc)::value;
        split_group<Dec, G>(blk, h, cs, c.lo[r] + 32 * G, c.hi[r] + 32 * G);
      });
      c.d[r] = h.d;
      c.dmin[r] = h.dmin;
      store256(c.corr[r], h.corr);
    }
  }
}

// Transposes 16 x 16 dwords in place: v[i] dword j <-> v[j] dword i.
PM_INLINE void transpose16x16(__m512i (&v)[16]) {
  __m512i a[16], b[16];
  for (int j = 0; j < 16; j += 2) {
    a[j] = _mm512_unpacklo_epi32(v[j], v[j + 1]);
    a[j + 1] = _mm512_unpackhi_epi32(v[j], v[j + 1]);
  }
  // b[4j + m], 128-bit lane L: dword 4L + m of rows 4j..4j+3.
  for (int j = 0; j < 16; j += 4) {
    b[j] = _mm512_unpacklo_epi64(a[j], a[j + 2]);
    b[j + 1] = _mm512_unpackhi_epi64(a[j], a[j + 2]);
    b[j + 2] = _mm512_unpacklo_epi64(a[j + 1], a[j + 3]);
    b[j + 3] = _mm512_unpackhi_epi64(a[j + 1], a[j + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    const __m512i x0 = _mm512_shuffle_i32x4(b[m], b[4 + m], 0x88), y0 = _mm512_shuffle_i32x4(b[8 + m], b[12 + m], 0x88);
    const __m512i x1 = _mm512_shuffle_i32x4(b[m], b[4 + m], 0xDD), y1 = _mm512_shuffle_i32x4(b[8 + m], b[12 + m], 0xDD);
    v[m] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    v[8 + m] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    v[4 + m] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    v[12 + m] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

// Tokens acts[0..n-1] (n <= 16; the last repeats to fill 16) laid out as B operands, block by block.
inline void lay_out_tokens(const uint8_t* const* acts, int n, int cols, Acts16* dst) {
  const int nb = cols / 256;
  kfamily::ActQ8K a[16];
  for (int i = 0; i < 16; ++i) a[i] = kfamily::act_view(acts[i < n ? i : n - 1], cols);
  for (int b = 0; b < nb; ++b) {
    Acts16& t = dst[b];
    for (int c = 0; c < 4; ++c) {
      __m512i v[16];
      for (int i = 0; i < 16; ++i) v[i] = _mm512_loadu_si512(a[i].qs + 256 * b + 64 * c);
      transpose16x16(v);
      for (int k = 0; k < 16; ++k) _mm512_store_si512(t.q[c][k], v[k]);
    }
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 16; ++i) std::memcpy(&t.bsums[j][i], a[i].bsums + 16 * b + 2 * j, 4);
    for (int i = 0; i < 16; ++i) t.d[i] = a[i].d[b];
  }
}

// All seven tiles 16 x 64 bytes: C hi (0, 2) and lo (1, 3) for two blocks in flight, rows x tokens
// int32; A hi (4) and lo (6), 16 rows x 64 weight bytes; B (5), 16 x (16 tokens x 4 bytes).
inline void configure_tiles() {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int i = 0; i < 7; ++i) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  PM_TILE_LOADCONFIG(&cfg);
}

// Block b's exact dots: 256 * (CH) + (CL) is each row's I with each token.
#define PM_KAMX_DOTS(CH, CL, b)                     \
  do {                                              \
    PM_TILE_ZERO(CH);                               \
    PM_TILE_ZERO(CL);                               \
    for (int k = 0; k < 4; ++k) {                   \
      PM_TILE_LOADD(5, a[b].q[k], 64);              \
      PM_TILE_LOADD(4, w[b].hi[0] + 64 * k, 256);   \
      PM_TILE_DPBSSD(CH, 4, 5);                     \
      PM_TILE_LOADD(6, w[b].lo[0] + 64 * k, 256);   \
      PM_TILE_DPBUSD(CL, 6, 5);                     \
    }                                               \
  } while (0)

// Sixteen repacked rows x the first n of sixteen laid-out tokens; two blocks in flight, so a block's
// products run while the one before is stored and scaled.
template <class Dec>
__attribute__((noinline)) void tile16(const Weights16* w, const Acts16* a, int nb, int n, float* out,
                                      ptrdiff_t out_stride) {
  __m512 acc[16];
  for (auto& v : acc) v = _mm512_setzero_ps();
  alignas(64) int32_t hi[16][16], lo[16][16];
  const auto scale = [&](int b) {
    const __m512 da = _mm512_load_ps(a[b].d);
    static_for<16>([&](auto ic) {
      constexpr int i = decltype(ic)::value;
      const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(hi[i]), 8), _mm512_load_si512(lo[i]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(_mm512_set1_ps(w[b].d[i]), da), acc[i]);
      if constexpr (Dec::kMin) {
        __m512i m = _mm512_setzero_si512();
        for (int j = 0; j < 8; ++j)
          m = _mm512_dpwssd_epi32(m, _mm512_set1_epi32(w[b].corr[i][j]), _mm512_load_si512(a[b].bsums[j]));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(m), _mm512_mul_ps(_mm512_set1_ps(w[b].dmin[i]), da), acc[i]);
      }
    });
  };
  PM_KAMX_DOTS(0, 1, 0);
  int b = 0;
  for (; b + 2 <= nb; b += 2) {
    PM_KAMX_DOTS(2, 3, b + 1);
    PM_TILE_STORED(0, hi, 64);
    PM_TILE_STORED(1, lo, 64);
    scale(b);
    if (b + 2 < nb) PM_KAMX_DOTS(0, 1, b + 2);
    PM_TILE_STORED(2, hi, 64);
    PM_TILE_STORED(3, lo, 64);
    scale(b + 1);
  }
  if (b < nb) {
    PM_TILE_STORED(0, hi, 64);
    PM_TILE_STORED(1, lo, 64);
    scale(b);
  }
  alignas(64) float res[16][16];
  for (int i = 0; i < 16; ++i) _mm512_store_ps(res[i], acc[i]);
  for (int t = 0; t < n; ++t)
    for (int i = 0; i < 16; ++i) out[t * out_stride + i] = res[i][t];
}
#undef PM_KAMX_DOTS

// Tokens from which a call goes through the tiles (fewer: kfamily's 512-bit tiles).
constexpr int kMinTokens = pocketmoe::amx::kSuperMinTokens;
static_assert(kMinTokens > driver::kFusedMaxTokens);

template <class Dec>
void matmul(const MatmulTask& t) {
  const int rows16 = t.n_tokens >= kMinTokens ? (t.row_end - t.row_begin) / 16 * 16 : 0;
  if (rows16 > 0) {
    const int nb = t.cols / 256;
    auto* w = reinterpret_cast<Weights16*>(t.scratch);
    auto* a = reinterpret_cast<Acts16*>(w + nb);
    configure_tiles();
    for (int tk = 0; tk < t.n_tokens; tk += kPassTokens) {
      const int n = t.n_tokens - tk < kPassTokens ? t.n_tokens - tk : kPassTokens;
      for (int g = 0; g < n; g += 16)
        lay_out_tokens(t.acts + tk + g, n - g < 16 ? n - g : 16, t.cols, a + g / 16 * nb);
      for (int r = t.row_begin; r < t.row_begin + rows16; r += 16) {
        repack16<Dec>(t.weight + static_cast<size_t>(r) * t.row_bytes, t.row_bytes, nb, w);
        for (int g = 0; g < n; g += 16)
          tile16<Dec>(w, a + g / 16 * nb, nb, n - g < 16 ? n - g : 16,
                      t.out + (r - t.row_begin) + (tk + g) * t.out_stride, t.out_stride);
      }
    }
    PM_TILE_RELEASE();
  }
  if (rows16 < t.row_end - t.row_begin) {
    MatmulTask rest = t;
    rest.row_begin = t.row_begin + rows16;
    rest.out = t.out + rows16;
    driver::matmul<kfamily::Family, Dec>(rest);
  }
}

}  // namespace pocketmoe::PM_ISA::kamx
