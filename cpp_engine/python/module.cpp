// pocketmoe._native: numpy bindings of the native CPU kernels. The GIL is released while they run.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <vector>

#include <memory>

#include "pocketmoe/act_quant.h"
#include "pocketmoe/ops.h"
#include "pocketmoe/runtime.h"
#include "pocketmoe/isa.h"
#include "pocketmoe/matmul.h"
#include "pocketmoe/types.h"
#include "bind_util.h"

namespace py = pybind11;
using namespace pocketmoe;
using namespace pocketmoe::bind;

namespace {

py::array_t<float> output(const py::object& out, py::ssize_t rows, py::ssize_t cols) {
  if (out.is_none()) return py::array_t<float>({rows, cols});
  auto o = checked<float>(out.cast<py::array>(), "out", 2);
  if (o.shape(0) != rows || o.shape(1) != cols)
    throw py::value_error("out must have shape (" + std::to_string(rows) + ", " + std::to_string(cols) + ")");
  if (!o.writeable()) throw py::value_error("out must be writeable");
  return o;
}

// `a` as a C-contiguous array of T: the array itself when it already is one, else a converted copy.
template <class T>
py::array_t<T> as_array(const py::handle& a, const char* name) {
  if (py::isinstance<py::array_t<T, py::array::c_style>>(a)) return py::reinterpret_borrow<py::array_t<T>>(a);
  auto c = py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(a);
  if (!c) throw py::value_error(std::string(name) + " must be convertible to a " + dtype_name<T>() + " array");
  return c;
}

py::array_t<float> floats(const py::handle& x) { return as_array<float>(x, "x"); }

// x: float32 [T, cols] -> [T, rows], or [cols] -> [rows] (out then (rows,) or (1, rows)).
py::array_t<float> gemm_py(const py::array& weight, int ggml_type, const py::handle& x, const py::object& out) {
  auto w = checked<uint8_t>(weight, "weight", 2);
  auto xa = floats(x);
  if (xa.ndim() != 1 && xa.ndim() != 2)
    throw py::value_error("x must be [T, cols] or [cols], got " + std::to_string(xa.ndim()) + " dimensions");
  const bool vec = xa.ndim() == 1;
  const py::ssize_t rows = w.shape(0), n_tokens = vec ? 1 : xa.shape(0), cols = xa.shape(vec ? 0 : 1);
  py::array_t<float> y;
  if (vec && !out.is_none()) {
    auto o = checked<float>(out.cast<py::array>(), "out", -1);
    if (o.size() != rows || o.ndim() > 2 || (o.ndim() == 2 && o.shape(0) != 1))
      throw py::value_error("out must have shape (" + std::to_string(rows) + ",) or (1, " + std::to_string(rows) +
                            ")");
    if (!o.writeable()) throw py::value_error("out must be writeable");
    y = o.ndim() == 1 ? o : py::array_t<float>({rows}, {static_cast<py::ssize_t>(sizeof(float))}, o.mutable_data(), o);
  } else if (vec) {
    y = py::array_t<float>(rows);
  } else {
    y = output(out, n_tokens, rows);
  }
  const uint8_t* wp = w.data();
  const float* xp = xa.data();
  float* yp = y.mutable_data();
  const size_t row_bytes = static_cast<size_t>(w.shape(1));
  // Small calls run in microseconds: releasing and re-taking the GIL would cost more than it frees.
  if (static_cast<size_t>(rows) * row_bytes * static_cast<size_t>(n_tokens) < (size_t{64} << 10)) {
    gemm(wp, static_cast<int>(rows), row_bytes, ggml_type, xp, static_cast<int>(n_tokens), static_cast<int>(cols), yp);
  } else {
    py::gil_scoped_release release;
    gemm(wp, static_cast<int>(rows), row_bytes, ggml_type, xp, static_cast<int>(n_tokens), static_cast<int>(cols), yp);
  }
  return y;
}

// weight: uint8 [H, rows, row_bytes]; x: float32 [H, T, cols] -> [H, T, rows].
py::array_t<float> gemm_batched_py(const py::array& weight, int ggml_type, const py::handle& x,
                                   const py::object& out) {
  auto w = checked<uint8_t>(weight, "weight", 3);
  auto xa = floats(x);
  if (xa.ndim() != 3) throw py::value_error("x must be [H, T, cols], got " + std::to_string(xa.ndim()) + " dimensions");
  const py::ssize_t heads = w.shape(0), rows = w.shape(1), n_tokens = xa.shape(1), cols = xa.shape(2);
  if (xa.shape(0) != heads)
    throw py::value_error("x has " + std::to_string(xa.shape(0)) + " heads, the weight " + std::to_string(heads));
  py::array_t<float> y;
  if (out.is_none()) {
    y = py::array_t<float>({heads, n_tokens, rows});
  } else {
    y = checked<float>(out.cast<py::array>(), "out", 3);
    if (y.shape(0) != heads || y.shape(1) != n_tokens || y.shape(2) != rows)
      throw py::value_error("out must have shape (" + std::to_string(heads) + ", " + std::to_string(n_tokens) + ", " +
                            std::to_string(rows) + ")");
    if (!y.writeable()) throw py::value_error("out must be writeable");
  }
  const uint8_t* wp = w.data();
  const float* xp = xa.data();
  float* yp = y.mutable_data();
  const size_t row_bytes = static_cast<size_t>(w.shape(2));
  const auto run = [&] {
    gemm_batched(wp, static_cast<int>(heads), static_cast<int>(rows), row_bytes, ggml_type, xp,
                 static_cast<int>(n_tokens), static_cast<int>(cols), yp);
  };
  if (static_cast<size_t>(heads * rows) * row_bytes * static_cast<size_t>(n_tokens) < (size_t{64} << 10)) {
    run();
  } else {
    py::gil_scoped_release release;
    run();
  }
  return y;
}

// x, expert_ids, expert_weights: converted (to float32 / int32, C order) only when they are not already.
py::array_t<float> moe_forward_py(const py::handle& x, const py::handle& expert_ids, const py::handle& expert_weights_,
                                  const py::array& gate, int gate_type, const py::array& up, int up_type,
                                  const py::array& down, int down_type, int n_experts, int ffn,
                                  const py::object& out, float swiglu_limit) {
  auto xa = as_array<float>(x, "x");
  auto ids = as_array<int32_t>(expert_ids, "expert_ids");
  auto wts = as_array<float>(expert_weights_, "expert_weights");
  if (xa.ndim() != 2 || ids.ndim() != 2 || wts.ndim() != 2)
    throw py::value_error("x, expert_ids and expert_weights must have 2 dimensions");
  const py::ssize_t n_tokens = xa.shape(0), hidden = xa.shape(1), top_k = ids.shape(1);
  if (ids.shape(0) != n_tokens || wts.shape(0) != n_tokens || wts.shape(1) != top_k)
    throw py::value_error("expert_ids and expert_weights must both have shape (" + std::to_string(n_tokens) +
                          ", K)");
  const MoEWeights g = expert_weights(gate, "gate", gate_type);
  const MoEWeights u = expert_weights(up, "up", up_type);
  const MoEWeights d = expert_weights(down, "down", down_type);
  auto y = output(out, n_tokens, hidden);
  const float* xp = xa.data();
  const int32_t* ip = ids.data();
  const float* wp = wts.data();
  float* yp = y.mutable_data();
  {
    py::gil_scoped_release release;
    moe_forward(xp, static_cast<int>(n_tokens), static_cast<int>(hidden), ip, wp, static_cast<int>(top_k), g, u, d,
                n_experts, ffn, yp, swiglu_limit);
  }
  return y;
}

// y[t] = sum_k w[t, k] * c[t, k] in slot order with fma from 0, as moe_forward combines its slots:
// expert outputs computed elsewhere (another device, a worker thread) sum to moe_forward's bits.
py::array_t<float> moe_combine_py(const py::array& contrib, const py::array& weights) {
  auto c = checked<float>(contrib, "contrib", 3);
  auto w = checked<float>(weights, "weights", 2);
  const py::ssize_t n = c.shape(0), k = c.shape(1), d = c.shape(2);
  if (w.shape(0) != n || w.shape(1) != k)
    throw py::value_error("weights must have shape (" + std::to_string(n) + ", " + std::to_string(k) + ")");
  py::array_t<float> y({n, d});
  const float* cp = c.data();
  const float* wp = w.data();
  float* yp = y.mutable_data();
  {
    py::gil_scoped_release release;
    for (py::ssize_t t = 0; t < n; ++t)
      for (py::ssize_t r = 0; r < d; ++r) {
        float acc = 0.0f;
        for (py::ssize_t j = 0; j < k; ++j) acc = std::fma(wp[t * k + j], cp[(t * k + j) * d + r], acc);
        yp[t * d + r] = acc;
      }
  }
  return y;
}

py::array_t<float> dequantize_py(const py::array& raw, int ggml_type, int n) {
  auto r = checked<uint8_t>(raw, "raw", -1);
  const TypeInfo& t = type_info(ggml_type);
  if (static_cast<size_t>(r.nbytes()) != weight_row_bytes(t, n))
    throw py::value_error("raw holds " + std::to_string(r.nbytes()) + " bytes, " + std::to_string(n) + " " + t.name +
                          " values need " + std::to_string(weight_row_bytes(t, n)));
  py::array_t<float> y(n);
  dequantize_row(ggml_type, r.data(), n, y.mutable_data());
  return y;
}

py::array_t<float> activation_roundtrip_py(const py::array& x, int ggml_type) {
  auto xa = checked<float>(x, "x", 2);
  const TypeInfo& t = type_info(ggml_type);
  const int rows = static_cast<int>(xa.shape(0)), cols = static_cast<int>(xa.shape(1));
  if (cols % act_block_values(t.act) != 0)
    throw py::value_error("x rows must be a multiple of " + std::to_string(act_block_values(t.act)) + " values");
  py::array_t<float> y({rows, cols});
  std::vector<uint8_t> row(act_row_bytes(t.act, cols));
  for (int i = 0; i < rows; ++i) {
    quantize_act_row(t.act, xa.data() + static_cast<size_t>(i) * cols, cols, row.data());
    dequantize_act_row(t.act, row.data(), cols, y.mutable_data() + static_cast<size_t>(i) * cols);
  }
  return y;
}

// ---- Ops (pocketmoe/ops.h). Weights and fixed parameters are handles made once at load; the
// per-call arrays are checked here.

WeightHandle make_weight(const py::array& blocks, int ggml_type, int cols) {
  auto a = checked<uint8_t>(blocks, "blocks", -1);
  if (a.ndim() != 2 && a.ndim() != 3) throw py::value_error("blocks must have 2 or 3 dimensions");
  WeightHandle h;
  h.w.data = a.data();
  h.w.ggml_type = ggml_type;
  h.w.heads = a.ndim() == 3 ? static_cast<int>(a.shape(0)) : 1;
  h.w.rows = static_cast<int>(a.shape(a.ndim() - 2));
  h.w.row_bytes = static_cast<size_t>(a.shape(a.ndim() - 1));
  h.w.cols = cols;
  check_weight("weight", h.w, h.w.heads, h.w.rows, cols);
  h.keep = a;
  return h;
}

py::array_t<float> rms_norm_py(const py::array& x, const py::array& w, float eps) {
  auto xa = rows_of(x, "x", -1);
  const py::ssize_t n = xa.shape(0), d = xa.shape(1);
  py::array_t<float> y({n, d});
  rms_norm(xa.data(), vector_of(w, "weight", d), static_cast<int>(n), static_cast<int>(d), eps, y.mutable_data());
  return y;
}

py::array_t<float> add_rms_norm_py(const py::array& x, const py::array& add, const py::array& w, float eps) {
  auto xa = rows_of(x, "x", -1);
  const py::ssize_t n = xa.shape(0), d = xa.shape(1);
  auto aa = rows_of(add, "add", d);
  if (aa.shape(0) != n) throw py::value_error("add must have as many rows as x");
  py::array_t<float> y({n, d});
  add_rms_norm(xa.mutable_data(), aa.data(), vector_of(w, "weight", d), static_cast<int>(n), static_cast<int>(d), eps,
               y.mutable_data());
  return y;
}

py::object finalize_py(const py::array& x, const py::array& a, const py::object& b, const py::object& w, float eps) {
  auto xa = rows_of(x, "x", -1);
  const py::ssize_t n = xa.shape(0), d = xa.shape(1);
  auto aa = rows_of(a, "a", d);
  const float* bp = nullptr;
  if (!b.is_none()) {
    auto ba = rows_of(b.cast<py::array>(), "b", d);
    if (ba.shape(0) != n) throw py::value_error("b must have as many rows as x");
    bp = ba.data();
  }
  if (aa.shape(0) != n) throw py::value_error("a must have as many rows as x");
  const float* wp = vector_of(w, "weight", d);
  if (wp == nullptr) {
    finalize(xa.mutable_data(), aa.data(), bp, nullptr, static_cast<int>(n), static_cast<int>(d), eps, nullptr);
    return py::none();
  }
  py::array_t<float> y({n, d});
  finalize(xa.mutable_data(), aa.data(), bp, wp, static_cast<int>(n), static_cast<int>(d), eps, y.mutable_data());
  return std::move(y);
}

void rope_py(const py::array& x, int heads, int head_dim, int rot, bool neox, const py::array& cos2,
             const py::array& sin2) {
  auto xa = checked<float>(x, "x", 2);
  if (xa.shape(1) != static_cast<py::ssize_t>(heads) * head_dim)
    throw py::value_error("x rows must hold heads * head_dim values");
  const py::ssize_t n = xa.shape(0);
  auto c = rows_of(cos2, "cos2", rot), s = rows_of(sin2, "sin2", rot);
  if (c.shape(0) != n || s.shape(0) != n) throw py::value_error("cos2 and sin2 need one row per row of x");
  rope(xa.mutable_data(), static_cast<int>(n), static_cast<size_t>(xa.shape(1)), heads, head_dim, rot, neox, c.data(),
       s.data());
}

// The rows' cache layout (pocketmoe/ops.h KVLayout) from the step's arrays; cachep: the cache's rows [rows, w].
KVLayout kv_layout_of(const py::array& cache, int w, const py::array& seq, const py::array& keys,
                      const py::array& write_rows, const py::array& table, int page, py::ssize_t n, void*& cachep) {
  const KVType type = kv_type_of(cache, 2, w);
  auto ta = checked<int32_t>(table, "page_table", 2);
  cachep = py::array(cache).mutable_data();
  return KVLayout{ints_of(seq, "seq", n), ints_of(keys, "keys", n), ints_of(write_rows, "write_rows", n), ta.data(),
                  static_cast<int>(ta.shape(0)), static_cast<int>(ta.shape(1)), page,
                  static_cast<int>(cache.shape(0)), type};
}

py::array_t<float> mla_attention_py(const MLAShape& sh, const py::array& q, const py::array& kv,
                                    const py::array& kv_norm, const WeightHandle& k_b, const WeightHandle& v_b,
                                    const py::array& cos2, const py::array& sin2, const py::array& cache,
                                    const py::array& seq, const py::array& keys, const py::array& write_rows,
                                    const py::array& table, int page) {
  const int w = sh.kv_lora + sh.qk_rope;
  auto qa = rows_of(q, "q", static_cast<py::ssize_t>(sh.n_head) * (sh.qk_nope + sh.qk_rope));
  const py::ssize_t n = qa.shape(0);
  auto kva = rows_of(kv, "kv", w);
  auto c = rows_of(cos2, "cos2", sh.qk_rope), s = rows_of(sin2, "sin2", sh.qk_rope);
  if (kva.shape(0) != n || c.shape(0) != n || s.shape(0) != n)
    throw py::value_error("q, kv, cos2 and sin2 need the same number of rows");
  void* cachep = nullptr;
  const KVLayout layout = kv_layout_of(cache, w, seq, keys, write_rows, table, page, n, cachep);
  const float* norm = vector_of(kv_norm, "kv_norm", sh.kv_lora);
  py::array_t<float> out({n, static_cast<py::ssize_t>(sh.n_head) * sh.v_head});
  const float *qp = qa.data(), *kvp = kva.data(), *cp = c.data(), *sp = s.data();
  float* op = out.mutable_data();
  run(size_t{1} << 20, [&] {
    mla_attention(sh, qp, kvp, norm, k_b.w, v_b.w, cp, sp, cachep, layout, static_cast<int>(n), op);
  });
  return out;
}

py::array_t<float> gqa_attention_py(const GQAShape& sh, const py::array& q, const py::array& k, const py::array& v,
                                    const py::array& cos2, const py::array& sin2, const py::array& cache,
                                    const py::array& seq, const py::array& keys, const py::array& write_rows,
                                    const py::array& table, int page) {
  if (sh.n_head <= 0 || sh.n_head_kv <= 0 || sh.head_dim <= 0 || sh.v_dim <= 0 || sh.rot <= 0)
    throw py::value_error("gqa_attention: the shape's heads and dims must be positive");
  const int w = sh.n_head_kv * (sh.head_dim + sh.v_dim);
  auto qa = rows_of(q, "q", static_cast<py::ssize_t>(sh.n_head) * sh.head_dim);
  const py::ssize_t n = qa.shape(0);
  auto ka = rows_of(k, "k", static_cast<py::ssize_t>(sh.n_head_kv) * sh.head_dim);
  auto va = rows_of(v, "v", static_cast<py::ssize_t>(sh.n_head_kv) * sh.v_dim);
  auto c = rows_of(cos2, "cos2", sh.rot), s = rows_of(sin2, "sin2", sh.rot);
  if (ka.shape(0) != n || va.shape(0) != n || c.shape(0) != n || s.shape(0) != n)
    throw py::value_error("q, k, v, cos2 and sin2 need the same number of rows");
  void* cachep = nullptr;
  const KVLayout layout = kv_layout_of(cache, w, seq, keys, write_rows, table, page, n, cachep);
  py::array_t<float> q_work({n, static_cast<py::ssize_t>(sh.n_head) * sh.head_dim});
  py::array_t<float> out({n, static_cast<py::ssize_t>(sh.n_head) * sh.v_dim});
  const float *qp = qa.data(), *kp = ka.data(), *vp = va.data(), *cp = c.data(), *sp = s.data();
  float *qw = q_work.mutable_data(), *op = out.mutable_data();
  run(size_t{1} << 20, [&] { gqa_attention(sh, qp, kp, vp, cp, sp, cachep, layout, static_cast<int>(n), qw, op); });
  return out;
}

py::tuple route_py(const RouteParams& p, const py::array& x, const WeightHandle& gate, const py::object& bias) {
  auto xa = rows_of(x, "x", gate.w.cols);
  const py::ssize_t n = xa.shape(0);
  py::array_t<int32_t> ids({n, static_cast<py::ssize_t>(p.top_k)});
  py::array_t<float> weights({n, static_cast<py::ssize_t>(p.top_k)});
  const float* bp = vector_of(bias, "bias", p.n_experts);
  route(p, xa.data(), static_cast<int>(n), gate.w, bp, ids.mutable_data(), weights.mutable_data());
  return py::make_tuple(ids, weights);
}

py::array_t<float> gated_ffn_py(const py::array& x, const WeightHandle& gate, const WeightHandle& up,
                                const WeightHandle& down) {
  auto xa = rows_of(x, "x", gate.w.cols);
  const py::ssize_t n = xa.shape(0);
  py::array_t<float> y({n, static_cast<py::ssize_t>(down.w.rows)});
  const float* xp = xa.data();
  float* yp = y.mutable_data();
  run(weight_bytes(gate.w) * 3, [&] { gated_ffn(gate.w, up.w, down.w, xp, static_cast<int>(n), yp); });
  return y;
}

py::list linear_multi_py(const py::array& x, const std::vector<const WeightHandle*>& weights) {
  if (weights.empty() || weights.size() > 4) throw py::value_error("linear_multi takes 1 to 4 weights");
  const int cols = weights[0]->w.cols;
  auto xa = rows_of(x, "x", cols);
  const py::ssize_t n = xa.shape(0);
  py::list outs;
  const Weight* ws[4];
  float* ys[4];
  size_t work = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const Weight& w = weights[i]->w;
    if (w.cols != cols || w.heads != 1) throw py::value_error("linear_multi weights must be 2-D and share their input");
    py::array_t<float> y({n, static_cast<py::ssize_t>(w.rows)});
    ws[i] = &w;
    ys[i] = y.mutable_data();
    work += weight_bytes(w);
    outs.append(y);
  }
  const float* xp = xa.data();
  const int n_w = static_cast<int>(weights.size());
  run(work, [&] { linear_multi(ws, n_w, xp, static_cast<int>(n), ys); });
  return outs;
}

