// RMSNorm, add + RMSNorm, and rope (normal and NeoX pairs, partial dims) on float32 rows.
//
// Norms: one block per row (grid.x = rows), any blockDim.x that is a multiple of 32. Rows have their own
// strides (a norm over the c_kv slice of a [T, C+R] row). y = x * rsqrt(mean(x^2) + eps) * w, as
// ops.reference.rms_norm_rows.
// Rope: one block per token (grid.x = T); thread j of the token handles pair j of every head. The rope
// tables are the reference's cos2 / sin2 [T, R] rows (layers.rotary.Rotary.span): each value becomes
// x[i] * cos2[i] + x[partner] * sin2[i]; partners are (2i, 2i+1), or (i, i + R/2) in NeoX mode. A thread
// reads both members of its pair before writing them, so x and y may be the same buffer.
#include "common.cuh"

__device__ __forceinline__ float row_rms_scale(const float* x, int d, float eps, float* scratch) {
  float ss = 0.0f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) ss += x[i] * x[i];
  ss = block_sum(ss, scratch);
  return rsqrtf(ss / (float)d + eps);
}

// x [rows, ldx], w [d] -> y [rows, ldy]: the first d values of every row normed.
extern "C" __global__ void rms_norm_f32(const float* __restrict__ x, long long ldx, const float* __restrict__ w,
                                        float* __restrict__ y, long long ldy, int d, float eps) {
  __shared__ float scratch[WARP];
  const float* xr = x + blockIdx.x * ldx;
  float* yr = y + blockIdx.x * ldy;
  const float s = row_rms_scale(xr, d, eps, scratch);
  for (int i = threadIdx.x; i < d; i += blockDim.x) yr[i] = xr[i] * s * w[i];
}

// x [rows, d] += add [rows, d] (the residual stream, in place), then y = rms_norm(x) * w.
extern "C" __global__ void add_rms_norm_f32(float* __restrict__ x, const float* __restrict__ add,
                                            const float* __restrict__ w, float* __restrict__ y, int d, float eps) {
  __shared__ float scratch[WARP];
  float* xr = x + (long long)blockIdx.x * d;
  const float* ar = add + (long long)blockIdx.x * d;
  float* yr = y + (long long)blockIdx.x * d;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    const float v = xr[i] + ar[i];
    xr[i] = v;
    ss += v * v;
  }
  const float s = rsqrtf(block_sum(ss, scratch) / (float)d + eps);
  for (int i = threadIdx.x; i < d; i += blockDim.x) yr[i] = xr[i] * s * w[i];
}

// Token t's heads at x + t * ld + h * head_stride + off: their first n_rot values rotated into y (same
// layout; the other values of y are not written). cos2, sin2 [T, n_rot].
extern "C" __global__ void rope_f32(const float* x, float* y, const float* __restrict__ cos2,
                                    const float* __restrict__ sin2, long long ld, int n_head, int head_stride,
                                    int off, int n_rot, int neox) {
  const int t = blockIdx.x, half = n_rot / 2;
  const float* c = cos2 + (long long)t * n_rot;
  const float* s = sin2 + (long long)t * n_rot;
  for (int j = threadIdx.x; j < n_head * half; j += blockDim.x) {
    const int h = j / half, p = j % half;
    const int i0 = neox ? p : 2 * p, i1 = neox ? p + half : 2 * p + 1;
    const long long base = t * ld + (long long)h * head_stride + off;
    const float a = x[base + i0], b = x[base + i1];
    y[base + i0] = a * c[i0] + b * s[i0];
    y[base + i1] = b * c[i1] + a * s[i1];
  }
}
