// DeepSeek-V4's compressed keys (dsv4.h): the compressors' per-token states and pooled block entries, the rope on
// the last dims of heads, and the lightning indexer's choice of entries. The elementwise arithmetic rounds every
// product and sum on its own (the reference's order); the pooling's exp, the norms and the indexer's dot
// products are the reference's math in another float order. Each row's, block's and query's values depend on
// its own inputs only.
#pragma GCC optimize("fp-contract=off")

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

#include "dsv4_parts.h"
#include "../workspace.h"

namespace pocketmoe {
namespace dsv4 {
namespace {

float* grow(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// dot(a, b) over n values (n % 8 == 0): two interleaved 8-lane FMA chains, then their sum across lanes, in a
// fixed order for a given n.
float dot(const float* a, const float* b, int n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  if (i < n) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  const __m256 s = _mm256_add_ps(s0, s1);
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}

// Indexer work (multiply-adds) below which one thread scores every query (waking the pool costs more).
constexpr size_t kInlineIndexer = size_t{1} << 18;

}  // namespace

double sum_squares(const float* x, int n) {
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    const __m256 a2 = _mm256_mul_ps(a, a), b2 = _mm256_mul_ps(b, b);
    acc[0] = _mm256_add_pd(acc[0], _mm256_cvtps_pd(_mm256_castps256_ps128(a2)));
    acc[1] = _mm256_add_pd(acc[1], _mm256_cvtps_pd(_mm256_extractf128_ps(a2, 1)));
    acc[2] = _mm256_add_pd(acc[2], _mm256_cvtps_pd(_mm256_castps256_ps128(b2)));
    acc[3] = _mm256_add_pd(acc[3], _mm256_cvtps_pd(_mm256_extractf128_ps(b2, 1)));
  }
  alignas(32) double lanes[16];
  for (int j = 0; j < 4; ++j) _mm256_store_pd(lanes + 4 * j, acc[j]);
  double s = 0.0;
  for (int j = 0; j < 16; ++j) s += lanes[j];
  for (; i < n; ++i) s += static_cast<double>(x[i] * x[i]);
  return s;
}

void rope_tail(float* x, int n, size_t stride, int heads, int d, int rot, const int32_t* pos, const float* cos2,
               const float* sin2, bool inverse) {
  for (int t = 0; t < n; ++t) {
    const float* c = cos2 + static_cast<size_t>(pos[t]) * rot;
    const float* s = sin2 + static_cast<size_t>(pos[t]) * rot;
    for (int h = 0; h < heads; ++h) {
      float* v = x + t * stride + static_cast<size_t>(h) * d + (d - rot);
      int i = 0;
      for (; i + 8 <= rot; i += 8) {  // x * cos2 +- (pairs swapped) * sin2, each product rounded, then the sum
        const __m256 xv = _mm256_loadu_ps(v + i);
        const __m256 a = _mm256_mul_ps(xv, _mm256_loadu_ps(c + i));
        const __m256 b = _mm256_mul_ps(_mm256_permute_ps(xv, 0xB1), _mm256_loadu_ps(s + i));
        _mm256_storeu_ps(v + i, inverse ? _mm256_sub_ps(a, b) : _mm256_add_ps(a, b));
      }
      for (; i < rot; i += 2) {
        const float x0 = v[i], x1 = v[i + 1];
        if (inverse) {
          v[i] = x0 * c[i] - x1 * s[i];
          v[i + 1] = x1 * c[i + 1] - x0 * s[i + 1];
        } else {
          v[i] = x0 * c[i] + x1 * s[i];
          v[i + 1] = x1 * c[i + 1] + x0 * s[i + 1];
        }
      }
    }
  }
}

void compressor_states(const DSV4Compressor& k, const float* kv, const float* score, int n, const int32_t* positions,
                       const int32_t* write_rows, const kv::Rows& cache) {
  const int c = k.wkv->rows;
  static thread_local std::vector<float> sum_;
  float* sum = grow(sum_, c);
  for (int t = 0; t < n; ++t) {
    const float* st = score + static_cast<size_t>(t) * c;
    const float* ape = k.ape + static_cast<size_t>(positions[t] % k.ratio) * c;
    for (int i = 0; i < c; ++i) sum[i] = st[i] + ape[i];
    cache.write(write_rows[t], k.kv, kv + static_cast<size_t>(t) * c, c);
    cache.write(write_rows[t], k.score, sum, c);
  }
}

void compress_blocks(const DSV4Compressor& k, const KVLayout& kv, int s, int start, int end, const kv::Rows& cache,
                     int rot, const float* cos2, const float* sin2) {
  const int r = k.ratio, d = k.dim;
  const bool overlap = r == 4;
  const int m = overlap ? 2 * r : r;  // pooled tokens per channel
  static thread_local std::vector<float> kv_, sc_, pooled_;
  float* kvb = grow(kv_, static_cast<size_t>(m) * d);
  float* scb = grow(sc_, static_cast<size_t>(m) * d);
  float* pooled = grow(pooled_, static_cast<size_t>(4) * d);
  float *mx = pooled + d, *sum = pooled + 2 * d, *entry = pooled + 3 * d;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int b = start / r; b < end / r; ++b) {
    // the block's m rows of d channels: with overlap the previous block's first d (none before block 0: kv 0,
    // score -inf), then this block's last d; else this block's d
    for (int i = 0; i < m; ++i) {
      float* kr = kvb + static_cast<size_t>(i) * d;
      float* sr = scb + static_cast<size_t>(i) * d;
      const bool prev = overlap && i < r;
      const int p = prev ? (b - 1) * r + i : b * r + (overlap ? i - r : i);
      if (p < 0) {
        std::fill(kr, kr + d, 0.0f);
        std::fill(sr, sr + d, neg_inf);
        continue;
      }
      const int64_t row = cache_row(kv, s, p);
      const int off = prev || !overlap ? 0 : d;
      cache.read(row, k.kv + off, d, kr);
      cache.read(row, k.score + off, d, sr);
    }
    std::fill(mx, mx + d, neg_inf);
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < d; ++j) mx[j] = std::max(mx[j], scb[static_cast<size_t>(i) * d + j]);
    std::fill(sum, sum + d, 0.0f);
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < d; ++j) {
        float& e = scb[static_cast<size_t>(i) * d + j];
        e = std::exp(e - mx[j]);
        sum[j] = sum[j] + e;
      }
    std::fill(pooled, pooled + d, 0.0f);
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < d; ++j) {
        const float pr = scb[static_cast<size_t>(i) * d + j] / sum[j];
        const float v = kvb[static_cast<size_t>(i) * d + j] * pr;
        pooled[j] = pooled[j] + v;
      }
    rms_norm(pooled, k.norm, 1, d, k.eps, entry);
    const int32_t first = b * r;
    rope_tail(entry, 1, 0, 1, d, rot, &first, cos2, sin2, false);
    cache.write(cache_row(kv, s, b * r + r - 1), k.entry, entry, d);
  }
}

