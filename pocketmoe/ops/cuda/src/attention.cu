// Attention over the paged KV cache for a batch of sequences (ops.reference.mla_attention / gqa_attention).
//
// Token t belongs to sequence seq[t] and attends to its positions 0..n_keys[t]-1 (position + 1: the causal
// mask); position p lives in cache row page_table[seq[t] * n_pages + p / page] * page + p % page. Keys are read
// in tiles of ATT_TILE with an online softmax (running max and sum), all in a fixed order: no atomics, the same
// result every run.
//
// A block takes several heads that read the same key rows (MLA: every head; GQA: the query heads of one KV head),
// at most ATT_HEADS (per_block) of them, so each row is read once for all of them, not once per head. And the
// keys are split (flash-decoding): a token's keys fall into spans of span_tiles(n_keys) tiles each, at least
// min_tiles and at most max_spans spans, so a decode step of a few blocks of heads still fills the GPU and one
// block never walks a long context alone. Grid (blocks of heads, S, T) with S at least the most spans of any
// token (a block past its token's spans returns); blockDim.x a multiple of 32 with value dims <= ATT_VACC *
// blockDim.x. A one-span token's block writes the output; a block of a token of several spans writes its span's
// partials (running max, sum, unnormalized values) to part [T, H, S, Dv + 2] and attention_merge_f32 folds the
// spans in order. The spans follow from the token's key count alone, and a head's arithmetic is the same in any
// block of heads, so its result is the same whatever else is in the batch and whatever S the launch has.
// Dynamic shared memory: the block's queries, per_block * dk floats.
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
#define ATT_HEADS 16  // heads of one block at most (they share each key row it reads)
#define ATT_VACC 4    // value dims per thread: dv <= ATT_VACC * blockDim.x

// Tiles per span of a token of n_keys keys: at least min_tiles, and few enough for at most max_spans spans.
__device__ __forceinline__ int span_tiles(int n_keys, int min_tiles, int max_spans) {
  const int tiles = (n_keys + ATT_TILE - 1) / ATT_TILE;
  return max(min_tiles, (tiles + max_spans - 1) / max_spans);
}

__device__ __forceinline__ int spans_of(int n_keys, int min_tiles, int max_spans) {
  const int per = span_tiles(n_keys, min_tiles, max_spans);
  return max(1, ((n_keys + ATT_TILE - 1) / ATT_TILE + per - 1) / per);
}

// A block's work: heads h0 .. h0 + nh - 1 of token blockIdx.z over its keys [k0, k1) of span blockIdx.y
// (k0 == k1: past the token's spans, the block returns), into the output (one span) or the span partials.
struct Work {
  int h0, nh, k0, k1;
  bool split;
};

// Block x of a token whose heads come in share groups of `shared` heads that read the same key rows (MLA: one
// group of every head; GQA: a group per KV head), each group in blocks of at most per_block heads.
__device__ __forceinline__ Work work_of_block(int n_keys, int shared, int per_block, int min_tiles, int max_spans) {
  const int blocks = (shared + per_block - 1) / per_block, g = blockIdx.x / blocks;
  const int h_in = blockIdx.x % blocks * per_block;
  const int s = blockIdx.y, spans = spans_of(n_keys, min_tiles, max_spans);
  const int len = span_tiles(n_keys, min_tiles, max_spans) * ATT_TILE;
  if (s >= spans) return Work{0, 0, 0, 0, false};
  return Work{g * shared + h_in, min(per_block, shared - h_in), s * len, min(n_keys, (s + 1) * len), spans > 1};
}

// A block's static shared memory, declared once in each kernel (one per instantiation of attend would take
// three times its 4.6 KiB, which with V2-Lite's 37 KiB of queries passes the 48 KiB a launch may have).
struct AttShared {
  float p[ATT_HEADS][ATT_TILE];  // the tile's scores, then their exps, per head
  long long rows[ATT_TILE];      // the tile's cache rows (element offsets)
  float corr[ATT_HEADS];         // each head's rescale of its values for this tile
  float lsum[ATT_HEADS];         // each head's sum of exps, at the end
};

// A block's queries, value i of its heads' [nh, dk] (head h0 first): GQA's as they lie (HeadQueries), MLA's made
// as they are loaded (MlaQueries).
struct HeadQueries {
  const float* q;  // head h0's query, dk floats a head
  __device__ __forceinline__ float operator()(int i) const { return q[i]; }
};

