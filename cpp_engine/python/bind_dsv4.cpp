// pocketmoe._native's DeepSeek-V4 ops (pocketmoe/ops.h hc_* and dsv4_attention): the mHC mixing and the
// attention core. Shapes are checked here.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <string>
#include <vector>

#include "bind_util.h"

namespace pocketmoe::bind {
namespace {

py::array_t<float> dsv4_attend_py(const py::array& q, const py::array& cache, const py::array& key_offsets,
                                  const py::array& starts, const py::array& sinks, float scale) {
  auto qa = checked<float>(q, "q", 3);
  const py::ssize_t t = qa.shape(0), h = qa.shape(1), d = qa.shape(2);
  auto ca = checked<float>(cache, "cache", -1);
  auto ko = checked<int64_t>(key_offsets, "key_offsets", 1);
  auto st = checked<int32_t>(starts, "starts", 1);
  const float* sp = vector_of(sinks, "sinks", h);
  if (st.shape(0) != t + 1) throw py::value_error("starts must hold T + 1 = " + std::to_string(t + 1) + " values");
  const int32_t* s = st.data();
  for (py::ssize_t i = 0; i < t; ++i)
    if (s[i + 1] < s[i]) throw py::value_error("starts must not decrease");
  if (t > 0 && s[t] != ko.shape(0))
    throw py::value_error("starts ends at " + std::to_string(s[t]) + " but key_offsets holds " +
                          std::to_string(ko.shape(0)) + " keys");
  py::array_t<float> out({t, h, d});
  const float *qp = qa.data(), *cp = ca.data();
  const int64_t* kp = ko.data();
  float* op = out.mutable_data();
  const size_t n_values = static_cast<size_t>(ca.size());
  run(static_cast<size_t>(ko.shape(0)) * d * 4, [&] {
    dsv4_attention(qp, static_cast<int>(t), static_cast<int>(h), static_cast<int>(d), scale, sp, cp, n_values, kp, s,
                   op);
  });
  return out;
}

py::array_t<float> hc_sinkhorn_py(const py::array& softmax, int iters, float eps) {
  auto a = checked<float>(softmax, "comb", 3);
  const py::ssize_t t = a.shape(0), n = a.shape(1);
  if (a.shape(2) != n) throw py::value_error("comb must be [T, n, n], got a last dimension of " +
                                             std::to_string(a.shape(2)) + " for n = " + std::to_string(n));
  if (iters < 1) throw py::value_error("hc_sinkhorn needs at least one iteration");
  py::array_t<float> y({t, n, n});
  std::copy(a.data(), a.data() + a.size(), y.mutable_data());
  hc_sinkhorn(y.mutable_data(), static_cast<int>(t), static_cast<int>(n), iters, eps);
  return y;
}

py::array_t<float> hc_mix_py(const py::array& x, const py::array& w) {
  auto xa = checked<float>(x, "x", 3);
  auto wa = checked<float>(w, "w", 2);
  const py::ssize_t t = xa.shape(0), n = xa.shape(1), d = xa.shape(2);
  if (wa.shape(0) != t || wa.shape(1) != n)
    throw py::value_error("w must be [" + std::to_string(t) + ", " + std::to_string(n) + "] for x [T, n, D]");
  py::array_t<float> y({t, d});
  hc_mix(xa.data(), wa.data(), static_cast<int>(t), static_cast<int>(n), static_cast<int>(d), y.mutable_data());
  return y;
}

py::array_t<float> hc_post_py(const py::array& out, const py::array& x, const py::array& post, const py::array& comb) {
  auto xa = checked<float>(x, "x", 3);
  const py::ssize_t t = xa.shape(0), n = xa.shape(1), d = xa.shape(2);
  auto oa = rows_of(out, "out", d);
  auto pa = rows_of(post, "post", n);
  auto ca = checked<float>(comb, "comb", 3);
  if (oa.shape(0) != t || pa.shape(0) != t || ca.shape(0) != t || ca.shape(1) != n || ca.shape(2) != n)
    throw py::value_error("hc_post wants out [T, D], x [T, n, D], post [T, n] and comb [T, n, n] for T = " +
                          std::to_string(t) + ", n = " + std::to_string(n));
  py::array_t<float> y({t, n, d});
  hc_post(oa.data(), xa.data(), pa.data(), ca.data(), static_cast<int>(t), static_cast<int>(n), static_cast<int>(d),
          y.mutable_data());
  return y;
}

}  // namespace

void bind_dsv4(py::module_& m) {
  m.def("dsv4_attend", &dsv4_attend_py, py::arg("q"), py::arg("cache"), py::arg("key_offsets"), py::arg("starts"),
        py::arg("sinks"), py::arg("scale"),
        "DeepSeek-V4 attention: q [T, H, d] over each query's keys (cache value offsets key_offsets[starts[t]:"
        "starts[t+1]], K = V), softmax with the heads' sinks -> [T, H, d].");
  m.def("hc_sinkhorn", &hc_sinkhorn_py, py::arg("softmax"), py::arg("iters"), py::arg("eps"),
        "DeepSeek-V4 mHC: comb [T, n, n] from its row softmax (+ eps, columns, then iters - 1 rows and columns).");
  m.def("hc_mix", &hc_mix_py, py::arg("x"), py::arg("w"), "y [T, D] = sum_i w[:, i] * x[:, i] in stream order.");
  m.def("hc_post", &hc_post_py, py::arg("out"), py::arg("x"), py::arg("post"), py::arg("comb"),
        "streams [T, n, D]: stream j = out * post_j + sum_i x_i * comb[i, j].");
}

}  // namespace pocketmoe::bind
