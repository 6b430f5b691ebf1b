// Matmuls straight from raw GGUF blocks: activation quantization (once per row), GEMV for a few tokens, and
// the grouped expert GEMM of prefill. Legend: T tokens, O output rows, I input columns, P (token, slot) pairs.
//
// Activations, as the CPU kernels take them (cpp_engine/src/act_quant.cpp): 32-value weight types and NVFP4
// read Q8_0 rows (int8 q [T, I], float d [T, I/32] rounded to fp16 after q is rounded with the fp32 scale,
// float s [T, I/32]), 256-value types read Q8_K rows (q [T, I], fp32 d [T, I/256], int16 sums of 16
// [T, I/16]); d = max|x| / 127 and q = round-to-nearest-even(x * (127 / max|x|)). s is llama.cpp's block_q8_1
// s: fp16(d32 * (exact sum of the block's 32 q)), d32 the fp32 scale before its fp16 rounding, kept unrounded
// where |d32 * sum| passes 65504 (llama.cpp would store inf). Float weights take the float rows x [T, I].
//
// Each output is one lane-level sequence over the blocks of its row (lane l takes blocks l, l + 32, ... of
// a 32-value type, the same 32-value halves of NVFP4's 64-value blocks; lanes 8j..8j+7 share super-block j,
// j + 4, ..., one group of 32 each, their integer sums added exactly before the float step), then a xor
// butterfly over the warp: no atomics, and the GEMV and the GEMM give bitwise the same value for the same row
// and activation row. Per block the float steps are those of the CPU kernels: acc = fma(float(int dot),
// dw * da, acc) (k-quants: d * da, then dmin * da for the min sum; Q4_1 / Q5_1: then acc = fma(m, s, acc), as
// llama.cpp's Q8_1 dot does; NVFP4: one step per 16 values, d_s * da, in order, as llama.cpp's CPU dot).
//
// Launch geometry (block = (B, 1, 1), B a multiple of 32, W = B / 32 warps):
//   quantize_q8_0 / quantize_q8_k (x's rows ld floats apart) and their quantize_swiglu_ forms: grid
//     (ceil(I / 32 / W) or ceil(I / 256 / W), T); one warp per block; q, d and s / sums contiguous.
//   gemv_<type>: grid (ceil(O / W), ceil(T / 8)); one warp per output row, up to 8 tokens per blockIdx.y.
//     y [T, O]; weight [O, row_bytes] contiguous.
//   moe_gemm_<type>: grid (ceil(O / (4 W)), any n >= 1, G); group g = blockIdx.z (with has_groups, g =
//     groups[blockIdx.z], the block exiting where it is -1: the step's non-empty groups only) reads expert weight
//     experts[g] ([O, row_bytes]) and pairs offsets[g] .. offsets[g + 1] - 1 of tokens[] / slots[], in tiles
//     of 8 pairs (blockIdx.y, + n, ...); the activation row of pair p is tokens[p] (act_by_pair = 0) or
//     tokens[p] * top_k + slots[p] (act_by_pair = 1); its output is y[tokens[p] * top_k + slots[p], :O].
//     With top_k = 0, slots[p] is the output row itself and tokens[p] any input row (pairs off a [T, K] grid).
//     Each warp takes 4 rows of the block's 4 W; a chunk of 1024 activation values of the tile's pairs is
//     staged in shared memory and read by every row.
#include "act_quant.cuh"
#include "gemm.cuh"

// ---- activation quantization ----

extern "C" __global__ void quantize_q8_0(const float* x, int ld, int8_t* q, float* d, float* s, int cols) {
  pmq::quantize_rows<32>(pmq::Plain{x, ld}, q, d, s, cols);
}

extern "C" __global__ void quantize_q8_k(const float* x, int ld, int8_t* q, float* d, int16_t* sums, int cols) {
  pmq::quantize_rows<256>(pmq::Plain{x, ld}, q, d, sums, cols);
}

// quantize_swiglu_*: the same of silu(g) * u (clamped with limit > 0) for gate and up in one buffer gu: row r's
// gate at gu + r * ld, its up u_off further on (act_quant.cuh Swiglu).
extern "C" __global__ void quantize_swiglu_q8_0(const float* gu, long long u_off, int ld, float limit, int8_t* q,
                                                float* d, float* s, int cols) {
  pmq::quantize_rows<32>(pmq::Swiglu{gu, u_off, ld, limit}, q, d, s, cols);
}

