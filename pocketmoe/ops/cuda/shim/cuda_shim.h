// CPU execution shim for the package's CUDA C: the same .cu text compiles with g++ and runs on the host.
//
// Every CUDA thread of a block is a fiber (cuda_shim.cpp); blocks run one after another. __syncthreads() and
// the __shfl_*_sync() calls are scheduling points where the scheduler checks that the whole block (or all 32
// lanes of the warp) arrived at the same call, and reports divergence or deadlock otherwise. Static
// __shared__ variables live in the linker section "pm_shim_shared", which is poisoned (0xFF bytes: NaN for
// float and half) at the start of every block, as is the dynamic shared memory. The harness
// (pocketmoe/testing/cuda_shim.py) rewrites `extern __shared__ T name[];` in the sources it is given into a
// pointer to the dynamic buffer; that form is not supported in headers the sources include. The harness builds
// with -fsanitize=alignment trapping: a load or store through a pointer not aligned to its type, which x86
// would carry out and a GPU stops (cudaErrorMisalignedAddress), is a fault here too (fault.h).
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <type_traits>

#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __constant__
#undef __forceinline__
#undef __noinline__
#undef __launch_bounds__
#undef __align__
#define __global__
#define __device__
#define __host__
#define __constant__ const
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ __attribute__((section("pm_shim_shared"), aligned(16), used)) static

namespace pm_shim {

enum Shuffle : int { SHFL_IDX = 0, SHFL_UP = 1, SHFL_DOWN = 2, SHFL_XOR = 3, SHFL_NONE = 4 };

extern uint3 g_thread_idx, g_block_idx;
extern dim3 g_block_dim, g_grid_dim;
extern unsigned char g_dynamic_shared[];

void barrier(const char* file, int line);
// Exchanges 8 bytes with the other lanes of the warp; returns what this lane receives.
uint64_t shuffle(int kind, unsigned mask, uint64_t value, int arg, int width, const char* file, int line);

template <class T>
inline T shuffle_value(int kind, unsigned mask, T value, int arg, int width, const char* file, int line) {
  static_assert(sizeof(T) <= 8, "shuffles move values of at most 8 bytes");
  uint64_t bits = 0;
  memcpy(&bits, &value, sizeof(T));
  asm volatile("" ::: "memory");
  bits = shuffle(kind, mask, bits, arg, width, file, line);
  asm volatile("" ::: "memory");
  T out;
  memcpy(&out, &bits, sizeof(T));
  return out;
}

inline void barrier_point(const char* file, int line) {
  asm volatile("" ::: "memory");  // shared memory written by other fibers must be re-read after the barrier
  barrier(file, line);
  asm volatile("" ::: "memory");
}

}  // namespace pm_shim

#define threadIdx (static_cast<const uint3&>(::pm_shim::g_thread_idx))
#define blockIdx (static_cast<const uint3&>(::pm_shim::g_block_idx))
#define blockDim (static_cast<const dim3&>(::pm_shim::g_block_dim))
#define gridDim (static_cast<const dim3&>(::pm_shim::g_grid_dim))
#define warpSize 32

#define __syncthreads() ::pm_shim::barrier_point(__FILE__, __LINE__)
#define __syncwarp(...) ((void)::pm_shim::shuffle_value(::pm_shim::SHFL_NONE, 0xffffffffu, 0, 0, 32, __FILE__, __LINE__))
#define PM_SHIM_SHFL(kind, mask, var, arg, ...) \
  ::pm_shim::shuffle_value((kind), (mask), (var), (arg), pm_shim_width(__VA_ARGS__), __FILE__, __LINE__)
#define __shfl_sync(mask, var, ...) PM_SHIM_SHFL(::pm_shim::SHFL_IDX, mask, var, __VA_ARGS__, 32)
#define __shfl_up_sync(mask, var, ...) PM_SHIM_SHFL(::pm_shim::SHFL_UP, mask, var, __VA_ARGS__, 32)
#define __shfl_down_sync(mask, var, ...) PM_SHIM_SHFL(::pm_shim::SHFL_DOWN, mask, var, __VA_ARGS__, 32)
#define __shfl_xor_sync(mask, var, ...) PM_SHIM_SHFL(::pm_shim::SHFL_XOR, mask, var, __VA_ARGS__, 32)

// The optional width argument: PM_SHIM_SHFL appends a default 32; the first of the remaining values wins.
inline int pm_shim_width(int width, ...) { return width; }

// Signed int8x4 dot product plus accumulator.
inline int __dp4a(int a, int b, int c) {
  unsigned int acc = static_cast<unsigned int>(c);  // wraps on overflow, as the hardware does
  for (int i = 0; i < 4; ++i)
    acc += static_cast<unsigned int>(static_cast<int8_t>(a >> (8 * i)) * static_cast<int8_t>(b >> (8 * i)));
  return static_cast<int>(acc);
}
inline unsigned int __dp4a(unsigned int a, unsigned int b, unsigned int c) {
  for (int i = 0; i < 4; ++i) c += ((a >> (8 * i)) & 0xffu) * ((b >> (8 * i)) & 0xffu);
  return c;
}

inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
// one rounding each (the shim compiles with -ffp-contract=off, so nothing fuses them)
inline float __fmul_rn(float x, float y) { return x * y; }
inline float __fadd_rn(float x, float y) { return x + y; }
inline float __saturatef(float x) { return fminf(fmaxf(x, 0.0f), 1.0f); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline void __sincosf(float x, float* s, float* c) { *s = sinf(x); *c = cosf(x); }
inline int __float_as_int(float x) { int i; memcpy(&i, &x, 4); return i; }
inline float __int_as_float(int i) { float x; memcpy(&x, &i, 4); return x; }
inline unsigned int __float_as_uint(float x) { unsigned int i; memcpy(&i, &x, 4); return i; }
inline float __uint_as_float(unsigned int i) { float x; memcpy(&x, &i, 4); return x; }
inline int __float2int_rn(float x) { return static_cast<int>(nearbyintf(x)); }
inline int __float2int_rz(float x) { return static_cast<int>(x); }
inline int __mul24(int a, int b) { return a * b; }
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
template <class T>
inline T __ldg(const T* p) { return *p; }

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
