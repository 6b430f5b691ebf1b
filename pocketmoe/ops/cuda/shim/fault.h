// Turns a fault inside a kernel (SIGSEGV, SIGBUS, SIGFPE, and SIGILL: the trap of a misaligned access, which
// the shim's build checks as a GPU does) into an error the harness raises, instead of a crashed Python
// (cuda_shim.cpp only). While a launch runs, handlers on an alternate signal stack jump back
// to the launch (sigsetjmp there); afterwards the previous handlers and alternate stack are restored. Not
// used under AddressSanitizer, which reports faults itself.
#pragma once

#include <setjmp.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace pm_shim {
namespace {

constexpr int kNumFaultSignals = 4;
constexpr int kFaultSignals[kNumFaultSignals] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL};

struct FaultTrap {
  sigjmp_buf jump;
  volatile sig_atomic_t armed = 0;
  long tid = 0;
  int sig = 0;
  void* addr = nullptr;  // the faulting address (SIGILL: the trapping instruction's)
  struct sigaction old[kNumFaultSignals];
  stack_t old_stack;
  alignas(16) char alt_stack[64 * 1024];
};

FaultTrap g_trap;

void restore_fault_handlers() {
  for (int i = 0; i < kNumFaultSignals; ++i) sigaction(kFaultSignals[i], &g_trap.old[i], nullptr);
}

void on_fault(int sig, siginfo_t* info, void*) {
  if (g_trap.armed && syscall(SYS_gettid) == g_trap.tid) {
    g_trap.armed = 0;
    g_trap.sig = sig;
    g_trap.addr = info->si_addr;
    siglongjmp(g_trap.jump, 1);
  }
  restore_fault_handlers();  // another thread's fault: it faults again, into the handler it had before
}

void arm_fault_trap() {
  stack_t ss{};
  ss.ss_sp = g_trap.alt_stack;
  ss.ss_size = sizeof g_trap.alt_stack;
  sigaltstack(&ss, &g_trap.old_stack);
  struct sigaction sa{};
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  for (int i = 0; i < kNumFaultSignals; ++i) sigaction(kFaultSignals[i], &sa, &g_trap.old[i]);
  g_trap.tid = syscall(SYS_gettid);
  g_trap.armed = 1;
}

void disarm_fault_trap() {
  g_trap.armed = 0;
  restore_fault_handlers();
  sigaltstack(&g_trap.old_stack, nullptr);
}

}  // namespace
}  // namespace pm_shim