extern "C" __global__ void quantize_swiglu_q8_k(const float* gu, long long u_off, int ld, float limit, int8_t* q,
                                                float* d, int16_t* sums, int cols) {
  pmq::quantize_rows<256>(pmq::Swiglu{gu, u_off, ld, limit}, q, d, sums, cols);
}

// ---- GEMV: y [T, O] = x [T, I] W^T; xs: the Q8_0 rows' s (read by Q4_1 / Q5_1) or the Q8_K sums ----

extern "C" __global__ void gemv_q4_0(const uint8_t* w, const int8_t* xq, const float* xd, const float* xs,
                                    float* y, int rows, int cols, int n_tokens) {
  pmq::gemv_q<pmq::Q4_0>(w, xq, xd, xs, y, rows, cols, n_tokens);
}

extern "C" __global__ void gemv_q4_1(const uint8_t* w, const int8_t* xq, const float* xd, const float* xs,
                                    float* y, int rows, int cols, int n_tokens) {
  pmq::gemv_q<pmq::Q4_1>(w, xq, xd, xs, y, rows, cols, n_tokens);
}

extern "C" __global__ void gemv_q5_0(const uint8_t* w, const int8_t* xq, const float* xd, const float* xs,
                                    float* y, int rows, int cols, int n_tokens) {
  pmq::gemv_q<pmq::Q5_0>(w, xq, xd, xs, y, rows, cols, n_tokens);
}

extern "C" __global__ void gemv_q5_1(const uint8_t* w, const int8_t* xq, const float* xd, const float* xs,
                                    float* y, int rows, int cols, int n_tokens) {
  pmq::gemv_q<pmq::Q5_1>(w, xq, xd, xs, y, rows, cols, n_tokens);
}

extern "C" __global__ void gemv_q8_0(const uint8_t* w, const int8_t* xq, const float* xd, const float* xs,
                                    float* y, int rows, int cols, int n_tokens) {
  pmq::gemv_q<pmq::Q8_0>(w, xq, xd, xs, y, rows, cols, n_tokens);
}

extern "C" __global__ void gemv_iq4_nl(const uint8_t* w, const int8_t* xq, const float* xd, const float* xs,
                                      float* y, int rows, int cols, int n_tokens) {
  pmq::gemv_q<pmq::IQ4NL>(w, xq, xd, xs, y, rows, cols, n_tokens);
}

extern "C" __global__ void gemv_mxfp4(const uint8_t* w, const int8_t* xq, const float* xd, const float* xs,
                                     float* y, int rows, int cols, int n_tokens) {
  pmq::gemv_q<pmq::MXFP4>(w, xq, xd, xs, y, rows, cols, n_tokens);
}

extern "C" __global__ void gemv_nvfp4(const uint8_t* w, const int8_t* xq, const float* xd, const float* xs,
                                     float* y, int rows, int cols, int n_tokens) {
  pmq::gemv_q<pmq::NVFP4>(w, xq, xd, xs, y, rows, cols, n_tokens);
}

extern "C" __global__ void gemv_q1_0(const uint8_t* w, const int8_t* xq, const float* xd, const float* xs, float* y,
                                    int rows, int cols, int n_tokens) {
  pmq::gemv_q<pmq::Q1_0>(w, xq, xd, xs, y, rows, cols, n_tokens);
}

extern "C" __global__ void gemv_q2_k(const uint8_t* w, const int8_t* xq, const float* xd, const int16_t* xs,
                                    float* y, int rows, int cols, int n_tokens) {
  pmq::gemv_q<pmq::Q2K>(w, xq, xd, xs, y, rows, cols, n_tokens);
}

extern "C" __global__ void gemv_q3_k(const uint8_t* w, const int8_t* xq, const float* xd, const int16_t* xs,
                                    float* y, int rows, int cols, int n_tokens) {
  pmq::gemv_q<pmq::Q3K>(w, xq, xd, xs, y, rows, cols, n_tokens);
}

extern "C" __global__ void gemv_q4_k(const uint8_t* w, const int8_t* xq, const float* xd, const int16_t* xs,
                                    float* y, int rows, int cols, int n_tokens) {
  pmq::gemv_q<pmq::Q4K>(w, xq, xd, xs, y, rows, cols, n_tokens);
}