py::array_t<float> embed_py(const WeightHandle& table, const py::array& tokens) {
  auto ta = checked<int32_t>(tokens, "tokens", 1);
  const py::ssize_t n = ta.shape(0);
  py::array_t<float> y({n, static_cast<py::ssize_t>(table.w.cols)});
  embed(table.w, ta.data(), static_cast<int>(n), y.mutable_data());
  return y;
}

// ---- Sublayers: made once per layer with its weights (kept alive here), called with the per-step arrays.

// The residual stream x [n, d] (updated in place) and, with a norm weight, the next sublayer's input.
struct ResidualArrays {
  Residual r;
  py::object next = py::none();
};

ResidualArrays residual_of(const py::array& x, py::ssize_t n, py::ssize_t d, const py::object& norm, float eps) {
  auto xa = rows_of(x, "x", d);
  if (xa.shape(0) != n) throw py::value_error("x must have as many rows as xn");
  if (!xa.writeable()) throw py::value_error("x must be writeable");
  ResidualArrays out;
  out.r.x = xa.mutable_data();
  out.r.eps = eps;
  out.r.norm_w = vector_of(norm, "norm", d);
  if (out.r.norm_w != nullptr) {
    py::array_t<float> next({n, d});
    out.r.next = next.mutable_data();
    out.next = std::move(next);
  }
  return out;
}

