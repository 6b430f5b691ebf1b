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
  void drain(int thread);
  void worker_main(int thread);

  int n_threads_;
  std::vector<std::thread> workers_;
  ItemFn fn_ = nullptr;
  void* ctx_ = nullptr;
  int n_items_ = 0;
  std::atomic<int> next_item_{0};
  std::atomic<int> busy_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  std::condition_variable wake_;
};

int physical_core_count();

}  // namespace pocketmoe
