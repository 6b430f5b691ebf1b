// The kernels of each instruction set, by ggml type (isa_*.cpp), and the set chosen at run time
// (isa.cpp). The integer-weight kernels exist for AVX2, AVX-VNNI, AVX-512 VNNI and AMX (the 32-value
// types; AVX-512 VNNI for the rest) and give bitwise the same results; the float-weight ones (F32, F16,
// BF16) are AVX2 only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "pocketmoe/matmul.h"

namespace pocketmoe {

using KernelTable = MatmulFn (*)(int ggml_type);   // nullptr for a type the set has no kernel for

namespace avx2 {
MatmulFn integer_kernel(int ggml_type);
MatmulFn float_kernel(int ggml_type);
size_t scratch_bytes(int ggml_type, int cols);
}  // namespace avx2
namespace avxvnni {
MatmulFn integer_kernel(int ggml_type);
}  // namespace avxvnni
namespace avx512vnni {
MatmulFn integer_kernel(int ggml_type);
}  // namespace avx512vnni
namespace amx {
MatmulFn integer_kernel(int ggml_type);
// Tokens per call from which the AMX tiles run: for the 32-value types (an AMX block costs about what
// their 512-bit tile takes for 12-14 tokens on one Sapphire Rapids core), and for the 256-value ones
// (sixteen rows x up to sixteen tokens cost about what their 512-bit tiles take for 9-10 tokens).
constexpr int kLegacyMinTokens = 13;
constexpr int kSuperMinTokens = 10;
}  // namespace amx

// Whether this CPU (and its OS) can run the set named as POCKETMOE_ISA names it; false for other names.
bool cpu_has_isa(const std::string& name);

// The integer kernel of ggml_type in the chosen set (kernel_isa()); nullptr for float types.
MatmulFn active_integer_kernel(int ggml_type);

// Runs every integer type's kernel from `candidate` and from AVX2 on the same random blocks
// (rows x 512, each token count in turn, both from `seed`) and compares the outputs bit for bit.
// Returns "" when all are identical, else the first difference of each type that differs, "; "-joined.
std::string compare_with_avx2(KernelTable candidate, const std::vector<int>& token_counts, int rows, uint32_t seed);

}  // namespace pocketmoe