extern "C" __global__ void gemv_q5_k(const uint8_t* w, const int8_t* xq, const float* xd, const int16_t* xs,
                                    float* y, int rows, int cols, int n_tokens) {
  pmq::gemv_q<pmq::Q5K>(w, xq, xd, xs, y, rows, cols, n_tokens);
}

extern "C" __global__ void gemv_q6_k(const uint8_t* w, const int8_t* xq, const float* xd, const int16_t* xs,
                                    float* y, int rows, int cols, int n_tokens) {
  pmq::gemv_q<pmq::Q6K>(w, xq, xd, xs, y, rows, cols, n_tokens);
}

extern "C" __global__ void gemv_iq2_xxs(const uint8_t* w, const int8_t* xq, const float* xd, const int16_t* xs,
                                       float* y, int rows, int cols, int n_tokens) {
  pmq::gemv_q<pmq::IQ2XXS>(w, xq, xd, xs, y, rows, cols, n_tokens);
}

extern "C" __global__ void gemv_iq3_xxs(const uint8_t* w, const int8_t* xq, const float* xd, const int16_t* xs,
                                       float* y, int rows, int cols, int n_tokens) {
  pmq::gemv_q<pmq::IQ3XXS>(w, xq, xd, xs, y, rows, cols, n_tokens);
}

extern "C" __global__ void gemv_iq1_s(const uint8_t* w, const int8_t* xq, const float* xd, const int16_t* xs,
                                     float* y, int rows, int cols, int n_tokens) {
  pmq::gemv_q<pmq::IQ1S>(w, xq, xd, xs, y, rows, cols, n_tokens);
}

extern "C" __global__ void gemv_iq2_xs(const uint8_t* w, const int8_t* xq, const float* xd, const int16_t* xs,
                                       float* y, int rows, int cols, int n_tokens) {
  pmq::gemv_q<pmq::IQ2XS>(w, xq, xd, xs, y, rows, cols, n_tokens);
}

extern "C" __global__ void gemv_iq2_s(const uint8_t* w, const int8_t* xq, const float* xd, const int16_t* xs,
                                      float* y, int rows, int cols, int n_tokens) {
  pmq::gemv_q<pmq::IQ2S>(w, xq, xd, xs, y, rows, cols, n_tokens);
}

extern "C" __global__ void gemv_iq3_s(const uint8_t* w, const int8_t* xq, const float* xd, const int16_t* xs,
                                      float* y, int rows, int cols, int n_tokens) {
  pmq::gemv_q<pmq::IQ3S>(w, xq, xd, xs, y, rows, cols, n_tokens);
}

extern "C" __global__ void gemv_iq1_m(const uint8_t* w, const int8_t* xq, const float* xd, const int16_t* xs,
                                     float* y, int rows, int cols, int n_tokens) {
  pmq::gemv_q<pmq::IQ1M>(w, xq, xd, xs, y, rows, cols, n_tokens);
}

extern "C" __global__ void gemv_iq4_xs(const uint8_t* w, const int8_t* xq, const float* xd, const int16_t* xs,
                                      float* y, int rows, int cols, int n_tokens) {
  pmq::gemv_q<pmq::IQ4XS>(w, xq, xd, xs, y, rows, cols, n_tokens);
}

extern "C" __global__ void gemv_tq2_0(const uint8_t* w, const int8_t* xq, const float* xd, const int16_t* xs,
                                     float* y, int rows, int cols, int n_tokens) {
  pmq::gemv_q<pmq::TQ20>(w, xq, xd, xs, y, rows, cols, n_tokens);
}

extern "C" __global__ void gemv_tq1_0(const uint8_t* w, const int8_t* xq, const float* xd, const int16_t* xs,
                                     float* y, int rows, int cols, int n_tokens) {
  pmq::gemv_q<pmq::TQ10>(w, xq, xd, xs, y, rows, cols, n_tokens);
}

extern "C" __global__ void gemv_f32(const uint8_t* w, const float* x, float* y, int rows, int cols, int n_tokens) {
  pmq::gemv_f<pmq::F32>(w, x, y, rows, cols, n_tokens);
}

extern "C" __global__ void gemv_f16(const uint8_t* w, const float* x, float* y, int rows, int cols, int n_tokens) {
  pmq::gemv_f<pmq::F16>(w, x, y, rows, cols, n_tokens);
}

extern "C" __global__ void gemv_bf16(const uint8_t* w, const float* x, float* y, int rows, int cols, int n_tokens) {
  pmq::gemv_f<pmq::BF16>(w, x, y, rows, cols, n_tokens);
}

