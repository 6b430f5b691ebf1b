// Gated FFN and embedding rows (pocketmoe/ops.h), and the weight check every op uses.
#include <stdexcept>
#include <string>
#include <vector>

#include "pocketmoe/matmul.h"
#include "pocketmoe/ops.h"
#include "pocketmoe/silu.h"
#include "pocketmoe/types.h"
#include "../workspace.h"

namespace pocketmoe {

void check_weight(const char* what, const Weight& w, int heads, int rows, int cols) {
  if (w.data == nullptr) throw std::invalid_argument(std::string(what) + " is missing");
  const size_t want = weight_row_bytes(type_info(w.ggml_type), cols);
  if (w.heads != heads || w.rows != rows || w.cols != cols || w.row_bytes != want)
    throw std::invalid_argument(std::string(what) + " is [" + std::to_string(w.heads) + ", " + std::to_string(w.rows) +
                                ", " + std::to_string(w.cols) + "] in rows of " + std::to_string(w.row_bytes) +
                                " bytes; expected [" + std::to_string(heads) + ", " + std::to_string(rows) + ", " +
                                std::to_string(cols) + "] in rows of " + std::to_string(want));
}

void gated_ffn(const Weight& gate, const Weight& up, const Weight& down, const float* x, int n, float* y) {
  const int hidden = gate.cols, ff = gate.rows;
  check_weight("ffn gate", gate, 1, ff, hidden);
  check_weight("ffn up", up, 1, ff, hidden);
  check_weight("ffn down", down, 1, hidden, ff);
  if (n <= 0) return;
  static thread_local std::vector<float> g_, u_;
  const size_t width = static_cast<size_t>(n) * ff;
  if (g_.size() < width) g_.resize(width), u_.resize(width);
  std::unique_lock<std::mutex> lock;
  Runtime& rt = acquire_runtime(lock);
  const GemmOp ops[2] = {{gate.data, ff, gate.row_bytes, gate.ggml_type, g_.data()},
                         {up.data, ff, up.row_bytes, up.ggml_type, u_.data()}};
  gemm_multi(rt, ops, 2, x, n, hidden);
  silu_mul(g_.data(), u_.data(), static_cast<int>(width));
  gemm(rt, down.data, hidden, down.row_bytes, down.ggml_type, g_.data(), n, ff, y);
}

void linear_multi(const Weight* const* weights, int n_weights, const float* x, int n, float* const* ys) {
  if (n_weights < 1 || n_weights > 4) throw std::invalid_argument("linear_multi takes 1 to 4 weights");
  const int cols = weights[0]->cols;
  GemmOp ops[4];
  for (int i = 0; i < n_weights; ++i) {
    const Weight& w = *weights[i];
    check_weight("linear_multi weight", w, 1, w.rows, cols);
    ops[i] = GemmOp{w.data, w.rows, w.row_bytes, w.ggml_type, ys[i]};
  }
  std::unique_lock<std::mutex> lock;
  gemm_multi(acquire_runtime(lock), ops, n_weights, x, n, cols);
}

void embed(const Weight& table, const int32_t* tokens, int n, float* y) {
  check_weight("token_embd", table, 1, table.rows, table.cols);
  for (int t = 0; t < n; ++t)
    if (tokens[t] < 0 || tokens[t] >= table.rows)
      throw std::invalid_argument("token id " + std::to_string(tokens[t]) + " is outside the vocabulary of " +
                                  std::to_string(table.rows) + " tokens");
  for (int t = 0; t < n; ++t)
    dequantize_row(table.ggml_type, table.data + table.row_bytes * tokens[t], table.cols,
                   y + static_cast<size_t>(t) * table.cols);
}

}  // namespace pocketmoe
