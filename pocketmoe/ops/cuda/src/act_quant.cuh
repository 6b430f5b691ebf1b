// Activation quantization as the CPU does it (cpp_engine/src/act_quant.cpp); see matmul.cu.
#pragma once

#include "common.cuh"

namespace pmq {

// The fp32 scale of one block from its max |x|, and the int8 of x (|x * inv| <= 127; ties to even).
__device__ __forceinline__ int round_q8(float x, float inv) { return __float2int_rn(x * inv); }

// What a quantize kernel reads at (row, column) of its [rows, cols] input: the rows themselves, ld floats apart
// (Plain: ld > cols reads each row's leading values in place, as MLA's per-head q_nope), or silu(gate) * up made
// on the fly (Swiglu), so the FFN's down projection quantizes its input without a launch that writes it first.
struct Plain {
  const float* x;
  int ld;
  __device__ __forceinline__ float operator()(long long row, int col) const { return x[row * ld + col]; }
};

// layers.experts.swiglu: silu(g) * u, with limit > 0 the clamped form silu(min(g, limit)) * clamp(u, -limit,
// limit); silu(g) = g / (1 + exp(-g)) as torch computes it, the product rounded on its own. Row r's g at
// gu + r * ld, its u at gu + u_off + r * ld (gate and up stacked, or side by side in one matmul's rows).
struct Swiglu {
  const float* gu;
  long long u_off;
  int ld;
  float limit;
  __device__ __forceinline__ float operator()(long long row, int col) const {
    const long long i = row * ld + col;
    float a = gu[i], b = gu[u_off + i];
    if (limit > 0.0f) {
      a = fminf(a, limit);
      b = fminf(fmaxf(b, -limit), limit);
    }
    return __fmul_rn(a / (1.0f + expf(-a)), b);
  }
};

// Block b of row `row` quantized by one warp (every lane of it, with the same row and b).
// s: llama.cpp's block_q8_1 s, fp16(d32 * sum of the 32 q) with d32 the fp32 scale; past fp16's range
// (where llama.cpp stores inf) the fp32 product itself.
template <class Src>
__device__ __forceinline__ void quantize_q8_0_block(Src x, long long row, int b, int8_t* q, float* d, float* s,
                                                    int cols) {
  const int lane = threadIdx.x % WARP;
  const float v = x(row, 32 * b + lane);
  const float amax = warp_max(fabsf(v));
  const bool zero = !(amax > 0.0f);
  const int qv = zero ? 0 : round_q8(v, 127.0f / amax);
  q[row * cols + 32 * b + lane] = static_cast<int8_t>(qv);
  const int isum = warp_sum_int(qv);
  if (lane == 0) {
    const float d32 = zero ? 0.0f : amax / 127.0f;
    const float p = d32 * static_cast<float>(isum);
    // llama.cpp's block_q8_0 keeps its scale as fp16; the values were rounded with the fp32 one.
    d[row * (cols / 32) + b] = __half2float(__float2half(d32));
    s[row * (cols / 32) + b] = fabsf(p) > 65504.0f ? p : __half2float(__float2half(p));
  }
}

template <class Src>
__device__ __forceinline__ void quantize_q8_k_block(Src x, long long row, int b, int8_t* q, float* d,
                                                    int16_t* sums, int cols) {
  const int lane = threadIdx.x % WARP;
  float xb[8];
  float m = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    xb[j] = x(row, 256 * b + 8 * lane + j);
    m = fmaxf(m, fabsf(xb[j]));
  }
  const float amax = warp_max(m);
  const bool zero = !(amax > 0.0f);
  const float inv = zero ? 0.0f : 127.0f / amax;
  uint32_t packed[2] = {0, 0};
  int s = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int v = zero ? 0 : round_q8(xb[j], inv);
    s += v;
    packed[j / 4] |= static_cast<uint32_t>(static_cast<uint8_t>(v)) << (8 * (j % 4));
  }
  uint32_t* qo = reinterpret_cast<uint32_t*>(q + row * cols + 256 * b + 8 * lane);
  qo[0] = packed[0];
  qo[1] = packed[1];
  s += __shfl_xor_sync(FULL_MASK, s, 1);
  if (lane % 2 == 0) sums[row * (cols / 16) + 16 * b + lane / 2] = static_cast<int16_t>(s);
  if (lane == 0) d[row * (cols / 256) + b] = zero ? 0.0f : amax / 127.0f;
}

// Block b of row `row` for BLOCK-value weights: Q8_0 (32) or Q8_K (256).
template <int BLOCK, class Src, class Sums>
__device__ __forceinline__ void quantize_block(Src x, long long row, int b, int8_t* q, float* d, Sums* s, int cols) {
  if constexpr (BLOCK == 32) {
    quantize_q8_0_block(x, row, b, q, d, s, cols);
  } else {
    quantize_q8_k_block(x, row, b, q, d, s, cols);
  }
}

// The quantize kernels' geometry: grid (ceil(blocks of a row / warps), rows), one warp per block of a row.
template <int BLOCK, class Src, class Sums>
__device__ __forceinline__ void quantize_rows(Src x, int8_t* q, float* d, Sums* s, int cols) {
  const int b = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  if (b < cols / BLOCK) quantize_block<BLOCK>(x, blockIdx.y, b, q, d, s, cols);
}

// Row `row` quantized by the warps of one block, warp w taking blocks w, w + warps, ... of the row.
template <int BLOCK, class Src, class Sums>
__device__ __forceinline__ void quantize_row(Src x, long long row, int8_t* q, float* d, Sums* s, int cols) {
  for (int b = threadIdx.x / WARP; b < cols / BLOCK; b += blockDim.x / WARP)
    quantize_block<BLOCK>(x, row, b, q, d, s, cols);
}

}  // namespace pmq