struct MLASublayerHandle {
  MLAShape shape;
  MLAWeights w;
  std::vector<py::object> keep;
};

MLASublayerHandle make_mla_sublayer(const MLAShape& shape, const py::object& wq, const py::object& wq_a,
                                    const py::object& q_a_norm, const py::object& wq_b, const py::object& wkv_a,
                                    const py::object& kv_a_norm, const py::object& k_b, const py::object& v_b,
                                    const py::object& wo) {
  MLASublayerHandle h{shape, {}, {}};
  h.w.wq = optional_weight(wq, h.keep);
  h.w.wq_a = optional_weight(wq_a, h.keep);
  h.w.wq_b = optional_weight(wq_b, h.keep);
  h.w.wkv_a = optional_weight(wkv_a, h.keep);
  h.w.k_b = optional_weight(k_b, h.keep);
  h.w.v_b = optional_weight(v_b, h.keep);
  h.w.wo = optional_weight(wo, h.keep);
  if ((h.w.wq == nullptr) == (h.w.wq_a == nullptr || h.w.wq_b == nullptr) || !h.w.wkv_a || !h.w.k_b || !h.w.v_b ||
      !h.w.wo)
    throw py::value_error("an MLA sublayer needs wq or the pair wq_a / wq_b, and wkv_a, k_b, v_b and wo");
  const int d = h.w.wkv_a->cols, qw = shape.n_head * (shape.qk_nope + shape.qk_rope);
  const Weight& first = h.w.wq ? *h.w.wq : *h.w.wq_a;
  check_weight("attn_q / attn_q_a", first, 1, first.rows, d);
  check_weight("attn_kv_a_mqa", *h.w.wkv_a, 1, shape.kv_lora + shape.qk_rope, d);
  if (h.w.wq_b) {
    check_weight("attn_q_b", *h.w.wq_b, 1, qw, first.rows);
    h.w.q_a_norm = kept_vector(q_a_norm, "q_a_norm", first.rows, h.keep);
    if (h.w.q_a_norm == nullptr) throw py::value_error("the q LoRA pair needs attn_q_a_norm");
  } else {
    check_weight("attn_q", first, 1, qw, d);
  }
  check_weight("attn_output", *h.w.wo, 1, d, shape.n_head * shape.v_head);
  h.w.kv_a_norm = kept_vector(kv_a_norm, "kv_a_norm", shape.kv_lora, h.keep);
  if (h.w.kv_a_norm == nullptr) throw py::value_error("an MLA sublayer needs attn_kv_a_norm");
  return h;
}

