// 512-bit tiles of the 32-value types, included by lfamily.h in builds with PM_AVX512: sixteen
// repacked rows per tile, and in builds with PM_AMX the same repacked rows through AMX tiles.
#pragma once

namespace pocketmoe::PM_ISA::lfamily {

// Sixteen rows of one block for 512-bit tiles: q[s] holds values 4s..4s+3 of rows 0..15 in turn.
// For tile16 as unsigned bytes: signed weights (kOffset == 0) stored as q + 128, which it takes back
// out of the exact integer dot with the activation sums; for AMX as the signed weights (q - kOffset;
// kMin types keep q, which is below 32).
struct alignas(64) CanonX16 {
  uint8_t q[8][64];
  float d[16];
  float m[16];   // the mins of kMin types
};
static_assert(sizeof(CanonX16) == 640);

template <class Dec>
constexpr int kBias16 = Dec::kOffset > 0 ? kSubtract<Dec> : 128;

// acc + m * s per lane: the min step of a kMin type for sixteen rows.
PM_INLINE __m512 add_min16(__m512 acc, __m512 m, float s) { return _mm512_fmadd_ps(m, _mm512_set1_ps(s), acc); }

template <class Dec, bool kSignedWeights = false>
void repack16(const uint8_t* const (&w)[16], size_t row_bytes, int nb, CanonX16* dst) {
  // Added to every weight byte (mod 256): unsigned for tile16, signed for AMX.
  const int shift = kSignedWeights ? -kSubtract<Dec> : Dec::kOffset > 0 ? 0 : 128;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(shift));
  for (int b = 0; b < nb; ++b) {
    const uint8_t* next = w[0] + 16 * row_bytes + static_cast<size_t>(b) * 16 * Dec::kBytes;
    for (int off = 0; off < 16 * Dec::kBytes; off += 64) prefetch(next + off);
    for (int half = 0; half < 2; ++half) {
      const uint8_t* blk[8];
      __m256i v[8];
      for (int r = 0; r < 8; ++r) {
        blk[r] = w[8 * half + r] + static_cast<size_t>(b) * Dec::kBytes;
        v[r] = Dec::quants(blk[r]);
      }
      transpose8x8(v);
      for (int s = 0; s < 8; ++s)
        _mm256_store_si256(reinterpret_cast<__m256i*>(dst[b].q[s] + 32 * half), _mm256_add_epi8(v[s], flip));
      _mm256_store_ps(dst[b].d + 8 * half, Dec::scales8(blk));
      if constexpr (Dec::kMin) _mm256_store_ps(dst[b].m + 8 * half, Dec::mins8(blk));
    }
  }
}

// Sixteen repacked rows x C tokens: the exact integer dot of each row, then tile8's float steps,
// one row per lane.
// kSignedWeights: the rows were repacked signed (for AMX); they are moved to unsigned (+128) on load.
template <class Dec, int C, bool kSignedWeights = false>
__attribute__((noinline)) void tile16(const CanonX16* w, const ActQ8_0* a, int nb, float* out, ptrdiff_t out_stride) {
  constexpr int kBias = kSignedWeights ? 128 : kBias16<Dec>;
  __m512 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    __m512i dot[C];
    for (int c = 0; c < C; ++c) dot[c] = _mm512_setzero_si512();
    static_for<8>([&](auto sc) {
      constexpr int s = decltype(sc)::value;
      __m512i q = _mm512_load_si512(w[b].q[s]);
      if constexpr (kSignedWeights) q = _mm512_xor_si512(q, _mm512_set1_epi8(static_cast<char>(0x80)));
      for (int c = 0; c < C; ++c) {
        const __m512i av = _mm512_set1_epi32(static_cast<int>(load_u32(reinterpret_cast<const uint8_t*>(a[c].qs + 32 * b + 4 * s))));
        dot[c] = _mm512_dpbusd_epi32(dot[c], q, av);
        keep_in_register(dot[c]);
      }
    });
    const __m512 dw = _mm512_load_ps(w[b].d);
    for (int c = 0; c < C; ++c) {
      if constexpr (kBias > 0) dot[c] = _mm512_sub_epi32(dot[c], _mm512_set1_epi32(kBias * a[c].sums[b]));
      acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[c]), _mm512_mul_ps(dw, _mm512_set1_ps(a[c].d[b])), acc[c]);
      if constexpr (Dec::kMin) acc[c] = add_min16(acc[c], _mm512_load_ps(w[b].m), a[c].s[b]);
    }
  }
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + c * out_stride, acc[c]);
}

