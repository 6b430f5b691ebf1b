// Attention over a paged cache for the rows of several sequences (pocketmoe/ops.h): DeepSeek MLA over latent
// rows, and grouped-query attention over rows of per-head K and V.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "pocketmoe/ops.h"
#include "pocketmoe/silu.h"
#include "../simd.h"
#include "kv_values.h"
#include "../workspace.h"

namespace pocketmoe {
namespace {

using simd::hsum;

// Attention of fewer multiply-adds than this runs on the caller alone (waking the pool costs more).
constexpr size_t kInlineAttention = size_t{1} << 16;
constexpr int kGroup = 4;       // heads per register tile
constexpr int kKeyChunk = 64;   // keys per partial softmax: a chunk of 576-value rows (147 KiB) stays in L2
// Floats of chunk partials one dispatch holds at most (prefill runs its queries in batches under it, and a
// query of many heads over many keys its heads in blocks), unless one head's partials alone are more.
constexpr size_t kPartialFloats = size_t{4} << 20;

float* grow(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

int chunks_of(int keys) { return (keys + kKeyChunk - 1) / kKeyChunk; }

// A query's chunks fold, in order, into at most kMaxSpans spans of span_chunks consecutive chunks each, one partial
// per (head, span), merged at the end: the partials stay small at any context (DeepSeek-V3's 128 heads at 32k
// keys: 8 MiB, where one per chunk took 135 MB and made the heads run in blocks, each reading the whole cache).
// Both counts follow from the query's keys alone, so its arithmetic does too.
constexpr int kMaxSpans = 32;
int span_chunks(int chunks) { return (chunks + kMaxSpans - 1) / kMaxSpans; }
int spans_of(int chunks) { return (chunks + span_chunks(chunks) - 1) / span_chunks(chunks); }

using kv::BHalf;
using kv::Half;
using kv::load8;
using kv::store_values;
using kv::typed;
using kv::value_bytes;

// one(item, thread) for every item: on the caller alone when the work is small or there is one item (waking
// the pool costs more).
template <class F>
void run_items(ThreadPool& pool, int items, size_t work, const F& one) {
  if (work < kInlineAttention || items <= 1) {
    for (int item = 0; item < items; ++item) one(item, 0);
  } else {
    pool.parallel_for(items, [&](int item, int thread) { one(item, thread); });
  }
}

// The heads of one query that read the same key rows (all of an MLA or DeepSeek-V4 query's heads; the
// query heads of one GQA KV head). A key is the w values at k_off of its row, its value the c values at v_off.
struct AttnUnit {
  const void* const* rows;   // rows[s]: key s's cache row (values of the attention's type T), s < keys
  int keys;
  int k_off, v_off;
  const float* q;            // head j's query: q + j * q_stride (w values)
  size_t q_stride;
  float* o;                  // head j's output: o + j * o_stride (c values)
  size_t o_stride;
  const float* sinks;        // DeepSeek-V4: head j's sink logit sinks[j] (its probability mass is dropped), or null
};

// K keys [s, s + K) against G heads: sc[j][s + k - k0] = dot(q[j], key s + k) * scale. pre[k]: a row to
// prefetch (to L2 if ToL2, else L1), a 64-byte cache line at a time.
template <class T, int G, int K, bool ToL2>
PM_INLINE void score_keys(const void* const* rows, int s, int k0, int w, int k_off, float scale,
                          const float* const* q, const T* const* pre, float (*sc)[kKeyChunk]) {
  const T* r[K];
  for (int k = 0; k < K; ++k) r[k] = static_cast<const T*>(rows[s + k]) + k_off;
  __m256 a[G][K];
  for (int j = 0; j < G; ++j)
    for (int k = 0; k < K; ++k) a[j][k] = _mm256_setzero_ps();
  for (int i = 0; i < w; i += 8) {
    if (i % (64 / sizeof(T)) == 0)
      for (int k = 0; k < K; ++k) {
        const char* line = reinterpret_cast<const char*>(pre[k] + i);
        if constexpr (ToL2) {
          _mm_prefetch(line, _MM_HINT_T1);
        } else {
          _mm_prefetch(line, _MM_HINT_T0);
        }
      }
    __m256 x[K];
    for (int k = 0; k < K; ++k) x[k] = load8(r[k] + i);
    for (int j = 0; j < G; ++j) {
      const __m256 qv = _mm256_loadu_ps(q[j] + i);
      for (int k = 0; k < K; ++k) a[j][k] = _mm256_fmadd_ps(qv, x[k], a[j][k]);
    }
  }
  for (int j = 0; j < G; ++j)
    for (int k = 0; k < K; ++k) sc[j][s + k - k0] = hsum(a[j][k]) * scale;
}

// sc[j][s - k0] = dot(q[j], key s) * scale for keys [k0, k1) and G <= 4 heads. Each dot is one 8-lane FMA chain
// over the w values and one horizontal sum, whichever keys it is computed beside. Three keys at a time: twelve
// chains keep both FMA pipes busy through a load's latency (eight did not). next: n_next rows to bring to L2.
template <class T, int G>
void chunk_scores(const void* const* rows, int k0, int k1, int w, int k_off, float scale, const float* const* q,
                  const void* const* next, int n_next, float (*sc)[kKeyChunk]) {
  constexpr int K = 3;
  const auto row = [&](const void* const* r, int s) { return static_cast<const T*>(r[s]) + k_off; };
  int s = k0;
  for (; s + K <= k1; s += K) {
    const T* pre[K];
    if (n_next > 0) {
      // This chunk is in L2 already (an earlier head group read it): bring the next chunk's rows to L2 meanwhile.
      for (int k = 0; k < K; ++k) pre[k] = row(next, std::min(s - k0 + k, n_next - 1));
      score_keys<T, G, K, true>(rows, s, k0, w, k_off, scale, q, pre, sc);
    } else {
      // The keys two steps ahead (their first touch of DRAM or L3 stalled the loop).
      for (int k = 0; k < K; ++k) pre[k] = s + 2 * K + k < k1 ? row(rows, s + 2 * K + k) : row(rows, s + k);
      score_keys<T, G, K, false>(rows, s, k0, w, k_off, scale, q, pre, sc);
    }
  }
  for (; s < k1; ++s) {
    const T* pre[1] = {row(rows, s)};
    score_keys<T, G, 1, false>(rows, s, k0, w, k_off, scale, q, pre, sc);
  }
}

// o[j][i0 .. i0 + 8V) = sum over keys s in [k0, k1), in order, of p[j][s - k0] * value s.
template <class T, int G, int V>
PM_INLINE void value_strip(const void* const* rows, int k0, int k1, int v_off, int i0, const float (*p)[kKeyChunk],
                           float* const* o) {
  __m256 acc[G][V];
  for (int j = 0; j < G; ++j)
    for (int v = 0; v < V; ++v) acc[j][v] = _mm256_setzero_ps();
  for (int s = k0; s < k1; ++s) {
    const T* row = static_cast<const T*>(rows[s]) + v_off + i0;
    __m256 x[V];
    for (int v = 0; v < V; ++v) x[v] = load8(row + 8 * v);
    for (int j = 0; j < G; ++j) {
      const __m256 pj = _mm256_broadcast_ss(p[j] + (s - k0));
      for (int v = 0; v < V; ++v) acc[j][v] = _mm256_fmadd_ps(pj, x[v], acc[j][v]);
    }
  }
  for (int j = 0; j < G; ++j)
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(o[j] + i0 + 8 * v, acc[j][v]);
}

// One key chunk [k0, k1) for G heads: m[j] the largest score, l[j] the sum of exp(score - m[j]) and o[j] the
// values weighted by those exps (c values, 16 at a time over the chunk's keys, which stay in L2).
template <class T, int G>
void attend_chunk(const AttnUnit& u, int h0, int k0, int k1, int w, int c, float scale, int n_next, float* m,
                  float* l, float* const* o) {
  const float* q[G];
  for (int j = 0; j < G; ++j) q[j] = u.q + (h0 + j) * u.q_stride;
  alignas(32) float sc[G][kKeyChunk];
  chunk_scores<T, G>(u.rows, k0, k1, w, u.k_off, scale, q, u.rows + k1, n_next, sc);
  for (int j = 0; j < G; ++j) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int s = 0; s < k1 - k0; ++s) mx = std::max(mx, sc[j][s]);
    m[j] = mx;
    l[j] = exp_shifted(sc[j], k1 - k0, mx);
  }
  int i0 = 0;
  for (; i0 + 24 <= c; i0 += 24) value_strip<T, G, 3>(u.rows, k0, k1, u.v_off, i0, sc, o);
  if (c - i0 == 16) value_strip<T, G, 2>(u.rows, k0, k1, u.v_off, i0, sc, o);
  if (c - i0 == 8) value_strip<T, G, 1>(u.rows, k0, k1, u.v_off, i0, sc, o);
}

// Heads h0 .. h0+g-1 (g <= 4) of a unit over one key chunk, bringing the n_next rows after it to L2 meanwhile;
// m[j], l[j] and o[j] (c values) per head.
template <class T>
void attend_chunk_heads(int g, const AttnUnit& u, int h0, int k0, int k1, int w, int c, float scale, int n_next,
                        float* m, float* l, float* const* o) {
  switch (g) {
    case 4: attend_chunk<T, 4>(u, h0, k0, k1, w, c, scale, n_next, m, l, o); break;
    case 3: attend_chunk<T, 3>(u, h0, k0, k1, w, c, scale, n_next, m, l, o); break;
    case 2: attend_chunk<T, 2>(u, h0, k0, k1, w, c, scale, n_next, m, l, o); break;
    default: attend_chunk<T, 1>(u, h0, k0, k1, w, c, scale, n_next, m, l, o); break;
  }
}

// out[0 .. 8V) = inv * sum over chunks k, in order, of f[k] * o[k * o_stride + ...]: V chains of FMAs side by side
// (one alone waits out each FMA's latency: 64 chunks of 512 values took 5% of a 4096-key decode's attention).
template <int V>
PM_INLINE void merge_strip(int chunks, const float* f, const float* o, size_t o_stride, __m256 inv, float* out) {
  __m256 acc[V];
  for (int v = 0; v < V; ++v) acc[v] = _mm256_setzero_ps();
  for (int k = 0; k < chunks; ++k) {
    const __m256 fk = _mm256_broadcast_ss(f + k);
    for (int v = 0; v < V; ++v) acc[v] = _mm256_fmadd_ps(fk, _mm256_loadu_ps(o + k * o_stride + 8 * v), acc[v]);
  }
  for (int v = 0; v < V; ++v) _mm256_storeu_ps(out + 8 * v, _mm256_mul_ps(acc[v], inv));
}

// Folds a chunk's partial (m1, l1, o1: c values) into its span's running one (m, l, o), rescaled to the larger max.
void fold_chunk(float& m, float& l, float* o, float m1, float l1, const float* o1, int c) {
  const float mx = std::max(m, m1), a = std::exp(m - mx), b = std::exp(m1 - mx);
  const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
  for (int i = 0; i < c; i += 8)
    _mm256_storeu_ps(o + i, _mm256_fmadd_ps(vb, _mm256_loadu_ps(o1 + i), _mm256_mul_ps(va, _mm256_loadu_ps(o + i))));
  l = std::fma(a, l, b * l1);
  m = mx;
}

// One head's output from its chunks' partials, in chunk order: with M the largest m[k] (and the sink),
// f[k] = exp(m[k] - M), out = sum_k f[k] o[k] / (sum_k f[k] l[k] [+ exp(sink - M)]). o[k] is at o + k * o_stride;
// out may be o when there is one chunk (each strip of outputs is read before it is written).
void merge_chunks(int chunks, const float* m, const float* l, const float* o, size_t o_stride, int c,
                  const float* sink, float* out) {
  static thread_local std::vector<float> f_;
  float* f = grow(f_, chunks);
  float mx = -std::numeric_limits<float>::infinity();
  for (int k = 0; k < chunks; ++k) mx = std::max(mx, m[k]);
  if (sink != nullptr) mx = std::max(mx, *sink);
  std::copy(m, m + chunks, f);
  exp_shifted(f, chunks, mx);
  float total = 0.0f;
  for (int k = 0; k < chunks; ++k) total = std::fma(l[k], f[k], total);
  if (sink != nullptr) {
    float s = *sink;
    total += exp_shifted(&s, 1, mx);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / total);
  int i = 0;
  for (; i + 64 <= c; i += 64) merge_strip<8>(chunks, f, o + i, o_stride, inv, out + i);
  for (; i < c; i += 8) merge_strip<1>(chunks, f, o + i, o_stride, inv, out + i);
}

// Attention for every unit, `heads` heads each: per (unit, key chunk, block of heads) a partial softmax folded into
// its span's, then per (unit, head) the merge of its spans in order. A head's arithmetic depends only on its query
// and keys: never on the units beside it, the head blocks, the batches or the threads.
template <class T>
void attend_units(ThreadPool& pool, const AttnUnit* units, int n_units, int heads, int w, int c, float scale) {
  if (n_units <= 0 || heads <= 0) return;
  size_t work = 0;
  int total_chunks = 0, max_spans = 0;
  for (int u = 0; u < n_units; ++u) {
    work += static_cast<size_t>(heads) * units[u].keys * (w + c);
    const int chunks = chunks_of(units[u].keys);
    total_chunks += chunks;
    if (chunks > 1) max_spans = std::max(max_spans, spans_of(chunks));
  }
  const size_t per_head = static_cast<size_t>(max_spans) * (c + 2);
  if (per_head * heads > kPartialFloats && heads > kGroup) {
    // Very many heads of wide values: the heads in blocks whose partials fit, each a call of its own over the
    // same units.
    const int block = std::max(kGroup, static_cast<int>(kPartialFloats / per_head) / kGroup * kGroup);
    std::vector<AttnUnit> sub(units, units + n_units);
    for (int h0 = 0; h0 < heads; h0 += block) {
      for (int u = 0; u < n_units; ++u) {
        sub[u].q = units[u].q + h0 * units[u].q_stride;
        sub[u].o = units[u].o + h0 * units[u].o_stride;
        sub[u].sinks = units[u].sinks ? units[u].sinks + h0 : nullptr;
      }
      attend_units<T>(pool, sub.data(), n_units, std::min(block, heads - h0), w, c, scale);
    }
    return;
  }
  static thread_local std::vector<float> ml_, part_;
  static thread_local std::vector<int> first_;
  std::vector<int>& first = first_;
  // Whole units per item while there are enough chunks to keep every thread busy (each chunk read once into
  // L2 for all heads); else blocks of kGroup heads.
  const int per_item = total_chunks >= 4 * pool.size() ? heads : std::min(heads, kGroup);
  const int blocks = (heads + per_item - 1) / per_item;
  // Runs of chunks per item while there are plenty (up to 8, at least 4 items per thread): each chunk after an
  // item's first comes to L2 while the later head groups work on the one before it (4096 keys: 2 -> 8 chunks an
  // item, 4-10% less time per layer on Zen 4). A run is whole spans (one item folds a span's chunks in order).
  const int run = per_item == heads && heads > kGroup ? std::clamp(total_chunks / (4 * pool.size()), 1, 8) : 1;
  const auto run_spans = [&](int chunks) { return std::max(1, run / span_chunks(chunks)); };
  const auto items_of = [&](int chunks) {
    return (spans_of(chunks) + run_spans(chunks) - 1) / run_spans(chunks) * blocks;
  };

  for (int u0 = 0; u0 < n_units;) {
    // A batch of units whose partials fit kPartialFloats (at least one unit); a one-chunk unit has none.
    size_t slots = 0;
    int u1 = u0;
    first.assign(1, 0);
    std::vector<size_t> slot0;
    for (; u1 < n_units; ++u1) {
      const int chunks = chunks_of(units[u1].keys);
      const size_t need = chunks > 1 ? static_cast<size_t>(heads) * spans_of(chunks) : 0;
      if (u1 > u0 && (slots + need) * (c + 2) > kPartialFloats) break;
      slot0.push_back(slots);
      slots += need;
      first.push_back(first.back() + items_of(chunks));
    }
    float* m = grow(ml_, 2 * slots);
    float* l = m + slots;
    float* part = grow(part_, slots * c);

    const auto chunk_item = [&](int item, int) {
      static thread_local std::vector<float> fold_;
      const int b = static_cast<int>(std::upper_bound(first.begin(), first.end(), item) - first.begin()) - 1;
      const AttnUnit& u = units[u0 + b];
      const int chunks = chunks_of(u.keys), sc = span_chunks(chunks), spans = spans_of(chunks);
      const int hb = (item - first[b]) % blocks;
      const int c0 = (item - first[b]) / blocks * run_spans(chunks) * sc;
      const int c1 = std::min(chunks, c0 + run_spans(chunks) * sc);
      for (int chunk = c0; chunk < c1; ++chunk) {
        const int k0 = chunk * kKeyChunk, k1 = std::min(u.keys, k0 + kKeyChunk);
        const int n_next = chunk + 1 < c1 ? std::min(kKeyChunk, u.keys - k1) : 0;
        for (int h0 = hb * per_item; h0 < std::min(heads, (hb + 1) * per_item); h0 += kGroup) {
          const int g = std::min(kGroup, heads - h0);
          const int pre = h0 > hb * per_item ? n_next : 0;  // the first head group reads this chunk in
          float* o[kGroup];
          float mj[kGroup], lj[kGroup];
          if (chunks == 1) {
            // The only chunk: its partial goes straight to the output and merges in place.
            for (int j = 0; j < g; ++j) o[j] = u.o + (h0 + j) * u.o_stride;
            attend_chunk_heads<T>(g, u, h0, k0, k1, w, c, scale, pre, mj, lj, o);
            for (int j = 0; j < g; ++j)
              merge_chunks(1, mj + j, lj + j, o[j], 0, c, u.sinks ? u.sinks + h0 + j : nullptr, o[j]);
            continue;
          }
          // The span's partial takes its first chunk's as it is and folds in each later one.
          const size_t base = slot0[b] + static_cast<size_t>(h0) * spans + chunk / sc;
          const bool opens = chunk % sc == 0;
          float* fold = opens ? nullptr : grow(fold_, static_cast<size_t>(kGroup) * c);
          for (int j = 0; j < g; ++j) o[j] = opens ? part + (base + static_cast<size_t>(j) * spans) * c : fold + j * c;
          attend_chunk_heads<T>(g, u, h0, k0, k1, w, c, scale, pre, mj, lj, o);
          for (int j = 0; j < g; ++j) {
            const size_t s = base + static_cast<size_t>(j) * spans;
            if (opens) {
              m[s] = mj[j], l[s] = lj[j];
            } else {
              fold_chunk(m[s], l[s], part + s * c, mj[j], lj[j], o[j], c);
            }
          }
        }
      }
    };
    run_items(pool, first.back(), work, chunk_item);

    // Merge every (unit, head) of more than one chunk.
    std::vector<int> multi;
    for (int u = u0; u < u1; ++u)
      if (units[u].keys > kKeyChunk) multi.push_back(u);
    const auto merge_item = [&](int item, int) {
      const int b = multi[item / heads] - u0, j = item % heads;
      const AttnUnit& u = units[u0 + b];
      const int spans = spans_of(chunks_of(u.keys));
      const size_t base = slot0[b] + static_cast<size_t>(j) * spans;
      merge_chunks(spans, m + base, l + base, part + base * c, c, c, u.sinks ? u.sinks + j : nullptr,
                   u.o + j * u.o_stride);
    };
    run_items(pool, static_cast<int>(multi.size()) * heads, work, merge_item);
    u0 = u1;
  }
}

// Checks the layout against the call and returns, per sequence, the row pointers of its keys.
std::vector<std::vector<const void*>> key_rows(const KVLayout& L, int n_rows, const void* cache, int w) {
  const size_t row_bytes = value_bytes(L.type) * w;
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
  std::vector<std::vector<const void*>> rows(L.n_seqs);
  for (int s = 0; s < L.n_seqs; ++s) {
    rows[s].resize(need[s]);
    const int32_t* table = L.table + static_cast<size_t>(s) * L.table_width;
    for (int p = 0; p < need[s]; ++p) {
      const long long r = static_cast<long long>(table[p / L.page]) * L.page + p % L.page;
      if (table[p / L.page] < 0 || r >= L.cache_rows)
        throw std::invalid_argument("attention: sequence " + std::to_string(s) + " position " + std::to_string(p) +
                                    " maps to cache row " + std::to_string(r) + " of " + std::to_string(L.cache_rows));
      rows[s][p] = static_cast<const char*>(cache) + static_cast<size_t>(r) * row_bytes;
    }
  }
  return rows;
}

// Each row's cache entry: lat [n, w] stored at its write row, as the cache's type.
void write_rows(const KVLayout& L, const float* lat, int n, int w, void* cache) {
  typed(L.type, cache, [&](auto* rows) {
    for (int t = 0; t < n; ++t)
      store_values(lat + static_cast<size_t>(t) * w, w, rows + static_cast<size_t>(L.write_rows[t]) * w);
  });
}

// attend_units over keys of the cache's type.
void attend_cache(const KVLayout& L, ThreadPool& pool, const AttnUnit* units, int n_units, int heads, int w, int c,
                  float scale, void* cache) {
  typed(L.type, cache, [&](auto* rows) {
    using T = std::remove_pointer_t<decltype(rows)>;
    attend_units<T>(pool, units, n_units, heads, w, c, scale);
  });
}

}  // namespace

