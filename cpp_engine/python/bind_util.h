// What the binding files of pocketmoe._native share: array checks, the weight handle, running without the GIL.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>
#include <type_traits>
#include <vector>

#include "pocketmoe/ops.h"
#include "pocketmoe/runtime.h"

namespace pocketmoe::bind {

namespace py = pybind11;

template <class T>
const char* dtype_name() {
  if constexpr (std::is_same_v<T, uint8_t>) return "uint8";
  if constexpr (std::is_same_v<T, int32_t>) return "int32";
  if constexpr (std::is_same_v<T, int64_t>) return "int64";
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

// A KV cache array: float32, float16, or uint16 holding bfloat16 bits (numpy has no bfloat16), C-contiguous
// (and writeable unless the op only reads it) with `ndim` dimensions (any with ndim < 0), the last of w values (any
// with w < 0).
inline KVType kv_type_of(const py::array& cache, int ndim, int w, bool written = true) {
  KVType type;
  if (cache.dtype().is(py::dtype::of<float>())) {
    type = KVType::kF32;
  } else if (cache.dtype().is(py::dtype("float16"))) {
    type = KVType::kF16;
  } else if (cache.dtype().is(py::dtype::of<uint16_t>())) {
    type = KVType::kBF16;
  } else {
    throw py::value_error("cache must be float32, float16 or uint16 (bfloat16 bits), got " +
                          std::string(py::str(cache.dtype())));
  }
  if (!(cache.flags() & py::array::c_style)) throw py::value_error("cache must be C-contiguous");
  if (written && !cache.writeable()) throw py::value_error("cache must be writeable");
  if (ndim >= 0 && cache.ndim() != ndim)
    throw py::value_error("cache must have " + std::to_string(ndim) + " dimensions, got " +
                          std::to_string(cache.ndim()));
  if (w >= 0 && cache.shape(cache.ndim() - 1) != w)
    throw py::value_error("cache rows have " + std::to_string(cache.shape(cache.ndim() - 1)) + " values, expected " +
                          std::to_string(w));
  return type;
}

// A weight and the array it points into (kept alive by the handle).
struct WeightHandle {
  Weight w;
  py::array keep;
};

// x as float32 [T, d] (C order): T = rows; d must match when given.
inline py::array_t<float> rows_of(const py::array& x, const char* name, py::ssize_t d) {
  auto a = checked<float>(x, name, 2);
  if (d >= 0 && a.shape(1) != d)
    throw py::value_error(std::string(name) + " rows have " + std::to_string(a.shape(1)) + " values, expected " +
                          std::to_string(d));
  return a;
}

inline const float* vector_of(const py::object& v, const char* name, py::ssize_t n) {
  if (v.is_none()) return nullptr;
  auto a = checked<float>(v.cast<py::array>(), name, 1);
  if (a.shape(0) != n)
    throw py::value_error(std::string(name) + " has " + std::to_string(a.shape(0)) + " values, expected " +
                          std::to_string(n));
  return a.data();
}

inline const int32_t* ints_of(const py::array& v, const char* name, py::ssize_t n) {
  auto a = checked<int32_t>(v, name, 1);
  if (a.shape(0) != n)
    throw py::value_error(std::string(name) + " has " + std::to_string(a.shape(0)) + " values, expected " +
                          std::to_string(n));
  return a.data();
}

// Runs f without the GIL when the call moves at least this many bytes of weights (else it is too short).
template <class F>
void run(size_t work, F&& f) {
  if (work < (size_t{64} << 10)) {
    f();
  } else {
    py::gil_scoped_release release;
    f();
  }
}

inline size_t weight_bytes(const Weight& w) { return static_cast<size_t>(w.heads) * w.rows * w.row_bytes; }

inline const Weight* optional_weight(const py::object& h, std::vector<py::object>& keep) {
  if (h.is_none()) return nullptr;
  keep.push_back(h);
  return &h.cast<const WeightHandle&>().w;
}

inline const float* kept_vector(const py::object& v, const char* name, py::ssize_t n, std::vector<py::object>& keep) {
  const float* p = vector_of(v, name, n);
  if (p != nullptr) keep.push_back(v);
  return p;
}

// uint8 GGUF blocks, C-contiguous, or [E, rows, row_bytes] with each expert's rows contiguous and any
// stride between experts (one half of a fused gate_up tensor, as numpy slices it).
inline MoEWeights expert_weights(const py::array& a, const char* name, int ggml_type) {
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

// The DeepSeek-V4 ops (bind_dsv4.cpp).
void bind_dsv4(py::module_& m);

}  // namespace pocketmoe::bind
