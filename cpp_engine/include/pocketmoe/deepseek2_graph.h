// A whole DeepSeek-V2 forward pass on the native kernels: one call per chunk of tokens, no Python
// between the ops. Weights are raw GGUF blocks owned by the caller (memory-mapped file views).
//
// Every op works on one token's row at a time or is batch-invariant (the GEMM kernels, the MoE op),
// and attention computes each (head, query) from the cache in one fixed order, so a token's logits
// are bitwise the same whether it came in a prefill chunk of any size or alone in decode.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "pocketmoe/engine.h"

namespace pocketmoe {

struct Engine;  // the locked pool and workspace (src/workspace.h)

// One weight as the kernels read it: [heads,] rows x cols values in rows of row_bytes bytes.
struct GraphLinear {
  const uint8_t* data = nullptr;
  int ggml_type = -1;
  int heads = 1;
  int rows = 0;
  int cols = 0;
  size_t row_bytes = 0;
  bool present() const { return data != nullptr; }
};

struct GraphFFN {  // down(silu(gate x) * up x)
  GraphLinear gate, up, down;
  bool present() const { return gate.present(); }
};

struct Deepseek2Layer {
  const float* attn_norm = nullptr;
  GraphLinear wq;                    // [H*(N+R), D], or the q LoRA pair below
  GraphLinear wq_a, wq_b;
  const float* q_a_norm = nullptr;
  GraphLinear wkv_a;                 // [C+R, D]
  const float* kv_a_norm = nullptr;
  GraphLinear k_b, v_b;              // [H, C, N], [H, V, C]
  GraphLinear wo;                    // [D, H*V]
  const float* ffn_norm = nullptr;
  GraphFFN dense;                    // leading dense layers
  GraphLinear router;                // [E, D]; MoE layers
  const float* router_bias = nullptr;  // [E], added for selection only
  MoEWeights experts_gate{}, experts_up{}, experts_down{};
  int expert_ffn = 0;
  GraphFFN shared;                   // shared experts, optional
};

struct Deepseek2Params {
  int hidden = 0, n_head = 0, qk_nope = 0, qk_rope = 0, v_head = 0, kv_lora = 0, q_lora = 0;
  float attn_scale = 0.0f, rms_eps = 0.0f;
  int n_experts = 0, top_k = 0, gating = 1, n_groups = 1, groups_used = 1;  // gating 1 softmax, 2 sigmoid
  bool weight_norm = false;
  float weight_scale = 1.0f;
};

// Where a forward's time goes, summed over calls until reset (the caller's wall clock, pool included).
struct GraphProfile {
  enum Op { kEmbed, kNorm, kQKV, kRopeCache, kKB, kAttention, kVB, kAttnOut, kRouter, kExperts, kShared, kDense,
            kHead, kCount };
  static const char* name(int op);
  std::array<double, kCount> seconds{};
  long long calls = 0;
  long long tokens = 0;
};

class Deepseek2Graph {
 public:
  // cache: [layers, n_ctx, kv_lora + qk_rope] float32, written at the positions each forward covers.
  Deepseek2Graph(const Deepseek2Params& params, std::vector<Deepseek2Layer> layers, GraphLinear embed,
                 const float* output_norm, GraphLinear head, float* cache, int n_ctx);

  // tokens [n] at positions start..start+n-1; cos2, sin2: [n, qk_rope] rotary tables of those positions
  // (cos per pair twice; -sin, +sin per pair). logits: [n, vocab], or [1, vocab] (the last token) with
  // last_only.
  void forward(const int32_t* tokens, int n, int start, const float* cos2, const float* sin2, bool last_only,
               float* logits);

  int vocab() const { return head_.rows; }
  const GraphProfile& profile() const { return profile_; }
  void reset_profile() { profile_ = GraphProfile{}; }
  int n_ctx() const { return n_ctx_; }

 private:
  void layer(Engine& e, const Deepseek2Layer& l, float* cache, int n, int start, const float* cos2,
             const float* sin2);
  void attention(Engine& e, const float* cache, int n, int start);
  void route(int n, const float* bias);
  void ffn(Engine& e, const GraphFFN& f, const float* x, int n, float* y);

  // Adds the time since the previous lap to an op (a steady_clock read: ~20 ns, ~15 per layer).
  struct Laps {
    GraphProfile& prof;
    std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();
    void lap(GraphProfile::Op op) {
      const auto now = std::chrono::steady_clock::now();
      prof.seconds[op] += std::chrono::duration<double>(now - last).count();
      last = now;
    }
  };

  Deepseek2Params p_;
  GraphProfile profile_;
  std::vector<Deepseek2Layer> layers_;
  GraphLinear embed_, head_;
  const float* output_norm_;
  float* cache_;
  int n_ctx_;
  int width_;                        // cached values per token per layer: kv_lora + qk_rope
  // Buffers sized for the largest chunk so far, reused by every call.
  std::vector<float> x_, xn_, q_, qa_, kv_, qn_, qlat_, qc_, olat_, ov_, oc_, t0_, t1_, t2_, t3_, rl_, ew_;
  std::vector<int32_t> ids_;
  std::vector<std::vector<float>> scores_;  // per pool thread: attention scores of one work item
};

}  // namespace pocketmoe
