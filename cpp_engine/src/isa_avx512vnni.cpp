// AVX-512 VNNI (EVEX-encoded vpdpbusd / vpdpwssd, AVX512VL/BW/DQ: Intel Cascade Lake, Ice Lake,
// Sapphire Rapids and later, AMD Zen 4 and later): the integer kernels, giving bitwise the AVX2
// kernels' results. The on-the-fly (decode) kernels stay on 256-bit vectors, which keep their shape
// and avoid the clock penalty of 512-bit ones on older Xeons; the repacked (prefill) tiles, which
// are compute-bound, use 512-bit vectors (PM_AVX512) and still form the 256-bit kernels' integers.
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")
// GCC 12's own AVX-512 headers fill unused lanes from _mm512_undefined_*(), a self-initialized
// variable that -Wall reports as uninitialized in every caller.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define PM_ISA avx512vnni
#define PM_VNNI 1
#define PM_AVX512 1
#define PM_DPBUSD _mm256_dpbusd_epi32
#define PM_DPWSSD _mm256_dpwssd_epi32
#include "int_kernels.inc"
