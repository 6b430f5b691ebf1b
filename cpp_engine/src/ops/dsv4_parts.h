// The pieces of DeepSeek-V4's attention sublayer (dsv4.h), shared by dsv4_attention.cpp and dsv4_compress.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "pocketmoe/dsv4.h"
#include "kv_values.h"

namespace pocketmoe {
namespace dsv4 {

// sum_i x[i]^2, each square rounded to float (as rms_norm's), summed in double over 16 lanes (i mod 16) and then
// the lanes in order: one fixed order for a given n, four independent chains instead of one.
double sum_squares(const float* x, int n);

// Cache row of position p of the step's sequence s.
inline int64_t cache_row(const KVLayout& kv, int s, int p) {
  return static_cast<int64_t>(kv.table[static_cast<size_t>(s) * kv.table_width + p / kv.page]) * kv.page +
         p % kv.page;
}

// Rotates the last `rot` dims of `heads` heads of d values in each of n rows (row t starts at x + t * stride) in
// interleaved pairs by the table rows [rot] of positions pos[t]; `inverse` rotates back. Each value:
// x[i] * cos2[i] +- x[partner] * sin2[i], the products and the sum rounded one by one.
void rope_tail(float* x, int n, size_t stride, int heads, int d, int rot, const int32_t* pos, const float* cos2,
               const float* sin2, bool inverse);

// Each token's compressor state into its cache row: kv, and score + ape[pos % r]; kv, score [T, c] (wkv x, wgate x).
void compressor_states(const DSV4Compressor& k, const float* kv, const float* score, int n, const int32_t* positions,
                       const int32_t* write_rows, const kv::Rows& cache);

// The entries of the blocks that positions start..end-1 of sequence s complete, each in its last token's row.
// cos2 / sin2: the compressed rope tables [., rot] by position.
void compress_blocks(const DSV4Compressor& k, const KVLayout& kv, int s, int start, int end, const kv::Rows& cache,
                     int rot, const float* cos2, const float* sin2);

// The entries each of the t queries of sequence s at positions start.. keeps of its n_ent = end / r: its top_k
// visible ones by sum_h w_h relu(q_h . k_s), in ascending order, query i's kept[i * top_k ..] (count[i] of them).
// q [t, h * hd] (roped), w [t, h].
void indexer_keep(const DSV4Indexer& idx, const float* q, const float* w, int t, int start, int end,
                  const KVLayout& kv, int s, const kv::Rows& cache, std::vector<int32_t>& kept,
                  std::vector<int32_t>& count);

}  // namespace dsv4
}  // namespace pocketmoe