// An attention sublayer's call from Python: checks xn [T, d], the rope tables [T, rot] and the step's cache
// layout (rows of w values), then runs sublayer(xn, cos2, sin2, cache, layout, n, residual) on the pool.
template <class Sublayer>
py::object attention_sublayer_call(int d, int w, int rot, const py::array& xn, const py::array& x,
                                   const py::object& norm, float eps, const py::array& cos2, const py::array& sin2,
                                   const py::array& cache, const py::array& seq, const py::array& keys,
                                   const py::array& write_rows, const py::array& table, int page, Sublayer&& sublayer) {
  auto xa = rows_of(xn, "xn", d);
  const py::ssize_t n = xa.shape(0);
  auto c = rows_of(cos2, "cos2", rot), s = rows_of(sin2, "sin2", rot);
  if (c.shape(0) != n || s.shape(0) != n) throw py::value_error("xn, cos2 and sin2 need the same number of rows");
  void* cachep = nullptr;
  const KVLayout layout = kv_layout_of(cache, w, seq, keys, write_rows, table, page, n, cachep);
  ResidualArrays res = residual_of(x, n, d, norm, eps);
  const float *xp = xa.data(), *cp = c.data(), *sp = s.data();
  run(size_t{1} << 20, [&] { sublayer(xp, cp, sp, cachep, layout, static_cast<int>(n), res.r); });
  return res.next;
}