// MLA: head h's query is [q_abs[h] (kv_lora: k_b of its q_nope), rope(q_pe[h]) (rope)], q_pe read from the
// model's q ([q_nope, q_pe] a head) and rotated as norm_rope.cu's rope_f32 does (pairs 2p, 2p + 1; MLA's rope
// is not NeoX): no [T, H, C + R] buffer, no copies and no rope launch before the attention.
struct MlaQueries {
  const float* q_abs;  // head h0's, kv_lora floats a head
  const float* q;      // head h0's [q_nope, q_pe], q_nope + rope floats a head
  const float* cos2;   // the token's [rope]
  const float* sin2;
  int kv_lora, rope, q_nope;
  __device__ __forceinline__ float operator()(int i) const {
    const int dk = kv_lora + rope, h = i / dk, c = i % dk;
    if (c < kv_lora) return q_abs[h * kv_lora + c];
    const int j = c - kv_lora, i0 = j & ~1, i1 = i0 + 1;
    const float* pe = q + h * (q_nope + rope) + q_nope;
    const float a = pe[i0], b = pe[i1];
    return j == i0 ? a * cos2[i0] + b * sin2[i0] : b * cos2[i1] + a * sin2[i1];
  }
};

// The heads of `work` over its keys: per key tile the rows' addresses, each key's scores against every head (a
// warp per key, lanes over its dims, the key read once for all heads), each head's softmax step (a thread per
// head, in key order), then the values (each thread ATT_VACC value dims of every head, the value read once).
// q: the block's queries (dk floats a head); out: head h0's output (dv floats a head); part: token t's partials
// [H, S, Dv + 2] (head stride part_stride), unnormalized values, then the running max and sum.
template <class T, class Q>
__device__ __forceinline__ void attend(Q q, const T* __restrict__ cache, long long ld,
                                       int key_off, int dk, int val_off, int dv, Work work,
                                       const int32_t* __restrict__ pages, int page, float scale,
                                       float* __restrict__ out, float* __restrict__ part, long long part_stride,
                                       AttShared* sh) {
  extern __shared__ float qs[];  // [nh, dk]
  float(*p)[ATT_TILE] = sh->p;
  long long* rows = sh->rows;
  float *corr = sh->corr, *lsum = sh->lsum;
  const int tid = threadIdx.x, lane = tid % WARP, w = tid / WARP, nw = blockDim.x / WARP, nh = work.nh;
  for (int i = tid; i < nh * dk; i += blockDim.x) qs[i] = q(i);
  float acc[ATT_HEADS][ATT_VACC];
#pragma unroll
  for (int h = 0; h < ATT_HEADS; ++h)
#pragma unroll
    for (int k = 0; k < ATT_VACC; ++k) acc[h][k] = 0.0f;
  float m = NEG_INF, l = 0.0f;  // thread h < nh: head h's running max and sum
  for (int s0 = work.k0; s0 < work.k1; s0 += ATT_TILE) {
    const int n = min(ATT_TILE, work.k1 - s0);
    for (int j = tid; j < n; j += blockDim.x) {
      const int pos = s0 + j;
      rows[j] = ((long long)pages[pos / page] * page + pos % page) * ld;
    }
    __syncthreads();  // the rows (and the first time, the queries) before the scores read them
    for (int j = w; j < n; j += nw) {
      const T* key = cache + rows[j] + key_off;
      float d[ATT_HEADS];
#pragma unroll
      for (int h = 0; h < ATT_HEADS; ++h) d[h] = 0.0f;
      for (int i = lane; i < dk; i += WARP) {
        const float x = kv_value(key[i]);
#pragma unroll
        for (int h = 0; h < ATT_HEADS; ++h)
          if (h < nh) d[h] += qs[h * dk + i] * x;
      }
#pragma unroll
      for (int h = 0; h < ATT_HEADS; ++h) {
        if (h < nh) {  // the same for the whole warp
          const float dot = warp_sum(d[h]);
          if (lane == 0) p[h][j] = dot * scale;
        }
      }
    }
    __syncthreads();  // every score before the softmax reads them
    if (tid < nh) {
      float mx = m;
      for (int j = 0; j < n; ++j) mx = fmaxf(mx, p[tid][j]);
      float sum = 0.0f;
      for (int j = 0; j < n; ++j) {
        const float e = expf(p[tid][j] - mx);
        p[tid][j] = e;
        sum += e;
      }
      const float c = expf(m - mx);
      l = l * c + sum;
      m = mx;
      corr[tid] = c;
    }
    __syncthreads();  // the exps and corrections before the values read them
#pragma unroll
    for (int h = 0; h < ATT_HEADS; ++h) {
      if (h < nh) {
        const float c = corr[h];
#pragma unroll
        for (int k = 0; k < ATT_VACC; ++k) acc[h][k] *= c;
      }
    }
    for (int j = 0; j < n; ++j) {
      float v[ATT_VACC];
#pragma unroll
      for (int k = 0; k < ATT_VACC; ++k) {
        const int c = tid + k * blockDim.x;
        v[k] = c < dv ? kv_value(cache[rows[j] + val_off + c]) : 0.0f;
      }
#pragma unroll
      for (int h = 0; h < ATT_HEADS; ++h) {
        if (h < nh) {
          const float pj = p[h][j];
#pragma unroll
          for (int k = 0; k < ATT_VACC; ++k) acc[h][k] += pj * v[k];
        }
      }
    }
    __syncthreads();  // every read of this tile's rows and exps before the next tile's overwrite them
  }
  if (tid < nh) lsum[tid] = l;
  __syncthreads();  // the sums before the threads divide by them
#pragma unroll
  for (int h = 0; h < ATT_HEADS; ++h) {
    if (h < nh) {
#pragma unroll
      for (int k = 0; k < ATT_VACC; ++k) {
        const int c = tid + k * blockDim.x;
        if (c >= dv) continue;
        if (work.split) {
          part[h * part_stride + c] = acc[h][k];
        } else {
          out[h * dv + c] = acc[h][k] / lsum[h];
        }
      }
    }
  }
  if (work.split && tid < nh) {
    part[tid * part_stride + dv] = m;
    part[tid * part_stride + dv + 1] = l;
  }
}