template <class Dec, bool kSignedWeights = false>
void repack_rows16(const uint8_t* weight, size_t row_bytes, int nb, int r, CanonX16* canon) {
  const uint8_t* w[16];
  for (int i = 0; i < 16; ++i) w[i] = weight + static_cast<size_t>(r + i) * row_bytes;
  repack16<Dec, kSignedWeights>(w, row_bytes, nb, canon);
}

// Repacked rows r..r+15 of the task against its tokens tk0..tk1-1, four at a time.
template <class Dec, bool kSignedWeights = false>
void tiles16(const MatmulTask& t, int r, const CanonX16* canon, int tk0, int tk1) {
  const int nb = t.cols / 32;
  ActQ8_0 a[4];
  for (int tk = tk0; tk < tk1; tk += 4) {
    const int n = tk1 - tk < 4 ? tk1 - tk : 4;
    for (int i = 0; i < n; ++i) a[i] = act_view(t.acts[tk + i], t.cols);
    float* o = t.out + (r - t.row_begin) + tk * t.out_stride;
    switch (n) {
      case 4: tile16<Dec, 4, kSignedWeights>(canon, a, nb, o, t.out_stride); break;
      case 3: tile16<Dec, 3, kSignedWeights>(canon, a, nb, o, t.out_stride); break;
      case 2: tile16<Dec, 2, kSignedWeights>(canon, a, nb, o, t.out_stride); break;
      default: tile16<Dec, 1, kSignedWeights>(canon, a, nb, o, t.out_stride); break;
    }
  }
}

// Rows r..r+15 of the task, repacked, against every token.
template <class Dec>
void rows16(const MatmulTask& t, int r, CanonX16* canon) {
  repack_rows16<Dec>(t.weight, t.row_bytes, t.cols / 32, r, canon);
  tiles16<Dec>(t, r, canon, 0, t.n_tokens);
}

#if PM_AMX
// The tile instructions (the test build maps these names onto an emulation).
#ifndef PM_TILE_LOADD
#define PM_TILE_LOADCONFIG(cfg) _tile_loadconfig(cfg)
#define PM_TILE_RELEASE() _tile_release()
#define PM_TILE_ZERO(t) _tile_zero(t)
#define PM_TILE_LOADD(t, p, stride) _tile_loadd(t, p, stride)
#define PM_TILE_STORED(t, p, stride) _tile_stored(t, p, stride)
#define PM_TILE_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)
#define PM_TILE_DPBUSD(c, a, b) _tile_dpbusd(c, a, b)
#endif

// LDTILECFG's 64-byte operand, palette 1.
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64);

// Two sets of three tiles, for two blocks in flight: C (0, 1), n tokens x 16 int32; A (2, 3), n
// tokens x 32 activation bytes; B (4, 5), 8 x 64 weight bytes.
inline void configure_tiles(int n) {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int i = 0; i < 2; ++i) {
    cfg.rows[i] = static_cast<uint8_t>(n);
    cfg.colsb[i] = 64;
    cfg.rows[2 + i] = static_cast<uint8_t>(n);
    cfg.colsb[2 + i] = 32;
    cfg.rows[4 + i] = 8;
    cfg.colsb[4 + i] = 64;
  }
  PM_TILE_LOADCONFIG(&cfg);
}

// Whether the n activation rows lie `stride` bytes apart, as a tile load reads them.
inline bool evenly_spaced(const uint8_t* const* acts, int n, size_t* stride) {
  *stride = n > 1 ? static_cast<size_t>(acts[1] - acts[0]) : 64;
  if (n > 1 && acts[1] <= acts[0]) return false;
  for (int i = 2; i < n; ++i)
    if (acts[i] - acts[i - 1] != acts[1] - acts[0]) return false;
  return true;
}

