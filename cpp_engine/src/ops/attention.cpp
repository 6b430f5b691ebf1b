// Attention over a paged cache for the rows of several sequences (pocketmoe/ops.h): DeepSeek MLA over latent
// rows, and grouped-query attention over rows of per-head K and V.
#include <immintrin.h>

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "pocketmoe/ops.h"
#include "pocketmoe/silu.h"
#include "../simd.h"
#include "../workspace.h"

namespace pocketmoe {
namespace {

using simd::hsum;

// Attention of fewer multiply-adds than this runs on the caller alone (waking the pool costs more).
constexpr size_t kInlineAttention = size_t{1} << 16;
constexpr int kGroup = 4;  // heads per work item

float* grow(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// One score buffer of kGroup x max_keys floats per pool thread, kept by the calling thread (the workers'
// thread_local ones stay empty).
std::vector<std::vector<float>>& score_buffers(ThreadPool& pool, int max_keys) {
  static thread_local std::vector<std::vector<float>> scores;
  if (scores.size() < static_cast<size_t>(pool.size())) scores.resize(pool.size());
  for (auto& s : scores) grow(s, static_cast<size_t>(kGroup) * max_keys);
  return scores;
}

// one(item, thread) for every item: on the caller alone when the work is small (waking the pool costs more).
template <class F>
void run_items(ThreadPool& pool, int items, size_t work, const F& one) {
  if (work < kInlineAttention) {
    for (int item = 0; item < items; ++item) one(item, 0);
  } else {
    pool.parallel_for(items, [&](int item, int thread) { one(item, thread); });
  }
}

// Attention of one query for G heads (G <= 4) over `keys` cache rows: the key is the w values at
// k_off of a row, the value the c values at v_off (MLA: both 0, c_kv being the key's first c values):
// scores, softmax, and the probability-weighted sum of the values. Each head's arithmetic is the same
// for any G, any batch and any chunk the query came in, so it never depends on how the work was grouped.
// rows[s]: key s's cache row; q[j]: w values; sc[j]: room for `keys` scores; o[j]: c outputs.
// sinks (DeepSeek-V4): per head an extra logit in the softmax whose probability mass is dropped.
template <int G>
void attend(const float* const* rows, int keys, int w, int c, float scale, const float* const* q, float* const* sc,
            float* const* o, int k_off = 0, int v_off = 0, const float* sinks = nullptr) {
  // Two accumulators per head (even / odd groups of 8): the FMA chains are half as long.
  for (int s = 0; s < keys; ++s) {
    const float* row = rows[s] + k_off;
    __m256 a[G][2];
    for (int j = 0; j < G; ++j) a[j][0] = a[j][1] = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= w; i += 16) {
      const __m256 r0 = _mm256_loadu_ps(row + i), r1 = _mm256_loadu_ps(row + i + 8);
      for (int j = 0; j < G; ++j) {
        a[j][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q[j] + i), r0, a[j][0]);
        a[j][1] = _mm256_fmadd_ps(_mm256_loadu_ps(q[j] + i + 8), r1, a[j][1]);
      }
    }
    if (i < w) {
      const __m256 r0 = _mm256_loadu_ps(row + i);
      for (int j = 0; j < G; ++j) a[j][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q[j] + i), r0, a[j][0]);
    }
    for (int j = 0; j < G; ++j) sc[j][s] = hsum(_mm256_add_ps(a[j][0], a[j][1])) * scale;
  }
  float inv[G];
  for (int j = 0; j < G; ++j) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int s = 0; s < keys; ++s) mx = std::max(mx, sc[j][s]);
    if (sinks == nullptr) {
      inv[j] = 1.0f / exp_shifted(sc[j], keys, mx);
    } else {
      mx = std::max(mx, sinks[j]);
      float sink = sinks[j];
      const float z = exp_shifted(sc[j], keys, mx);
      inv[j] = 1.0f / (z + exp_shifted(&sink, 1, mx));
    }
  }
  // o[j] = sum_s p[j][s] * c_kv[s] / sum_j, 16 outputs of every head at a time (kept in registers).
  for (int i0 = 0; i0 < c; i0 += 16) {
    const int nv = c - i0 >= 16 ? 2 : 1;
    __m256 acc[G][2];
    for (int j = 0; j < G; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    for (int s = 0; s < keys; ++s) {
      const float* row = rows[s] + v_off + i0;
      const __m256 r0 = _mm256_loadu_ps(row);
      const __m256 r1 = nv == 2 ? _mm256_loadu_ps(row + 8) : _mm256_setzero_ps();
      for (int j = 0; j < G; ++j) {
        const __m256 p = _mm256_broadcast_ss(sc[j] + s);
        acc[j][0] = _mm256_fmadd_ps(p, r0, acc[j][0]);
        acc[j][1] = _mm256_fmadd_ps(p, r1, acc[j][1]);
      }
    }
    for (int j = 0; j < G; ++j) {
      const __m256 iv = _mm256_set1_ps(inv[j]);
      _mm256_storeu_ps(o[j] + i0, _mm256_mul_ps(acc[j][0], iv));
      if (nv == 2) _mm256_storeu_ps(o[j] + i0 + 8, _mm256_mul_ps(acc[j][1], iv));
    }
  }
}

