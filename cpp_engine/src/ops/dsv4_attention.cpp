// DeepSeek-V4's attention sublayer (dsv4.h) in one call: the projections in as few pool dispatches as their inputs
// allow (each weight's rows bitwise what it gives alone), the norms, rope and cache writes, the compressed entries
// and the indexer (dsv4_compress.cpp), the attention core (dsv4_attention in attention.cpp) over each query's own
// keys, the inverse rope and the grouped output LoRA.
#pragma GCC optimize("fp-contract=off")

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "dsv4_parts.h"

namespace pocketmoe {
namespace {

using dsv4::cache_row;
using dsv4::rope_tail;

float* grow(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

[[noreturn]] void fail(const std::string& what) { throw std::invalid_argument("dsv4 attention: " + what); }

void check(const DSV4Attention& a, int width, const DSV4Step& st, int n) {
  const int h = a.n_head, d = a.head_dim, g = a.o_groups, D = a.wq_a->cols;
  if (h <= 0 || d <= 0 || d % 8 || a.n_rot <= 0 || a.n_rot % 2 || a.n_rot > d || g <= 0 || h * d % g)
    fail(std::to_string(h) + " heads of " + std::to_string(d) + " dims, rope on " + std::to_string(a.n_rot) +
         ", " + std::to_string(g) + " output groups do not fit together");
  check_weight("attn_q_a", *a.wq_a, 1, a.wq_a->rows, D);
  check_weight("attn_q_b", *a.wq_b, 1, h * d, a.wq_a->rows);
  check_weight("attn_kv", *a.wkv, 1, d, D);
  check_weight("attn_output_a", *a.wo_a, g, a.wo_a->rows, h * d / g);
  check_weight("attn_output_b", *a.wo_b, 1, a.wo_b->rows, g * a.wo_a->rows);
  if ((a.comp == nullptr) != (a.ratio == 0) || (a.idx != nullptr) != (a.ratio == 4))
    fail("a ratio-" + std::to_string(a.ratio) + " layer needs a compressor iff ratio > 0 and an indexer iff 4");
  for (const DSV4Compressor* k : {a.comp, a.idx ? &a.idx->comp : nullptr}) {
    if (k == nullptr) continue;
    const int c = k->ratio == 4 ? 2 * k->dim : k->dim;
    check_weight("compressor kv", *k->wkv, 1, c, D);
    check_weight("compressor gate", *k->wgate, 1, c, D);
    if (k->ratio != a.ratio || k->dim < a.n_rot || std::max({k->kv + c, k->score + c, k->entry + k->dim}) > width)
      fail("a compressor's ratio, dims or cache offsets do not fit the layer's rows of " + std::to_string(width));
  }
  if (a.idx != nullptr) {
    const DSV4Indexer& i = *a.idx;
    if (i.head_dim % 8 || i.head_dim != i.comp.dim || i.top_k <= 0) fail("the indexer's head dims or top_k");
    check_weight("indexer q_b", *i.wq_b, 1, i.n_head * i.head_dim, a.wq_a->rows);
    check_weight("indexer proj", *i.proj, 1, i.n_head, D);
  }
  if (a.kv + d > width) fail("the kv values run past the cache row of " + std::to_string(width));
  for (int t = 0; t < n; ++t) {
    if (st.positions[t] < 0 || st.positions[t] >= st.rope_rows)
      fail("position " + std::to_string(st.positions[t]) + " is outside the rope tables of " +
           std::to_string(st.rope_rows) + " rows");
    if (st.kv.write_rows[t] < 0 || st.kv.write_rows[t] >= st.kv.cache_rows || st.kv.seq[t] < 0 ||
        st.kv.seq[t] >= st.kv.n_seqs)
      fail("row " + std::to_string(t) + " writes outside the cache or names no sequence of the step");
    if (t > 0 && st.kv.seq[t] == st.kv.seq[t - 1] && st.positions[t] != st.positions[t - 1] + 1)
      fail("a sequence's rows must be at consecutive positions");
  }
}

// An unweighted RMSNorm of each of `heads` heads of d values in n rows (the squares summed in double).
void head_norms(float* x, int n, int heads, int d, float eps) {
  for (size_t r = 0; r < static_cast<size_t>(n) * heads; ++r) {
    float* v = x + r * d;
    const double ss = dsv4::sum_squares(v, d);
    const float scale = 1.0f / std::sqrt(static_cast<float>(ss / d) + eps);
    for (int i = 0; i < d; ++i) v[i] = v[i] * scale;
  }
}

}  // namespace

void dsv4_attention_sublayer(const DSV4Attention& a, const float* x, int n, void* cache_values, int width,
                             const DSV4Step& st, float* out) {
  if (n <= 0) return;
  check(a, width, st, n);
  const kv::Rows cache{cache_values, st.kv.type, width};
  const int h = a.n_head, d = a.head_dim, rot = a.n_rot, ql = a.wq_a->rows, g = a.o_groups;
  const DSV4Compressor* comps[2] = {a.comp, a.idx ? &a.idx->comp : nullptr};
  const int c0 = a.comp ? a.comp->wkv->rows : 0, c1 = a.idx ? a.idx->comp.wkv->rows : 0;
  const int ih = a.idx ? a.idx->n_head : 0, iq_w = a.idx ? a.idx->n_head * a.idx->head_dim : 0;
  static thread_local std::vector<float> qa_, kv_, q_, st_, iq_, o_, og_, y_, oa_;
  const size_t nn = static_cast<size_t>(n);
  float* qa = grow(qa_, nn * ql);
  float* kv = grow(kv_, nn * d);
  float* q = grow(q_, nn * h * d);
  float* states = grow(st_, nn * 2 * (c0 + c1));  // kv and score of each compressor
  float* iw = grow(iq_, nn * (iq_w + ih));
  float* iq = iw + nn * ih;
  {  // everything that reads x: q_a, kv, the attention compressor's state; then the indexer's and its weights
    const Weight* ws[4] = {a.wq_a, a.wkv, nullptr, nullptr};
    float* ys[4] = {qa, kv, states, states + nn * c0};
    int m = 2;
    if (a.comp) ws[2] = a.comp->wkv, ws[3] = a.comp->wgate, m = 4;
    linear_multi(ws, m, x, n, ys);
    if (a.idx) {
      const Weight* wi[3] = {a.idx->comp.wkv, a.idx->comp.wgate, a.idx->proj};
      float* yi[3] = {states + nn * 2 * c0, states + nn * (2 * c0 + c1), iw};
      linear_multi(wi, 3, x, n, yi);
    }
  }
  rms_norm(qa, a.q_a_norm, n, ql, a.eps, qa);
  {
    const Weight* ws[2] = {a.wq_b, a.idx ? a.idx->wq_b : nullptr};
    float* ys[2] = {q, iq};
    linear_multi(ws, a.idx ? 2 : 1, qa, n, ys);
  }
  head_norms(q, n, h, d, a.eps);
  rope_tail(q, n, static_cast<size_t>(h) * d, h, d, rot, st.positions, st.cos2, st.sin2, false);
  rms_norm(kv, a.kv_norm, n, d, a.eps, kv);
  rope_tail(kv, n, d, 1, d, rot, st.positions, st.cos2, st.sin2, false);
  for (int t = 0; t < n; ++t) cache.write(st.kv.write_rows[t], a.kv, kv + static_cast<size_t>(t) * d, d);
  if (a.comp) dsv4::compressor_states(*a.comp, states, states + nn * c0, n, st.positions, st.kv.write_rows, cache);
  if (a.idx) {
    dsv4::compressor_states(a.idx->comp, states + nn * 2 * c0, states + nn * (2 * c0 + c1), n, st.positions,
                            st.kv.write_rows, cache);
    const int ihd = a.idx->head_dim;
    rope_tail(iq, n, iq_w, ih, ihd, rot, st.positions, st.cos2, st.sin2, false);
    for (size_t i = 0; i < nn * ih; ++i) iw[i] = iw[i] * a.idx->w_scale;
  }
  // Per sequence: its completed blocks' entries, the indexer's choice, and each query's keys: the window rows in
  // position order, then its visible (kept) entries in block order.
  static thread_local std::vector<int64_t> offsets;
  static thread_local std::vector<int32_t> starts;
  static thread_local std::vector<int32_t> kept, count;
  offsets.clear();
  starts.assign(1, 0);
  for (int t0 = 0; t0 < n;) {
    const int s = st.kv.seq[t0];
    int t1 = t0 + 1;
    while (t1 < n && st.kv.seq[t1] == s) ++t1;
    const int start = st.positions[t0], end = st.positions[t1 - 1] + 1;
    const KVLayout& kl = st.kv;
    if ((end - 1) / kl.page >= kl.table_width) fail("position " + std::to_string(end - 1) + " is past the page table");
    for (int pg = 0; pg <= (end - 1) / kl.page; ++pg) {
      const int32_t page = kl.table[static_cast<size_t>(s) * kl.table_width + pg];
      if (page < 0 || (static_cast<int64_t>(page) + 1) * kl.page > kl.cache_rows)
        fail("sequence " + std::to_string(s) + "'s page " + std::to_string(pg) + " is outside the cache");
    }
    for (const DSV4Compressor* k : comps)
      if (k) dsv4::compress_blocks(*k, st.kv, s, start, end, cache, rot, st.cos2, st.sin2);
    if (a.idx)
      dsv4::indexer_keep(*a.idx, iq + static_cast<size_t>(t0) * iq_w, iw + static_cast<size_t>(t0) * ih, t1 - t0,
                         start, end, st.kv, s, cache, kept, count);
    for (int t = t0; t < t1; ++t) {
      const int p = st.positions[t];
      for (int k = std::max(0, p - a.window + 1); k <= p; ++k)
        offsets.push_back(cache_row(st.kv, s, k) * width + a.kv);
      const auto entry = [&](int b) {
        offsets.push_back(cache_row(st.kv, s, b * a.ratio + a.ratio - 1) * width + a.comp->entry);
      };
      if (a.idx) {
        const int32_t* ki = kept.data() + static_cast<size_t>(t - t0) * a.idx->top_k;
        for (int j = 0; j < count[t - t0]; ++j) entry(ki[j]);
      } else {
        for (int b = 0; b < (a.ratio ? (p + 1) / a.ratio : 0); ++b) entry(b);
      }
      starts.push_back(static_cast<int32_t>(offsets.size()));
    }
    t0 = t1;
  }
  float* o = grow(o_, nn * h * d);
  dsv4_attention(q, n, h, d, a.scale, a.sinks, cache.data, cache.type, static_cast<size_t>(st.kv.cache_rows) * width,
                 offsets.data(), starts.data(), o);
  rope_tail(o, n, static_cast<size_t>(h) * d, h, d, rot, st.positions, st.cos2, st.sin2, true);
  // Grouped output: o [T, G, cols] -> [G, T, cols] -> wo_a per group [G, T, r] -> [T, G * r] -> wo_b.
  const int cols = h * d / g, r = a.wo_a->rows;
  float* og = grow(og_, nn * h * d);
  for (int t = 0; t < n; ++t)
    for (int j = 0; j < g; ++j)
      std::copy(o + (static_cast<size_t>(t) * g + j) * cols, o + (static_cast<size_t>(t) * g + j + 1) * cols,
                og + (static_cast<size_t>(j) * n + t) * cols);
  float* y = grow(y_, nn * g * r);
  gemm_batched(a.wo_a->data, g, r, a.wo_a->row_bytes, a.wo_a->ggml_type, og, n, cols, y);
  float* oa = grow(oa_, nn * g * r);
  for (int j = 0; j < g; ++j)
    for (int t = 0; t < n; ++t)
      std::copy(y + (static_cast<size_t>(j) * n + t) * r, y + (static_cast<size_t>(j) * n + t + 1) * r,
                oa + (static_cast<size_t>(t) * g + j) * r);
  const Weight* wo[1] = {a.wo_b};
  float* yo[1] = {out};
  linear_multi(wo, 1, oa, n, yo);
}

}  // namespace pocketmoe
