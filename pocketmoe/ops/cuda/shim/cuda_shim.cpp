// The scheduler of the CPU execution shim (see cuda_shim.h): one fiber per CUDA thread of a block, blocks in
// order. A round runs every runnable thread (lowest id first, or highest first with order=1) until its next
// scheduling point; after the round, warps whose 32 lanes wait at the same shuffle exchange values, and a
// block whose live threads all wait at the same __syncthreads() is released. Anything else is an error. With
// order=2 (3: highest first) the warps run one at a time instead, each until it waits at a barrier (run_block).
#include "cuda_shim.h"

#include <dlfcn.h>
#include <stdio.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "fault.h"
#include "fiber.h"

#ifdef PM_SHIM_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

extern "C" unsigned char __start_pm_shim_shared[], __stop_pm_shim_shared[];  // from the linker

namespace pm_shim {

uint3 g_thread_idx, g_block_idx;
dim3 g_block_dim, g_grid_dim;
// What a launch may ask for without cudaFuncSetAttribute(MaxDynamicSharedMemorySize), which the engine's
// launcher (CuPy RawModule) never sets: 48 KiB on every architecture.
constexpr long long kMaxDynamicShared = 48 * 1024;
alignas(256) unsigned char g_dynamic_shared[kMaxDynamicShared];
// Keeps the section (and so its start/stop symbols) present when no kernel declares __shared__ variables.
__attribute__((section("pm_shim_shared"), aligned(16))) unsigned char g_shared_anchor[16];

namespace {

enum State { RUNNABLE, AT_BARRIER, AT_SHUFFLE, DONE };
enum Result { OK = 0, BAD_LAUNCH = 1, DIVERGENCE = 2, DEADLOCK = 3, BAD_CALL = 4, FAULT = 5, SANITIZER = 6 };

#ifdef PM_SHIM_ASAN
constexpr size_t kStackBytes = 512 * 1024;
#else
constexpr size_t kStackBytes = 64 * 1024;
#endif

struct Fiber {
  Context ctx;
  char* stack = nullptr;  // usable stack, above one guard page
  bool started = false;   // its context is inside the kernel loop (else it needs makecontext)
  State state = DONE;
  uint3 tid;
  const char* file = "";
  int line = 0, kind = 0, arg = 0, width = 32;
  unsigned mask = 0;
  uint64_t in = 0, out = 0;
  void* fake_stack = nullptr;
};

struct Run {
  const char* kernel = "";
  void (*entry)(void* const*) = nullptr;
  void* const* args = nullptr;
  Fiber fibers[1024];  // fixed: a suspended fiber's frames hold references to its own entry
  int mapped = 0;      // fibers[0, mapped) have stacks
  int nthreads = 0, current = -1;
  Context sched;
  const void* sched_stack_bottom = nullptr;
  size_t sched_stack_size = 0;
  int code = OK;
  std::string error;
};

Run g_run;
std::mutex g_mutex;

void fiber_main();

void switch_to_scheduler(Fiber& f, bool exiting) {
#ifdef PM_SHIM_ASAN
  __sanitizer_start_switch_fiber(exiting ? nullptr : &f.fake_stack, g_run.sched_stack_bottom, g_run.sched_stack_size);
#else
  (void)exiting;
#endif
  switch_context(f.ctx, g_run.sched);
#ifdef PM_SHIM_ASAN
  __sanitizer_finish_switch_fiber(f.fake_stack, &g_run.sched_stack_bottom, &g_run.sched_stack_size);
#endif
}

void fiber_main() {  // never returns
#ifdef PM_SHIM_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &g_run.sched_stack_bottom, &g_run.sched_stack_size);
#endif
  for (;;) {  // each pass is one CUDA thread of one block; the scheduler resumes it for the next block
    g_run.entry(g_run.args);
    Fiber& f = g_run.fibers[g_run.current];
    f.state = DONE;
    switch_to_scheduler(f, false);
  }
}

void resume(int i) {
  Fiber& f = g_run.fibers[i];
  g_run.current = i;
  g_thread_idx = f.tid;
  if (!f.started) {
    init_context(f.ctx, f.stack, kStackBytes, fiber_main);
    f.started = true;
  }
#ifdef PM_SHIM_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f.stack, kStackBytes);
#endif
  switch_context(g_run.sched, f.ctx);
#ifdef PM_SHIM_ASAN
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  g_run.current = -1;
}

void ensure_fibers(int n) {
  for (; g_run.mapped < n; ++g_run.mapped) g_run.fibers[g_run.mapped].stack = map_stack(kStackBytes);
}

const char* sync_name(const Fiber& f) {
  if (f.state == AT_BARRIER) return "__syncthreads()";
  static const char* names[] = {"__shfl_sync()", "__shfl_up_sync()", "__shfl_down_sync()", "__shfl_xor_sync()",
                                "__syncwarp()"};
  return names[f.kind];
}

std::string where(const Fiber& f) {
  if (f.state == DONE) return "have exited";
  return std::string("wait at ") + sync_name(f) + " (" + f.file + ":" + std::to_string(f.line) + ")";
}

std::string dims(const uint3& v) {
  return "(" + std::to_string(v.x) + "," + std::to_string(v.y) + "," + std::to_string(v.z) + ")";
}

// "threads 0-31 wait at __syncthreads() (x.cu:12), threads 32-63 have exited" over the threads [lo, hi).
std::string groups(int lo, int hi) {
  std::map<std::tuple<int, int, const char*, int>, std::vector<int>> by_place;
  for (int i = lo; i < hi; ++i) {
    const Fiber& f = g_run.fibers[i];
    by_place[{f.state, f.state == AT_SHUFFLE ? f.kind : -1, f.file, f.line}].push_back(i);
  }
  std::string out;
  for (auto& [key, ids] : by_place) {
    std::string ranges;
    for (size_t a = 0; a < ids.size();) {
      size_t b = a;
      while (b + 1 < ids.size() && ids[b + 1] == ids[b] + 1) ++b;
      ranges += (ranges.empty() ? "" : ",") + std::to_string(ids[a]) + (b > a ? "-" + std::to_string(ids[b]) : "");
      a = b + 1;
    }
    out += (out.empty() ? "" : "; ") + std::string(ids.size() > 1 ? "threads " : "thread ") + ranges + " " +
           where(g_run.fibers[ids[0]]);
  }
  return out;
}

void fail(int code, const std::string& what) {
  if (g_run.code != OK) return;
  g_run.code = code;
  g_run.error = std::string("kernel '") + g_run.kernel + "' block " + dims(g_block_idx) + ": " + what;
}

bool same_place(const Fiber& a, const Fiber& b) {
  return a.state == b.state && a.line == b.line && strcmp(a.file, b.file) == 0 &&
         (a.state != AT_SHUFFLE || (a.kind == b.kind && a.width == b.width));
}

void exchange(Fiber* lanes) {
  uint64_t in[32];
  for (int l = 0; l < 32; ++l) in[l] = lanes[l].in;
  for (int l = 0; l < 32; ++l) {
    Fiber& f = lanes[l];
    const int segmask = 32 - f.width, min_lane = l & segmask;
    const int max_lane = min_lane | ((f.kind == SHFL_UP ? 0 : 31) & ~segmask);
    int j = l;
    bool ok = false;
    switch (f.kind) {
      case SHFL_IDX: j = min_lane | (f.arg & 31 & ~segmask); ok = j <= max_lane; break;
      case SHFL_UP: j = l - f.arg; ok = j >= max_lane; break;
      case SHFL_DOWN: j = l + f.arg; ok = j <= max_lane; break;
      case SHFL_XOR: j = l ^ f.arg; ok = j <= max_lane; break;
      default: break;
    }
    f.out = ok ? in[j] : in[l];
    f.state = RUNNABLE;
  }
}

// Exchanges the values of warp w when its 32 lanes all wait at one shuffle (true); false when they do not (or
// wait at different ones: divergence, recorded).
bool resolve_warp(int w) {
  Fiber* lanes = &g_run.fibers[32 * w];
  for (int l = 0; l < 32; ++l)
    if (lanes[l].state != AT_SHUFFLE) return false;
  for (int l = 1; l < 32; ++l)
    if (!same_place(lanes[0], lanes[l])) {
      fail(DIVERGENCE, "divergence in warp " + std::to_string(w) + ": " + groups(32 * w, 32 * w + 32) +
                           "; all 32 lanes must reach the same shuffle");
      return false;
    }
  exchange(lanes);
  return true;
}

// Resolves every warp whose lanes all wait at one shuffle; false when none could.
bool resolve_shuffles() {
  bool progress = false;
  for (int w = 0; w < g_run.nthreads / 32 && g_run.code == OK; ++w) progress |= resolve_warp(w);
  return progress && g_run.code == OK;
}

// Releases the barrier when every live thread waits at the same one; otherwise records why not.
bool resolve_barrier() {
  int live = 0, first = -1, done = 0;
  bool all_barrier = true;
  for (int i = 0; i < g_run.nthreads; ++i) {
    const Fiber& f = g_run.fibers[i];
    if (f.state == DONE) { ++done; continue; }
    ++live;
    if (first < 0) first = i;
    if (f.state != AT_BARRIER) all_barrier = false;
  }
  if (live == 0) return false;
  if (all_barrier) {
    bool same = done == 0;
    for (int i = first; i < g_run.nthreads && same; ++i)
      same = g_run.fibers[i].state == DONE || same_place(g_run.fibers[first], g_run.fibers[i]);
    if (!same) {
      fail(DIVERGENCE, "divergence at a barrier: " + groups(0, g_run.nthreads) +
                           "; every thread of the block must reach the same __syncthreads()");
      return false;
    }
    for (int i = 0; i < g_run.nthreads; ++i) g_run.fibers[i].state = RUNNABLE;
    return true;
  }
  for (int w = 0; w < g_run.nthreads; w += 32) {  // a warp part at a shuffle, part elsewhere
    bool shuffle = false, exited = false;
    for (int l = w; l < w + 32; ++l) {
      shuffle |= g_run.fibers[l].state == AT_SHUFFLE;
      exited |= g_run.fibers[l].state == DONE;
    }
    if (shuffle && exited) {
      fail(DIVERGENCE, "divergence in warp " + std::to_string(w / 32) + ": " + groups(w, w + 32) +
                           "; all 32 lanes must reach the same shuffle");
      return false;
    }
  }
  fail(DEADLOCK, "deadlock, no thread can proceed: " + groups(0, g_run.nthreads));
  return false;
}

std::string fault_description() {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(g_trap.addr);
  std::string who = g_run.current >= 0 ? "thread " + dims(g_run.fibers[g_run.current].tid) : "the shim";
  for (const Fiber& f : g_run.fibers)
    if (addr + page_bytes() >= reinterpret_cast<uintptr_t>(f.stack) && addr < reinterpret_cast<uintptr_t>(f.stack))
      return who + " overflowed its " + std::to_string(kStackBytes / 1024) +
             " KiB stack (local arrays too large for a CUDA thread?)";
  char hex[32];
  snprintf(hex, sizeof hex, "0x%lx", static_cast<unsigned long>(addr));
  if (g_trap.sig == SIGFPE) return who + " raised an arithmetic exception (integer division by zero?)";
  if (g_trap.sig == SIGILL) {
    // The build traps on a load or store through a pointer not aligned to its type (-fsanitize=alignment): x86
    // would read it, a GPU stops the kernel with cudaErrorMisalignedAddress.
    Dl_info where{};
    char at[256];
    if (dladdr(g_trap.addr, &where) && where.dli_sname)
      snprintf(at, sizeof at, "%s+0x%lx", where.dli_sname,
               static_cast<unsigned long>(addr - reinterpret_cast<uintptr_t>(where.dli_saddr)));
    else
      snprintf(at, sizeof at, "%s", hex);
    return who + " made a misaligned load or store (in " + at + "): a value read or written at an address " +
           "not a multiple of its type's alignment, which the GPU stops with cudaErrorMisalignedAddress";
  }
  return who + (g_trap.sig == SIGBUS ? " got SIGBUS" : " accessed invalid memory") + " at address " + hex +
         " (a null or out-of-bounds pointer?); ShimModule(..., sanitize=True) shows where";
}

#ifdef PM_SHIM_ASAN
// With -fsanitize-recover=address and ASAN_OPTIONS=halt_on_error=0 a report does not end the process: the
// launch finishes and fails with the first report, naming the thread that made it.
void on_asan_report(const char* report) {
  if (g_run.code != OK) return;
  std::string who = g_run.current >= 0 ? "thread " + dims(g_run.fibers[g_run.current].tid) : "the shim";
  std::string text(report);
  const size_t summary = text.find("SUMMARY:");
  const size_t from = summary == std::string::npos ? 0 : summary + 9;  // past "SUMMARY: "
  fail(SANITIZER, who + ": " + text.substr(from, std::min(text.find('\n', from), from + 2000) - from) +
                      " (the full report is on stderr)");
}
#endif

unsigned char g_poison = 0xff;  // the byte shared memory is filled with at the start of every block

void poison_shared(long long dynamic_bytes) {
  memset(__start_pm_shim_shared, g_poison, static_cast<size_t>(__stop_pm_shim_shared - __start_pm_shim_shared));
#ifdef PM_SHIM_ASAN
  // Past the launch's dynamic size is out of bounds, as on the device.
  ASAN_UNPOISON_MEMORY_REGION(g_dynamic_shared, kMaxDynamicShared);
  ASAN_POISON_MEMORY_REGION(g_dynamic_shared + dynamic_bytes, kMaxDynamicShared - dynamic_bytes);
#endif
  memset(g_dynamic_shared, g_poison, static_cast<size_t>(dynamic_bytes));
}

// Runs threads [lo, hi) of the block once each, up to their next scheduling point (highest first if reverse).
bool run_round(int lo, int hi, bool reverse) {
  for (int k = lo; k < hi; ++k) {
    const int i = reverse ? hi - 1 - (k - lo) : k;
    if (g_run.fibers[i].state == RUNNABLE) resume(i);
    if (g_run.code != OK) return false;
  }
  return true;
}

// The schedules (order bits): without ORDER_WARPS every thread takes one step per round, the warps side by
// side; with it each warp runs (its shuffles resolved as it goes) until it waits at a barrier or exits before
// the next warp starts: the unfairest schedule a GPU may pick, which shows a warp reading shared memory that
// another warp writes, or overwriting it while another still reads, with no barrier between. ORDER_REVERSE:
// highest thread (and warp) ids first.
constexpr int ORDER_REVERSE = 1, ORDER_WARPS = 2;

void run_block(int order) {
  const dim3 b = g_block_dim;
  for (int i = 0; i < g_run.nthreads; ++i) {
    Fiber& f = g_run.fibers[i];
    f.tid = make_uint3(i % b.x, (i / b.x) % b.y, i / (b.x * b.y));
    f.state = RUNNABLE;
  }
  const bool reverse = order & ORDER_REVERSE;
  const int nwarps = g_run.nthreads / 32;
  for (;;) {
    if (order & ORDER_WARPS) {
      for (int k = 0; k < nwarps; ++k) {
        const int w = reverse ? nwarps - 1 - k : k;
        do {
          if (!run_round(32 * w, 32 * w + 32, reverse)) return;
        } while (resolve_warp(w));
        if (g_run.code != OK) return;
      }
    } else if (!run_round(0, g_run.nthreads, reverse)) {
      return;
    }
    if (resolve_shuffles()) continue;
    if (g_run.code != OK || !resolve_barrier()) return;
  }
}

std::string check_launch(const long long* grid, const long long* block, long long shared_bytes) {
  const long long gmax[3] = {2147483647LL, 65535, 65535}, bmax[3] = {1024, 1024, 64};
  const char* axis = "xyz";
  for (int a = 0; a < 3; ++a) {
    if (grid[a] < 1 || grid[a] > gmax[a])
      return "grid." + std::string(1, axis[a]) + " is " + std::to_string(grid[a]) + "; it must be in 1.." +
             std::to_string(gmax[a]);
    if (block[a] < 1 || block[a] > bmax[a])
      return "block." + std::string(1, axis[a]) + " is " + std::to_string(block[a]) + "; it must be in 1.." +
             std::to_string(bmax[a]);
  }
  const long long n = block[0] * block[1] * block[2];
  if (n > 1024) return "the block has " + std::to_string(n) + " threads; at most 1024 are allowed";
  if (block[0] % 32 != 0)
    return "blockDim.x is " + std::to_string(block[0]) + "; it must be a multiple of 32 (whole warps)";
  if (shared_bytes < 0 || shared_bytes > kMaxDynamicShared)
    return "shared_mem is " + std::to_string(shared_bytes) + " bytes; it must be in 0.." +
           std::to_string(kMaxDynamicShared) + " (more needs cudaFuncSetAttribute, which the launcher does not call)";
  return "";
}

}  // namespace

void barrier(const char* file, int line) {
  Fiber& f = g_run.fibers[g_run.current];
  f.state = AT_BARRIER;
  f.file = file;
  f.line = line;
  switch_to_scheduler(f, false);
  g_thread_idx = f.tid;
}

uint64_t shuffle(int kind, unsigned mask, uint64_t value, int arg, int width, const char* file, int line) {
  Fiber& f = g_run.fibers[g_run.current];
  if (mask != 0xffffffffu && g_run.code == OK)
    fail(BAD_CALL, "thread " + dims(f.tid) + " calls a shuffle with mask 0x" + [&] {
      char hex[16];
      snprintf(hex, sizeof hex, "%08x", mask);
      return std::string(hex);
    }() + " (" + file + ":" + std::to_string(line) + "); only the full mask 0xffffffff is supported");
  if ((width < 1 || width > 32 || (width & (width - 1)) != 0) && g_run.code == OK)
    fail(BAD_CALL, "thread " + dims(f.tid) + " calls a shuffle with width " + std::to_string(width) + " (" +
                       file + ":" + std::to_string(line) + "); it must be a power of two up to 32");
  f.state = AT_SHUFFLE;
  f.kind = kind;
  f.mask = mask;
  f.in = value;
  f.arg = arg;
  f.width = width;
  f.file = file;
  f.line = line;
  switch_to_scheduler(f, false);
  g_thread_idx = f.tid;
  return f.out;
}

}  // namespace pm_shim

