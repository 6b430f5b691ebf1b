// A block reduction through shared memory, and the subject of the mutation check (tests/test_cuda_shim.py).

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

// Two block sums in a row through one scratch array (the pattern of the engine's block_sum): each warp's
// shuffle sum, one partial per warp in scratch, then every warp sums the partials. The first barrier keeps a
// warp's second write to scratch after every warp's reads of the first sum; -DNO_REUSE_BARRIER drops it (the
// race that only a schedule running one warp ahead of the others shows).
__device__ float warp_total(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ float block_total(float v, float* scratch) {
  v = warp_total(v);
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32, nw = blockDim.x / 32;
#ifndef NO_REUSE_BARRIER
  __syncthreads();
#endif
  if (lane == 0) scratch[w] = v;
  __syncthreads();
  return warp_total(lane < nw ? scratch[lane] : 0.0f);
}

// Every thread writes its block's sum of x and sum of x * x.
extern "C" __global__ void sum_and_squares(const float* __restrict__ x, float* __restrict__ s,
                                           float* __restrict__ s2) {
  __shared__ float scratch[32];
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const float v = x[i];
  s[i] = block_total(v, scratch);
  s2[i] = block_total(v * v, scratch);
}
