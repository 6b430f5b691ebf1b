// The GEMV and grouped GEMM bodies of every weight type (templates on a quant.cuh decoder); see matmul.cu.
#pragma once

#include "quant.cuh"

namespace pmq {

constexpr int kGemvTokens = 8;     // tokens per blockIdx.y of a GEMV
constexpr int kTileRows = 4;       // rows per warp of a GEMM tile
constexpr int kTilePairs = 8;      // pairs per GEMM tile
constexpr int kChunk = 1024;       // quantized activation values per chunk: one warp step of every type
constexpr int kFloatChunk = 256;   // float activation values per chunk

// Values per activation scale under a decoder: Q8_0 (32) for the 32- and 64-value types, Q8_K (256) for the
// super-blocks. Block indices of the steps count these (a 64-value block is two).
template <class D>
__device__ __forceinline__ constexpr int act_block() { return D::kValues == 256 ? 256 : 32; }

// A few tokens' activation rows; block indices count from the rows' first block.
struct ActRows {
  const int8_t* q;
  const float* d;
  const int16_t* s;    // Q8_K: sums of 16
  const float* bs;     // Q8_0: the s of each block (matmul.cu), d_stride apart
  int q_stride, d_stride, s_stride;   // elements from one token's row to the next
};

// The 32 quants of piece p of a block (a 32-value block has one piece and its decoder takes no index).
template <class D>
__device__ __forceinline__ void quants_of(const uint8_t* blk, int p, int (&q)[8]) {
  if constexpr (D::kValues == 32) {
    D::quants(blk, q);
  } else {
    D::quants(blk, p, q);
  }
}

// One warp step of a 32-value type: lane l takes block b0 + l (index ab0 + l in a). A type with a min adds
// m * s, s the activation block's fp16-rounded d32 * (sum of its quants), as llama.cpp's Q8_1 dot does.
// Larger blocks are taken in 32-value pieces, piece b0 + l: a 64-value type (NVFP4, a scale per 16) with a
// float step per 16, a 128-value one (Q1_0, one scale) with a float step per piece.
template <class D, int NT>
__device__ __forceinline__ void step_l(const uint8_t* wrow, int nb, int b0, const ActRows& a, int ab0, int nt,
                                       float (&acc)[NT]) {
  constexpr int kPieces = D::kValues / 32;
  constexpr bool kHalves = kPieces == 2;
  const int lane = threadIdx.x % WARP, b = b0 + lane;
  if (b >= nb) return;
  const uint8_t* blk = wrow + static_cast<long long>(b / kPieces) * D::kBytes;
  int q[8];
  float dw[2] = {0.0f, 0.0f}, mw = 0.0f;
  quants_of<D>(blk, b % kPieces, q);
  if constexpr (kHalves) {
    D::scales(blk, b % 2, dw);
  } else {
    dw[0] = D::scale(blk);
  }
  if constexpr (D::kMin) mw = D::min(blk);
  const int ab = ab0 + lane;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (t < nt) {
      const int* x = reinterpret_cast<const int*>(a.q + t * a.q_stride + 32 * ab);
      const float da = a.d[t * a.d_stride + ab];
      if constexpr (kHalves) {
        int d0 = 0, d1 = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          d0 = __dp4a(q[k], x[k], d0);
          d1 = __dp4a(q[k + 4], x[k + 4], d1);
        }
        acc[t] = fmaf(static_cast<float>(d0), dw[0] * da, acc[t]);
        acc[t] = fmaf(static_cast<float>(d1), dw[1] * da, acc[t]);
      } else {
        int dot = 0;
#pragma unroll
        for (int k = 0; k < 8; ++k) dot = __dp4a(q[k], x[k], dot);
        acc[t] = fmaf(static_cast<float>(dot), dw[0] * da, acc[t]);
      }
      if constexpr (D::kMin) acc[t] = fmaf(mw, a.bs[t * a.d_stride + ab], acc[t]);
    }
  }
}

