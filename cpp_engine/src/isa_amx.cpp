// AMX-INT8 (Intel Sapphire Rapids and later) on top of AVX-512 VNNI: the 32-value types' repacked
// (prefill) rows go through AMX tiles (TDPBSSD), sixteen tokens x sixteen rows of exact integer dots
// per instruction, and the 256-value types' through TDPBSSD / TDPBUSD (kfamily_amx.h), then the same
// float steps as every other build; every other kernel is the AVX-512 VNNI set's. Results are
// bitwise the AVX2 kernels'.
#if defined(__clang__) ? __clang_major__ >= 14 : __GNUC__ >= 12
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,amx-tile,amx-int8")
// GCC 12's AVX-512 headers: see isa_avx512vnni.cpp.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define PM_ISA amx
#define PM_VNNI 1
#define PM_AVX512 1
#define PM_AMX 1
#define PM_DPBUSD _mm256_dpbusd_epi32
#define PM_DPWSSD _mm256_dpwssd_epi32
#include "amx_kernels.inc"
#else
// The compiler cannot target AMX: no kernels, and the dispatcher skips the set.
#include "kernels.h"
namespace pocketmoe::amx {
MatmulFn integer_kernel(int) { return nullptr; }
}  // namespace pocketmoe::amx
#endif