// ---- grouped expert GEMM: y [P, O], one row per (token, slot) ----

extern "C" __global__ void moe_gemm_q4_0(const uint8_t* const* experts, const int32_t* offsets,
                                        const int32_t* tokens, const int32_t* slots, const int8_t* xq,
                                        const float* xd, const float* xs, float* y, int rows, int cols,
                                        int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  pmq::moe_gemm_q<pmq::Q4_0>(experts, offsets, tokens, slots, xq, xd, xs, y, rows, cols, top_k, act_by_pair, groups,
                             has_groups);
}

extern "C" __global__ void moe_gemm_q4_1(const uint8_t* const* experts, const int32_t* offsets,
                                        const int32_t* tokens, const int32_t* slots, const int8_t* xq,
                                        const float* xd, const float* xs, float* y, int rows, int cols,
                                        int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  pmq::moe_gemm_q<pmq::Q4_1>(experts, offsets, tokens, slots, xq, xd, xs, y, rows, cols, top_k, act_by_pair, groups,
                             has_groups);
}

extern "C" __global__ void moe_gemm_q5_0(const uint8_t* const* experts, const int32_t* offsets,
                                        const int32_t* tokens, const int32_t* slots, const int8_t* xq,
                                        const float* xd, const float* xs, float* y, int rows, int cols,
                                        int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  pmq::moe_gemm_q<pmq::Q5_0>(experts, offsets, tokens, slots, xq, xd, xs, y, rows, cols, top_k, act_by_pair, groups,
                             has_groups);
}

extern "C" __global__ void moe_gemm_q5_1(const uint8_t* const* experts, const int32_t* offsets,
                                        const int32_t* tokens, const int32_t* slots, const int8_t* xq,
                                        const float* xd, const float* xs, float* y, int rows, int cols,
                                        int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  pmq::moe_gemm_q<pmq::Q5_1>(experts, offsets, tokens, slots, xq, xd, xs, y, rows, cols, top_k, act_by_pair, groups,
                             has_groups);
}

extern "C" __global__ void moe_gemm_q8_0(const uint8_t* const* experts, const int32_t* offsets,
                                        const int32_t* tokens, const int32_t* slots, const int8_t* xq,
                                        const float* xd, const float* xs, float* y, int rows, int cols,
                                        int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  pmq::moe_gemm_q<pmq::Q8_0>(experts, offsets, tokens, slots, xq, xd, xs, y, rows, cols, top_k, act_by_pair, groups,
                             has_groups);
}

extern "C" __global__ void moe_gemm_iq4_nl(const uint8_t* const* experts, const int32_t* offsets,
                                          const int32_t* tokens, const int32_t* slots, const int8_t* xq,
                                          const float* xd, const float* xs, float* y, int rows, int cols,
                                          int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  pmq::moe_gemm_q<pmq::IQ4NL>(experts, offsets, tokens, slots, xq, xd, xs, y, rows, cols, top_k, act_by_pair, groups,
                             has_groups);
}

extern "C" __global__ void moe_gemm_mxfp4(const uint8_t* const* experts, const int32_t* offsets,
                                         const int32_t* tokens, const int32_t* slots, const int8_t* xq,
                                         const float* xd, const float* xs, float* y, int rows, int cols,
                                         int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  pmq::moe_gemm_q<pmq::MXFP4>(experts, offsets, tokens, slots, xq, xd, xs, y, rows, cols, top_k, act_by_pair, groups,
                             has_groups);
}

extern "C" __global__ void moe_gemm_nvfp4(const uint8_t* const* experts, const int32_t* offsets,
                                         const int32_t* tokens, const int32_t* slots, const int8_t* xq,
                                         const float* xd, const float* xs, float* y, int rows, int cols,
                                         int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  pmq::moe_gemm_q<pmq::NVFP4>(experts, offsets, tokens, slots, xq, xd, xs, y, rows, cols, top_k, act_by_pair, groups,
                             has_groups);
}

extern "C" __global__ void moe_gemm_q1_0(const uint8_t* const* experts, const int32_t* offsets,
                                        const int32_t* tokens, const int32_t* slots, const int8_t* xq,
                                        const float* xd, const float* xs, float* y, int rows, int cols,
                                        int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  pmq::moe_gemm_q<pmq::Q1_0>(experts, offsets, tokens, slots, xq, xd, xs, y, rows, cols, top_k, act_by_pair, groups,
                             has_groups);
}

