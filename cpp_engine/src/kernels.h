// Per-type matmul entry points (one translation unit per kernel family).
#pragma once

#include "pocketmoe/matmul.h"

namespace pocketmoe::kernels {

void matmul_q2_k(const MatmulTask& t);
void matmul_q3_k(const MatmulTask& t);
void matmul_q4_k(const MatmulTask& t);
void matmul_q5_k(const MatmulTask& t);
void matmul_q6_k(const MatmulTask& t);
void matmul_iq2_xxs(const MatmulTask& t);
void matmul_iq1_m(const MatmulTask& t);
void matmul_iq4_xs(const MatmulTask& t);
void matmul_q4_0(const MatmulTask& t);
void matmul_q5_0(const MatmulTask& t);
void matmul_q8_0(const MatmulTask& t);
void matmul_mxfp4(const MatmulTask& t);
void matmul_f32(const MatmulTask& t);
void matmul_f16(const MatmulTask& t);
void matmul_bf16(const MatmulTask& t);

size_t kfamily_scratch_bytes(int cols);
size_t lfamily_scratch_bytes(int cols);

}  // namespace pocketmoe::kernels
