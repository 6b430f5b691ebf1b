// Attention over the paged KV cache for a batch of sequences (ops.reference.mla_attention / gqa_attention).
//
// Token t belongs to sequence seq[t] and attends to its positions 0..n_keys[t]-1 (position + 1: the causal
// mask); position p lives in cache row page_table[seq[t] * n_pages + p / page] * page + p % page. Keys are read
// in tiles of ATT_TILE with an online softmax (running max and sum), all in a fixed order: no atomics, the same
// result every run.
//
// Split over the keys (flash-decoding): a token's keys fall into spans of span_tiles(n_keys) tiles each, at
// least min_tiles and at most max_spans spans, so a decode step of a few heads still fills the GPU and one
// block never walks a long context alone. One block per (head, span, token): grid (H, S, T) with S at least
// the most spans of any token (a block past its token's spans returns); blockDim.x a multiple of 32 with value
// dims <= ATT_ACC * blockDim.x. A one-span token's block writes the output; a block of a token of several spans
// writes its span's partial (running max, sum, unnormalized values) to part [T, H, S, Dv + 2] and
// attention_merge_f32 folds the spans in order. The spans follow from the token's key count alone, so its result
// is the same whatever else is in the batch and whatever S the launch has. Heads are the grid's fastest index:
// MLA's heads read the same latent rows, and blocks next to each other share them in L2. Dynamic shared memory:
// the query, dk floats.
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

// Tiles per span of a token of n_keys keys: at least min_tiles, and few enough for at most max_spans spans.
__device__ __forceinline__ int span_tiles(int n_keys, int min_tiles, int max_spans) {
  const int tiles = (n_keys + ATT_TILE - 1) / ATT_TILE;
  return max(min_tiles, (tiles + max_spans - 1) / max_spans);
}

__device__ __forceinline__ int spans_of(int n_keys, int min_tiles, int max_spans) {
  const int per = span_tiles(n_keys, min_tiles, max_spans);
  return max(1, ((n_keys + ATT_TILE - 1) / ATT_TILE + per - 1) / per);
}

// Where a block's work goes: its keys [k0, k1), and either the output (one span) or its span's partial.
struct Span {
  int k0, k1;
  float* part;  // [Dv + 2]: unnormalized values, then the running max and sum; nullptr: write out
};

// Block (h, s, t)'s span of its token (k0 == k1: none, the block returns).
__device__ __forceinline__ Span span_of_block(int n_keys, int min_tiles, int max_spans, float* part, int dv) {
  const int s = blockIdx.y, spans = spans_of(n_keys, min_tiles, max_spans);
  if (s >= spans) return Span{0, 0, nullptr};
  const int len = span_tiles(n_keys, min_tiles, max_spans) * ATT_TILE;
  const long long at = (((long long)blockIdx.z * gridDim.x + blockIdx.x) * gridDim.y + s) * (dv + 2);
  return Span{s * len, min(n_keys, (s + 1) * len), spans > 1 ? part + at : nullptr};
}

