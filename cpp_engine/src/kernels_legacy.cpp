#include "decode_legacy.h"
#include "driver.h"
#include "ffamily.h"
#include "kernels.h"
#include "lfamily.h"

namespace pocketmoe::kernels {

void matmul_q4_0(const MatmulTask& t) { lfamily::matmul<decode::Q4_0>(t); }
void matmul_q5_0(const MatmulTask& t) { lfamily::matmul<decode::Q5_0>(t); }
void matmul_q8_0(const MatmulTask& t) { lfamily::matmul<decode::Q8_0>(t); }
void matmul_mxfp4(const MatmulTask& t) { lfamily::matmul<decode::MXFP4>(t); }
void matmul_f32(const MatmulTask& t) { driver::matmul<ffamily::Family, decode::F32>(t); }
void matmul_f16(const MatmulTask& t) { driver::matmul<ffamily::Family, decode::F16>(t); }
void matmul_bf16(const MatmulTask& t) { driver::matmul<ffamily::Family, decode::BF16>(t); }

size_t lfamily_scratch_bytes(int cols) { return lfamily::scratch_bytes(cols); }

}  // namespace pocketmoe::kernels
