// Entry points of the native CPU kernels: one thread pool and one reusable workspace per process (the runtime).
#pragma once

#include <cstdint>
#include <string>

namespace pocketmoe {

// y[T, rows] = x[T, cols] @ W^T, W given as GGUF blocks: rows of row_bytes bytes.
void gemm(const uint8_t* weight, int rows, size_t row_bytes, int ggml_type, const float* x, int n_tokens,
          int cols, float* y);

// y[h] = x[h] @ W[h]^T for h < heads, in one pool dispatch (per-head weights such as DeepSeek MLA's
// attn_k_b / attn_v_b). W: [heads, rows, row_bytes] GGUF blocks; x: [heads, T, cols]; y: [heads, T, rows].
// y[h] is bitwise what gemm(W[h], x[h]) gives.
void gemm_batched(const uint8_t* weight, int heads, int rows, size_t row_bytes, int ggml_type, const float* x,
                  int n_tokens, int cols, float* y);

struct MoEWeights {
  const uint8_t* data;   // expert 0's [out_features, row_bytes] GGUF blocks
  size_t nbytes;         // bytes from data to the end of the last expert
  int ggml_type;
  // Bytes from one expert to the next; 0: out_features * row_bytes (experts packed). Larger when the
  // tensor is one half of a fused [E, 2 * ffn, row_bytes] gate_up tensor.
  size_t expert_stride = 0;
};

// y[t] = sum over k = 0..K-1 of weights[t, k] * down_e(silu(gate_e x[t]) * up_e x[t]), e = ids[t, k],
// accumulated in fp32 in slot order. x, y: [T, hidden]; ids, weights: [T, K]. With swiglu_limit L > 0
// the SwiGLU is clamped (DeepSeek-V4, as llama.cpp does): silu(min(gate, L)) * clamp(up, -L, L).
void moe_forward(const float* x, int n_tokens, int hidden, const int32_t* ids, const float* weights,
                 int top_k, const MoEWeights& gate, const MoEWeights& up, const MoEWeights& down,
                 int n_experts, int ffn, float* y, float swiglu_limit = 0.0f);

void set_num_threads(int n);
int get_num_threads();

bool cpu_supported();          // AVX2, FMA, F16C and BMI2 present
std::string describe();

}  // namespace pocketmoe
