// Fiber contexts for the shim's scheduler (cuda_shim.cpp only): stacks with a guard page, and a switch.
//
// On x86-64 a context is a stack pointer: pm_shim_switch pushes the callee-saved registers, the x87 control
// word and MXCSR, swaps stacks and pops the other context's (a few nanoseconds). Elsewhere, or with
// -DPM_SHIM_UCONTEXT, a ucontext and swapcontext (which makes a system call per switch).
#pragma once

#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <new>

namespace pm_shim {
namespace {

#if defined(__x86_64__) && !defined(PM_SHIM_UCONTEXT)
#define PM_SHIM_FAST_SWITCH 1
struct Context {
  void* sp = nullptr;
};
extern "C" void pm_shim_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .p2align 4
  .type pm_shim_switch,@function
pm_shim_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  fnstcw (%rsp)
  stmxcsr 8(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  fldcw (%rsp)
  ldmxcsr 8(%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size pm_shim_switch,.-pm_shim_switch
)");
#else
struct Context {
  ucontext_t uc;
};
#endif

inline void switch_context(Context& save, Context& load) {
#ifdef PM_SHIM_FAST_SWITCH
  pm_shim_switch(&save.sp, load.sp);
#else
  swapcontext(&save.uc, &load.uc);
#endif
}

// Makes `c` enter `entry` (which must never return) on the stack [stack, stack + bytes) at the next switch.
inline void init_context(Context& c, char* stack, size_t bytes, void (*entry)()) {
#ifdef PM_SHIM_FAST_SWITCH
  // The frame pm_shim_switch pops: x87 control word and MXCSR, r15..r12, rbx, rbp, then the return address.
  uint64_t* sp = reinterpret_cast<uint64_t*>(stack + bytes) - 10;  // stack + bytes is 16-byte aligned
  uint16_t fcw;
  uint32_t mxcsr;
  asm volatile("fnstcw %0" : "=m"(fcw));
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  memset(sp, 0, 10 * sizeof(uint64_t));
  memcpy(&sp[0], &fcw, sizeof fcw);
  memcpy(&sp[1], &mxcsr, sizeof mxcsr);
  sp[8] = reinterpret_cast<uint64_t>(entry);  // at top - 16: after `ret`, rsp % 16 == 8 as after a call
  c.sp = sp;
#else
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
#endif
}

inline size_t page_bytes() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

// A stack of `bytes` above one inaccessible guard page (an overflow faults instead of corrupting a
// neighbour; the harness builds with -fstack-clash-protection so large frames probe page by page).
inline char* map_stack(size_t bytes) {
  void* p = mmap(nullptr, bytes + page_bytes(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  mprotect(p, page_bytes(), PROT_NONE);
  return static_cast<char*>(p) + page_bytes();
}

}  // namespace
}  // namespace pm_shim
