#include <algorithm>
#include <stdexcept>
#include <string>

#include "pocketmoe/act_quant.h"
#include "pocketmoe/runtime.h"
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
  gemm(acquire_runtime(lock), weight, rows, row_bytes, ggml_type, x, n_tokens, cols, y);
}

void gemm(Runtime& e, const uint8_t* weight, int rows, size_t row_bytes, int ggml_type, const float* x, int n_tokens,
          int cols, float* y) {
  const GemmOp op{weight, rows, row_bytes, ggml_type, y};
  gemm_multi(e, &op, 1, x, n_tokens, cols);
}

uint8_t* quantize_rows(ThreadPool& pool, Buffer& buf, ActFormat format, const float* x, int n_rows, int cols,
                       bool on_caller) {
  const size_t arb = act_row_bytes(format, cols);
  uint8_t* rows = buf.get(arb * n_rows);
  const auto one = [&](int r) { quantize_act_row(format, x + static_cast<size_t>(r) * cols, cols, rows + arb * r); };
  if (on_caller) {
    for (int r = 0; r < n_rows; ++r) one(r);
  } else {
    pool.parallel_for(n_rows, [&](int r, int) { one(r); });
  }
  return rows;
}

void gemm_multi(Runtime& e, const GemmOp* ops, int n_ops, const float* x, int n_tokens, int cols) {
  constexpr int kMaxOps = 4;
  if (n_ops > kMaxOps) throw std::invalid_argument("gemm_multi: at most 4 weights per call");
  size_t work = 0;
  for (int i = 0; i < n_ops; ++i) {
    const GemmOp& op = ops[i];
    const TypeInfo& type = type_info(op.ggml_type);
    const size_t expected = weight_row_bytes(type, cols);
    if (op.row_bytes != expected)
      throw std::invalid_argument(std::string("gemm: a ") + type.name + " row of " + std::to_string(cols) +
                                  " values is " + std::to_string(expected) + " bytes, the weight has " +
                                  std::to_string(op.row_bytes));
    work += static_cast<size_t>(std::max(op.rows, 0)) * op.row_bytes * static_cast<size_t>((n_tokens + 3) / 4);
  }
  if (n_tokens <= 0 || work == 0) return;

  ThreadPool& pool = *e.pool;
  Workspace& ws = e.ws;
  const bool inline_call = work < kInlineWork;

  // Per op, its kernel and its activation rows; x is quantized once per format (Q8_K in slot 0, Q8_0 in 1).
  const uint8_t** slot_acts[3] = {nullptr, nullptr, nullptr};  // Q8_K, Q8_0, F32
  const uint8_t** op_acts[kMaxOps];
  MatmulFn fns[kMaxOps];
  for (int i = 0; i < n_ops; ++i) {
    const ActFormat fmt = type_info(ops[i].ggml_type).act;
    const int slot = fmt == ActFormat::kQ8_K ? 0 : fmt == ActFormat::kQ8_0 ? 1 : 2;
    if (!slot_acts[slot]) {
      const uint8_t** acts = slot_acts[slot] = ws.act_ptrs[slot].get_as<const uint8_t*>(n_tokens);
      if (fmt == ActFormat::kF32) {
        for (int t = 0; t < n_tokens; ++t) acts[t] = reinterpret_cast<const uint8_t*>(x + static_cast<size_t>(t) * cols);
      } else {
        const size_t arb = act_row_bytes(fmt, cols);
        const uint8_t* rows = quantize_rows(pool, ws.acts[slot], fmt, x, n_tokens, cols, inline_call || n_tokens == 1);
        for (int t = 0; t < n_tokens; ++t) acts[t] = rows + arb * t;
      }
    }
    op_acts[i] = slot_acts[slot];
    fns[i] = matmul_kernel(ops[i].ggml_type);
  }

  // Work items: (op, row block, token chunk), about 8 per thread for each op.
  int rows_per_item[kMaxOps], row_items[kMaxOps], first_item[kMaxOps + 1];
  size_t scratch = 0;
  const int token_chunks = (n_tokens + kTokenChunk - 1) / kTokenChunk;
  const int target_items = inline_call ? 1 : std::max(1, pool.size() * 8 / token_chunks);
  first_item[0] = 0;
  for (int i = 0; i < n_ops; ++i) {
    const int rows = std::max(ops[i].rows, 0);
    rows_per_item[i] =
        inline_call ? std::max(rows, 1) : std::min(rows, std::max(16, round_up((rows + target_items - 1) / target_items, 8)));
    row_items[i] = rows == 0 ? 0 : (rows + rows_per_item[i] - 1) / rows_per_item[i];
    first_item[i + 1] = first_item[i] + row_items[i] * token_chunks;
    scratch = std::max(scratch, matmul_scratch_bytes(ops[i].ggml_type, cols));
  }
  for (Buffer& b : ws.per_thread) b.get(scratch + 64);

  pool.parallel_for(first_item[n_ops], [&](int item, int thread) {
    int i = 0;
    while (item >= first_item[i + 1]) ++i;
    const GemmOp& op = ops[i];
    const int local = item - first_item[i];
    const int r0 = (local % row_items[i]) * rows_per_item[i];
    const int t0 = (local / row_items[i]) * kTokenChunk;
    MatmulTask task{};
    task.weight = op.weight;
    task.row_bytes = op.row_bytes;
    task.cols = cols;
    task.row_begin = r0;
    task.row_end = std::min(op.rows, r0 + rows_per_item[i]);
    task.acts = op_acts[i] + t0;
    task.n_tokens = std::min(kTokenChunk, n_tokens - t0);
    task.out = op.y + static_cast<size_t>(t0) * op.rows + r0;
    task.out_stride = op.rows;
    task.scratch = ws.per_thread[thread].get(scratch + 64);
    fns[i](task);
  });
}

void gemm_batched(const uint8_t* weight, int heads, int rows, size_t row_bytes, int ggml_type, const float* x,
                  int n_tokens, int cols, float* y) {
  std::unique_lock<std::mutex> lock;
  gemm_batched(acquire_runtime(lock), weight, heads, rows, row_bytes, ggml_type, x, n_tokens, cols, y);
}

void gemm_batched(Runtime& e, const uint8_t* weight, int heads, int rows, size_t row_bytes, int ggml_type,
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
    // A few rows (decode: one per head) quantize faster than the pool wakes.
    const size_t arb = act_row_bytes(type.act, cols);
    const uint8_t* rows = quantize_rows(pool, ws.acts[0], type.act, x, n_act, cols,
                                        inline_call || static_cast<size_t>(n_act) * cols <= kInlineQuantValues);
    for (int i = 0; i < n_act; ++i) acts[i] = rows + arb * i;
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
