// The close of a sublayer: combine_f32 sums the routed experts' outputs, then finalize_f32 (ops.reference.finalize)
// does x += a + b (routed + shared, or one output) and makes the next sublayer's input y = rms_norm(x) * w;
// finalize_q8_0 / finalize_q8_k quantize y too, for the next sublayer's first matmuls.
#include "act_quant.cuh"

// The routed experts' combine (layers.experts.combine) of value i of token t: the sum over k of w[t, k] * c[t, k, i]
// for c [T, K, d] (a token's K unweighted expert outputs) and w [T, K], in slot order 0..K-1 in fp32 with every
// product and sum rounded on its own (no fused multiply-add), as torch's ops compute it: the same bits. k >= 1.
__device__ __forceinline__ float combined(const float* __restrict__ c, const float* __restrict__ w, int k, int d,
                                          long long t, int i) {
  const float* ct = c + t * k * d;
  const float* wt = w + t * k;
  float acc = __fmul_rn(ct[i], wt[0]);
  for (int j = 1; j < k; ++j) acc = __fadd_rn(acc, __fmul_rn(ct[static_cast<long long>(j) * d + i], wt[j]));
  return acc;
}

// combine_f32: y [T, d] of the combine, one launch where torch takes 2K - 1. One block per token (grid.x = T).
extern "C" __global__ void combine_f32(const float* __restrict__ c, const float* __restrict__ w,
                                       float* __restrict__ y, int k, int d) {
  const long long t = blockIdx.x;
  for (int i = threadIdx.x; i < d; i += blockDim.x) y[t * d + i] = combined(c, w, k, d, t, i);
}

// finalize_f32: one block per row of x [rows, d] (grid.x = rows), blockDim.x a multiple of 32. The sublayer's
// output a [rows, d], or with k >= 1 the routed experts' unweighted outputs a [rows, k, d] combined with their
// weights kw [rows, k] as combine_f32 does (the combine and the finalize in one launch); n_add = 2 adds b (the
// shared experts'), n_add = 1 ignores it; norm = 0 ignores w and y (the last sublayer: no norm follows). The sum
// is x + (a + b), in the reference's order. Returns whether y was written.
__device__ __forceinline__ bool finalize_row(float* __restrict__ x, const float* __restrict__ a,
                                             const float* __restrict__ kw, int k, const float* __restrict__ b,
                                             int n_add, const float* __restrict__ w, float* __restrict__ y, int norm,
                                             int d, float eps) {
  __shared__ float scratch[WARP];
  const long long t = blockIdx.x, row = t * d;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    const float out = k ? combined(a, kw, k, d, t, i) : a[row + i];
    const float add = n_add == 2 ? out + b[row + i] : out;
    const float v = x[row + i] + add;
    x[row + i] = v;
    ss += v * v;
  }
  if (!norm) return false;  // uniform over the block: no thread reaches the barrier below
  const float s = rsqrtf(block_sum(ss, scratch) / (float)d + eps);
  for (int i = threadIdx.x; i < d; i += blockDim.x) y[row + i] = x[row + i] * s * w[i];
  return true;
}

extern "C" __global__ void finalize_f32(float* __restrict__ x, const float* __restrict__ a,
                                        const float* __restrict__ kw, int k, const float* __restrict__ b, int n_add,
                                        const float* __restrict__ w, float* __restrict__ y, int norm, int d,
                                        float eps) {
  finalize_row(x, a, kw, k, b, n_add, w, y, norm, d, eps);
}

// finalize_q8_0 / finalize_q8_k: finalize_f32 with norm, then y's row quantized for the next sublayer's first
// matmuls as matmul.cu's quantize_q8_0 / quantize_q8_k would (act_quant.cuh: the same bits), in the same launch.
// q, qd and qs / sums: as those kernels' outputs for y [rows, d].
template <int BLOCK, class Sums>
__device__ __forceinline__ void finalize_quantized(float* x, const float* a, const float* kw, int k, const float* b,
                                                   int n_add, const float* w, float* y, int d, float eps, int8_t* q,
                                                   float* qd, Sums* qs) {
  finalize_row(x, a, kw, k, b, n_add, w, y, 1, d, eps);
  __syncthreads();  // the row's y, written by every thread of the block, is read by each warp's blocks
  pmq::quantize_row<BLOCK>(pmq::Plain{y, d}, blockIdx.x, q, qd, qs, d);
}

extern "C" __global__ void finalize_q8_0(float* __restrict__ x, const float* __restrict__ a,
                                         const float* __restrict__ kw, int k, const float* __restrict__ b,
                                         int n_add, const float* __restrict__ w, float* y, float eps, int d,
                                         int8_t* __restrict__ q, float* __restrict__ qd, float* __restrict__ qs) {
  finalize_quantized<32>(x, a, kw, k, b, n_add, w, y, d, eps, q, qd, qs);
}

extern "C" __global__ void finalize_q8_k(float* __restrict__ x, const float* __restrict__ a,
                                         const float* __restrict__ kw, int k, const float* __restrict__ b,
                                         int n_add, const float* __restrict__ w, float* y, float eps, int d,
                                         int8_t* __restrict__ q, float* __restrict__ qd, int16_t* __restrict__ sums) {
  finalize_quantized<256>(x, a, kw, k, b, n_add, w, y, d, eps, q, qd, sums);
}
