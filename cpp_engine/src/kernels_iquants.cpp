#include "decode_iquants.h"
#include "driver.h"
#include "kernels.h"
#include "kfamily.h"

namespace pocketmoe::kernels {

void matmul_iq2_xxs(const MatmulTask& t) { driver::matmul<kfamily::Family, decode::IQ2XXS>(t); }
void matmul_iq1_m(const MatmulTask& t) { driver::matmul<kfamily::Family, decode::IQ1M>(t); }
void matmul_iq4_xs(const MatmulTask& t) { driver::matmul<kfamily::Family, decode::IQ4XS>(t); }

}  // namespace pocketmoe::kernels