void indexer_keep(const DSV4Indexer& idx, const float* q, const float* w, int t, int start, int end,
                  const KVLayout& kv, int s, const kv::Rows& cache, std::vector<int32_t>& kept,
                  std::vector<int32_t>& count) {
  const int r = idx.comp.ratio, n_ent = end / r, h = idx.n_head, hd = idx.head_dim;
  count.assign(std::max(t, 0), 0);
  if (n_ent == 0 || t <= 0) return;
  kept.resize(static_cast<size_t>(t) * idx.top_k);
  // The entries as floats: the cache's own rows, or converted once for all the queries.
  static thread_local std::vector<float> converted_;
  float* converted = cache.type == KVType::kF32 ? nullptr : grow(converted_, static_cast<size_t>(n_ent) * hd);
  std::vector<const float*> keys(n_ent);
  for (int b = 0; b < n_ent; ++b) {
    float* scratch = converted != nullptr ? converted + static_cast<size_t>(b) * hd : nullptr;
    keys[b] = cache.floats(cache_row(kv, s, b * r + r - 1), idx.comp.entry, hd, scratch);
  }
  const int k = std::min(idx.top_k, n_ent);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const auto one = [&](int i) {
    static thread_local std::vector<float> score_;
    static thread_local std::vector<int> order_;
    float* score = grow(score_, n_ent);
    if (order_.size() < static_cast<size_t>(n_ent)) order_.resize(n_ent);
    const int visible = (start + i + 1) / r;
    const float* qi = q + static_cast<size_t>(i) * h * hd;
    const float* wi = w + static_cast<size_t>(i) * h;
    for (int b = 0; b < n_ent; ++b) {
      if (b >= visible) {
        score[b] = neg_inf;
        continue;
      }
      float acc = 0.0f;
      for (int j = 0; j < h; ++j) {
        const float v = std::max(dot(qi + static_cast<size_t>(j) * hd, keys[b], hd), 0.0f) * wi[j];
        acc = acc + v;
      }
      score[b] = acc;
    }
    int* order = order_.data();
    std::iota(order, order + n_ent, 0);
    // llama.cpp's top_k is std::partial_sort: exact ties at the boundary go as its heap takes them
    std::partial_sort(order, order + k, order + n_ent, [&](int a, int c) { return score[a] > score[c]; });
    int32_t* ki = kept.data() + static_cast<size_t>(i) * idx.top_k;
    int c = 0;
    for (int j = 0; j < k; ++j)
      if (order[j] < visible) ki[c++] = order[j];
    std::sort(ki, ki + c);
    count[i] = c;
  };
  if (static_cast<size_t>(t) * n_ent * h * hd < kInlineIndexer) {
    for (int i = 0; i < t; ++i) one(i);
  } else {
    std::unique_lock<std::mutex> lock;
    acquire_runtime(lock).pool->parallel_for(t, [&](int i, int) { one(i); });
  }
}

}  // namespace dsv4
}  // namespace pocketmoe
