// Small kernels that pin the CPU execution shim's CUDA semantics (tests/test_cuda_shim.py).
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

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

// float -> half -> float and float -> bf16 -> float; and the raw halves/bf16s of a half tensor read back.
extern "C" __global__ void half_round_trip(const float* x, float* via_half, float* via_bf16, const __half* h,
                                           __nv_bfloat16* h_as_bf16, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  via_half[i] = __half2float(__float2half(x[i]));
  via_bf16[i] = __bfloat162float(__float2bfloat16(x[i]));
  h_as_bf16[i] = __float2bfloat16(__half2float(h[i]));
}

// Each block reverses its blockDim.x values through dynamic shared memory (shared_mem = blockDim.x * 4).
extern "C" __global__ void dynamic_reverse(const float* x, float* y) {
  extern __shared__ float smem[];
  const int t = threadIdx.x, i = blockIdx.x * blockDim.x + t;
  smem[t] = x[i];
  __syncthreads();
  y[i] = smem[blockDim.x - 1 - t];
}

// Reads shared memory that no thread wrote: the shim's poison shows through (bit patterns out).
extern "C" __global__ void read_unwritten(int32_t* static_bits, int32_t* dynamic_bits) {
  __shared__ int32_t never_written[64];
  extern __shared__ __align__(16) int32_t dyn[];
  const int t = threadIdx.x;
  static_bits[blockIdx.x * blockDim.x + t] = never_written[t % 64];
  dynamic_bits[blockIdx.x * blockDim.x + t] = dyn[t];
}

// Every thread writes its (threadIdx, blockIdx, blockDim, gridDim) at its global linear index.
extern "C" __global__ void coordinates(int32_t* out) {
  const long long block = blockIdx.x + (long long)gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z);
  const int nthreads = blockDim.x * blockDim.y * blockDim.z;
  const int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  int32_t* o = out + (block * nthreads + t) * 12;
  o[0] = threadIdx.x; o[1] = threadIdx.y; o[2] = threadIdx.z;
  o[3] = blockIdx.x; o[4] = blockIdx.y; o[5] = blockIdx.z;
  o[6] = blockDim.x; o[7] = blockDim.y; o[8] = blockDim.z;
  o[9] = gridDim.x; o[10] = gridDim.y; o[11] = gridDim.z;
}

// out[j] = sum of the first `n` values of tensor j of a pointer array, plus `bias`; one thread per tensor.
extern "C" __global__ void pointer_array_sum(const float* const* __restrict__ ptrs, float* out, int count,
                                             long long n, float bias) {
  const int j = threadIdx.x;
  if (j >= count) return;
  float s = bias;
  for (long long i = 0; i < n; ++i) s += ptrs[j][i];
  out[j] = s;
}