// attend<G> for g (1..4) heads.
void attend_heads(int g, const float* const* rows, int keys, int w, int c, float scale, const float* const* q,
                  float* const* sc, float* const* o, int k_off = 0, int v_off = 0, const float* sinks = nullptr) {
  switch (g) {
    case 4: attend<4>(rows, keys, w, c, scale, q, sc, o, k_off, v_off, sinks); break;
    case 3: attend<3>(rows, keys, w, c, scale, q, sc, o, k_off, v_off, sinks); break;
    case 2: attend<2>(rows, keys, w, c, scale, q, sc, o, k_off, v_off, sinks); break;
    default: attend<1>(rows, keys, w, c, scale, q, sc, o, k_off, v_off, sinks); break;
  }
}

// Checks the layout against the call and returns, per sequence, the row pointers of its keys.
std::vector<std::vector<const float*>> key_rows(const KVLayout& L, int n_rows, const float* cache, int w) {
  if (L.page <= 0 || L.n_seqs <= 0 || L.table_width <= 0)
    throw std::invalid_argument("attention: empty KV layout (" + std::to_string(L.n_seqs) + " sequences, pages of " +
                                std::to_string(L.page) + ")");
  std::vector<int> need(L.n_seqs, 0);
  for (int t = 0; t < n_rows; ++t) {
    const int s = L.seq[t];
    if (s < 0 || s >= L.n_seqs || L.keys[t] <= 0 || L.keys[t] > L.table_width * L.page)
      throw std::invalid_argument("attention: row " + std::to_string(t) + " has sequence " + std::to_string(s) + " and " +
                                  std::to_string(L.keys[t]) + " keys; the call has " + std::to_string(L.n_seqs) +
                                  " sequences of at most " + std::to_string(L.table_width * L.page) + " keys");
    if (L.write_rows[t] < 0 || L.write_rows[t] >= L.cache_rows)
      throw std::invalid_argument("attention: cache row " + std::to_string(L.write_rows[t]) + " is outside the " +
                                  std::to_string(L.cache_rows) + " rows of the cache");
    need[s] = std::max(need[s], L.keys[t]);
  }
  std::vector<std::vector<const float*>> rows(L.n_seqs);
  for (int s = 0; s < L.n_seqs; ++s) {
    rows[s].resize(need[s]);
    const int32_t* table = L.table + static_cast<size_t>(s) * L.table_width;
    for (int p = 0; p < need[s]; ++p) {
      const long long r = static_cast<long long>(table[p / L.page]) * L.page + p % L.page;
      if (table[p / L.page] < 0 || r >= L.cache_rows)
        throw std::invalid_argument("attention: sequence " + std::to_string(s) + " position " + std::to_string(p) +
                                    " maps to cache row " + std::to_string(r) + " of " + std::to_string(L.cache_rows));
      rows[s][p] = cache + static_cast<size_t>(r) * w;
    }
  }
  return rows;
}

}  // namespace

