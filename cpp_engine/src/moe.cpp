// Routed experts of one MoE layer: gate/up per (expert, ffn row block), then down per hidden row
// block over all experts, combined per token in slot order. The shared experts, when given, take
// part in both dispatches (gate/up per (row block, token chunk), down beside the routed downs).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "pocketmoe/act_quant.h"
#include "pocketmoe/runtime.h"
#include "pocketmoe/matmul.h"
#include "pocketmoe/ops.h"
#include "pocketmoe/silu.h"
#include "pocketmoe/types.h"
#include "workspace.h"

namespace pocketmoe {
namespace {

int round_up(int v, int m) { return (v + m - 1) / m * m; }

// The shared expert's tokens per kernel call, as gemm's: one call's activations stay in L2.
constexpr int kSharedTokenChunk = 256;

// Rows per work item: about 8 items per thread, a multiple of `align`, at most max(align, cap).
int block_rows(int total_rows, int rows, int threads, int align, int cap) {
  const int want = round_up((total_rows + threads * 8 - 1) / (threads * 8), align);
  return std::min(round_up(rows, align), std::max(align, std::min(want, cap)));
}

struct Routing {
  int* count;      // [E] pairs per expert
  int* offset;     // [E + 1] first sorted slot of each expert
  int* pair;       // [T*K] sorted slot -> pair t*K + k (by expert, then pair)
  int* slot;       // [T*K] pair -> sorted slot
  int* active;     // [E] experts with at least one pair, ascending
  int n_active;
};

Routing route(const int32_t* ids, int n_pairs, int n_experts, Buffer& ints) {
  const size_t ne = static_cast<size_t>(n_experts), np = static_cast<size_t>(n_pairs);
  int* base = ints.get_as<int>(4 * ne + 1 + 2 * np);
  Routing r{base, base + ne, base + 2 * ne + 1, base + 2 * ne + 1 + np, base + 2 * ne + 1 + 2 * np, 0};
  int* next = r.active + ne;
  std::fill(r.count, r.count + n_experts, 0);
  for (int p = 0; p < n_pairs; ++p) {
    if (ids[p] < 0 || ids[p] >= n_experts)
      throw std::invalid_argument("moe_forward: expert id " + std::to_string(ids[p]) + " at position " +
                                  std::to_string(p) + " is outside [0, " + std::to_string(n_experts) + ")");
    ++r.count[ids[p]];
  }
  r.offset[0] = 0;
  for (int e = 0; e < n_experts; ++e) {
    r.offset[e + 1] = r.offset[e] + r.count[e];
    next[e] = r.offset[e];
    if (r.count[e] > 0) r.active[r.n_active++] = e;
  }
  for (int p = 0; p < n_pairs; ++p) {
    const int s = next[ids[p]]++;
    r.pair[s] = p;
    r.slot[p] = s;
  }
  return r;
}

struct ExpertLayout {
  size_t row_bytes;
  size_t stride;  // bytes from one expert to the next
};

// Row bytes and expert stride, after checking that the weight holds n_experts of [rows, cols].
ExpertLayout checked_layout(const char* what, const MoEWeights& w, int n_experts, int rows, int cols) {
  const TypeInfo& t = type_info(w.ggml_type);
  const size_t row_bytes = weight_row_bytes(t, cols);
  const size_t expert = static_cast<size_t>(rows) * row_bytes;
  const size_t stride = w.expert_stride ? w.expert_stride : expert;
  const size_t want = static_cast<size_t>(n_experts - 1) * stride + expert;
  if (stride < expert)
    throw std::invalid_argument(std::string("moe_forward: ") + what + " experts are " + std::to_string(stride) +
                                " bytes apart, less than one expert's " + std::to_string(expert));
  if (w.data == nullptr || (w.expert_stride ? w.nbytes < want : w.nbytes != want))
    throw std::invalid_argument(std::string("moe_forward: ") + what + " holds " + std::to_string(w.nbytes) +
                                " bytes; " + std::to_string(n_experts) + " experts of [" + std::to_string(rows) +
                                ", " + std::to_string(cols) + "] " + t.name + " need " + std::to_string(want));
  return {row_bytes, stride};
}

}  // namespace

void moe_forward(const float* x, int n_tokens, int hidden, const int32_t* ids, const float* weights, int top_k,
                 const MoEWeights& gate, const MoEWeights& up, const MoEWeights& down, int n_experts, int ffn,
                 float* y, float swiglu_limit) {
  std::unique_lock<std::mutex> lock;
  moe_forward(acquire_runtime(lock), x, n_tokens, hidden, ids, weights, top_k, gate, up, down, n_experts, ffn, y,
              swiglu_limit);
}

void moe_forward(Runtime& e, const float* x, int n_tokens, int hidden, const int32_t* ids, const float* weights,
                 int top_k, const MoEWeights& gate, const MoEWeights& up, const MoEWeights& down, int n_experts,
                 int ffn, float* y, float swiglu_limit, const SharedFFN* shared) {
  if (n_experts <= 0 || top_k <= 0 || hidden <= 0 || ffn <= 0)
    throw std::invalid_argument("moe_forward: n_experts, top_k, hidden and ffn must be positive");
  const ExpertLayout gl = checked_layout("gate", gate, n_experts, ffn, hidden);
  const ExpertLayout ul = checked_layout("up", up, n_experts, ffn, hidden);
  const ExpertLayout dl = checked_layout("down", down, n_experts, hidden, ffn);
  const int sffn = shared ? shared->down->cols : 0;
  const bool shared_gate_up = shared && shared->gate;  // else down reads shared->h
  if (shared) {
    check_weight("ffn_down_shexp", *shared->down, 1, hidden, sffn);
    if (shared_gate_up) {
      check_weight("ffn_gate_shexp", *shared->gate, 1, sffn, hidden);
      check_weight("ffn_up_shexp", *shared->up, 1, sffn, hidden);
    } else if (shared->h == nullptr) {
      throw std::invalid_argument("moe_forward: a shared expert needs its gate and up or its down's input");
    }
  }
  const size_t gate_rb = gl.row_bytes, gate_es = gl.stride, up_rb = ul.row_bytes, up_es = ul.stride;
  const size_t down_rb = dl.row_bytes, down_es = dl.stride;
  if (n_tokens <= 0) return;
  const TypeInfo& gt = type_info(gate.ggml_type);
  const TypeInfo& ut = type_info(up.ggml_type);
  const TypeInfo& dt = type_info(down.ggml_type);
  const int n_pairs = n_tokens * top_k;

  ThreadPool& pool = *e.pool;
  Workspace& ws = e.ws;
  const int threads = pool.size();
  const Routing rt = route(ids, n_pairs, n_experts, ws.ints);

  // The token rows in each activation format a weight needs, quantized once per format.
  const uint8_t* format_rows[3] = {nullptr, nullptr, nullptr};
  const auto token_rows = [&](ActFormat f) {
    const uint8_t*& rows = format_rows[static_cast<int>(f)];
    if (rows == nullptr)
      rows = f == ActFormat::kF32 ? reinterpret_cast<const uint8_t*>(x)
                                  : quantize_rows(pool, ws.acts[f == ActFormat::kQ8_K ? 0 : 1], f, x, n_tokens,
                                                  hidden, false);
    return rows;
  };
  // x's rows are packed; quantized rows are padded to 64 bytes.
  const auto row_stride = [&](ActFormat f) {
    return f == ActFormat::kF32 ? 4 * static_cast<size_t>(hidden) : act_row_bytes(f, hidden);
  };

  // Per sorted slot, its token's row in the format gate and up each need.
  const ActFormat formats[2] = {gt.act, ut.act};
  const uint8_t** slot_acts[2];
  bool copied[2] = {false, false};
  for (int i = 0; i < 2; ++i) {
    const uint8_t* rows = token_rows(formats[i]);
    const size_t stride = row_stride(formats[i]);
    slot_acts[i] = ws.act_ptrs[i].get_as<const uint8_t*>(n_pairs);
    for (int s = 0; s < n_pairs; ++s) slot_acts[i][s] = rows + stride * (rt.pair[s] / top_k);
    // A kernel that loads many rows with one stride (AMX) gets each expert's tokens as consecutive rows:
    // a copy per slot, a small cost beside the experts' GEMMs when they see enough tokens for it.
    const int type = i == 0 ? gate.ggml_type : up.ggml_type;
    // Copied once the experts average the tokens from which the kernel takes that path.
    const int even_from = matmul_even_rows_tokens(type);
    if (even_from == 0 || n_pairs < even_from * rt.n_active || formats[i] == ActFormat::kF32) continue;
    if (i == 1 && formats[1] == formats[0] && copied[0]) {
      std::copy(slot_acts[0], slot_acts[0] + n_pairs, slot_acts[1]);
    } else {
      uint8_t* copy = ws.slot_rows[i].get(stride * n_pairs);
      for (int s = 0; s < n_pairs; ++s) {
        std::memcpy(copy + stride * s, slot_acts[i][s], stride);
        slot_acts[i][s] = copy + stride * s;
      }
    }
    copied[i] = true;
  }
  // The shared expert's gate and up read every token, in order (rows already consecutive).
  const uint8_t** shared_acts[2] = {nullptr, nullptr};
  if (shared_gate_up) {
    const uint8_t** ptrs = ws.act_ptrs[2].get_as<const uint8_t*>(2 * static_cast<size_t>(n_tokens));
    const Weight* gu[2] = {shared->gate, shared->up};
    for (int i = 0; i < 2; ++i) {
      const ActFormat f = type_info(gu[i]->ggml_type).act;
      const uint8_t* rows = token_rows(f);
      const size_t stride = row_stride(f);
      shared_acts[i] = ptrs + static_cast<size_t>(i) * n_tokens;
      for (int t = 0; t < n_tokens; ++t) shared_acts[i][t] = rows + stride * t;
    }
  }

  // Phase A: h[slot] = silu(gate x) * up x, written straight into down's activation format; the shared
  // expert's h after the slots', in its down's format.
  const ActFormat hfmt = dt.act;
  const ActFormat sfmt = shared ? type_info(shared->down->ggml_type).act : hfmt;
  const int hblock = std::max(16, act_block_values(hfmt)), sblock = std::max(16, act_block_values(sfmt));
  const size_t harb = act_row_bytes(hfmt, ffn), sarb = shared ? act_row_bytes(sfmt, sffn) : 0;
  const int shared_rows = shared ? n_tokens : 0;
  uint8_t* hbuf = ws.hidden.get(harb * n_pairs + sarb * shared_rows);
  uint8_t* sbuf = hbuf + harb * n_pairs;
  const uint8_t** hrows = ws.hidden_ptrs.get_as<const uint8_t*>(n_pairs + shared_rows);
  for (int s = 0; s < n_pairs; ++s) hrows[s] = hbuf + harb * s;
  for (int t = 0; t < shared_rows; ++t) hrows[n_pairs + t] = sbuf + sarb * t;

  const int shared_chunks = (n_tokens + kSharedTokenChunk - 1) / kSharedTokenChunk;
  int max_count = shared_gate_up ? std::min(n_tokens, kSharedTokenChunk) : 0;
  for (int i = 0; i < rt.n_active; ++i) max_count = std::max(max_count, rt.count[rt.active[i]]);
  const int rows_all = rt.n_active * ffn + sffn;
  const int rows_a = block_rows(rows_all, ffn, threads, hblock, 256);
  const int rows_s = shared ? block_rows(rows_all, sffn, threads, sblock, 256) : 0;
  const int rows_b = block_rows(hidden, hidden, threads, 16, 256);
  size_t mm_scratch = std::max({matmul_scratch_bytes(gate.ggml_type, hidden),
                                matmul_scratch_bytes(up.ggml_type, hidden), matmul_scratch_bytes(down.ggml_type, ffn)});
  if (shared) mm_scratch = std::max(mm_scratch, matmul_scratch_bytes(shared->down->ggml_type, sffn));
  if (shared_gate_up)
    mm_scratch = std::max({mm_scratch, matmul_scratch_bytes(shared->gate->ggml_type, hidden),
                           matmul_scratch_bytes(shared->up->ggml_type, hidden)});
  const size_t a_floats = 2 * static_cast<size_t>(max_count) * std::max(rows_a, rows_s);
  const size_t b_floats = static_cast<size_t>(n_pairs) * rows_b;
  const size_t thread_bytes = mm_scratch + 64 + 4 * std::max(a_floats, b_floats);
  for (Buffer& b : ws.per_thread) b.get(thread_bytes);

  const int blocks_a = (ffn + rows_a - 1) / rows_a;
  const int routed_items = rt.n_active * blocks_a;
  const int shared_blocks = shared ? (sffn + rows_s - 1) / rows_s : 0;
  const int shared_items = shared_blocks * shared_chunks;  // (row block, token chunk)
  pool.parallel_for(routed_items + shared_items, [&](int item, int thread) {
    const bool sh = item >= routed_items;
    const int expert = sh ? -1 : rt.active[item / blocks_a];
    const int width = sh ? sffn : ffn, rows = sh ? rows_s : rows_a;
    const int r0 = (sh ? (item - routed_items) % shared_blocks : item % blocks_a) * rows;
    const int r1 = std::min(width, r0 + rows);
    const int t0 = sh ? (item - routed_items) / shared_blocks * kSharedTokenChunk : 0;  // shared: first token
    const int count = sh ? std::min(kSharedTokenChunk, n_tokens - t0) : rt.count[expert];
    if (sh && !shared_gate_up) {  // the caller's h, quantized
      const int block = act_block_values(sfmt);
      for (int t = t0; t < t0 + count; ++t)
        quantize_act_blocks(sfmt, shared->h + static_cast<size_t>(t) * sffn + r0, sffn, r0 / block, r1 / block,
                            sbuf + sarb * t);
      return;
    }
    uint8_t* scratch = ws.per_thread[thread].get(thread_bytes);
    float* g = reinterpret_cast<float*>(scratch + mm_scratch + 64);
    float* u = g + static_cast<size_t>(count) * rows;

    MatmulTask task{};
    task.cols = hidden;
    task.row_begin = r0;
    task.row_end = r1;
    task.n_tokens = count;
    task.out_stride = rows;
    task.scratch = scratch;
    if (sh) {
      task.weight = shared->gate->data;
      task.row_bytes = shared->gate->row_bytes;
      task.acts = shared_acts[0] + t0;
      task.out = g;
      matmul_kernel(shared->gate->ggml_type)(task);
      task.weight = shared->up->data;
      task.row_bytes = shared->up->row_bytes;
      task.acts = shared_acts[1] + t0;
      task.out = u;
      matmul_kernel(shared->up->ggml_type)(task);
    } else {
      const int first = rt.offset[expert];
      task.weight = gate.data + static_cast<size_t>(expert) * gate_es;
      task.row_bytes = gate_rb;
      task.acts = slot_acts[0] + first;
      task.out = g;
      matmul_kernel(gate.ggml_type)(task);
      task.weight = up.data + static_cast<size_t>(expert) * up_es;
      task.row_bytes = up_rb;
      task.acts = slot_acts[1] + first;
      task.out = u;
      matmul_kernel(up.ggml_type)(task);
    }

    // The shared expert is a plain SwiGLU (gated_ffn); the limit clamps the routed experts only.
    const float limit = sh ? 0.0f : swiglu_limit;
    const ActFormat fmt = sh ? sfmt : hfmt;
    const int block = act_block_values(fmt);
    for (int i = 0; i < count; ++i) {
      float* gi = g + static_cast<size_t>(i) * rows;
      float* ui = u + static_cast<size_t>(i) * rows;
      if (limit > 0.0f) {
        for (int j = 0; j < r1 - r0; ++j) {
          gi[j] = std::min(gi[j], limit);
          ui[j] = std::clamp(ui[j], -limit, limit);
        }
      }
      silu_mul(gi, ui, r1 - r0);
      uint8_t* dst = sh ? sbuf + sarb * (t0 + i) : hbuf + harb * (rt.offset[expert] + i);
      quantize_act_blocks(fmt, gi, width, r0 / block, r1 / block, dst);
    }
  });

  // Phase B: per block of hidden rows, every active expert's down rows, then the slot-order sum; the
  // shared expert's down rows straight into its output.
  const int blocks_b = (hidden + rows_b - 1) / rows_b;
  const MatmulFn down_fn = matmul_kernel(down.ggml_type);
  const MatmulFn shared_down_fn = shared ? matmul_kernel(shared->down->ggml_type) : nullptr;
  pool.parallel_for(blocks_b, [&](int item, int thread) {
    const int r0 = item * rows_b, r1 = std::min(hidden, r0 + rows_b);
    uint8_t* scratch = ws.per_thread[thread].get(thread_bytes);
    float* yb = reinterpret_cast<float*>(scratch + mm_scratch + 64);
    MatmulTask task{};
    task.row_begin = r0;
    task.row_end = r1;
    task.scratch = scratch;
    for (int i = 0; i < rt.n_active; ++i) {
      const int expert = rt.active[i];
      task.weight = down.data + static_cast<size_t>(expert) * down_es;
      task.row_bytes = down_rb;
      task.cols = ffn;
      task.acts = hrows + rt.offset[expert];
      task.n_tokens = rt.count[expert];
      task.out = yb + static_cast<size_t>(rt.offset[expert]) * rows_b;
      task.out_stride = rows_b;
      down_fn(task);
    }
    for (int t = 0; t < n_tokens; ++t) {
      float* yt = y + static_cast<size_t>(t) * hidden;
      for (int r = r0; r < r1; ++r) {
        float acc = 0.0f;
        for (int k = 0; k < top_k; ++k)
          acc = std::fma(weights[t * top_k + k], yb[static_cast<size_t>(rt.slot[t * top_k + k]) * rows_b + (r - r0)], acc);
        yt[r] = acc;
      }
    }
    for (int t0 = 0; shared && t0 < n_tokens; t0 += kSharedTokenChunk) {
      task.weight = shared->down->data;
      task.row_bytes = shared->down->row_bytes;
      task.cols = sffn;
      task.acts = hrows + n_pairs + t0;
      task.n_tokens = std::min(kSharedTokenChunk, n_tokens - t0);
      task.out = shared->y + static_cast<size_t>(t0) * hidden + r0;
      task.out_stride = hidden;
      shared_down_fn(task);
    }
  });
}

}  // namespace pocketmoe
