#include "pocketmoe/matmul.h"

#include <stdexcept>

#include "kernels.h"
#include "pocketmoe/isa.h"
#include "pocketmoe/types.h"

namespace pocketmoe {

MatmulFn matmul_kernel(int ggml_type) {
  type_info(ggml_type);   // throws, naming the supported types, when there is no kernel
  if (MatmulFn fn = active_integer_kernel(ggml_type)) return fn;
  if (MatmulFn fn = avx2::float_kernel(ggml_type)) return fn;
  throw std::logic_error("ggml type " + std::to_string(ggml_type) + " is listed but has no kernel");
}

size_t matmul_scratch_bytes(int ggml_type, int cols) { return avx2::scratch_bytes(ggml_type, cols); }

int matmul_even_rows_tokens(int ggml_type) {
  const bool tiles = kernel_isa().name == "amx" && type_info(ggml_type).act == ActFormat::kQ8_0;
  return tiles ? amx::kLegacyMinTokens : 0;
}

}  // namespace pocketmoe
