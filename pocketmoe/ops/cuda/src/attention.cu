// Attention over the paged KV cache for a batch of sequences (ops.reference.mla_attention / gqa_attention).
//
// One block per (query token, head): grid (T, H), blockDim.x a multiple of 32 with value dims <= ATT_ACC *
// blockDim.x. Token t belongs to sequence seq[t] and attends to its positions 0..n_keys[t]-1 (position + 1:
// the causal mask); position p lives in cache row page_table[seq[t] * n_pages + p / page] * page + p % page.
// Keys are read in tiles of ATT_TILE with an online softmax (running max and sum), all in a fixed order:
// no atomics, the same result every run. Dynamic shared memory: the query, dk floats.
//
// MLA (absorbed): q [T, H, C+R] is [q_nope absorbed by k_b, roped q_pe]; a cache row is [c_kv, k_pe], the
// key of every head, and its first C values are the value: out [T, H, C] is the latent output that v_b
// maps to v_head. GQA: q [T, H, Dh] roped; a cache row is [K of the G KV heads, then their V]; head h reads
// KV head h / (H / G); out [T, H, Dv].
//
// The cache stores float32, IEEE half or bfloat16 values (kv_type: common.cuh kv_value / kv_store): an entry
// is computed in float32 and rounded to nearest even, and read back exactly; the arithmetic is float32
// whatever the type.
#include "common.cuh"

#define ATT_TILE 64
#define ATT_ACC 8

