// GGML tensor types the native kernels understand, and the activation formats they consume.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace pocketmoe {

enum GgmlType : int {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kIQ2_XXS = 16,
  kIQ2_XS = 17,
  kIQ3_XXS = 18,
  kIQ1_S = 19,
  kIQ3_S = 21,
  kIQ2_S = 22,
  kIQ4_NL = 20,
  kIQ4_XS = 23,
  kIQ1_M = 29,
  kBF16 = 30,
  kTQ1_0 = 34,
  kTQ2_0 = 35,
  kMXFP4 = 39,
  kNVFP4 = 40,
  kQ1_0 = 41,
};

// How a weight type wants its activations: float rows, or int8 rows with one float scale per
// 32 values (Q8_0) or per 256 values plus int16 sums of each 16 values (Q8_K).
enum class ActFormat { kF32, kQ8_0, kQ8_K };

struct TypeInfo {
  int ggml_type;
  const char* name;
  int block_values;
  int block_bytes;
  ActFormat act;
};

const TypeInfo* find_type(int ggml_type);         // nullptr when the kernels do not support it
const TypeInfo& type_info(int ggml_type);         // throws std::invalid_argument when unsupported
size_t weight_row_bytes(const TypeInfo& type, int cols);  // throws unless cols % block_values == 0
std::vector<int> supported_types();

int act_block_values(ActFormat format);            // 1, 32 or 256
size_t act_row_bytes(ActFormat format, int cols);  // bytes of one activation row, a multiple of 64

}  // namespace pocketmoe
