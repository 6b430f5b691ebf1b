// The KV cache's value types (common.cuh kv_store / kv_value), for tests/test_cuda_ops.py: each x[i] stored
// as half and as bfloat16, and read back.
#include "common.cuh"

extern "C" __global__ void kv_round(const float* __restrict__ x, __half* __restrict__ h,
                                    __nv_bfloat16* __restrict__ b, float* __restrict__ back_h,
                                    float* __restrict__ back_b, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  kv_store(h + i, x[i]);
  kv_store(b + i, x[i]);
  back_h[i] = kv_value(h[i]);
  back_b[i] = kv_value(b[i]);
}