// One warp step of a 256-value type: lanes 8j..8j+7 take groups 0..7 of super-block b0 + j.
template <class D, int NT>
__device__ __forceinline__ void step_k(const uint8_t* wrow, int nb, int b0, const ActRows& a, int ab0, int nt,
                                       float (&acc)[NT]) {
  const int lane = threadIdx.x % WARP, g = lane % 8;
  const bool valid = b0 + lane / 8 < nb;
  int q[8] = {0, 0, 0, 0, 0, 0, 0, 0}, sc[2] = {0, 0}, mn[2] = {0, 0};
  float d = 0.0f, dmin = 0.0f;
  if (valid) {
    const uint8_t* blk = wrow + static_cast<long long>(b0 + lane / 8) * D::kBytes;
    D::head(blk, d, dmin);
    D::group(blk, g, q, sc, mn);
  }
  const int ab = ab0 + lane / 8;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (t < nt) {
      int is = 0, ms = 0;
      if (valid) {
        const int* x = reinterpret_cast<const int*>(a.q + t * a.q_stride + 256 * ab + 32 * g);
        int d0 = 0, d1 = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          d0 = __dp4a(q[k], x[k], d0);
          d1 = __dp4a(q[k + 4], x[k + 4], d1);
        }
        is = sc[0] * d0 + sc[1] * d1;
        if constexpr (D::kMin) {
          const int16_t* s = a.s + t * a.s_stride + 16 * ab + 2 * g;
          ms = mn[0] * s[0] + mn[1] * s[1];
        }
      }
#pragma unroll
      for (int o = 1; o < 8; o <<= 1) {
        is += __shfl_xor_sync(FULL_MASK, is, o);
        if constexpr (D::kMin) ms += __shfl_xor_sync(FULL_MASK, ms, o);
      }
      if (valid && g == 0) {
        const float da = a.d[t * a.d_stride + ab];
        acc[t] = fmaf(static_cast<float>(is), d * da, acc[t]);
        if constexpr (D::kMin) acc[t] = fmaf(static_cast<float>(ms), dmin * da, acc[t]);
      }
    }
  }
}

template <class D, int NT>
__device__ __forceinline__ void step(const uint8_t* wrow, int nb, int b0, const ActRows& a, int ab0, int nt,
                                     float (&acc)[NT]) {
  if constexpr (act_block<D>() == 32) {
    step_l<D, NT>(wrow, nb, b0, a, ab0, nt, acc);
  } else {
    step_k<D, NT>(wrow, nb, b0, a, ab0, nt, acc);
  }
}

// ---- GEMV ----

template <class D, int NT>
__device__ __forceinline__ void gemv_row(const uint8_t* wrow, const ActRows& a, float* y, int rows, int cols, int row,
                                         int nt) {
  const int nb = cols / act_block<D>();
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
  for (int b0 = 0; b0 < nb; b0 += kChunk / act_block<D>()) step<D, NT>(wrow, nb, b0, a, b0, nt, acc);
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (t < nt) {
      const float v = warp_sum(acc[t]);
      if (threadIdx.x % WARP == 0) y[static_cast<long long>(t) * rows + row] = v;
    }
  }
}

// The rows of tokens t0.. : xs is the Q8_0 s (float, one per block) or the Q8_K sums (int16, one per 16).
__device__ __forceinline__ ActRows act_rows(const int8_t* xq, const float* xd, const float* xs, int t0, int cols,
                                            int nd) {
  const long long t = t0;
  return ActRows{xq + t * cols, xd + t * nd, nullptr, xs + t * nd, cols, nd, 0};
}

__device__ __forceinline__ ActRows act_rows(const int8_t* xq, const float* xd, const int16_t* xs, int t0, int cols,
                                            int nd) {
  const long long t = t0;
  return ActRows{xq + t * cols, xd + t * nd, xs + t * (cols / 16), nullptr, cols, nd, cols / 16};
}

template <class D, class S>
__device__ __forceinline__ void gemv_q(const uint8_t* w, const int8_t* xq, const float* xd, const S* xs, float* y,
                                       int rows, int cols, int n_tokens) {
  static_assert((act_block<D>() == 32) == (sizeof(S) == 4), "xs: float s (Q8_0 rows) or int16 sums");
  const int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  const int t0 = blockIdx.y * kGemvTokens;
  if (row >= rows || t0 >= n_tokens) return;
  const int nt = min(n_tokens - t0, kGemvTokens);
  const int nd = cols / act_block<D>();
  const ActRows a = act_rows(xq, xd, xs, t0, cols, nd);
  const uint8_t* wrow = w + static_cast<long long>(row) * (cols / D::kValues) * D::kBytes;
  float* yt = y + static_cast<long long>(t0) * rows;
  if (nt == 1) {
    gemv_row<D, 1>(wrow, a, yt, rows, cols, row, 1);
  } else {
    gemv_row<D, kGemvTokens>(wrow, a, yt, rows, cols, row, nt);
  }
}

template <class D, int NT>
__device__ __forceinline__ void gemv_row_f(const uint8_t* wrow, const float* x, float* y, int rows, int cols, int row,
                                           int nt) {
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
  for (int i = threadIdx.x % WARP; i < cols; i += WARP) {
    const float wv = D::load(wrow, i);
#pragma unroll
    for (int t = 0; t < NT; ++t)
      if (t < nt) acc[t] = fmaf(wv, x[static_cast<long long>(t) * cols + i], acc[t]);
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (t < nt) {
      const float v = warp_sum(acc[t]);
      if (threadIdx.x % WARP == 0) y[static_cast<long long>(t) * rows + row] = v;
    }
  }
}

