#include "decode_kquants.h"
#include "driver.h"
#include "kernels.h"
#include "kfamily.h"

namespace pocketmoe::kernels {

void matmul_q2_k(const MatmulTask& t) { driver::matmul<kfamily::Family, decode::Q2K>(t); }
void matmul_q3_k(const MatmulTask& t) { driver::matmul<kfamily::Family, decode::Q3K>(t); }
void matmul_q4_k(const MatmulTask& t) { driver::matmul<kfamily::Family, decode::Q4K>(t); }
void matmul_q5_k(const MatmulTask& t) { driver::matmul<kfamily::Family, decode::Q5K>(t); }
void matmul_q6_k(const MatmulTask& t) { driver::matmul<kfamily::Family, decode::Q6K>(t); }

size_t kfamily_scratch_bytes(int cols) { return driver::scratch_bytes<kfamily::Family>(cols); }

}  // namespace pocketmoe::kernels