// attend over a cache of kv_type (the same branch for every thread of the launch).
template <class Q, class... Args>
__device__ __forceinline__ void attend_kv(int kv_type, Q q, const void* cache, Args... args) {
  if (kv_type == KV_F16) {
    attend(q, static_cast<const __half*>(cache), args...);
  } else if (kv_type == KV_BF16) {
    attend(q, static_cast<const __nv_bfloat16*>(cache), args...);
  } else {
    attend(q, static_cast<const float*>(cache), args...);
  }
}

// Grid (blocks of heads, S, T): every head shares the latent rows, in blocks of per_block heads.
// q_abs [T, H, kv_lora], q [T, H, q_nope + rope], cos2 / sin2 [T, rope]: MlaQueries.
extern "C" __global__ void mla_attention_f32(const float* __restrict__ q_abs, const float* __restrict__ q,
                                             const float* __restrict__ cos2, const float* __restrict__ sin2,
                                             const void* __restrict__ cache,
                                             const int32_t* __restrict__ seq, const int32_t* __restrict__ n_keys,
                                             const int32_t* __restrict__ page_table, int n_pages, int page,
                                             float* __restrict__ out, float* __restrict__ part, int n_head,
                                             int kv_lora, int rope, int q_nope, float scale, int kv_type,
                                             int per_block, int min_tiles, int max_spans) {
  __shared__ AttShared sh;
  const int t = blockIdx.z, d = kv_lora + rope;
  const Work work = work_of_block(n_keys[t], n_head, per_block, min_tiles, max_spans);
  if (work.k0 == work.k1) return;  // past the token's spans: the whole block
  const long long qh = (long long)t * n_head + work.h0, ps = (long long)gridDim.y * (kv_lora + 2);
  const MlaQueries queries{q_abs + qh * kv_lora, q + qh * (q_nope + rope), cos2 + (long long)t * rope,
                           sin2 + (long long)t * rope, kv_lora, rope, q_nope};
  attend_kv(kv_type, queries, cache, (long long)d, 0, d, 0, kv_lora, work,
            page_table + (long long)seq[t] * n_pages, page, scale, out + qh * kv_lora,
            part + qh * ps + (long long)blockIdx.y * (kv_lora + 2), ps, &sh);
}

// Grid (blocks of heads, S, T): the query heads of each KV head share its rows, in blocks of per_block heads.
extern "C" __global__ void gqa_attention_f32(const float* __restrict__ q, const void* __restrict__ cache,
                                             const int32_t* __restrict__ seq, const int32_t* __restrict__ n_keys,
                                             const int32_t* __restrict__ page_table, int n_pages, int page,
                                             float* __restrict__ out, float* __restrict__ part, int n_head,
                                             int n_head_kv, int head_dim, int v_dim, float scale, int kv_type,
                                             int per_block, int min_tiles, int max_spans) {
  __shared__ AttShared sh;
  const int t = blockIdx.z, shared = n_head / n_head_kv;
  const Work work = work_of_block(n_keys[t], shared, per_block, min_tiles, max_spans);
  if (work.k0 == work.k1) return;  // past the token's spans: the whole block
  const int g = work.h0 / shared;
  const long long qh = (long long)t * n_head + work.h0, ps = (long long)gridDim.y * (v_dim + 2);
  const long long ld = (long long)n_head_kv * (head_dim + v_dim);
  attend_kv(kv_type, HeadQueries{q + qh * head_dim}, cache, ld, g * head_dim, head_dim,
            n_head_kv * head_dim + g * v_dim, v_dim, work, page_table + (long long)seq[t] * n_pages, page, scale,
            out + qh * v_dim, part + qh * ps + (long long)blockIdx.y * (v_dim + 2), ps, &sh);
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
