// pocketmoe._native: numpy bindings of the native CPU kernels. The GIL is released while they run.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include <memory>

#include "pocketmoe/act_quant.h"
#include "pocketmoe/deepseek2_graph.h"
#include "pocketmoe/engine.h"
#include "pocketmoe/isa.h"
#include "pocketmoe/matmul.h"
#include "pocketmoe/types.h"

namespace py = pybind11;
using namespace pocketmoe;

namespace {

template <class T>
const char* dtype_name() {
  if constexpr (std::is_same_v<T, uint8_t>) return "uint8";
  if constexpr (std::is_same_v<T, int32_t>) return "int32";
  return "float32";
}

// The array itself when it is C-contiguous of dtype T with `ndim` dims (any when -1); else ValueError.
template <class T>
py::array_t<T> checked(const py::array& a, const char* name, int ndim) {
  if (!a.dtype().is(py::dtype::of<T>()))
    throw py::value_error(std::string(name) + " must be " + dtype_name<T>() + ", got " +
                          std::string(py::str(a.dtype())));
  if (!(a.flags() & py::array::c_style)) throw py::value_error(std::string(name) + " must be C-contiguous");
  if (ndim >= 0 && a.ndim() != ndim)
    throw py::value_error(std::string(name) + " must have " + std::to_string(ndim) + " dimensions, got " +
                          std::to_string(a.ndim()));
  return py::reinterpret_borrow<py::array_t<T>>(a);
}

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

// uint8 GGUF blocks, C-contiguous, or [E, rows, row_bytes] with each expert's rows contiguous and any
// stride between experts (one half of a fused gate_up tensor, as numpy slices it).
MoEWeights expert_weights(const py::array& a, const char* name, int ggml_type) {
  if (a.ndim() == 3 && a.dtype().is(py::dtype::of<uint8_t>()) && !(a.flags() & py::array::c_style) &&
      a.strides(2) == 1 && a.strides(1) == a.shape(2) && a.strides(0) >= a.shape(1) * a.shape(2)) {
    const size_t expert = static_cast<size_t>(a.shape(1) * a.shape(2));
    const size_t stride = static_cast<size_t>(a.strides(0));
    const size_t span = a.shape(0) > 0 ? static_cast<size_t>(a.shape(0) - 1) * stride + expert : 0;
    return {static_cast<const uint8_t*>(a.data()), span, ggml_type, stride};
  }
  auto w = checked<uint8_t>(a, name, -1);
  return {w.data(), static_cast<size_t>(w.nbytes()), ggml_type};
}

// x, expert_ids, expert_weights: converted (to float32 / int32, C order) only when they are not already.
py::array_t<float> moe_forward_py(const py::handle& x, const py::handle& expert_ids, const py::handle& expert_weights_,
                                  const py::array& gate, int gate_type, const py::array& up, int up_type,
                                  const py::array& down, int down_type, int n_experts, int ffn,
                                  const py::object& out) {
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
                n_experts, ffn, yp);
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

// ---- Deepseek2Graph: the arrays it reads are kept alive by the Python object.

struct GraphHandle {
  std::unique_ptr<Deepseek2Graph> graph;
  py::list keep;   // every array the graph points into
  int qk_rope = 0;
};

// (uint8 [rows, row_bytes] or [heads, rows, row_bytes] blocks, ggml_type, cols), or None.
GraphLinear graph_linear(const py::handle& spec, const char* name, py::list& keep) {
  GraphLinear w;
  if (spec.is_none()) return w;
  auto t = spec.cast<py::tuple>();
  if (t.size() != 3) throw py::value_error(std::string(name) + " must be (blocks, ggml_type, cols)");
  auto a = checked<uint8_t>(t[0].cast<py::array>(), name, -1);
  if (a.ndim() != 2 && a.ndim() != 3) throw py::value_error(std::string(name) + " blocks must have 2 or 3 dimensions");
  keep.append(a);
  w.data = a.data();
  w.ggml_type = t[1].cast<int>();
  w.heads = a.ndim() == 3 ? static_cast<int>(a.shape(0)) : 1;
  w.rows = static_cast<int>(a.shape(a.ndim() - 2));
  w.row_bytes = static_cast<size_t>(a.shape(a.ndim() - 1));
  w.cols = t[2].cast<int>();
  return w;
}

const float* graph_floats(const py::handle& a, const char* name, py::list& keep) {
  if (a.is_none()) return nullptr;
  auto f = checked<float>(a.cast<py::array>(), name, 1);
  keep.append(f);
  return f.data();
}

MoEWeights graph_experts(const py::handle& spec, const char* name, py::list& keep) {
  auto t = spec.cast<py::tuple>();
  auto a = t[0].cast<py::array>();
  keep.append(a);
  return expert_weights(a, name, t[1].cast<int>());
}

GraphFFN graph_ffn(const py::dict& d, const char* prefix, py::list& keep) {
  const std::string p(prefix);
  GraphFFN f;
  if (!d.contains(p + "gate")) return f;
  f.gate = graph_linear(d[(p + "gate").c_str()], (p + "gate").c_str(), keep);
  f.up = graph_linear(d[(p + "up").c_str()], (p + "up").c_str(), keep);
  f.down = graph_linear(d[(p + "down").c_str()], (p + "down").c_str(), keep);
  return f;
}

std::unique_ptr<GraphHandle> make_graph(const py::dict& params, const py::list& layers, const py::handle& embed,
                                        const py::handle& output_norm, const py::handle& head, const py::array& cache) {
  auto h = std::make_unique<GraphHandle>();
  py::list& keep = h->keep;
  Deepseek2Params p;
  using P = Deepseek2Params;
  static const std::pair<const char*, int P::*> kInts[] = {
      {"hidden", &P::hidden},       {"n_head", &P::n_head},   {"qk_nope", &P::qk_nope},   {"qk_rope", &P::qk_rope},
      {"v_head", &P::v_head},       {"kv_lora", &P::kv_lora}, {"q_lora", &P::q_lora},     {"n_experts", &P::n_experts},
      {"top_k", &P::top_k},         {"gating", &P::gating},   {"n_groups", &P::n_groups}, {"groups_used", &P::groups_used}};
  static const std::pair<const char*, float P::*> kFloats[] = {
      {"attn_scale", &P::attn_scale}, {"rms_eps", &P::rms_eps}, {"weight_scale", &P::weight_scale}};
  for (const auto& [key, field] : kInts) p.*field = params[key].cast<int>();
  for (const auto& [key, field] : kFloats) p.*field = params[key].cast<float>();
  p.weight_norm = params["weight_norm"].cast<bool>();

  using L = Deepseek2Layer;
  static const std::pair<const char*, GraphLinear L::*> kLinears[] = {
      {"wq", &L::wq}, {"wq_a", &L::wq_a}, {"wq_b", &L::wq_b}, {"wkv_a", &L::wkv_a},
      {"k_b", &L::k_b}, {"v_b", &L::v_b}, {"wo", &L::wo},     {"router", &L::router}};
  static const std::pair<const char*, const float* L::*> kVectors[] = {
      {"attn_norm", &L::attn_norm}, {"q_a_norm", &L::q_a_norm}, {"kv_a_norm", &L::kv_a_norm},
      {"ffn_norm", &L::ffn_norm},   {"router_bias", &L::router_bias}};
  std::vector<Deepseek2Layer> ls;
  for (const py::handle& item : layers) {
    auto d = item.cast<py::dict>();
    Deepseek2Layer l;
    for (const auto& [key, field] : kLinears)
      if (d.contains(key)) l.*field = graph_linear(d[key], key, keep);
    for (const auto& [key, field] : kVectors)
      if (d.contains(key)) l.*field = graph_floats(d[key], key, keep);
    l.dense = graph_ffn(d, "dense_", keep);
    if (d.contains("experts_gate")) {
      l.experts_gate = graph_experts(d["experts_gate"], "experts_gate", keep);
      l.experts_up = graph_experts(d["experts_up"], "experts_up", keep);
      l.experts_down = graph_experts(d["experts_down"], "experts_down", keep);
      l.expert_ffn = d["expert_ffn"].cast<int>();
    }
    l.shared = graph_ffn(d, "shared_", keep);
    ls.push_back(l);
  }
  auto c = checked<float>(cache, "cache", 3);
  if (!c.writeable()) throw py::value_error("cache must be writeable");
  if (c.shape(0) != static_cast<py::ssize_t>(ls.size()) || c.shape(2) != p.kv_lora + p.qk_rope)
    throw py::value_error("cache must have shape (" + std::to_string(ls.size()) + ", n_ctx, " +
                          std::to_string(p.kv_lora + p.qk_rope) + ")");
  keep.append(c);
  h->qk_rope = p.qk_rope;
  h->graph = std::make_unique<Deepseek2Graph>(p, std::move(ls), graph_linear(embed, "embed", keep),
                                              graph_floats(output_norm, "output_norm", keep),
                                              graph_linear(head, "head", keep), c.mutable_data(),
                                              static_cast<int>(c.shape(1)));
  return h;
}

py::array_t<float> graph_forward(GraphHandle& h, const py::handle& tokens, int start, const py::handle& cos2,
                                 const py::handle& sin2, bool last_only) {
  auto tk = as_array<int32_t>(tokens, "tokens");
  auto c2 = as_array<float>(cos2, "cos2");
  auto s2 = as_array<float>(sin2, "sin2");
  const py::ssize_t n = tk.size();
  if (tk.ndim() != 1) throw py::value_error("tokens must have 1 dimension");
  for (const auto* a : {&c2, &s2})
    if (a->ndim() != 2 || a->shape(0) != n || a->shape(1) != h.qk_rope)
      throw py::value_error("cos2 and sin2 must have shape (" + std::to_string(n) + ", " + std::to_string(h.qk_rope) +
                            ")");
  py::array_t<float> logits({last_only ? py::ssize_t{1} : n, static_cast<py::ssize_t>(h.graph->vocab())});
  const int32_t* tp = tk.data();
  const float* cp = c2.data();
  const float* sp = s2.data();
  float* lp = logits.mutable_data();
  {
    py::gil_scoped_release release;
    h.graph->forward(tp, static_cast<int>(n), start, cp, sp, last_only, lp);
  }
  return logits;
}

py::dict graph_profile(const GraphHandle& h) {
  const GraphProfile& prof = h.graph->profile();
  py::dict seconds;
  for (int op = 0; op < GraphProfile::kCount; ++op) seconds[GraphProfile::name(op)] = prof.seconds[op];
  py::dict out;
  out["seconds"] = seconds;
  out["calls"] = prof.calls;
  out["tokens"] = prof.tokens;
  return out;
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
        "y[t] = sum_k w[t,k] * down_e(silu(gate_e x[t]) * up_e x[t]), e = ids[t,k], fp32, slot order.");
  m.def("dequantize", &dequantize_py, py::arg("raw"), py::arg("ggml_type"), py::arg("n"),
        "Scalar reference dequantization of n values.");
  m.def("activation_roundtrip", &activation_roundtrip_py, py::arg("x"), py::arg("ggml_type"),
        "The activation values the kernels of ggml_type actually multiply (x after Q8_K / Q8_0 rounding).");
  py::class_<GraphHandle>(m, "Deepseek2Graph",
                          "A whole DeepSeek-V2 forward pass on the native kernels over caller-owned arrays.")
      .def(py::init(&make_graph), py::arg("params"), py::arg("layers"), py::arg("embed"), py::arg("output_norm"),
           py::arg("head"), py::arg("cache"))
      .def("forward", &graph_forward, py::arg("tokens"), py::arg("start"), py::arg("cos2"), py::arg("sin2"),
           py::arg("last_only") = false,
           "logits [n or 1, vocab] of tokens [n] at positions start..; writes their cache rows.")
      .def("profile", &graph_profile, "{'seconds': {op: s}, 'calls': n, 'tokens': n} since the last reset.")
      .def("reset_profile", [](GraphHandle& h) { h.graph->reset_profile(); });
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
