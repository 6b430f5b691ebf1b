// A Q8_0 GEMV in the style of the package's kernels (one warp per row), for the shim's speed and numerics.
#include <cuda_fp16.h>
#include <stdint.h>

// y[r] = sum_c dequant(w)[r, c] * x[c]; w: rows x (cols / 32) Q8_0 blocks of 34 bytes (fp16 scale, 32 int8).
extern "C" __global__ void q8_0_gemv_f32(const uint8_t* __restrict__ w, const float* __restrict__ x,
                                         float* __restrict__ y, int cols, int rows) {
  const int lane = threadIdx.x % 32, row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;  // whole warps leave together
  const int nb = cols / 32;
  const uint8_t* wr = w + (long long)row * nb * 34;
  float acc = 0.0f;
  for (int b = lane; b < nb; b += 32) {
    const uint8_t* blk = wr + b * 34;
    const float d = __half2float(__ushort_as_half((uint16_t)(blk[0] | (blk[1] << 8))));
    const float* xb = x + b * 32;
    float s = 0.0f;
    for (int j = 0; j < 32; ++j) s += (float)(int8_t)blk[2 + j] * xb[j];
    acc += d * s;
  }
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) y[row] = acc;
}