extern "C" __global__ void moe_gemm_q2_k(const uint8_t* const* experts, const int32_t* offsets,
                                        const int32_t* tokens, const int32_t* slots, const int8_t* xq,
                                        const float* xd, const int16_t* xs, float* y, int rows, int cols,
                                        int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  pmq::moe_gemm_q<pmq::Q2K>(experts, offsets, tokens, slots, xq, xd, xs, y, rows, cols, top_k, act_by_pair, groups,
                           has_groups);
}

extern "C" __global__ void moe_gemm_q3_k(const uint8_t* const* experts, const int32_t* offsets,
                                        const int32_t* tokens, const int32_t* slots, const int8_t* xq,
                                        const float* xd, const int16_t* xs, float* y, int rows, int cols,
                                        int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  pmq::moe_gemm_q<pmq::Q3K>(experts, offsets, tokens, slots, xq, xd, xs, y, rows, cols, top_k, act_by_pair, groups,
                           has_groups);
}

extern "C" __global__ void moe_gemm_q4_k(const uint8_t* const* experts, const int32_t* offsets,
                                        const int32_t* tokens, const int32_t* slots, const int8_t* xq,
                                        const float* xd, const int16_t* xs, float* y, int rows, int cols,
                                        int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  pmq::moe_gemm_q<pmq::Q4K>(experts, offsets, tokens, slots, xq, xd, xs, y, rows, cols, top_k, act_by_pair, groups,
                           has_groups);
}

extern "C" __global__ void moe_gemm_q5_k(const uint8_t* const* experts, const int32_t* offsets,
                                        const int32_t* tokens, const int32_t* slots, const int8_t* xq,
                                        const float* xd, const int16_t* xs, float* y, int rows, int cols,
                                        int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  pmq::moe_gemm_q<pmq::Q5K>(experts, offsets, tokens, slots, xq, xd, xs, y, rows, cols, top_k, act_by_pair, groups,
                           has_groups);
}

extern "C" __global__ void moe_gemm_q6_k(const uint8_t* const* experts, const int32_t* offsets,
                                        const int32_t* tokens, const int32_t* slots, const int8_t* xq,
                                        const float* xd, const int16_t* xs, float* y, int rows, int cols,
                                        int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  pmq::moe_gemm_q<pmq::Q6K>(experts, offsets, tokens, slots, xq, xd, xs, y, rows, cols, top_k, act_by_pair, groups,
                           has_groups);
}

extern "C" __global__ void moe_gemm_iq2_xxs(const uint8_t* const* experts, const int32_t* offsets,
                                           const int32_t* tokens, const int32_t* slots, const int8_t* xq,
                                           const float* xd, const int16_t* xs, float* y, int rows, int cols,
                                           int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  pmq::moe_gemm_q<pmq::IQ2XXS>(experts, offsets, tokens, slots, xq, xd, xs, y, rows, cols, top_k, act_by_pair, groups,
                              has_groups);
}

extern "C" __global__ void moe_gemm_iq3_xxs(const uint8_t* const* experts, const int32_t* offsets,
                                           const int32_t* tokens, const int32_t* slots, const int8_t* xq,
                                           const float* xd, const int16_t* xs, float* y, int rows, int cols,
                                           int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  pmq::moe_gemm_q<pmq::IQ3XXS>(experts, offsets, tokens, slots, xq, xd, xs, y, rows, cols, top_k, act_by_pair, groups,
                              has_groups);
}

extern "C" __global__ void moe_gemm_iq1_s(const uint8_t* const* experts, const int32_t* offsets,
                                         const int32_t* tokens, const int32_t* slots, const int8_t* xq,
                                         const float* xd, const int16_t* xs, float* y, int rows, int cols,
                                         int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  pmq::moe_gemm_q<pmq::IQ1S>(experts, offsets, tokens, slots, xq, xd, xs, y, rows, cols, top_k, act_by_pair, groups,
                             has_groups);
}

extern "C" __global__ void moe_gemm_iq2_xs(const uint8_t* const* experts, const int32_t* offsets,
                                           const int32_t* tokens, const int32_t* slots, const int8_t* xq,
                                           const float* xd, const int16_t* xs, float* y, int rows, int cols,
                                           int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  pmq::moe_gemm_q<pmq::IQ2XS>(experts, offsets, tokens, slots, xq, xd, xs, y, rows, cols, top_k, act_by_pair, groups,
                             has_groups);
}

