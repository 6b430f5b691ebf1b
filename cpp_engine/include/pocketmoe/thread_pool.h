// A small fork-join pool: the caller plus n-1 std::thread workers that spin briefly, then sleep.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace pocketmoe {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  // Calls fn(item, thread) for every item in [0, n_items), spread over all threads (thread 0 is the
  // caller); returns when every item is done. Items are handed out dynamically.
  template <class F>
  void parallel_for(int n_items, F&& fn) {
    run(n_items, [](void* ctx, int item, int thread) { (*static_cast<F*>(ctx))(item, thread); }, &fn);
  }

 private:
  using ItemFn = void (*)(void*, int, int);
  void run(int n_items, ItemFn fn, void* ctx);
  // Claims and runs items of run `gen` until none is left (or a newer run has begun).
  void drain(uint32_t gen, int thread);
  void worker_main(int thread);

  int n_threads_;
  std::vector<std::thread> workers_;
  // The current run: written by the caller before it publishes `work_`, read by a worker only after
  // it has claimed an item of that run (the run cannot end, so they cannot change, until that item is done).
  ItemFn fn_ = nullptr;
  void* ctx_ = nullptr;
  std::atomic<int> n_items_{0};
  // (generation << 32) | next unclaimed item. A worker claims by CAS, so a worker that wakes late
  // never takes an item of a newer run by mistake, and the caller waits only for claimed items.
  std::atomic<uint64_t> work_{0};
  std::atomic<int> done_{0};
  uint32_t generation_ = 0;   // caller side only (runs are serialized by the engine lock)
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  std::condition_variable wake_;
};

int physical_core_count();

}  // namespace pocketmoe
