// The VNNI kernels compiled for a CPU without VNNI, so that this machine's tests run them: the same
// source as isa_avxvnni.cpp / isa_avx512vnni.cpp, with vpdpbusd and vpdpwssd taken from SIMDe's
// portable implementations (https://github.com/simd-everywhere/simde) instead of the instructions.
#include <simde/x86/avx512/dpbusd.h>
#include <simde/x86/avx512/dpwssd.h>

#define PM_ISA vnni_emu
#define PM_VNNI 1
#define PM_DPBUSD simde_mm256_dpbusd_epi32
#define PM_DPWSSD simde_mm256_dpwssd_epi32
#include "../src/int_kernels.inc"