// Block b's exact dots into tile C (TDPBSSD: signed activations in A, signed weights in B, whose
// CanonX16.q layout, four bytes of each of 16 rows per tile row, is the one B takes).
#define PM_AMX_DOTS(C, A, B, b)                          \
  do {                                                   \
    PM_TILE_ZERO(C);                                     \
    PM_TILE_LOADD(A, act0 + 32 * (b), stride);           \
    PM_TILE_LOADD(B, w[b].q, 64);                        \
    PM_TILE_DPBSSD(C, A, B);                             \
  } while (0)

// Up to 16 tokens (rows `stride` apart, tiles configured for n) x 16 repacked signed rows: per
// block, one TDPBSSD forms every exact integer dot (with the offset already out of the weights, the
// same integers as tile16's), then tile16's float steps, one token per register: bitwise its
// results. Two blocks are in flight, so a block's products run while the one before is stored and
// scaled.
template <bool kMin>
__attribute__((noinline)) void amx_tile16(const CanonX16* w, const uint8_t* const* acts, int n, size_t stride, int cols,
                                          float* out, ptrdiff_t out_stride) {
  const int nb = cols / 32;
  const uint8_t* act0 = acts[0];
  const float* da[16];
  const float* sa[16];
  for (int i = 0; i < 16; ++i) {
    const ActQ8_0 a = act_view(acts[i < n ? i : n - 1], cols);
    da[i] = a.d;
    sa[i] = a.s;
  }
  __m512 acc[16];
  for (auto& v : acc) v = _mm512_setzero_ps();
  alignas(64) int32_t dots[16][16] = {};   // rows past n stay 0 (their results are not stored)
  const auto scale = [&](int b) {
    const __m512 dw = _mm512_load_ps(w[b].d);
    for (int i = 0; i < 16; ++i) {
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dots[i])), _mm512_mul_ps(dw, _mm512_set1_ps(da[i][b])),
                               acc[i]);
      if constexpr (kMin) acc[i] = add_min16(acc[i], _mm512_load_ps(w[b].m), sa[i][b]);
    }
  };
  PM_AMX_DOTS(0, 2, 4, 0);
  int b = 0;
  for (; b + 2 <= nb; b += 2) {
    PM_AMX_DOTS(1, 3, 5, b + 1);
    PM_TILE_STORED(0, dots, 64);
    scale(b);
    if (b + 2 < nb) PM_AMX_DOTS(0, 2, 4, b + 2);
    PM_TILE_STORED(1, dots, 64);
    scale(b + 1);
  }
  if (b < nb) {
    PM_TILE_STORED(0, dots, 64);
    scale(b);
  }
  for (int i = 0; i < n; ++i) _mm512_storeu_ps(out + i * out_stride, acc[i]);
}
#undef PM_AMX_DOTS

// Fewer tokens than this in a chunk go to tile16 (kernels.h).
constexpr int kAmxMinTokens = pocketmoe::amx::kLegacyMinTokens;

// Rows r..r+15 of the task, repacked signed, against every token: sixteen at a time through AMX, a
// short remainder through tile16.
template <class Dec>
void amx_rows16(const MatmulTask& t, int r, size_t stride, CanonX16* canon, int* configured) {
  repack_rows16<Dec, true>(t.weight, t.row_bytes, t.cols / 32, r, canon);
  int tk = 0;
  for (; t.n_tokens - tk >= kAmxMinTokens; tk += 16) {
    const int n = t.n_tokens - tk < 16 ? t.n_tokens - tk : 16;
    if (n != *configured) configure_tiles(*configured = n);
    amx_tile16<Dec::kMin>(canon, t.acts + tk, n, stride, t.cols, t.out + (r - t.row_begin) + tk * t.out_stride, t.out_stride);
  }
  if (tk < t.n_tokens) tiles16<Dec, true>(t, r, canon, tk, t.n_tokens);
}
#endif

}  // namespace pocketmoe::PM_ISA::lfamily
