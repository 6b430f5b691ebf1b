// The AVX-512 VNNI kernels, 512-bit repacked tiles included, compiled for a CPU without AVX-512, so
// that this machine's tests run them: the same source as isa_avx512vnni.cpp, with every _mm512_*
// intrinsic and vpdpbusd / vpdpwssd taken from SIMDe's portable implementations
// (https://github.com/simd-everywhere/simde; its native aliases map the Intel names onto them).
#include "simde_avx512.h"

#define PM_ISA avx512_emu
#define PM_VNNI 1
#define PM_AVX512 1
#define PM_AVX512_EMULATED 1
#define PM_DPBUSD simde_mm256_dpbusd_epi32
#define PM_DPWSSD simde_mm256_dpwssd_epi32
#include "../src/int_kernels.inc"
