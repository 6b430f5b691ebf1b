// pocketmoe._native: numpy bindings of the native CPU kernels. The GIL is released while they run.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "pocketmoe/act_quant.h"
#include "pocketmoe/engine.h"
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

MoEWeights expert_weights(const py::array& a, const char* name, int ggml_type) {
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
  m.def("set_num_threads", &set_num_threads, py::arg("n"));
  m.def("get_num_threads", &get_num_threads);
  m.def("describe", &describe);
  m.def("cpu_supported", &cpu_supported);
  m.def("supported_types", &supported_types);
}
