#include <pthread.h>

#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>

#include "pocketmoe/runtime.h"
#include "pocketmoe/isa.h"
#include "workspace.h"

namespace pocketmoe {
namespace {

Runtime& runtime_state() {
  static Runtime runtime;
  return runtime;
}

// fork() keeps only the calling thread: the child drops the parent's pool (its workers are gone)
// and its lock, and makes a new pool of the same size on first use.
void reset_after_fork() {
  Runtime& e = runtime_state();
  (void)e.pool.release();
  new (&e.mutex) std::mutex();
}

const int kForkHandler = pthread_atfork(nullptr, nullptr, reset_after_fork);

void ensure_pool(Runtime& e, int n_threads) {
  e.n_threads = n_threads;
  if (!e.pool || e.pool->size() != n_threads) {
    e.pool.reset();
    e.pool = std::make_unique<ThreadPool>(n_threads);
    e.ws.per_thread.resize(n_threads);
  }
}

}  // namespace

Buffer::~Buffer() { std::free(data_); }

uint8_t* Buffer::get(size_t n) {
  if (n > capacity_) {
    std::free(data_);
    const size_t cap = (n + 63) / 64 * 64;
    data_ = static_cast<uint8_t*>(std::aligned_alloc(64, cap));
    if (data_ == nullptr) {
      capacity_ = 0;
      throw std::bad_alloc();
    }
    capacity_ = cap;
  }
  return data_;
}

Runtime& acquire_runtime(std::unique_lock<std::mutex>& lock) {
  if (!cpu_supported())
    throw std::runtime_error("pocketmoe native kernels need a CPU with AVX2, FMA, F16C and BMI2; this one lacks them");
  Runtime& e = runtime_state();
  lock = std::unique_lock<std::mutex>(e.mutex);
  if (!e.pool) ensure_pool(e, e.n_threads > 0 ? e.n_threads : physical_core_count());
  return e;
}

void set_num_threads(int n) {
  if (n < 1) throw std::invalid_argument("set_num_threads: need at least 1 thread, got " + std::to_string(n));
  Runtime& e = runtime_state();
  std::lock_guard<std::mutex> lock(e.mutex);
  ensure_pool(e, n);
}

int get_num_threads() {
  Runtime& e = runtime_state();
  std::lock_guard<std::mutex> lock(e.mutex);
  return e.pool ? e.pool->size() : (e.n_threads > 0 ? e.n_threads : physical_core_count());
}

bool cpu_supported() {
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
           __builtin_cpu_supports("bmi2");
  }();
  return supported;
}

std::string describe() {
  if (!cpu_supported()) return "unsupported CPU (the native kernels need AVX2, FMA, F16C and BMI2)";
  const KernelIsa& isa = kernel_isa();
  std::string s = isa.name + " int8 kernels";
  if (!isa.note.empty()) s += " (" + isa.note + ")";
  return s + ", " + std::to_string(get_num_threads()) + " threads (" + std::to_string(physical_core_count()) +
         " physical cores)";
}

}  // namespace pocketmoe