py::object mla_sublayer_py(const MLASublayerHandle& h, const py::array& xn, const py::array& x, const py::object& norm,
                           float eps, const py::array& cos2, const py::array& sin2, const py::array& cache,
                           const py::array& seq, const py::array& keys, const py::array& write_rows,
                           const py::array& table, int page) {
  const MLAShape& sh = h.shape;
  return attention_sublayer_call(
      h.w.wkv_a->cols, sh.kv_lora + sh.qk_rope, sh.qk_rope, xn, x, norm, eps, cos2, sin2, cache, seq, keys, write_rows,
      table, page, [&](const float* xp, const float* cp, const float* sp, void* cachep, const KVLayout& layout, int n,
                       const Residual& r) { mla_sublayer(sh, h.w, xp, cp, sp, cachep, layout, n, r); });
}

struct GQASublayerHandle {
  GQAShape shape;
  GQAWeights w;
  std::vector<py::object> keep;
};

GQASublayerHandle make_gqa_sublayer(const GQAShape& shape, const py::object& wq, const py::object& wk,
                                    const py::object& wv, const py::object& wo, const py::object& q_norm,
                                    const py::object& k_norm, float eps) {
  GQASublayerHandle h{shape, {}, {}};
  h.w.wq = optional_weight(wq, h.keep);
  h.w.wk = optional_weight(wk, h.keep);
  h.w.wv = optional_weight(wv, h.keep);
  h.w.wo = optional_weight(wo, h.keep);
  if (!h.w.wq || !h.w.wk || !h.w.wv || !h.w.wo) throw py::value_error("a GQA sublayer needs wq, wk, wv and wo");
  const int d = h.w.wq->cols, qd = shape.n_head * shape.head_dim, kd = shape.n_head_kv * shape.head_dim;
  check_weight("attn_q", *h.w.wq, 1, qd, d);
  check_weight("attn_k", *h.w.wk, 1, kd, d);
  check_weight("attn_v", *h.w.wv, 1, shape.n_head_kv * shape.v_dim, d);
  check_weight("attn_output", *h.w.wo, 1, d, shape.n_head * shape.v_dim);
  h.w.q_norm = kept_vector(q_norm, "q_norm", qd, h.keep);
  h.w.k_norm = kept_vector(k_norm, "k_norm", kd, h.keep);
  h.w.eps = eps;
  return h;
}

py::object gqa_sublayer_py(const GQASublayerHandle& h, const py::array& xn, const py::array& x, const py::object& norm,
                           float eps, const py::array& cos2, const py::array& sin2, const py::array& cache,
                           const py::array& seq, const py::array& keys, const py::array& write_rows,
                           const py::array& table, int page) {
  const GQAShape& sh = h.shape;
  return attention_sublayer_call(
      h.w.wq->cols, sh.n_head_kv * (sh.head_dim + sh.v_dim), sh.rot, xn, x, norm, eps, cos2, sin2, cache, seq, keys,
      write_rows, table, page, [&](const float* xp, const float* cp, const float* sp, void* cachep,
                                   const KVLayout& layout, int n, const Residual& r) {
        gqa_sublayer(sh, h.w, xp, cp, sp, cachep, layout, n, r);
      });
}

struct FFNSublayerHandle {
  py::object gate, up, down;
};

py::object ffn_sublayer_py(const FFNSublayerHandle& h, const py::array& xn, const py::array& x, const py::object& norm,
                           float eps) {
  const Weight &g = h.gate.cast<const WeightHandle&>().w, &u = h.up.cast<const WeightHandle&>().w,
               &dn = h.down.cast<const WeightHandle&>().w;
  auto xa = rows_of(xn, "xn", g.cols);
  const py::ssize_t n = xa.shape(0);
  ResidualArrays res = residual_of(x, n, dn.rows, norm, eps);
  const float* xp = xa.data();
  run(weight_bytes(g) * 3, [&] { ffn_sublayer(g, u, dn, xp, static_cast<int>(n), res.r); });
  return res.next;
}

struct MoESublayerHandle {
  MoEParts m;
  int hidden = 0;
  std::vector<py::object> keep;
};

MoESublayerHandle make_moe_sublayer(const RouteParams& params, const py::object& gate_inp, const py::object& bias,
                                    const py::array& gate, int gate_type, const py::array& up, int up_type,
                                    const py::array& down, int down_type, int ffn, const py::object& shared_gate,
                                    const py::object& shared_up, const py::object& shared_down) {
  MoESublayerHandle h;
  h.m.route = params;
  h.m.gate_inp = optional_weight(gate_inp, h.keep);
  if (h.m.gate_inp == nullptr) throw py::value_error("an MoE sublayer needs its router weight ffn_gate_inp");
  h.hidden = h.m.gate_inp->cols;
  check_weight("ffn_gate_inp", *h.m.gate_inp, 1, params.n_experts, h.hidden);
  h.m.bias = kept_vector(bias, "bias", params.n_experts, h.keep);
  h.m.gate = expert_weights(gate, "gate", gate_type);
  h.m.up = expert_weights(up, "up", up_type);
  h.m.down = expert_weights(down, "down", down_type);
  h.keep.push_back(gate), h.keep.push_back(up), h.keep.push_back(down);
  h.m.ffn = ffn;
  h.m.shared_gate = optional_weight(shared_gate, h.keep);
  h.m.shared_up = optional_weight(shared_up, h.keep);
  h.m.shared_down = optional_weight(shared_down, h.keep);
  if ((h.m.shared_gate == nullptr) != (h.m.shared_up == nullptr) ||
      (h.m.shared_gate == nullptr) != (h.m.shared_down == nullptr))
    throw py::value_error("shared experts need all of gate, up and down");
  return h;
}

py::object moe_sublayer_py(const MoESublayerHandle& h, const py::array& xn, const py::array& x, const py::object& norm,
                           float eps) {
  auto xa = rows_of(xn, "xn", h.hidden);
  const py::ssize_t n = xa.shape(0);
  ResidualArrays res = residual_of(x, n, h.hidden, norm, eps);
  const float* xp = xa.data();
  {
    py::gil_scoped_release release;
    moe_sublayer(h.m, xp, static_cast<int>(n), h.hidden, res.r);
  }
  return res.next;
}

// ---- A recorded step, replayed in one call: embed -> norm -> sublayers (each closing with its residual
// update and, but for the last, the next sublayer's norm) -> final norm -> head. The order and the handles
// are what the model called through the ops when it was recorded (pocketmoe/ops/cpu.py); nothing in here
// knows an architecture. Bitwise what the same calls made one at a time give.
struct ProgramSublayer {
  enum Kind { kMLA = 0, kFFN = 1, kMoE = 2, kGQA = 3 } kind;
  py::object op;                 // the MLASublayer / FFNSublayer / MoESublayer / GQASublayer handle
  const float* norm = nullptr;   // the next sublayer's norm weight (null: the last sublayer)
  float eps = 0.0f;
  int layer = 0;                 // MLA, GQA: the cache layer it reads and writes
};

