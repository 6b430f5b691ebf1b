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