void mla_attention(const MLAShape& sh, const float* q, const float* kv, const float* kv_norm, const Weight& k_b,
                   const Weight& v_b, const float* cos2, const float* sin2, void* cache, const KVLayout& layout,
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
  static thread_local std::vector<float> lat_, qn_, qc_, qlat_, olat_, ov_;

  // Cache rows of these tokens: normed c_kv, then roped k_pe.
  float* lat = grow(lat_, static_cast<size_t>(n) * w);
  for (int t = 0; t < n; ++t) {
    const float* src = kv + static_cast<size_t>(t) * w;
    float* dst = lat + static_cast<size_t>(t) * w;
    rms_norm(src, kv_norm, 1, c, sh.eps, dst);
    std::copy(src + c, src + w, dst + c);
  }
  rope(lat + c, n, w, 1, r, r, false, cos2, sin2);
  write_rows(layout, lat, n, w, cache);

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

  // Attention in latent space: per query, its heads over its sequence's rows.
  float* olat = grow(olat_, static_cast<size_t>(h) * n * c);
  std::vector<AttnUnit> units(n);
  for (int t = 0; t < n; ++t)
    units[t] = {rows[layout.seq[t]].data(), layout.keys[t], 0, 0, qc + static_cast<size_t>(t) * w,
                static_cast<size_t>(n) * w, olat + static_cast<size_t>(t) * c, static_cast<size_t>(n) * c, nullptr};
  attend_cache(layout, *rt.pool, units.data(), n, h, w, c, sh.scale, cache);

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
                   const float* sin2, void* cache, const KVLayout& layout, int n, float* q_work, float* out) {
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
  static thread_local std::vector<float> kv_;

  // Cache rows of these tokens: roped K of every KV head, then V.
  float* kv = grow(kv_, static_cast<size_t>(n) * w);
  for (int t = 0; t < n; ++t) {
    float* dst = kv + static_cast<size_t>(t) * w;
    std::copy(k + static_cast<size_t>(t) * g * dh, k + static_cast<size_t>(t + 1) * g * dh, dst);
    std::copy(v + static_cast<size_t>(t) * g * dv, v + static_cast<size_t>(t + 1) * g * dv, dst + g * dh);
  }
  rope(kv, n, w, g, dh, r, sh.neox, cos2, sin2);
  write_rows(layout, kv, n, w, cache);
  std::copy(q, q + static_cast<size_t>(n) * h * dh, q_work);
  rope(q_work, n, static_cast<size_t>(h) * dh, h, dh, r, sh.neox, cos2, sin2);

  // Per (query, KV head): its query heads over the sequence's rows; query head j uses KV head j / (h / g).
  const int per = h / g;
  std::vector<AttnUnit> units(static_cast<size_t>(n) * g);
  for (int t = 0; t < n; ++t)
    for (int kv = 0; kv < g; ++kv) {
      const size_t h0 = static_cast<size_t>(t) * h + static_cast<size_t>(kv) * per;
      units[static_cast<size_t>(t) * g + kv] = {rows[layout.seq[t]].data(), layout.keys[t], kv * dh, g * dh + kv * dv,
                                                q_work + h0 * dh, static_cast<size_t>(dh), out + h0 * dv,
                                                static_cast<size_t>(dv), nullptr};
    }
  attend_cache(layout, *rt.pool, units.data(), n * g, per, dh, dv, sh.scale, cache);
}