struct StepProgramHandle {
  py::object embed, head;        // WeightHandles
  const float* first_norm = nullptr;
  const float* out_norm = nullptr;
  float first_eps = 0.0f, out_eps = 0.0f;
  std::vector<ProgramSublayer> subs;
  std::vector<py::object> keep;  // the norm arrays
};

StepProgramHandle make_step_program(const py::object& embed, const py::array& first_norm, float first_eps,
                                    const py::list& sublayers, const py::array& out_norm, float out_eps,
                                    const py::object& head) {
  StepProgramHandle h;
  const Weight& table = embed.cast<const WeightHandle&>().w;
  const Weight& hw = head.cast<const WeightHandle&>().w;
  const int d = table.cols;
  if (hw.cols != d || hw.heads != 1) throw py::value_error("the head must read rows of the embedding width");
  h.embed = embed, h.head = head;
  h.first_norm = kept_vector(first_norm, "first_norm", d, h.keep), h.first_eps = first_eps;
  h.out_norm = kept_vector(out_norm, "out_norm", d, h.keep), h.out_eps = out_eps;
  if (!h.first_norm || !h.out_norm) throw py::value_error("a step program needs its first and final norm weights");
  for (const py::handle item : sublayers) {
    auto t = item.cast<py::tuple>();
    if (t.size() != 5) throw py::value_error("a sublayer is (kind, op, norm, eps, layer)");
    ProgramSublayer sub;
    const int kind = t[0].cast<int>();
    if (kind < 0 || kind > 3) throw py::value_error("sublayer kind " + std::to_string(kind) + " is not 0, 1, 2 or 3");
    sub.kind = static_cast<ProgramSublayer::Kind>(kind);
    sub.op = t[1].cast<py::object>();
    if ((kind == 0 && !py::isinstance<MLASublayerHandle>(sub.op)) || (kind == 1 && !py::isinstance<FFNSublayerHandle>(sub.op)) ||
        (kind == 2 && !py::isinstance<MoESublayerHandle>(sub.op)) || (kind == 3 && !py::isinstance<GQASublayerHandle>(sub.op)))
      throw py::value_error("sublayer handle does not match its kind");
    sub.norm = kept_vector(t[2].cast<py::object>(), "norm", d, h.keep);
    sub.eps = t[3].cast<float>();
    sub.layer = t[4].cast<int>();
    h.subs.push_back(std::move(sub));
  }
  return h;
}

// The program's arithmetic (no Python objects touched: it runs without the GIL).
void run_program(const StepProgramHandle& h, const std::vector<const MLASublayerHandle*>& mla,
                 const std::vector<const GQASublayerHandle*>& gqa, const std::vector<const MoESublayerHandle*>& moe,
                 const std::vector<std::array<const Weight*, 3>>& ffn,
                 const Weight& emb, const Weight& head, const int32_t* tp, int nt, const float* cp, const float* sp,
                 void* cache0, size_t layer_bytes, const KVLayout& layout, float* lp) {
  const int d = emb.cols;
  const py::ssize_t n = nt;
  static thread_local std::vector<float> x_, a_, b_;
  const size_t nd = static_cast<size_t>(n) * d;
  if (x_.size() < nd) x_.resize(nd), a_.resize(nd), b_.resize(nd);
  float *x = x_.data(), *xn = a_.data(), *next = b_.data();
  embed(emb, tp, nt, x);
  rms_norm(x, h.first_norm, nt, d, h.first_eps, xn);
  for (size_t i = 0; i < h.subs.size(); ++i) {
    const ProgramSublayer& sub = h.subs[i];
    const Residual res{x, sub.norm, sub.eps, next};
    if (sub.kind == ProgramSublayer::kMLA || sub.kind == ProgramSublayer::kGQA) {
      void* layer_cache = static_cast<char*>(cache0) + sub.layer * layer_bytes;
      if (sub.kind == ProgramSublayer::kMLA) {
        mla_sublayer(mla[i]->shape, mla[i]->w, xn, cp, sp, layer_cache, layout, nt, res);
      } else {
        gqa_sublayer(gqa[i]->shape, gqa[i]->w, xn, cp, sp, layer_cache, layout, nt, res);
      }
    } else if (sub.kind == ProgramSublayer::kFFN) {
      ffn_sublayer(*ffn[i][0], *ffn[i][1], *ffn[i][2], xn, nt, res);
    } else {
      moe_sublayer(moe[i]->m, xn, nt, moe[i]->hidden, res);
    }
    if (sub.norm != nullptr) std::swap(xn, next);
  }
  rms_norm(x, h.out_norm, nt, d, h.out_eps, xn);
  const Weight* hw[1] = {&head};
  float* ys[1] = {lp};
  linear_multi(hw, 1, xn, nt, ys);
}

