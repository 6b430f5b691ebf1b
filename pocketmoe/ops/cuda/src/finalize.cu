// The fused close of a sublayer (ops.reference.finalize): x += a + b (routed + shared, or one output), then
// the next sublayer's input y = rms_norm(x) * w.
//
// One block per row of x [rows, d] (grid.x = rows), blockDim.x a multiple of 32. n_add = 1 ignores b;
// norm = 0 ignores w and y (the last sublayer: no norm follows). The sum is x + (a + b), in the reference's
// order.
#include "common.cuh"

extern "C" __global__ void finalize_f32(float* __restrict__ x, const float* __restrict__ a,
                                        const float* __restrict__ b, int n_add, const float* __restrict__ w,
                                        float* __restrict__ y, int norm, int d, float eps) {
  __shared__ float scratch[WARP];
  const long long row = (long long)blockIdx.x * d;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    const float add = n_add == 2 ? a[row + i] + b[row + i] : a[row + i];
    const float v = x[row + i] + add;
    x[row + i] = v;
    ss += v * v;
  }
  if (!norm) return;  // uniform over the block: no thread reaches the barrier below
  const float s = rsqrtf(block_sum(ss, scratch) / (float)d + eps);
  for (int i = threadIdx.x; i < d; i += blockDim.x) y[row + i] = x[row + i] * s * w[i];
}
