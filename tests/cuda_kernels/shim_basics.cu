// Small kernels that pin the CPU execution shim's CUDA semantics (tests/test_cuda_shim.py).
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

// Sum of each block's blockDim.x values through shared memory (a tree; blockDim.x a power of two <= 1024).
extern "C" __global__ void block_tree_sum(const float* __restrict__ x, float* __restrict__ out, int n) {
  __shared__ float buf[1024];
  const int t = threadIdx.x, i = blockIdx.x * blockDim.x + t;
  buf[t] = i < n ? x[i] : 0.0f;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (t < s) buf[t] += buf[t + s];
    __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = buf[0];
}

// Per lane: the xor butterfly sum, the down-shifted value by `delta`, and lane `src`'s value (width `width`).
extern "C" __global__ void warp_shuffles(const float* x, float* xor_sum, float* down, float* bcast, int delta,
                                         int src, int width) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  float v = x[i];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  xor_sum[i] = v;
  down[i] = __shfl_down_sync(0xffffffffu, x[i], delta, width);
  bcast[i] = __shfl_sync(0xffffffffu, x[i], src, width);
}

extern "C" __global__ void dp4a_kernel(const int32_t* a, const int32_t* b, const int32_t* c, int32_t* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = __dp4a(a[i], b[i], c[i]);
}