template <class D>
__device__ __forceinline__ void gemv_f(const uint8_t* w, const float* x, float* y, int rows, int cols, int n_tokens) {
  const int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  const int t0 = blockIdx.y * kGemvTokens;
  if (row >= rows || t0 >= n_tokens) return;
  const int nt = min(n_tokens - t0, kGemvTokens);
  const uint8_t* wrow = w + static_cast<long long>(row) * cols * D::kBytes;
  const float* xt = x + static_cast<long long>(t0) * cols;
  float* yt = y + static_cast<long long>(t0) * rows;
  if (nt == 1) {
    gemv_row_f<D, 1>(wrow, xt, yt, rows, cols, row, 1);
  } else {
    gemv_row_f<D, kGemvTokens>(wrow, xt, yt, rows, cols, row, nt);
  }
}

// ---- grouped expert GEMM ----

// Where the pairs of this block's group and tile live; false when the block has nothing to do.
struct Tile {
  int group, begin, count, row0;
};

// The group is blockIdx.z, or groups[blockIdx.z] with has_groups (-1: none).
__device__ __forceinline__ bool gemm_tile(const int32_t* offsets, const int32_t* groups, int has_groups, int rows,
                                          Tile& t) {
  t.group = has_groups ? groups[blockIdx.z] : static_cast<int>(blockIdx.z);
  t.row0 = blockIdx.x * (blockDim.x / WARP) * kTileRows;
  if (t.group < 0 || t.row0 >= rows) return false;
  t.begin = offsets[t.group];
  t.count = offsets[t.group + 1] - t.begin;
  return t.count > 0;
}

// Activation row of each pair of the tile (-1 past its end), written by the first kTilePairs threads.
__device__ __forceinline__ void tile_rows(int* srow, const int32_t* tokens, const int32_t* slots, int p0, int np,
                                          int top_k, int act_by_pair) {
  const int j = threadIdx.x;
  if (j < kTilePairs) srow[j] = j >= np ? -1 : act_by_pair ? tokens[p0 + j] * top_k + slots[p0 + j] : tokens[p0 + j];
}

// One chunk of the tile's activation rows into shared memory: dst[j * per + k] = src[row_j * stride + off + k] for
// pair j of the tile (row_j = srow[j]); zero past the tile's pairs and where k * unit (the values the element
// stands for) reaches the chunk's cn values.
template <class T>
__device__ __forceinline__ void stage_tile(T* dst, const T* src, const int* srow, int per, int unit, int cn,
                                           long long stride, long long off) {
  for (int i = threadIdx.x; i < kTilePairs * per; i += blockDim.x) {
    const int r = srow[i / per], k = i % per;
    dst[i] = r >= 0 && k * unit < cn ? src[static_cast<long long>(r) * stride + off + k] : T(0);
  }
}

__device__ __forceinline__ void zero_tile(float (&acc)[kTileRows][kTilePairs]) {
#pragma unroll
  for (int i = 0; i < kTileRows; ++i)
#pragma unroll
    for (int t = 0; t < kTilePairs; ++t) acc[i][t] = 0.0f;
}

template <int NT>
__device__ __forceinline__ void store_tile(float (&acc)[kTileRows][NT], const int32_t* tokens, const int32_t* slots,
                                           int p0, int np, float* y, int rows, int row0, int top_k) {
  const int warps = blockDim.x / WARP, warp = threadIdx.x / WARP;
#pragma unroll
  for (int i = 0; i < kTileRows; ++i) {
    const int r = row0 + warp + warps * i;
    if (r >= rows) continue;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t < np) {
        const float v = warp_sum(acc[i][t]);
        const long long out = static_cast<long long>(tokens[p0 + t]) * top_k + slots[p0 + t];
        if (threadIdx.x % WARP == 0) y[out * rows + r] = v;
      }
    }
  }
}

