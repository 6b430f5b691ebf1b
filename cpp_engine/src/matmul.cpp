#include "pocketmoe/matmul.h"

#include <stdexcept>

#include "kernels.h"
#include "pocketmoe/types.h"

namespace pocketmoe {

MatmulFn matmul_kernel(int ggml_type) {
  switch (ggml_type) {
    case kF32: return kernels::matmul_f32;
    case kF16: return kernels::matmul_f16;
    case kBF16: return kernels::matmul_bf16;
    case kQ4_0: return kernels::matmul_q4_0;
    case kQ5_0: return kernels::matmul_q5_0;
    case kQ8_0: return kernels::matmul_q8_0;
    case kMXFP4: return kernels::matmul_mxfp4;
    case kQ2_K: return kernels::matmul_q2_k;
    case kQ3_K: return kernels::matmul_q3_k;
    case kQ4_K: return kernels::matmul_q4_k;
    case kQ5_K: return kernels::matmul_q5_k;
    case kQ6_K: return kernels::matmul_q6_k;
    case kIQ2_XXS: return kernels::matmul_iq2_xxs;
    case kIQ1_M: return kernels::matmul_iq1_m;
    case kIQ4_XS: return kernels::matmul_iq4_xs;
    default: type_info(ggml_type); throw std::invalid_argument("unsupported ggml type");
  }
}

size_t matmul_scratch_bytes(int ggml_type, int cols) {
  switch (type_info(ggml_type).act) {
    case ActFormat::kQ8_K: return kernels::kfamily_scratch_bytes(cols);
    case ActFormat::kQ8_0: return kernels::lfamily_scratch_bytes(cols);
    default: return 0;
  }
}

}  // namespace pocketmoe