void mla_attention(const MLAShape& sh, const float* q, const float* kv, const float* kv_norm, const Weight& k_b,
                   const Weight& v_b, const float* cos2, const float* sin2, float* cache, const KVLayout& layout,
                   int n, float* out) {
  const int h = sh.n_head, nope = sh.qk_nope, r = sh.qk_rope, c = sh.kv_lora, v = sh.v_head, w = c + r;
  const int qw = nope + r;
  if (h <= 0 || nope <= 0 || r <= 0 || r % 8 || v <= 0 || c <= 0 || c % 8)
    throw std::invalid_argument("mla attention: heads " + std::to_string(h) + ", dims nope " + std::to_string(nope) +
                                " rope " + std::to_string(r) + " v " + std::to_string(v) + " latent " +
                                std::to_string(c) + " (rope and latent dims must be multiples of 8)");
  check_weight("attn_k_b", k_b, h, c, nope);
  check_weight("attn_v_b", v_b, h, v, c);
  if (n <= 0) return;
  const auto rows = key_rows(layout, n, cache, w);

  std::unique_lock<std::mutex> lock;
  Runtime& rt = acquire_runtime(lock);
  static thread_local std::vector<float> qn_, qc_, qlat_, olat_, ov_;

  // Cache rows of these tokens: normed c_kv, then roped k_pe.
  for (int t = 0; t < n; ++t) {
    const float* src = kv + static_cast<size_t>(t) * w;
    float* dst = cache + static_cast<size_t>(layout.write_rows[t]) * w;
    rms_norm(src, kv_norm, 1, c, sh.eps, dst);
    std::copy(src + c, src + w, dst + c);
  }
  for (int t = 0; t < n; ++t)
    rope(cache + static_cast<size_t>(layout.write_rows[t]) * w + c, 1, 0, 1, r, r, false,
         cos2 + static_cast<size_t>(t) * r, sin2 + static_cast<size_t>(t) * r);

  // Per head and token: q_nope [H, n, N] for k_b; the attention query [H, n, W] = (q_nope k_b, roped q_pe).
  float* qn = grow(qn_, static_cast<size_t>(h) * n * nope);
  float* qc = grow(qc_, static_cast<size_t>(h) * n * w);
  for (int hh = 0; hh < h; ++hh)
    for (int t = 0; t < n; ++t) {
      const float* src = q + (static_cast<size_t>(t) * h + hh) * qw;
      const size_t ht = static_cast<size_t>(hh) * n + t;
      std::copy(src, src + nope, qn + ht * nope);
      std::copy(src + nope, src + qw, qc + ht * w + c);
    }
  for (int hh = 0; hh < h; ++hh)
    rope(qc + static_cast<size_t>(hh) * n * w + c, n, w, 1, r, r, false, cos2, sin2);
  float* qlat = grow(qlat_, static_cast<size_t>(h) * n * c);
  gemm_batched(rt, k_b.data, h, c, k_b.row_bytes, k_b.ggml_type, qn, n, nope, qlat);
  for (size_t ht = 0; ht < static_cast<size_t>(h) * n; ++ht) std::copy(qlat + ht * c, qlat + (ht + 1) * c, qc + ht * w);

  // Every (query, group of up to 4 heads) is one work item.
  const int groups = (h + kGroup - 1) / kGroup;
  float* olat = grow(olat_, static_cast<size_t>(h) * n * c);
  ThreadPool& pool = *rt.pool;
  int max_keys = 0;
  size_t work = 0;
  for (int t = 0; t < n; ++t) {
    max_keys = std::max(max_keys, layout.keys[t]);
    work += static_cast<size_t>(h) * layout.keys[t] * w;
  }
  std::vector<std::vector<float>>& scores = score_buffers(pool, max_keys);
  const float scale = sh.scale;
  const auto one = [&](int item, int thread) {
    const int t = item / groups, h0 = (item % groups) * kGroup, g = std::min(kGroup, h - h0);
    const int keys = layout.keys[t];
    const float* const* key_rows = rows[layout.seq[t]].data();
    const float* qp[kGroup];
    float* sc[kGroup];
    float* o[kGroup];
    for (int j = 0; j < g; ++j) {
      const size_t ht = static_cast<size_t>(h0 + j) * n + t;
      qp[j] = qc + ht * w;
      sc[j] = scores[thread].data() + static_cast<size_t>(j) * keys;
      o[j] = olat + ht * c;
    }
    attend_heads(g, key_rows, keys, w, c, scale, qp, sc, o);
  };
  const int items = n * groups;
  run_items(pool, items, work, one);

  // o_lat [H, n, C] -> per head v [H, n, V] -> out [n, H*V].
  float* ov = grow(ov_, static_cast<size_t>(h) * n * v);
  gemm_batched(rt, v_b.data, h, v, v_b.row_bytes, v_b.ggml_type, olat, n, c, ov);
  for (int t = 0; t < n; ++t)
    for (int hh = 0; hh < h; ++hh) {
      const float* src = ov + (static_cast<size_t>(hh) * n + t) * v;
      std::copy(src, src + v, out + (static_cast<size_t>(t) * h + hh) * v);
    }
}