void dsv4_attention(const float* q, int n, int n_head, int d, float scale, const float* sinks, const void* cache,
                    KVType type, size_t cache_values, const int64_t* key_offsets, const int32_t* starts, float* out) {
  if (n_head <= 0 || d <= 0 || d % 8)
    throw std::invalid_argument("dsv4 attention: " + std::to_string(n_head) + " heads of " + std::to_string(d) +
                                " dims (heads positive, dims a positive multiple of 8)");
  if (n <= 0) return;
  if (starts[0] != 0) throw std::invalid_argument("dsv4 attention: the first query's keys must start at 0");
  for (int t = 0; t < n; ++t) {
    const int keys = starts[t + 1] - starts[t];
    if (keys <= 0)
      throw std::invalid_argument("dsv4 attention: query " + std::to_string(t) + " has " + std::to_string(keys) +
                                  " keys; every query sees at least its own row");
  }
  const size_t bytes = value_bytes(type);
  std::vector<const void*> ptrs(starts[n]);
  for (int i = 0; i < starts[n]; ++i) {
    if (key_offsets[i] < 0 || static_cast<size_t>(key_offsets[i]) + d > cache_values)
      throw std::invalid_argument("dsv4 attention: key " + std::to_string(i) + " at value offset " +
                                  std::to_string(key_offsets[i]) + " runs past the cache's " +
                                  std::to_string(cache_values) + " values");
    ptrs[i] = static_cast<const char*>(cache) + key_offsets[i] * bytes;
  }
  std::unique_lock<std::mutex> lock;
  Runtime& rt = acquire_runtime(lock);
  // Per query, its heads; K = V, the d values at each key's offset.
  std::vector<AttnUnit> units(n);
  for (int t = 0; t < n; ++t) {
    const size_t h0 = static_cast<size_t>(t) * n_head;
    units[t] = {ptrs.data() + starts[t], starts[t + 1] - starts[t], 0, 0, q + h0 * d, static_cast<size_t>(d),
                out + h0 * d, static_cast<size_t>(d), sinks};
  }
  typed(type, cache, [&](auto* values) {
    attend_units<std::remove_const_t<std::remove_pointer_t<decltype(values)>>>(*rt.pool, units.data(), n, n_head, d, d,
                                                                                 scale);
  });
}

}  // namespace pocketmoe
