// The per-type row kernels behind gemm and moe_forward.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pocketmoe {

// out[t * out_stride + (r - row_begin)] = dot(weight row r, activation row t)
// for r in [row_begin, row_end), t in [0, n_tokens). Each output is computed by one fixed sequence
// of float operations whatever the tile, row range or token count, so results are bitwise stable.
struct MatmulTask {
  const uint8_t* weight;        // row 0 of a [rows, row_bytes] block matrix
  size_t row_bytes;
  int cols;
  int row_begin;
  int row_end;
  const uint8_t* const* acts;   // n_tokens rows in the type's ActFormat
  int n_tokens;
  float* out;
  ptrdiff_t out_stride;
  uint8_t* scratch;             // matmul_scratch_bytes(type, cols) bytes, 64-byte aligned
};

using MatmulFn = void (*)(const MatmulTask& task);

MatmulFn matmul_kernel(int ggml_type);               // throws std::invalid_argument when unsupported
size_t matmul_scratch_bytes(int ggml_type, int cols);
// From how many tokens a call of ggml_type's kernel runs faster when its activation rows lie evenly
// spaced in memory (the 32-value types' AMX tiles load up to 16 of them with one stride; other rows
// take the 512-bit path), or 0 when never.
int matmul_even_rows_tokens(int ggml_type);

// Scalar dequantization of n values (n % block_values == 0); an independent reference for tests.
void dequantize_row(int ggml_type, const uint8_t* src, int n, float* dst);

}  // namespace pocketmoe
