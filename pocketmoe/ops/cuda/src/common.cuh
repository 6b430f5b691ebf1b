// Shared by every CUDA source of pocketmoe/ops/cuda: integer and half types, WARP, deterministic reductions.
//
// The same text compiles under NVRTC (no system headers: the integer types are declared here), nvcc, and g++
// with the CPU execution shim (pocketmoe/ops/cuda/shim). Reductions run in a fixed order (xor butterflies
// inside a warp, then the warps' partials in warp order), never with atomics, so results are bitwise
// repeatable run to run. After a butterfly every lane holds the same, bitwise equal, value.
#pragma once

#if defined(__CUDACC_RTC__)
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#else
#include <stdint.h>
#endif

#include <cuda_fp16.h>
#include <cuda_bf16.h>

// A KV cache's values: float32, IEEE half or bfloat16 (kv_type 0, 1, 2: --kv-dtype, as the CPU ops' KVType).
// kv_store rounds a float to nearest even (as torch's .to(dtype)); kv_value reads it back exactly.
#define KV_F16 1
#define KV_BF16 2
__device__ __forceinline__ float kv_value(float x) { return x; }
__device__ __forceinline__ float kv_value(__half x) { return __half2float(x); }
__device__ __forceinline__ float kv_value(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void kv_store(float* p, float x) { *p = x; }
__device__ __forceinline__ void kv_store(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void kv_store(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }

#define WARP 32
#define FULL_MASK 0xffffffffu
#define NEG_INF (-__int_as_float(0x7f800000))
#define POS_INF (__int_as_float(0x7f800000))

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  return v;
}

__device__ __forceinline__ int warp_sum_int(int v) {
#pragma unroll
  for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  return v;
}

// Inclusive prefix sum over the warp's lanes: lane l gets v of lanes 0..l.
__device__ __forceinline__ int warp_inclusive_sum(int v) {
  const int lane = threadIdx.x % WARP;
  for (int d = 1; d < WARP; d <<= 1) {
    const int u = __shfl_up_sync(FULL_MASK, v, d);
    if (lane >= d) v += u;
  }
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
  return v;
}

// The largest value of the warp and its index; ties go to the smaller index (idx -1 loses to any other).
__device__ __forceinline__ void warp_argmax(float& v, int& idx) {
#pragma unroll
  for (int o = WARP / 2; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(FULL_MASK, v, o);
    const int oi = __shfl_xor_sync(FULL_MASK, idx, o);
    if (oi >= 0 && (idx < 0 || ov > v || (ov == v && oi < idx))) {
      v = ov;
      idx = oi;
    }
  }
}

// Sum over the whole block (blockDim.x a multiple of WARP); every thread gets the total. `scratch` is a
// __shared__ float[WARP] of the caller; the first barrier lets consecutive calls reuse it.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  const int lane = threadIdx.x % WARP, w = threadIdx.x / WARP, nw = blockDim.x / WARP;
  __syncthreads();  // defensive: each caller (norms, finalize, the MLA latent) sums once per block today
  if (lane == 0) scratch[w] = v;
  __syncthreads();
  return warp_sum(lane < nw ? scratch[lane] : 0.0f);
}