extern "C" __global__ void moe_gemm_iq2_s(const uint8_t* const* experts, const int32_t* offsets,
                                          const int32_t* tokens, const int32_t* slots, const int8_t* xq,
                                          const float* xd, const int16_t* xs, float* y, int rows, int cols,
                                          int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  pmq::moe_gemm_q<pmq::IQ2S>(experts, offsets, tokens, slots, xq, xd, xs, y, rows, cols, top_k, act_by_pair, groups,
                             has_groups);
}

extern "C" __global__ void moe_gemm_iq3_s(const uint8_t* const* experts, const int32_t* offsets,
                                          const int32_t* tokens, const int32_t* slots, const int8_t* xq,
                                          const float* xd, const int16_t* xs, float* y, int rows, int cols,
                                          int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  pmq::moe_gemm_q<pmq::IQ3S>(experts, offsets, tokens, slots, xq, xd, xs, y, rows, cols, top_k, act_by_pair, groups,
                             has_groups);
}

extern "C" __global__ void moe_gemm_iq1_m(const uint8_t* const* experts, const int32_t* offsets,
                                         const int32_t* tokens, const int32_t* slots, const int8_t* xq,
                                         const float* xd, const int16_t* xs, float* y, int rows, int cols,
                                         int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  pmq::moe_gemm_q<pmq::IQ1M>(experts, offsets, tokens, slots, xq, xd, xs, y, rows, cols, top_k, act_by_pair, groups,
                             has_groups);
}

extern "C" __global__ void moe_gemm_iq4_xs(const uint8_t* const* experts, const int32_t* offsets,
                                          const int32_t* tokens, const int32_t* slots, const int8_t* xq,
                                          const float* xd, const int16_t* xs, float* y, int rows, int cols,
                                          int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  pmq::moe_gemm_q<pmq::IQ4XS>(experts, offsets, tokens, slots, xq, xd, xs, y, rows, cols, top_k, act_by_pair, groups,
                             has_groups);
}

extern "C" __global__ void moe_gemm_tq2_0(const uint8_t* const* experts, const int32_t* offsets,
                                         const int32_t* tokens, const int32_t* slots, const int8_t* xq,
                                         const float* xd, const int16_t* xs, float* y, int rows, int cols,
                                         int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  pmq::moe_gemm_q<pmq::TQ20>(experts, offsets, tokens, slots, xq, xd, xs, y, rows, cols, top_k, act_by_pair, groups,
                             has_groups);
}

extern "C" __global__ void moe_gemm_tq1_0(const uint8_t* const* experts, const int32_t* offsets,
                                         const int32_t* tokens, const int32_t* slots, const int8_t* xq,
                                         const float* xd, const int16_t* xs, float* y, int rows, int cols,
                                         int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  pmq::moe_gemm_q<pmq::TQ10>(experts, offsets, tokens, slots, xq, xd, xs, y, rows, cols, top_k, act_by_pair, groups,
                             has_groups);
}

extern "C" __global__ void moe_gemm_f32(const uint8_t* const* experts, const int32_t* offsets,
                                       const int32_t* tokens, const int32_t* slots, const float* x, float* y, int rows,
                                       int cols, int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  pmq::moe_gemm_f<pmq::F32>(experts, offsets, tokens, slots, x, y, rows, cols, top_k, act_by_pair, groups, has_groups);
}

extern "C" __global__ void moe_gemm_f16(const uint8_t* const* experts, const int32_t* offsets,
                                       const int32_t* tokens, const int32_t* slots, const float* x, float* y, int rows,
                                       int cols, int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  pmq::moe_gemm_f<pmq::F16>(experts, offsets, tokens, slots, x, y, rows, cols, top_k, act_by_pair, groups, has_groups);
}

extern "C" __global__ void moe_gemm_bf16(const uint8_t* const* experts, const int32_t* offsets,
                                        const int32_t* tokens, const int32_t* slots, const float* x, float* y, int rows,
                                        int cols, int top_k, int act_by_pair, const int32_t* groups, int has_groups) {
  pmq::moe_gemm_f<pmq::BF16>(experts, offsets, tokens, slots, x, y, rows, cols, top_k, act_by_pair, groups, has_groups);
}
