// The close of a sublayer: combine_f32 sums the routed experts' outputs, then finalize_f32 (ops.reference.finalize)
// does x += a + b (routed + shared, or one output) and makes the next sublayer's input y = rms_norm(x) * w.
#include "common.cuh"

// The routed experts' combine (layers.experts.combine): y[t] = sum over k of w[t, k] * c[t, k] for c [T, K, d]
// (a token's K unweighted expert outputs) and w [T, K], summed in slot order 0..K-1 in fp32 with every product
// and sum rounded on its own (no fused multiply-add), as torch's ops compute it: the same bits. One launch where
// torch takes 2K - 1. One block per token (grid.x = T); k >= 1.
extern "C" __global__ void combine_f32(const float* __restrict__ c, const float* __restrict__ w,
                                       float* __restrict__ y, int k, int d) {
  const long long t = blockIdx.x;
  const float* ct = c + t * k * d;
  const float* wt = w + t * k;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    float acc = __fmul_rn(ct[i], wt[0]);
    for (int j = 1; j < k; ++j) acc = __fadd_rn(acc, __fmul_rn(ct[static_cast<long long>(j) * d + i], wt[j]));
    y[t * d + i] = acc;
  }
}

// finalize_f32: one block per row of x [rows, d] (grid.x = rows), blockDim.x a multiple of 32. n_add = 1 ignores b;
// norm = 0 ignores w and y (the last sublayer: no norm follows). The sum is x + (a + b), in the reference's
// order.
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
