// Kernels that break CUDA's synchronisation rules; the shim must report each (tests/test_cuda_shim.py).
#include <stdint.h>

// The first warp stops at a barrier that the other warps skip (they exit).
extern "C" __global__ void barrier_in_branch(float* y) {
  if (threadIdx.x < 32) {
    __syncthreads();
  }
  y[threadIdx.x] = 1.0f;
}

// Two halves of the block wait at two different barriers.
extern "C" __global__ void two_barriers(float* y) {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  y[threadIdx.x] = 1.0f;
}

// Lanes 0-15 shuffle while lanes 16-31 have left.
extern "C" __global__ void shuffle_half_warp(float* y) {
  if (threadIdx.x % 32 >= 16) return;
  y[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}

// Lanes 0-15 wait at a shuffle that lanes 16-31 never reach, and lanes 16-31 at a barrier that needs 0-15.
extern "C" __global__ void shuffle_vs_barrier(float* y) {
  float v = 1.0f;
  if (threadIdx.x % 32 < 16) {
    v = __shfl_down_sync(0xffffffffu, v, 1);
  } else {
    __syncthreads();
  }
  y[threadIdx.x] = v;
}

// Every thread stores one float past the end of y (n values); only AddressSanitizer sees it.
extern "C" __global__ void write_past_end(float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i <= n) y[i] = 2.0f;
}

// 128 KiB of locals per thread: more than a fiber's stack (and than a CUDA thread should use).
extern "C" __global__ void huge_locals(float* y, int n) {
  volatile float big[32768];
  for (int i = 0; i < n; ++i) big[i] = (float)i;
  y[threadIdx.x] = big[n - 1];
}

// Integer division by `d` (the device returns garbage for d == 0; the host traps).
extern "C" __global__ void divide(int32_t* y, int d) { y[threadIdx.x] = 1000 / d; }

// Reads dynamic shared memory `n` floats past each thread's own value (past the launch's size for n >= 1
// when shared_mem = blockDim.x * 4); only AddressSanitizer sees it.
extern "C" __global__ void shared_past_end(float* y, int n) {
  extern __shared__ float dyn[];
  dyn[threadIdx.x] = 1.0f;
  __syncthreads();
  y[threadIdx.x] = dyn[threadIdx.x + n];
}

// A 4-byte load from p + off: misaligned for odd off or off = 2 (a GPU stops it; x86 would read it).
extern "C" __global__ void misaligned_load(const unsigned char* p, int off, int32_t* y) {
  y[threadIdx.x] = *reinterpret_cast<const int32_t*>(p + off);
}
