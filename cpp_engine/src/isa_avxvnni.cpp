// AVX-VNNI (VEX-encoded vpdpbusd / vpdpwssd: Intel Alder Lake and later, AMD Zen 5): the integer
// kernels on 256-bit vectors, giving bitwise the AVX2 kernels' results.
#if defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11
#pragma GCC target("avxvnni")
#define PM_ISA avxvnni
#define PM_VNNI 1
#define PM_DPBUSD _mm256_dpbusd_avx_epi32
#define PM_DPWSSD _mm256_dpwssd_avx_epi32
#include "int_kernels.inc"
#else
// The compiler cannot target AVX-VNNI: no kernels, and the dispatcher skips the set.
#include "kernels.h"
namespace pocketmoe::avxvnni {
MatmulFn integer_kernel(int) { return nullptr; }
}  // namespace pocketmoe::avxvnni
#endif
