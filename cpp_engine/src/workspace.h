// Process-wide kernel runtime: the thread pool and buffers that grow to the largest call and stay.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "pocketmoe/thread_pool.h"
#include "pocketmoe/types.h"

namespace pocketmoe {

class Buffer {
 public:
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept : data_(o.data_), capacity_(o.capacity_) { o.data_ = nullptr, o.capacity_ = 0; }
  ~Buffer();
  // At least n bytes, 64-byte aligned; previous contents are not kept when it grows.
  uint8_t* get(size_t n);
  template <class T>
  T* get_as(size_t count) {
    return reinterpret_cast<T*>(get(count * sizeof(T)));
  }

 private:
  uint8_t* data_ = nullptr;
  size_t capacity_ = 0;
};

struct Workspace {
  Buffer acts[2];
  Buffer act_ptrs[3];   // row pointers: [0] Q8_K / generic, [1] Q8_0, [2] float rows (gemm_multi)
  Buffer slot_rows[2];   // moe_forward: gate's / up's activation rows copied per sorted slot
  Buffer hidden;
  Buffer hidden_ptrs;
  Buffer ints;
  std::vector<Buffer> per_thread;   // one scratch area per pool thread
};

struct Runtime {
  std::mutex mutex;                 // one call at a time owns the pool and workspace
  std::unique_ptr<ThreadPool> pool;
  int n_threads = 0;                // requested size; 0 = one per physical core
  Workspace ws;
};

// The runtime, locked by `lock`; creates the pool on first use.
Runtime& acquire_runtime(std::unique_lock<std::mutex>& lock);

// The entry points of runtime.h for a caller that already holds the runtime (an op runs
// many of them under one lock). They use e.ws.acts, act_ptrs, hidden, hidden_ptrs, ints, per_thread.
struct MoEWeights;
void gemm(Runtime& e, const uint8_t* weight, int rows, size_t row_bytes, int ggml_type, const float* x, int n_tokens,
          int cols, float* y);
// Several weights applied to the same x [T, cols] in one pool dispatch, x quantized once per format;
// op.y gets [T, op.rows], bitwise what gemm gives for that weight alone.
struct GemmOp {
  const uint8_t* weight;
  int rows;
  size_t row_bytes;
  int ggml_type;
  float* y;
};
void gemm_multi(Runtime& e, const GemmOp* ops, int n_ops, const float* x, int n_tokens, int cols);

// x [n_rows, cols] quantized to `format` in buf, act_row_bytes(format, cols) bytes a row, on the caller
// alone or spread over the pool; returns the first row.
uint8_t* quantize_rows(ThreadPool& pool, Buffer& buf, ActFormat format, const float* x, int n_rows, int cols,
                       bool on_caller);
void gemm_batched(Runtime& e, const uint8_t* weight, int heads, int rows, size_t row_bytes, int ggml_type,
                  const float* x, int n_tokens, int cols, float* y);
// A dense gated FFN on moe_forward's tokens (DeepSeek's shared experts), run inside its two pool dispatches:
// gate and up [ffn, hidden] beside the routed experts' gate and up, down [hidden, ffn] beside their down.
// y [T, hidden] gets bitwise what gated_ffn gives; the SwiGLU limit does not apply to it. Without gate and
// up, h [T, ffn] is down's input, made by the caller (DeepSeek-V4's clamped SwiGLU): y = down h.
struct Weight;
struct SharedFFN {
  const Weight* gate;
  const Weight* up;
  const Weight* down;
  float* y;
  const float* h = nullptr;
};
void moe_forward(Runtime& e, const float* x, int n_tokens, int hidden, const int32_t* ids, const float* weights,
                 int top_k, const MoEWeights& gate, const MoEWeights& up, const MoEWeights& down, int n_experts,
                 int ffn, float* y, float swiglu_limit = 0.0f, const SharedFFN* shared = nullptr);

}  // namespace pocketmoe
