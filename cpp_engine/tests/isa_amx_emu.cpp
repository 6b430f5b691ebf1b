// The AMX set's kernels compiled for a CPU without AMX (or AVX-512), so that this machine's tests run
// them: the same source as isa_amx.cpp over SIMDe's AVX-512 and a plain emulation of the six tile
// instructions it uses, written from the Intel SDM's definitions (LDTILECFG palette 1, TILEZERO,
// TILELOADD, TILESTORED, TDPBSSD, TDPBUSD). The kernels the set takes from AVX-512 VNNI come from the
// emulated build of that set (isa_avx512_emu.cpp).
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "simde_avx512.h"

namespace pm_tile_emu {

struct Tiles {
  uint8_t rows[8] = {};
  uint16_t colsb[8] = {};
  alignas(64) uint8_t data[8][16][64] = {};
};
thread_local Tiles tiles;

inline void loadconfig(const void* cfg) {
  const auto* c = static_cast<const uint8_t*>(cfg);
  for (int t = 0; t < 8; ++t) {
    std::memcpy(&tiles.colsb[t], c + 16 + 2 * t, 2);
    tiles.rows[t] = c[48 + t];
  }
}

inline void zero(int t) { std::memset(tiles.data[t], 0, sizeof(tiles.data[t])); }

// Rows past the configured ones, and bytes past colsb, read as 0.
inline void loadd(int t, const void* base, size_t stride) {
  zero(t);
  for (int r = 0; r < tiles.rows[t]; ++r)
    std::memcpy(tiles.data[t][r], static_cast<const uint8_t*>(base) + r * stride, tiles.colsb[t]);
}

inline void stored(int t, void* base, size_t stride) {
  for (int r = 0; r < tiles.rows[t]; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, tiles.data[t][r], tiles.colsb[t]);
}

// C[m][n] += sum over k of A[m][4k + i] * B[k][4n + i], i < 4, B's bytes signed, A's signed (TDPBSSD) or
// unsigned (TDPBUSD), int32 wrapping.
template <typename AByte>
inline void dpb_sd(int c, int a, int b) {
  for (int m = 0; m < tiles.rows[c]; ++m)
    for (int n = 0; n < tiles.colsb[c] / 4; ++n) {
      int32_t acc;
      std::memcpy(&acc, &tiles.data[c][m][4 * n], 4);
      for (int k = 0; k < tiles.colsb[a] / 4; ++k)
        for (int i = 0; i < 4; ++i)
          acc += int32_t{static_cast<AByte>(tiles.data[a][m][4 * k + i])} *
                 int32_t{static_cast<int8_t>(tiles.data[b][k][4 * n + i])};
      std::memcpy(&tiles.data[c][m][4 * n], &acc, 4);
    }
}

inline void dpbssd(int c, int a, int b) { dpb_sd<int8_t>(c, a, b); }
inline void dpbusd(int c, int a, int b) { dpb_sd<uint8_t>(c, a, b); }

}  // namespace pm_tile_emu

#define PM_TILE_LOADCONFIG(cfg) pm_tile_emu::loadconfig(cfg)
#define PM_TILE_RELEASE() ((void)0)
#define PM_TILE_ZERO(t) pm_tile_emu::zero(t)
#define PM_TILE_LOADD(t, p, stride) pm_tile_emu::loadd(t, p, stride)
#define PM_TILE_STORED(t, p, stride) pm_tile_emu::stored(t, p, stride)
#define PM_TILE_DPBSSD(c, a, b) pm_tile_emu::dpbssd(c, a, b)
#define PM_TILE_DPBUSD(c, a, b) pm_tile_emu::dpbusd(c, a, b)

#define PM_ISA amx_emu
#define PM_VNNI 1
#define PM_AVX512 1
#define PM_AVX512_EMULATED 1
#define PM_AMX 1
#define PM_AMX_FALLBACK avx512_emu
#define PM_DPBUSD simde_mm256_dpbusd_epi32
#define PM_DPWSSD simde_mm256_dpwssd_epi32
#include "../src/amx_kernels.inc"
