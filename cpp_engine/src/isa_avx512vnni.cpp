// AVX-512 VNNI (EVEX-encoded vpdpbusd / vpdpwssd on 256-bit vectors, AVX512VL: Intel Cascade Lake,
// Ice Lake, Sapphire Rapids and later, AMD Zen 4 and later): the integer kernels, giving bitwise the
// AVX2 kernels' results. 256-bit vectors keep the kernels' shape (and so their float steps) and
// avoid the clock penalty of 512-bit ones on older Xeons.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
#define PM_ISA avx512vnni
#define PM_VNNI 1
#define PM_DPBUSD _mm256_dpbusd_epi32
#define PM_DPWSSD _mm256_dpwssd_epi32
#include "int_kernels.inc"
