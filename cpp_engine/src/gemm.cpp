#include <algorithm>
#include <stdexcept>
#include <string>

#include "pocketmoe/act_quant.h"
#include "pocketmoe/engine.h"
#include "pocketmoe/matmul.h"
#include "pocketmoe/types.h"
#include "workspace.h"

namespace pocketmoe {
namespace {

constexpr int kTokenChunk = 256;   // tokens per work item; keeps one item's activations in L2
// Below this many weight bytes x token tiles, the caller does the whole call alone: waking the pool
// and the join cost more than a second thread saves (~2 us at ~10 GB/s per thread).
constexpr size_t kInlineWork = size_t{48} << 10;
// gemm_batched quantizes up to this many activation values on the caller, without waking the pool.
constexpr size_t kInlineQuantValues = size_t{16} << 10;

int round_up(int v, int m) { return (v + m - 1) / m * m; }

}  // namespace

void gemm(const uint8_t* weight, int rows, size_t row_bytes, int ggml_type, const float* x, int n_tokens, int cols,
          float* y) {
  std::unique_lock<std::mutex> lock;
  gemm(acquire_engine(lock), weight, rows, row_bytes, ggml_type, x, n_tokens, cols, y);
}

void gemm(Engine& e, const uint8_t* weight, int rows, size_t row_bytes, int ggml_type, const float* x, int n_tokens,
          int cols, float* y) {
  const TypeInfo& type = type_info(ggml_type);
  const size_t expected = weight_row_bytes(type, cols);
  if (row_bytes != expected)
    throw std::invalid_argument(std::string("gemm: a ") + type.name + " row of " + std::to_string(cols) +
                                " values is " + std::to_string(expected) + " bytes, the weight has " +
                                std::to_string(row_bytes));
  if (rows <= 0 || n_tokens <= 0) return;

  ThreadPool& pool = *e.pool;
  Workspace& ws = e.ws;

  const bool inline_call = static_cast<size_t>(rows) * row_bytes * static_cast<size_t>((n_tokens + 3) / 4) < kInlineWork;
  const uint8_t** acts = ws.act_ptrs[0].get_as<const uint8_t*>(n_tokens);
  if (type.act == ActFormat::kF32) {
    for (int t = 0; t < n_tokens; ++t) acts[t] = reinterpret_cast<const uint8_t*>(x + static_cast<size_t>(t) * cols);
  } else {
    const size_t arb = act_row_bytes(type.act, cols);
    uint8_t* buf = ws.acts[0].get(arb * n_tokens);
    for (int t = 0; t < n_tokens; ++t) acts[t] = buf + arb * t;
    if (inline_call || n_tokens == 1) {
      for (int t = 0; t < n_tokens; ++t) quantize_act_row(type.act, x + static_cast<size_t>(t) * cols, cols, buf + arb * t);
    } else {
      pool.parallel_for(n_tokens, [&](int t, int) {
        quantize_act_row(type.act, x + static_cast<size_t>(t) * cols, cols, buf + arb * t);
      });
    }
  }

  const size_t scratch = matmul_scratch_bytes(ggml_type, cols);
  for (Buffer& b : ws.per_thread) b.get(scratch + 64);
  const int token_chunks = (n_tokens + kTokenChunk - 1) / kTokenChunk;
  const int target_items = inline_call ? 1 : std::max(1, pool.size() * 8 / token_chunks);
  const int rows_per_item =
      inline_call ? rows : std::min(rows, std::max(16, round_up((rows + target_items - 1) / target_items, 8)));
  const int row_items = (rows + rows_per_item - 1) / rows_per_item;
  const MatmulFn fn = matmul_kernel(ggml_type);

  pool.parallel_for(row_items * token_chunks, [&](int item, int thread) {
    const int r0 = (item % row_items) * rows_per_item;
    const int t0 = (item / row_items) * kTokenChunk;
    MatmulTask task{};
    task.weight = weight;
    task.row_bytes = row_bytes;
    task.cols = cols;
    task.row_begin = r0;
    task.row_end = std::min(rows, r0 + rows_per_item);
    task.acts = acts + t0;
    task.n_tokens = std::min(kTokenChunk, n_tokens - t0);
    task.out = y + static_cast<size_t>(t0) * rows + r0;
    task.out_stride = rows;
    task.scratch = ws.per_thread[thread].get(scratch + 64);
    fn(task);
  });
}

void gemm_batched(const uint8_t* weight, int heads, int rows, size_t row_bytes, int ggml_type, const float* x,
                  int n_tokens, int cols, float* y) {
  std::unique_lock<std::mutex> lock;
  gemm_batched(acquire_engine(lock), weight, heads, rows, row_bytes, ggml_type, x, n_tokens, cols, y);
}

void gemm_batched(Engine& e, const uint8_t* weight, int heads, int rows, size_t row_bytes, int ggml_type,
                  const float* x, int n_tokens, int cols, float* y) {
  const TypeInfo& type = type_info(ggml_type);
  const size_t expected = weight_row_bytes(type, cols);
  if (row_bytes != expected)
    throw std::invalid_argument(std::string("gemm_batched: a ") + type.name + " row of " + std::to_string(cols) +
                                " values is " + std::to_string(expected) + " bytes, the weight has " +
                                std::to_string(row_bytes));
  if (heads <= 0 || rows <= 0 || n_tokens <= 0) return;

  ThreadPool& pool = *e.pool;
  Workspace& ws = e.ws;

  const size_t head_bytes = static_cast<size_t>(rows) * row_bytes;
  const int n_act = heads * n_tokens;   // activation rows, head-major: x[h, t] is row h * n_tokens + t
  const bool inline_call =
      head_bytes * static_cast<size_t>(heads) * static_cast<size_t>((n_tokens + 3) / 4) < kInlineWork;
  const uint8_t** acts = ws.act_ptrs[0].get_as<const uint8_t*>(n_act);
  if (type.act == ActFormat::kF32) {
    for (int i = 0; i < n_act; ++i) acts[i] = reinterpret_cast<const uint8_t*>(x + static_cast<size_t>(i) * cols);
  } else {
    const size_t arb = act_row_bytes(type.act, cols);
    uint8_t* buf = ws.acts[0].get(arb * n_act);
    for (int i = 0; i < n_act; ++i) acts[i] = buf + arb * i;
    // A few rows (decode: one per head) quantize faster than the pool wakes.
    if (inline_call || static_cast<size_t>(n_act) * cols <= kInlineQuantValues) {
      for (int i = 0; i < n_act; ++i) quantize_act_row(type.act, x + static_cast<size_t>(i) * cols, cols, buf + arb * i);
    } else {
      pool.parallel_for(n_act, [&](int i, int) {
        quantize_act_row(type.act, x + static_cast<size_t>(i) * cols, cols, buf + arb * i);
      });
    }
  }

  const size_t scratch = matmul_scratch_bytes(ggml_type, cols);
  for (Buffer& b : ws.per_thread) b.get(scratch + 64);
  const int token_chunks = (n_tokens + kTokenChunk - 1) / kTokenChunk;
  // About 8 items per thread over all heads; a head's rows split only when there are fewer heads.
  const int row_items_wanted = inline_call ? 1 : std::max(1, (pool.size() * 8 + heads * token_chunks - 1) /
                                                                 (heads * token_chunks));
  const int rows_per_item =
      inline_call ? rows : std::min(rows, std::max(16, round_up((rows + row_items_wanted - 1) / row_items_wanted, 8)));
  const int row_items = (rows + rows_per_item - 1) / rows_per_item;
  const int head_items = row_items * token_chunks;
  const MatmulFn fn = matmul_kernel(ggml_type);

  pool.parallel_for(heads * head_items, [&](int item, int thread) {
    const int h = item / head_items;
    const int rest = item % head_items;
    const int r0 = (rest % row_items) * rows_per_item;
    const int t0 = (rest / row_items) * kTokenChunk;
    MatmulTask task{};
    task.weight = weight + head_bytes * h;
    task.row_bytes = row_bytes;
    task.cols = cols;
    task.row_begin = r0;
    task.row_end = std::min(rows, r0 + rows_per_item);
    task.acts = acts + static_cast<size_t>(h) * n_tokens + t0;
    task.n_tokens = std::min(kTokenChunk, n_tokens - t0);
    task.out = y + (static_cast<size_t>(h) * n_tokens + t0) * rows + r0;
    task.out_stride = rows;
    task.scratch = ws.per_thread[thread].get(scratch + 64);
    fn(task);
  });
}

}  // namespace pocketmoe