template <class T>
__device__ __forceinline__ void attend(const float* __restrict__ q, const T* __restrict__ cache, long long ld,
                                       int key_off, int dk, int val_off, int dv, Span span,
                                       const int32_t* __restrict__ pages, int page, float scale,
                                       float* __restrict__ out, float* qs, float* p, long long* rows,
                                       float* scratch) {
  const int tid = threadIdx.x, lane = tid % WARP, w = tid / WARP, nw = blockDim.x / WARP;
  for (int i = tid; i < dk; i += blockDim.x) qs[i] = q[i];
  float acc[ATT_ACC];
#pragma unroll
  for (int k = 0; k < ATT_ACC; ++k) acc[k] = 0.0f;
  float m = NEG_INF, l = 0.0f;
  for (int s0 = span.k0; s0 < span.k1; s0 += ATT_TILE) {
    const int n = min(ATT_TILE, span.k1 - s0);
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
  if (span.part == nullptr) {
#pragma unroll
    for (int k = 0; k < ATT_ACC; ++k) {
      const int c = tid + k * blockDim.x;
      if (c < dv) out[c] = acc[k] / l;
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < ATT_ACC; ++k) {
    const int c = tid + k * blockDim.x;
    if (c < dv) span.part[c] = acc[k];
  }
  if (tid == 0) {
    span.part[dv] = m;
    span.part[dv + 1] = l;
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
                                             float* __restrict__ out, float* __restrict__ part, int kv_lora,
                                             int rope, float scale, int kv_type, int min_tiles, int max_spans) {
  extern __shared__ float qs[];
  __shared__ float p[ATT_TILE];
  __shared__ long long rows[ATT_TILE];
  __shared__ float scratch[WARP];
  const int h = blockIdx.x, t = blockIdx.z, n_head = gridDim.x, d = kv_lora + rope;
  const Span span = span_of_block(n_keys[t], min_tiles, max_spans, part, kv_lora);
  if (span.k0 == span.k1) return;  // past the token's spans: the whole block
  const long long qh = (long long)t * n_head + h;
  attend_kv(kv_type, q + qh * d, cache, (long long)d, 0, d, 0, kv_lora, span,
            page_table + (long long)seq[t] * n_pages, page, scale, out + qh * kv_lora, qs, p, rows, scratch);
}

extern "C" __global__ void gqa_attention_f32(const float* __restrict__ q, const void* __restrict__ cache,
                                             const int32_t* __restrict__ seq, const int32_t* __restrict__ n_keys,
                                             const int32_t* __restrict__ page_table, int n_pages, int page,
                                             float* __restrict__ out, float* __restrict__ part, int n_head_kv,
                                             int head_dim, int v_dim, float scale, int kv_type, int min_tiles,
                                             int max_spans) {
  extern __shared__ float qs[];
  __shared__ float p[ATT_TILE];
  __shared__ long long rows[ATT_TILE];
  __shared__ float scratch[WARP];
  const int h = blockIdx.x, t = blockIdx.z, n_head = gridDim.x, g = h / (n_head / n_head_kv);
  const Span span = span_of_block(n_keys[t], min_tiles, max_spans, part, v_dim);
  if (span.k0 == span.k1) return;  // past the token's spans: the whole block
  const long long qh = (long long)t * n_head + h;
  const long long ld = (long long)n_head_kv * (head_dim + v_dim);
  attend_kv(kv_type, q + qh * head_dim, cache, ld, g * head_dim, head_dim, n_head_kv * head_dim + g * v_dim, v_dim,
            span, page_table + (long long)seq[t] * n_pages, page, scale, out + qh * v_dim, qs, p, rows, scratch);
}

// The spans' partials of each (head, token) of several spans folded, in span order, into out [T, H, Dv]:
// grid (H, T), part [T, H, S, Dv + 2] as the attention kernels wrote it (S = n_spans). A one-span token's
// output is already written. Each thread rescales its own value dims; no shared memory.
extern "C" __global__ void attention_merge_f32(const float* __restrict__ part, const int32_t* __restrict__ n_keys,
                                               float* __restrict__ out, int dv, int n_spans, int min_tiles,
                                               int max_spans) {
  const int h = blockIdx.x, t = blockIdx.y, n_head = gridDim.x;
  const int spans = spans_of(n_keys[t], min_tiles, max_spans);
  if (spans == 1) return;
  const long long qh = (long long)t * n_head + h;
  const float* ps = part + qh * n_spans * (dv + 2);
  float m = NEG_INF;
  for (int s = 0; s < spans; ++s) m = fmaxf(m, ps[s * (dv + 2) + dv]);
  float l = 0.0f;
  for (int s = 0; s < spans; ++s) l += ps[s * (dv + 2) + dv + 1] * expf(ps[s * (dv + 2) + dv] - m);
  for (int c = threadIdx.x; c < dv; c += blockDim.x) {
    float a = 0.0f;
    for (int s = 0; s < spans; ++s) a += ps[s * (dv + 2) + c] * expf(ps[s * (dv + 2) + dv] - m);
    out[qh * dv + c] = a / l;
  }
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