template <class T>
__device__ __forceinline__ void attend(const float* __restrict__ q, const T* __restrict__ cache, long long ld,
                                       int key_off, int dk, int val_off, int dv, int n_keys,
                                       const int32_t* __restrict__ pages, int page, float scale,
                                       float* __restrict__ out, float* qs, float* p, long long* rows,
                                       float* scratch) {
  const int tid = threadIdx.x, lane = tid % WARP, w = tid / WARP, nw = blockDim.x / WARP;
  for (int i = tid; i < dk; i += blockDim.x) qs[i] = q[i];
  float acc[ATT_ACC];
#pragma unroll
  for (int k = 0; k < ATT_ACC; ++k) acc[k] = 0.0f;
  float m = NEG_INF, l = 0.0f;
  for (int s0 = 0; s0 < n_keys; s0 += ATT_TILE) {
    const int n = min(ATT_TILE, n_keys - s0);
    for (int j = tid; j < n; j += blockDim.x) {
      const int pos = s0 + j;
      rows[j] = ((long long)pages[pos / page] * page + pos % page) * ld;
    }
    __syncthreads();
    for (int j = w; j < n; j += nw) {  // a warp per key, lanes over its dims
      const T* key = cache + rows[j] + key_off;
      float dot = 0.0f;
      for (int i = lane; i < dk; i += WARP) dot += qs[i] * kv_value(key[i]);
      dot = warp_sum(dot);
      if (lane == 0) p[j] = dot * scale;
    }
    __syncthreads();
    float tile_max = NEG_INF;
    for (int j = tid; j < n; j += blockDim.x) tile_max = fmaxf(tile_max, p[j]);
    const float m_new = fmaxf(m, block_max(tile_max, scratch));
    float part = 0.0f;
    for (int j = tid; j < n; j += blockDim.x) {
      const float e = expf(p[j] - m_new);
      p[j] = e;
      part += e;
    }
    const float tile_sum = block_sum(part, scratch);  // its barriers publish p
    const float corr = expf(m - m_new);
    l = l * corr + tile_sum;
    m = m_new;
#pragma unroll
    for (int k = 0; k < ATT_ACC; ++k) {
      const int c = tid + k * blockDim.x;
      if (c < dv) {
        float a = acc[k] * corr;
        for (int j = 0; j < n; ++j) a += p[j] * kv_value(cache[rows[j] + val_off + c]);
        acc[k] = a;
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int k = 0; k < ATT_ACC; ++k) {
    const int c = tid + k * blockDim.x;
    if (c < dv) out[c] = acc[k] / l;
  }
}

// attend over a cache of kv_type (the same branch for every thread of the launch).
template <class... Args>
__device__ __forceinline__ void attend_kv(int kv_type, const float* q, const void* cache, Args... args) {
  if (kv_type == KV_F16) {
    attend(q, static_cast<const __half*>(cache), args...);
  } else if (kv_type == KV_BF16) {
    attend(q, static_cast<const __nv_bfloat16*>(cache), args...);
  } else {
    attend(q, static_cast<const float*>(cache), args...);
  }
}

extern "C" __global__ void mla_attention_f32(const float* __restrict__ q, const void* __restrict__ cache,
                                             const int32_t* __restrict__ seq, const int32_t* __restrict__ n_keys,
                                             const int32_t* __restrict__ page_table, int n_pages, int page,
                                             float* __restrict__ out, int kv_lora, int rope, float scale,
                                             int kv_type) {
  extern __shared__ float qs[];
  __shared__ float p[ATT_TILE];
  __shared__ long long rows[ATT_TILE];
  __shared__ float scratch[WARP];
  const int t = blockIdx.x, h = blockIdx.y, n_head = gridDim.y, d = kv_lora + rope;
  const long long qh = (long long)t * n_head + h;
  attend_kv(kv_type, q + qh * d, cache, (long long)d, 0, d, 0, kv_lora, n_keys[t],
            page_table + (long long)seq[t] * n_pages, page, scale, out + qh * kv_lora, qs, p, rows, scratch);
}

extern "C" __global__ void gqa_attention_f32(const float* __restrict__ q, const void* __restrict__ cache,
                                             const int32_t* __restrict__ seq, const int32_t* __restrict__ n_keys,
                                             const int32_t* __restrict__ page_table, int n_pages, int page,
                                             float* __restrict__ out, int n_head_kv, int head_dim, int v_dim,
                                             float scale, int kv_type) {
  extern __shared__ float qs[];
  __shared__ float p[ATT_TILE];
  __shared__ long long rows[ATT_TILE];
  __shared__ float scratch[WARP];
  const int t = blockIdx.x, h = blockIdx.y, n_head = gridDim.y, g = h / (n_head / n_head_kv);
  const long long qh = (long long)t * n_head + h;
  const long long ld = (long long)n_head_kv * (head_dim + v_dim);
  attend_kv(kv_type, q + qh * head_dim, cache, ld, g * head_dim, head_dim, n_head_kv * head_dim + g * v_dim, v_dim,
            n_keys[t], page_table + (long long)seq[t] * n_pages, page, scale, out + qh * v_dim, qs, p, rows,
            scratch);
}

// Token t's latent into `row` (the values of the cache's type T).
template <class T>
__device__ __forceinline__ void latent_row(const float* __restrict__ x, const float* __restrict__ norm_w, float s,
                                           const float* __restrict__ c, const float* __restrict__ sn,
                                           T* __restrict__ row, int kv_lora, int rope) {
  for (int i = threadIdx.x; i < kv_lora; i += blockDim.x) kv_store(row + i, x[i] * s * norm_w[i]);
  for (int j = threadIdx.x; j < rope / 2; j += blockDim.x) {
    const float a = x[kv_lora + 2 * j], b = x[kv_lora + 2 * j + 1];
    kv_store(row + kv_lora + 2 * j, a * c[2 * j] + b * sn[2 * j]);
    kv_store(row + kv_lora + 2 * j + 1, b * c[2 * j + 1] + a * sn[2 * j + 1]);
  }
}

// The MLA latent of each token into its cache row (row write_rows[t] of `cache`, width C+R, kv_type values):
// [rms_norm(c_kv) * norm_w, rope(k_pe)] from kv [T, C+R] (the kv_a projection); normal rope pairs, cos2 /
// sin2 [T, R]. One block per token.
extern "C" __global__ void mla_latent_f32(const float* __restrict__ kv, const float* __restrict__ norm_w,
                                          const float* __restrict__ cos2, const float* __restrict__ sin2,
                                          const int32_t* __restrict__ write_rows, void* __restrict__ cache,
                                          int kv_lora, int rope, float eps, int kv_type) {
  __shared__ float scratch[WARP];
  const int t = blockIdx.x, d = kv_lora + rope;
  const float* x = kv + (long long)t * d;
  const long long at = (long long)write_rows[t] * d;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < kv_lora; i += blockDim.x) ss += x[i] * x[i];
  const float s = rsqrtf(block_sum(ss, scratch) / (float)kv_lora + eps);
  const float* c = cos2 + (long long)t * rope;
  const float* sn = sin2 + (long long)t * rope;
  if (kv_type == KV_F16) {
    latent_row(x, norm_w, s, c, sn, static_cast<__half*>(cache) + at, kv_lora, rope);
  } else if (kv_type == KV_BF16) {
    latent_row(x, norm_w, s, c, sn, static_cast<__nv_bfloat16*>(cache) + at, kv_lora, rope);
  } else {
    latent_row(x, norm_w, s, c, sn, static_cast<float*>(cache) + at, kv_lora, rope);
  }
}