using namespace pm_shim;

// The poison byte: 0xFF (the default) reads as NaN in float and half, which most arithmetic carries to the
// result but fmaxf and fminf drop; 0x7F reads as 3.4e38 in float and bf16 and as a large positive integer,
// which they keep.
extern "C" void pm_shim_set_poison(int byte) { pm_shim::g_poison = static_cast<unsigned char>(byte); }

// Runs the whole grid; 0 on success, else a Result code with a one-sentence message in err.
extern "C" int pm_shim_launch(const char* kernel, void (*entry)(void* const*), const long long* grid,
                              const long long* block, long long shared_bytes, void* const* args, int order, char* err,
                              int err_len) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_run.kernel = kernel;
  g_run.code = OK;
  g_run.error.clear();
  const std::string bad = check_launch(grid, block, shared_bytes);
  if (!bad.empty()) {
    g_run.code = BAD_LAUNCH;
    g_run.error = "bad launch of kernel '" + std::string(kernel) + "': " + bad;
  } else {
    g_run.entry = entry;
    g_run.args = args;
    g_run.nthreads = static_cast<int>(block[0] * block[1] * block[2]);
    ensure_fibers(g_run.nthreads);
    g_grid_dim = dim3(grid[0], grid[1], grid[2]);
    g_block_dim = dim3(block[0], block[1], block[2]);
    g_run.current = -1;
#ifdef PM_SHIM_ASAN
    __asan_set_error_report_callback(on_asan_report);
#else
    arm_fault_trap();
    if (sigsetjmp(g_trap.jump, 1) != 0)
      fail(FAULT, fault_description());
    else
#endif
      for (long long z = 0; z < grid[2] && g_run.code == OK; ++z)
        for (long long y = 0; y < grid[1] && g_run.code == OK; ++y)
          for (long long x = 0; x < grid[0] && g_run.code == OK; ++x) {
            g_block_idx = make_uint3(x, y, z);
            poison_shared(shared_bytes);
            run_block(order);
          }
#ifndef PM_SHIM_ASAN
    disarm_fault_trap();
#endif
    if (g_run.code != OK)  // the block's fibers stopped mid-kernel: start them afresh next time
      for (Fiber& f : g_run.fibers) f.started = false;
  }
  snprintf(err, static_cast<size_t>(err_len), "%s", g_run.error.c_str());
  return g_run.code;
}