void gqa_attention(const GQAShape& sh, const float* q, const float* k, const float* v, const float* cos2,
                   const float* sin2, float* cache, const KVLayout& layout, int n, float* q_work, float* out) {
  const int h = sh.n_head, g = sh.n_head_kv, dh = sh.head_dim, dv = sh.v_dim, r = sh.rot;
  if (h <= 0 || g <= 0 || h % g || dh <= 0 || dh % 8 || dv <= 0 || dv % 8 || r <= 0 || r % 2 || r > dh)
    throw std::invalid_argument("gqa attention: " + std::to_string(h) + " heads over " + std::to_string(g) +
                                " KV heads, head dims " + std::to_string(dh) + " / " + std::to_string(dv) + ", rope " +
                                std::to_string(r) + " (heads a multiple of KV heads, dims multiples of 8, rope even "
                                "and at most the head dims)");
  if (n <= 0) return;
  const int w = g * (dh + dv);
  const auto rows = key_rows(layout, n, cache, w);
  std::unique_lock<std::mutex> lock;
  Runtime& rt = acquire_runtime(lock);

  // Cache rows of these tokens: roped K of every KV head, then V.
  for (int t = 0; t < n; ++t) {
    float* dst = cache + static_cast<size_t>(layout.write_rows[t]) * w;
    std::copy(k + static_cast<size_t>(t) * g * dh, k + static_cast<size_t>(t + 1) * g * dh, dst);
    std::copy(v + static_cast<size_t>(t) * g * dv, v + static_cast<size_t>(t + 1) * g * dv, dst + g * dh);
    rope(dst, 1, 0, g, dh, r, sh.neox, cos2 + static_cast<size_t>(t) * r, sin2 + static_cast<size_t>(t) * r);
  }
  std::copy(q, q + static_cast<size_t>(n) * h * dh, q_work);
  rope(q_work, n, static_cast<size_t>(h) * dh, h, dh, r, sh.neox, cos2, sin2);

  // Work items: (query, KV head, up to 4 of its query heads); query head j uses KV head j / (h / g).
  const int per = h / g, chunks = (per + kGroup - 1) / kGroup;
  ThreadPool& pool = *rt.pool;
  int max_keys = 0;
  size_t work = 0;
  for (int t = 0; t < n; ++t) {
    max_keys = std::max(max_keys, layout.keys[t]);
    work += static_cast<size_t>(h) * layout.keys[t] * (dh + dv);
  }
  std::vector<std::vector<float>>& scores = score_buffers(pool, max_keys);
  const auto one = [&](int item, int thread) {
    const int t = item / (g * chunks), rem = item % (g * chunks), kv = rem / chunks;
    const int h0 = kv * per + (rem % chunks) * kGroup, cnt = std::min(kGroup, (kv + 1) * per - h0);
    const int keys = layout.keys[t];
    const float* const* key_rows = rows[layout.seq[t]].data();
    const float* qp[kGroup];
    float* sc[kGroup];
    float* o[kGroup];
    for (int j = 0; j < cnt; ++j) {
      const size_t th = static_cast<size_t>(t) * h + h0 + j;
      qp[j] = q_work + th * dh;
      sc[j] = scores[thread].data() + static_cast<size_t>(j) * keys;
      o[j] = out + th * dv;
    }
    const int k_off = kv * dh, v_off = g * dh + kv * dv;
    attend_heads(cnt, key_rows, keys, dh, dv, sh.scale, qp, sc, o, k_off, v_off);
  };
  const int items = n * g * chunks;
  run_items(pool, items, work, one);
}