// xs: as in act_rows; the Q8_0 s is staged for the types with a min only, the Q8_K sums for every type.
template <class D, class S>
__device__ __forceinline__ void moe_gemm_q(const uint8_t* const* experts, const int32_t* offsets,
                                           const int32_t* tokens, const int32_t* slots, const int8_t* xq,
                                           const float* xd, const S* xs, float* y, int rows, int cols,
                                           int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  constexpr int kA = act_block<D>(), kD = kChunk / kA, kS = kChunk / 16;
  constexpr bool kSums = kA == 256, kBlockS = kA == 32 && D::kMin;
  static_assert((kA == 32) == (sizeof(S) == 4), "xs: float s (Q8_0 rows) or int16 sums");
  __shared__ int sq[kTilePairs * kChunk / 4];
  __shared__ float sd[kTilePairs * kD];
  __shared__ int16_t ss[kSums ? kTilePairs * kS : 1];
  __shared__ float sbs[kBlockS ? kTilePairs * kD : 1];
  __shared__ int srow[kTilePairs];
  Tile tl;
  if (!gemm_tile(offsets, groups, has_groups, rows, tl)) return;
  const int warps = blockDim.x / WARP, warp = threadIdx.x / WARP;
  const int nb = cols / kA;
  const uint8_t* w = experts[tl.group];
  const long long row_bytes = static_cast<long long>(cols / D::kValues) * D::kBytes;
  for (int tile = blockIdx.y; tile * kTilePairs < tl.count; tile += gridDim.y) {
    const int p0 = tl.begin + tile * kTilePairs, np = min(kTilePairs, tl.count - tile * kTilePairs);
    tile_rows(srow, tokens, slots, p0, np, top_k, act_by_pair);
    float acc[kTileRows][kTilePairs];
    zero_tile(acc);
    for (int c0 = 0; c0 < cols; c0 += kChunk) {
      const int cn = min(kChunk, cols - c0);
      __syncthreads();   // the previous chunk's readers are done (and srow is written)
      // int8 values four to an int (cols and c0 are multiples of 32), one scale (and s) per block, one sum per 16
      stage_tile(sq, reinterpret_cast<const int*>(xq), srow, kChunk / 4, 4, cn, cols / 4, c0 / 4);
      stage_tile(sd, xd, srow, kD, kA, cn, nb, c0 / kA);
      if constexpr (kSums) stage_tile(ss, xs, srow, kS, 16, cn, cols / 16, c0 / 16);
      if constexpr (kBlockS) stage_tile(sbs, xs, srow, kD, kA, cn, nb, c0 / kA);
      __syncthreads();
      const ActRows a{reinterpret_cast<const int8_t*>(sq), sd, ss, sbs, kChunk, kD, kS};
#pragma unroll
      for (int i = 0; i < kTileRows; ++i) {
        const int r = tl.row0 + warp + warps * i;
        if (r < rows) step<D, kTilePairs>(w + r * row_bytes, nb, c0 / kA, a, 0, np, acc[i]);
      }
    }
    store_tile<kTilePairs>(acc, tokens, slots, p0, np, y, rows, tl.row0, top_k);
  }
}

template <class D>
__device__ __forceinline__ void moe_gemm_f(const uint8_t* const* experts, const int32_t* offsets,
                                           const int32_t* tokens, const int32_t* slots, const float* x, float* y,
                                           int rows, int cols, int top_k, int act_by_pair, const int32_t* groups,
                                           int has_groups) {
  __shared__ float sx[kTilePairs * kFloatChunk];
  __shared__ int srow[kTilePairs];
  Tile tl;
  if (!gemm_tile(offsets, groups, has_groups, rows, tl)) return;
  const int warps = blockDim.x / WARP, warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  const uint8_t* w = experts[tl.group];
  const long long row_bytes = static_cast<long long>(cols) * D::kBytes;
  for (int tile = blockIdx.y; tile * kTilePairs < tl.count; tile += gridDim.y) {
    const int p0 = tl.begin + tile * kTilePairs, np = min(kTilePairs, tl.count - tile * kTilePairs);
    tile_rows(srow, tokens, slots, p0, np, top_k, act_by_pair);
    float acc[kTileRows][kTilePairs];
    zero_tile(acc);
    for (int c0 = 0; c0 < cols; c0 += kFloatChunk) {
      const int cn = min(kFloatChunk, cols - c0);
      __syncthreads();
      stage_tile(sx, x, srow, kFloatChunk, 1, cn, cols, c0);
      __syncthreads();
#pragma unroll
      for (int i = 0; i < kTileRows; ++i) {
        const int r = tl.row0 + warp + warps * i;
        if (r >= rows) continue;
        const uint8_t* wrow = w + r * row_bytes;
        for (int k = lane; k < cn; k += WARP) {
          const float wv = D::load(wrow, c0 + k);
#pragma unroll
          for (int t = 0; t < kTilePairs; ++t)
            if (t < np) acc[i][t] = fmaf(wv, sx[t * kFloatChunk + k], acc[i][t]);
        }
      }
    }
    store_tile<kTilePairs>(acc, tokens, slots, p0, np, y, rows, tl.row0, top_k);
  }
}

}  // namespace pmq