// tokens int32 [T]; cache [L, rows, W] (float32, float16 or bfloat16 bits); the step's arrays as mla_sublayer takes
// them -> logits [T, V].
py::array_t<float> step_program_py(const StepProgramHandle& h, const py::array& tokens, const py::array& cos2,
                                   const py::array& sin2, const py::array& cache, const py::array& seq,
                                   const py::array& keys, const py::array& write_rows, const py::array& table,
                                   int page) {
  const Weight& emb = h.embed.cast<const WeightHandle&>().w;
  const Weight& head = h.head.cast<const WeightHandle&>().w;
  auto ta = checked<int32_t>(tokens, "tokens", 1);
  const py::ssize_t n = ta.shape(0);
  const KVType type = kv_type_of(cache, 3, -1);
  const py::ssize_t n_layers = cache.shape(0), rows = cache.shape(1), w = cache.shape(2);
  const float *cp = nullptr, *sp = nullptr;
  // Every handle resolved while the GIL is held.
  std::vector<const MLASublayerHandle*> mla(h.subs.size(), nullptr);
  std::vector<const GQASublayerHandle*> gqa(h.subs.size(), nullptr);
  std::vector<const MoESublayerHandle*> moe(h.subs.size(), nullptr);
  std::vector<std::array<const Weight*, 3>> ffn(h.subs.size(), {nullptr, nullptr, nullptr});
  for (size_t i = 0; i < h.subs.size(); ++i) {
    if (h.subs[i].kind == ProgramSublayer::kFFN) {
      const auto& f = h.subs[i].op.cast<const FFNSublayerHandle&>();
      ffn[i] = {&f.gate.cast<const WeightHandle&>().w, &f.up.cast<const WeightHandle&>().w,
                &f.down.cast<const WeightHandle&>().w};
    }
    if (h.subs[i].kind == ProgramSublayer::kMoE) moe[i] = &h.subs[i].op.cast<const MoESublayerHandle&>();
    // An attention sublayer: its cache rows (width) and rope width, as its own call checks them.
    int width = 0, rot = 0;
    if (h.subs[i].kind == ProgramSublayer::kMLA) {
      mla[i] = &h.subs[i].op.cast<const MLASublayerHandle&>();
      const MLAShape& sh = mla[i]->shape;
      width = sh.kv_lora + sh.qk_rope, rot = sh.qk_rope;
    } else if (h.subs[i].kind == ProgramSublayer::kGQA) {
      gqa[i] = &h.subs[i].op.cast<const GQASublayerHandle&>();
      const GQAShape& sh = gqa[i]->shape;
      width = sh.n_head_kv * (sh.head_dim + sh.v_dim), rot = sh.rot;
    } else {
      continue;
    }
    if (width != w || h.subs[i].layer < 0 || h.subs[i].layer >= n_layers)
      throw py::value_error("the cache does not match the recorded attention layers");
    cp = rows_of(cos2, "cos2", rot).data(), sp = rows_of(sin2, "sin2", rot).data();
  }
  if (cp && (cos2.shape(0) != n || sin2.shape(0) != n)) throw py::value_error("cos2 and sin2 need one row per token");
  auto tb = checked<int32_t>(table, "page_table", 2);
  const KVLayout layout{ints_of(seq, "seq", n), ints_of(keys, "keys", n), ints_of(write_rows, "write_rows", n),
                        tb.data(), static_cast<int>(tb.shape(0)), static_cast<int>(tb.shape(1)), page,
                        static_cast<int>(rows), type};
  py::array_t<float> logits({n, static_cast<py::ssize_t>(head.rows)});
  const int32_t* tp = ta.data();
  void* cache0 = py::array(cache).mutable_data();
  const size_t layer_bytes = static_cast<size_t>(rows) * w * cache.itemsize();
  float* lp = logits.mutable_data();
  const int nt = static_cast<int>(n);
  {
    py::gil_scoped_release release;
    run_program(h, mla, gqa, moe, ffn, emb, head, tp, nt, cp, sp, cache0, layer_bytes, layout, lp);
  }
  return logits;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "PocketMoE native CPU kernels on raw GGUF blocks (AVX2, own thread pool).";
  m.def("gemm", &gemm_py, py::arg("weight"), py::arg("ggml_type"), py::arg("x"), py::arg("out") = py::none(),
        "y[T, rows] = x[T, cols] @ W^T for W = uint8 [rows, row_bytes] GGUF blocks of ggml_type.");
  m.def("gemm_batched", &gemm_batched_py, py::arg("weight"), py::arg("ggml_type"), py::arg("x"),
        py::arg("out") = py::none(),
        "y[h] = x[h] @ W[h]^T for W = uint8 [H, rows, row_bytes] GGUF blocks, x = float32 [H, T, cols].");
  m.def("moe_forward", &moe_forward_py, py::arg("x"), py::arg("expert_ids"), py::arg("expert_weights"),
        py::arg("gate"), py::arg("gate_type"), py::arg("up"), py::arg("up_type"), py::arg("down"),
        py::arg("down_type"), py::arg("n_experts"), py::arg("ffn"), py::arg("out") = py::none(),
        py::arg("swiglu_limit") = 0.0f,
        "y[t] = sum_k w[t,k] * down_e(silu(gate_e x[t]) * up_e x[t]), e = ids[t,k], fp32, slot order; "
        "swiglu_limit L > 0: silu(min(gate, L)) * clamp(up, -L, L).");
  m.def("moe_combine", &moe_combine_py, py::arg("contrib"), py::arg("weights"),
        "y[t] = sum_k w[t,k] * contrib[t,k] in fp32 with fma in slot order, bitwise moe_forward's combine.");
  m.def("dequantize", &dequantize_py, py::arg("raw"), py::arg("ggml_type"), py::arg("n"),
        "Scalar reference dequantization of n values.");
  m.def("activation_roundtrip", &activation_roundtrip_py, py::arg("x"), py::arg("ggml_type"),
        "The activation values the kernels of ggml_type actually multiply (x after Q8_K / Q8_0 rounding).");
  py::class_<WeightHandle>(m, "Weight", "A weight for the ops: uint8 [heads,] rows x row_bytes GGUF blocks.")
      .def(py::init(&make_weight), py::arg("blocks"), py::arg("ggml_type"), py::arg("cols"))
      .def_property_readonly("rows", [](const WeightHandle& h) { return h.w.rows; })
      .def_property_readonly("cols", [](const WeightHandle& h) { return h.w.cols; });
  py::class_<MLAShape>(m, "MLAShape")
      .def(py::init([](int n_head, int qk_nope, int qk_rope, int v_head, int kv_lora, float scale, float eps) {
             return MLAShape{n_head, qk_nope, qk_rope, v_head, kv_lora, scale, eps};
           }),
           py::arg("n_head"), py::arg("qk_nope"), py::arg("qk_rope"), py::arg("v_head"), py::arg("kv_lora"),
           py::arg("scale"), py::arg("eps"));
  py::class_<GQAShape>(m, "GQAShape")
      .def(py::init([](int n_head, int n_head_kv, int head_dim, int v_dim, int rot, bool neox, float scale) {
             return GQAShape{n_head, n_head_kv, head_dim, v_dim, rot, neox, scale};
           }),
           py::arg("n_head"), py::arg("n_head_kv"), py::arg("head_dim"), py::arg("v_dim"), py::arg("rot"),
           py::arg("neox"), py::arg("scale"));
  py::class_<RouteParams>(m, "RouteParams")
      .def(py::init([](int n_experts, int top_k, int gating, int n_groups, int groups_used, bool norm, float scale,
                       float weight_sum_min, int gating_softmax, int gating_sigmoid) {
             return RouteParams{n_experts, top_k, gating, n_groups, groups_used, norm, scale, weight_sum_min,
                                gating_softmax, gating_sigmoid};
           }),
           py::arg("n_experts"), py::arg("top_k"), py::arg("gating"), py::arg("n_groups"), py::arg("groups_used"),
           py::arg("norm"), py::arg("scale"), py::arg("weight_sum_min"), py::arg("gating_softmax"),
           py::arg("gating_sigmoid"));
  bind_dsv4(m);
  m.def("rms_norm", &rms_norm_py, py::arg("x"), py::arg("weight"), py::arg("eps"), "y = rms_norm(x) * weight per row.");
  m.def("add_rms_norm", &add_rms_norm_py, py::arg("x"), py::arg("add"), py::arg("weight"), py::arg("eps"),
        "x += add (in place), then y = rms_norm(x) * weight.");
  m.def("finalize", &finalize_py, py::arg("x"), py::arg("a"), py::arg("b"), py::arg("weight"), py::arg("eps"),
        "x += a + b (in place; b may be None); with a norm weight returns rms_norm(x) * weight, else None.");
  m.def("rope", &rope_py, py::arg("x"), py::arg("heads"), py::arg("head_dim"), py::arg("rot"), py::arg("neox"),
        py::arg("cos2"), py::arg("sin2"), "Rotary embedding in place on the first rot dims of every head.");
  m.def("mla_attention", &mla_attention_py, py::arg("shape"), py::arg("q"), py::arg("kv"), py::arg("kv_norm"),
        py::arg("k_b"), py::arg("v_b"), py::arg("cos2"), py::arg("sin2"), py::arg("cache"), py::arg("seq"),
        py::arg("keys"), py::arg("write_rows"), py::arg("page_table"), py::arg("page"),
        "MLA attention of rows of several sequences over a paged latent cache (float32, float16, or uint16 holding "
        "bfloat16 bits) -> [T, H*V].");
  m.def("gqa_attention", &gqa_attention_py, py::arg("shape"), py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("cos2"), py::arg("sin2"), py::arg("cache"), py::arg("seq"), py::arg("keys"), py::arg("write_rows"),
        py::arg("page_table"), py::arg("page"),
        "Grouped-query attention of rows of several sequences over a paged K/V cache (float32, float16, or uint16 "
        "holding bfloat16 bits) -> [T, H*Dv].");
  m.def("route", &route_py, py::arg("params"), py::arg("x"), py::arg("gate"), py::arg("bias"),
        "(ids int32 [T, K], weights float32 [T, K]) of the router.");
  m.def("gated_ffn", &gated_ffn_py, py::arg("x"), py::arg("gate"), py::arg("up"), py::arg("down"),
        "down(silu(gate x) * up x).");
  m.def("linear_multi", &linear_multi_py, py::arg("x"), py::arg("weights"),
        "[x @ W^T for W in weights] in one dispatch, x quantized once per activation format.");
  m.def("embed", &embed_py, py::arg("table"), py::arg("tokens"), "Dequantized embedding rows of int32 tokens.");
  py::class_<MLASublayerHandle>(m, "MLASublayer", "An MLA attention sublayer's weights (projections, k_b, v_b, output).")
      .def(py::init(&make_mla_sublayer), py::arg("shape"), py::arg("wq"), py::arg("wq_a"), py::arg("q_a_norm"),
           py::arg("wq_b"), py::arg("wkv_a"), py::arg("kv_a_norm"), py::arg("k_b"), py::arg("v_b"), py::arg("wo"))
      .def("__call__", &mla_sublayer_py, py::arg("xn"), py::arg("x"), py::arg("norm"), py::arg("eps"), py::arg("cos2"),
           py::arg("sin2"), py::arg("cache"), py::arg("seq"), py::arg("keys"), py::arg("write_rows"),
           py::arg("page_table"), py::arg("page"),
           "x += attention(xn) in place; returns rms_norm(x) * norm (None without a norm).");
  py::class_<GQASublayerHandle>(m, "GQASublayer", "A GQA attention sublayer's weights (q, k, v, output, q/k norms).")
      .def(py::init(&make_gqa_sublayer), py::arg("shape"), py::arg("wq"), py::arg("wk"), py::arg("wv"), py::arg("wo"),
           py::arg("q_norm"), py::arg("k_norm"), py::arg("eps"))
      .def("__call__", &gqa_sublayer_py, py::arg("xn"), py::arg("x"), py::arg("norm"), py::arg("eps"), py::arg("cos2"),
           py::arg("sin2"), py::arg("cache"), py::arg("seq"), py::arg("keys"), py::arg("write_rows"),
           py::arg("page_table"), py::arg("page"),
           "x += attention(xn) in place; returns rms_norm(x) * norm (None without a norm).");
  py::class_<FFNSublayerHandle>(m, "FFNSublayer", "A gated FFN sublayer's weights.")
      .def(py::init([](const py::object& g, const py::object& u, const py::object& d) {
             (void)g.cast<const WeightHandle&>(), (void)u.cast<const WeightHandle&>(), (void)d.cast<const WeightHandle&>();
             return FFNSublayerHandle{g, u, d};
           }),
           py::arg("gate"), py::arg("up"), py::arg("down"))
      .def("__call__", &ffn_sublayer_py, py::arg("xn"), py::arg("x"), py::arg("norm"), py::arg("eps"),
           "x += ffn(xn) in place; returns rms_norm(x) * norm (None without a norm).");
  py::class_<MoESublayerHandle>(m, "MoESublayer", "An MoE sublayer's router, routed and shared experts.")
      .def(py::init(&make_moe_sublayer), py::arg("params"), py::arg("gate_inp"), py::arg("bias"), py::arg("gate"),
           py::arg("gate_type"), py::arg("up"), py::arg("up_type"), py::arg("down"), py::arg("down_type"),
           py::arg("ffn"), py::arg("shared_gate"), py::arg("shared_up"), py::arg("shared_down"))
      .def("__call__", &moe_sublayer_py, py::arg("xn"), py::arg("x"), py::arg("norm"), py::arg("eps"),
           "x += routed(xn) + shared(xn) in place; returns rms_norm(x) * norm (None without a norm).");
  py::class_<StepProgramHandle>(m, "StepProgram", "A recorded step (embed, norm, sublayers, norm, head) run in one call.")
      .def(py::init(&make_step_program), py::arg("embed"), py::arg("first_norm"), py::arg("first_eps"),
           py::arg("sublayers"), py::arg("out_norm"), py::arg("out_eps"), py::arg("head"))
      .def("__call__", &step_program_py, py::arg("tokens"), py::arg("cos2"), py::arg("sin2"), py::arg("cache"),
           py::arg("seq"), py::arg("keys"), py::arg("write_rows"), py::arg("page_table"), py::arg("page"),
           "logits [T, V] of every token of the step; writes the tokens' cache rows.");
  m.def("set_num_threads", &set_num_threads, py::arg("n"));
  m.def("get_num_threads", &get_num_threads);
  m.def("describe", &describe);
  m.def(
      "kernel_isa",
      [] {
        const KernelIsa& isa = kernel_isa();
        return py::dict(py::arg("name") = isa.name, py::arg("note") = isa.note);
      },
      "{'name': the instruction set of the integer kernels, 'note': why a wider one this CPU has is unused}.");
  m.def("cpu_supported", &cpu_supported);
  m.def("supported_types", &supported_types);
}