void dsv4_attention(const float* q, int n, int n_head, int d, float scale, const float* sinks, const float* cache,
                    size_t cache_values, const int64_t* key_offsets, const int32_t* starts, float* out) {
  if (n_head <= 0 || d <= 0 || d % 8)
    throw std::invalid_argument("dsv4 attention: " + std::to_string(n_head) + " heads of " + std::to_string(d) +
                                " dims (heads positive, dims a positive multiple of 8)");
  if (n <= 0) return;
  if (starts[0] != 0) throw std::invalid_argument("dsv4 attention: the first query's keys must start at 0");
  int max_keys = 0;
  size_t work = 0;
  for (int t = 0; t < n; ++t) {
    const int keys = starts[t + 1] - starts[t];
    if (keys <= 0)
      throw std::invalid_argument("dsv4 attention: query " + std::to_string(t) + " has " + std::to_string(keys) +
                                  " keys; every query sees at least its own row");
    max_keys = std::max(max_keys, keys);
    work += static_cast<size_t>(n_head) * keys * 2 * d;
  }
  std::vector<const float*> ptrs(starts[n]);
  for (int i = 0; i < starts[n]; ++i) {
    if (key_offsets[i] < 0 || static_cast<size_t>(key_offsets[i]) + d > cache_values)
      throw std::invalid_argument("dsv4 attention: key " + std::to_string(i) + " at value offset " +
                                  std::to_string(key_offsets[i]) + " runs past the cache's " +
                                  std::to_string(cache_values) + " values");
    ptrs[i] = cache + key_offsets[i];
  }
  std::unique_lock<std::mutex> lock;
  Runtime& rt = acquire_runtime(lock);
  ThreadPool& pool = *rt.pool;
  std::vector<std::vector<float>>& scores = score_buffers(pool, max_keys);
  // Work items: (query, up to 4 heads); K = V, the d values at each key's offset.
  const int chunks = (n_head + kGroup - 1) / kGroup;
  const auto one = [&](int item, int thread) {
    const int t = item / chunks, h0 = (item % chunks) * kGroup, cnt = std::min(kGroup, n_head - h0);
    const int keys = starts[t + 1] - starts[t];
    const float* qp[kGroup];
    float* sc[kGroup];
    float* o[kGroup];
    for (int j = 0; j < cnt; ++j) {
      const size_t th = static_cast<size_t>(t) * n_head + h0 + j;
      qp[j] = q + th * d;
      sc[j] = scores[thread].data() + static_cast<size_t>(j) * keys;
      o[j] = out + th * d;
    }
    attend_heads(cnt, ptrs.data() + starts[t], keys, d, d, scale, qp, sc, o, 0, 0, sinks + h0);
  };
  const int items = n * chunks;
  run_items(pool, items, work, one);
}

}  // namespace pocketmoe
