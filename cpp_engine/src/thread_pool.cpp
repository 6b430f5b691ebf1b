#include "pocketmoe/thread_pool.h"

#include <immintrin.h>
#include <sched.h>

#include <chrono>
#include <fstream>
#include <set>
#include <string>
#include <utility>

namespace pocketmoe {
namespace {

// How long an idle worker spins before it sleeps: long enough to cover the Python between two native
// calls and between two decode tokens (~0.3 ms on the 452M bench model), so a decode step does not wake a
// sleeping worker (with 100 us, a replayed decode step ran 0.15-0.3 ms slower inside decode than alone).
// Torch runs with one thread beside the native ops, so the spin takes no core from it.
constexpr auto kSpin = std::chrono::microseconds(2000);

// Item index of a closed run: past any n_items, so drain() claims nothing.
constexpr uint64_t kClosed = 0x7fffffff;

int read_int(const std::string& path) {
  std::ifstream f(path);
  int v = -1;
  f >> v;
  return v;
}

}  // namespace

int physical_core_count() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) {
    const unsigned n = std::thread::hardware_concurrency();
    return n ? static_cast<int>(n) : 1;
  }
  std::set<std::pair<int, int>> cores;
  int cpus = 0;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &set)) continue;
    ++cpus;
    const std::string dir = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
    const int package = read_int(dir + "physical_package_id"), core = read_int(dir + "core_id");
    cores.insert(core < 0 ? std::make_pair(-1, cpu) : std::make_pair(package, core));
  }
  return cores.empty() ? (cpus ? cpus : 1) : static_cast<int>(cores.size());
}

ThreadPool::ThreadPool(int n_threads) : n_threads_(n_threads < 1 ? 1 : n_threads) {
  for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { worker_main(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_.store(true);
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::drain(uint32_t gen, int thread) {
  uint64_t cur = work_.load();
  for (;;) {
    if (static_cast<uint32_t>(cur >> 32) != gen) return;
    const int item = static_cast<int>(static_cast<uint32_t>(cur));
    if (item >= n_items_.load(std::memory_order_relaxed)) return;
    if (!work_.compare_exchange_weak(cur, cur + 1)) continue;
    fn_(ctx_, item, thread);
    done_.fetch_add(1);
    cur = work_.load();
  }
}

void ThreadPool::run(int n_items, ItemFn fn, void* ctx) {
  if (n_items <= 0) return;
  if (workers_.empty() || n_items == 1) {
    for (int i = 0; i < n_items; ++i) fn(ctx, i, 0);
    return;
  }
  // Close the last run before touching its fields: a worker still inside drain() of that run may hold a
  // stale `cur` whose CAS would otherwise succeed against a larger n_items_, run an item of this run
  // under the old generation and count it in done_ twice over (the caller then waited forever).
  // The closed generation has nothing to claim (item index kClosed).
  work_.store((uint64_t{++generation_} << 32) | kClosed);
  fn_ = fn;
  ctx_ = ctx;
  n_items_.store(n_items);
  done_.store(0);
  const uint32_t gen = ++generation_;
  work_.store(uint64_t{gen} << 32);
  if (sleeping_.load() > 0) {
    { std::lock_guard<std::mutex> lock(mutex_); }
    wake_.notify_all();
  }
  drain(gen, 0);
  // Every item is claimed: wait only for those a worker is still running (a worker that has not
  // woken yet claims nothing). They finish within microseconds unless the OS parked one; then yield.
  const auto spin_until = std::chrono::steady_clock::now() + kSpin;
  for (int spins = 1; done_.load() != n_items; ++spins) {
    if (spins % 64 != 0 || std::chrono::steady_clock::now() < spin_until) {
      _mm_pause();
    } else {
      std::this_thread::yield();
    }
  }
}

void ThreadPool::worker_main(int thread) {
  uint32_t seen = 0;
  const auto current = [this] { return static_cast<uint32_t>(work_.load() >> 32); };
  for (;;) {
    const auto spin_until = std::chrono::steady_clock::now() + kSpin;
    int spins = 0;
    while (current() == seen && !stop_.load()) {
      _mm_pause();
      if (++spins % 64 == 0 && std::chrono::steady_clock::now() > spin_until) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleeping_.fetch_add(1);
        wake_.wait(lock, [&] { return current() != seen || stop_.load(); });
        sleeping_.fetch_sub(1);
      }
    }
    if (stop_.load()) return;
    seen = current();
    drain(seen, thread);
  }
}

}  // namespace pocketmoe
