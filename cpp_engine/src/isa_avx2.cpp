// The AVX2 + FMA baseline: every kernel, and the reference the wider sets are checked against.
#include <algorithm>

#include "ffamily.h"
#include "int_kernels.inc"

namespace pocketmoe::avx2 {

MatmulFn float_kernel(int ggml_type) {
  switch (ggml_type) {
    case kF32: return driver::matmul<ffamily::Family, decode::F32>;
    case kF16: return driver::matmul<ffamily::Family, decode::F16>;
    case kBF16: return driver::matmul<ffamily::Family, decode::BF16>;
    default: return nullptr;
  }
}

size_t scratch_bytes(int ggml_type, int cols) {
  switch (type_info(ggml_type).act) {
    case ActFormat::kQ8_K:
      return std::max(driver::scratch_bytes<kfamily::Family>(cols), static_cast<size_t>(cols / 256) * kfamily::kAmxScratchPerBlock);
    case ActFormat::kQ8_0: return lfamily::scratch_bytes(cols);
    default: return 0;
  }
}

}  // namespace pocketmoe::avx2
