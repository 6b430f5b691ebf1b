#include "pocketmoe/types.h"

#include <stdexcept>
#include <string>

namespace pocketmoe {
namespace {

const TypeInfo kTypes[] = {
    {kF32, "F32", 1, 4, ActFormat::kF32},
    {kF16, "F16", 1, 2, ActFormat::kF32},
    {kQ4_0, "Q4_0", 32, 18, ActFormat::kQ8_0},
    {kQ5_0, "Q5_0", 32, 22, ActFormat::kQ8_0},
    {kQ4_1, "Q4_1", 32, 20, ActFormat::kQ8_0},
    {kQ5_1, "Q5_1", 32, 24, ActFormat::kQ8_0},
    {kQ8_0, "Q8_0", 32, 34, ActFormat::kQ8_0},
    {kQ2_K, "Q2_K", 256, 84, ActFormat::kQ8_K},
    {kQ3_K, "Q3_K", 256, 110, ActFormat::kQ8_K},
    {kQ4_K, "Q4_K", 256, 144, ActFormat::kQ8_K},
    {kQ5_K, "Q5_K", 256, 176, ActFormat::kQ8_K},
    {kQ6_K, "Q6_K", 256, 210, ActFormat::kQ8_K},
    {kIQ2_XXS, "IQ2_XXS", 256, 66, ActFormat::kQ8_K},
    {kIQ4_XS, "IQ4_XS", 256, 136, ActFormat::kQ8_K},
    {kIQ1_M, "IQ1_M", 256, 56, ActFormat::kQ8_K},
    {kIQ3_XXS, "IQ3_XXS", 256, 98, ActFormat::kQ8_K},
    {kIQ1_S, "IQ1_S", 256, 50, ActFormat::kQ8_K},
    {kIQ2_XS, "IQ2_XS", 256, 74, ActFormat::kQ8_K},
    {kIQ2_S, "IQ2_S", 256, 82, ActFormat::kQ8_K},
    {kIQ3_S, "IQ3_S", 256, 110, ActFormat::kQ8_K},
    {kTQ1_0, "TQ1_0", 256, 54, ActFormat::kQ8_K},
    {kTQ2_0, "TQ2_0", 256, 66, ActFormat::kQ8_K},
    {kBF16, "BF16", 1, 2, ActFormat::kF32},
    {kMXFP4, "MXFP4", 32, 17, ActFormat::kQ8_0},
    {kNVFP4, "NVFP4", 64, 36, ActFormat::kQ8_0},
    {kQ1_0, "Q1_0", 128, 18, ActFormat::kQ8_0},
    {kIQ4_NL, "IQ4_NL", 32, 18, ActFormat::kQ8_0},
};

}  // namespace

const TypeInfo* find_type(int ggml_type) {
  for (const TypeInfo& t : kTypes)
    if (t.ggml_type == ggml_type) return &t;
  return nullptr;
}

std::vector<int> supported_types() {
  std::vector<int> out;
  for (const TypeInfo& t : kTypes) out.push_back(t.ggml_type);
  return out;
}

const TypeInfo& type_info(int ggml_type) {
  const TypeInfo* t = find_type(ggml_type);
  if (t == nullptr) {
    std::string names;
    for (const TypeInfo& s : kTypes) names += std::string(names.empty() ? "" : ", ") + s.name;
    throw std::invalid_argument("ggml type " + std::to_string(ggml_type) +
                                " has no native kernel; supported types are " + names);
  }
  return *t;
}

size_t weight_row_bytes(const TypeInfo& type, int cols) {
  if (cols <= 0 || cols % type.block_values != 0)
    throw std::invalid_argument(std::string(type.name) + " rows need a positive multiple of " +
                                std::to_string(type.block_values) + " values, got " + std::to_string(cols));
  return static_cast<size_t>(cols / type.block_values) * type.block_bytes;
}

int act_block_values(ActFormat format) {
  switch (format) {
    case ActFormat::kQ8_0: return 32;
    case ActFormat::kQ8_K: return 256;
    default: return 1;
  }
}

size_t act_row_bytes(ActFormat format, int cols) {
  size_t n = 0;
  switch (format) {
    case ActFormat::kF32: n = 4 * static_cast<size_t>(cols); break;
    case ActFormat::kQ8_0: n = static_cast<size_t>(cols) + 14 * static_cast<size_t>(cols / 32); break;
    case ActFormat::kQ8_K: n = static_cast<size_t>(cols) + 4 * static_cast<size_t>(cols / 256) + 2 * (cols / 16); break;
  }
  return (n + 63) / 64 * 64;
}

}  // namespace pocketmoe
