// pocketmoe._native's DeepSeek-V4 ops (pocketmoe/ops.h hc_* and dsv4_attention, pocketmoe/dsv4.h): the mHC
// mixing, the attention core, and the coarse ops whose weights are bound once in a handle (an mHC site, an
// attention sublayer, an MoE sublayer) and called with the step's arrays. Shapes are checked here.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "bind_util.h"
#include "pocketmoe/dsv4.h"

namespace pocketmoe::bind {
namespace {

py::array_t<float> dsv4_attend_py(const py::array& q, const py::array& cache, const py::array& key_offsets,
                                  const py::array& starts, const py::array& sinks, float scale) {
  auto qa = checked<float>(q, "q", 3);
  const py::ssize_t t = qa.shape(0), h = qa.shape(1), d = qa.shape(2);
  const KVType type = kv_type_of(cache, -1, -1, /*written=*/false);
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
  const float* qp = qa.data();
  const void* cp = cache.data();
  const int64_t* kp = ko.data();
  float* op = out.mutable_data();
  const size_t n_values = static_cast<size_t>(cache.size());
  run(static_cast<size_t>(ko.shape(0)) * d * 4, [&] {
    dsv4_attention(qp, static_cast<int>(t), static_cast<int>(h), static_cast<int>(d), scale, sp, cp, type, n_values,
                   kp, s, op);
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

// ---- mHC site: fn, scale, base bound once; pre (M = (2 + n) * n rows of fn) or head (n rows).
struct HCSiteHandle {
  HCSite s;
  int d = 0;
  std::vector<py::object> keep;
};

HCSiteHandle make_hc_site(const py::object& fn, const py::array& scale, const py::array& base, int n, int iters,
                          float eps, float rms_eps) {
  HCSiteHandle h;
  h.s.fn = optional_weight(fn, h.keep);
  if (h.s.fn == nullptr || n <= 0 || h.s.fn->cols % n) throw py::value_error("an mHC site needs fn [M, n * D]");
  const int rows = h.s.fn->rows;
  if (rows != (2 + n) * n && rows != n)
    throw py::value_error("an mHC site's fn has " + std::to_string(rows) + " rows; " + std::to_string(n) +
                          " streams need " + std::to_string((2 + n) * n) + " (a sublayer's) or " + std::to_string(n) +
                          " (the head's)");
  if (iters < 1) throw py::value_error("an mHC site needs at least one Sinkhorn iteration");
  h.s.scale = kept_vector(scale, "scale", rows == n ? 1 : 3, h.keep);
  h.s.base = kept_vector(base, "base", rows, h.keep);
  h.s.n = n, h.s.iters = iters, h.s.eps = eps, h.s.rms_eps = rms_eps;
  h.d = h.s.fn->cols / n;
  return h;
}

py::array_t<float> streams_of(const HCSiteHandle& h, const py::array& x) {
  auto xa = checked<float>(x, "x", 3);
  if (xa.shape(1) != h.s.n || xa.shape(2) != h.d)
    throw py::value_error("x must be [T, " + std::to_string(h.s.n) + ", " + std::to_string(h.d) + "]");
  return xa;
}

py::tuple hc_pre_py(const HCSiteHandle& h, const py::array& x) {
  if (h.s.fn->rows == h.s.n) throw py::value_error("this mHC site is the head's: call head");
  auto xa = streams_of(h, x);
  const py::ssize_t t = xa.shape(0), n = h.s.n;
  py::array_t<float> y({t, static_cast<py::ssize_t>(h.d)}), post({t, n}), comb({t, n, n});
  const float* xp = xa.data();
  float *yp = y.mutable_data(), *pp = post.mutable_data(), *cp = comb.mutable_data();
  run(weight_bytes(*h.s.fn), [&] { hc_pre(h.s, xp, static_cast<int>(t), h.d, yp, pp, cp); });
  return py::make_tuple(y, post, comb);
}

py::array_t<float> hc_head_py(const HCSiteHandle& h, const py::array& x) {
  if (h.s.fn->rows != h.s.n) throw py::value_error("this mHC site is a sublayer's: call pre");
  auto xa = streams_of(h, x);
  const py::ssize_t t = xa.shape(0);
  py::array_t<float> y({t, static_cast<py::ssize_t>(h.d)});
  const float* xp = xa.data();
  float* yp = y.mutable_data();
  run(weight_bytes(*h.s.fn), [&] { hc_head(h.s, xp, static_cast<int>(t), h.d, yp); });
  return y;
}

// ---- Attention sublayer: its compressors, indexer and weights bound once.
struct CompressorHandle {
  DSV4Compressor k;
  std::vector<py::object> keep;
};

CompressorHandle make_compressor(const py::object& wkv, const py::object& wgate, const py::array& ape,
                                 const py::array& norm, int ratio, int dim, float eps, int kv, int score, int entry) {
  CompressorHandle h;
  h.k.wkv = optional_weight(wkv, h.keep);
  h.k.wgate = optional_weight(wgate, h.keep);
  if (!h.k.wkv || !h.k.wgate || ratio <= 0 || dim <= 0)
    throw py::value_error("a compressor needs its kv and gate weights, a positive ratio and entry dims");
  const int c = ratio == 4 ? 2 * dim : dim;
  auto a = checked<float>(ape, "ape", 2);
  if (a.shape(0) != ratio || a.shape(1) != c)
    throw py::value_error("ape must be [" + std::to_string(ratio) + ", " + std::to_string(c) + "]");
  h.keep.push_back(ape);
  h.k.ape = a.data();
  h.k.norm = kept_vector(norm, "norm", dim, h.keep);
  h.k.ratio = ratio, h.k.dim = dim, h.k.eps = eps, h.k.kv = kv, h.k.score = score, h.k.entry = entry;
  if (kv < 0 || score < 0 || entry < 0) throw py::value_error("a compressor's cache offsets must not be negative");
  return h;
}

struct IndexerHandle {
  DSV4Indexer i;
  std::vector<py::object> keep;
};

IndexerHandle make_indexer(const py::object& wq_b, const py::object& proj, const py::object& comp, int n_head,
                           int head_dim, int top_k, float w_scale) {
  IndexerHandle h;
  h.i.wq_b = optional_weight(wq_b, h.keep);
  h.i.proj = optional_weight(proj, h.keep);
  if (!h.i.wq_b || !h.i.proj || comp.is_none()) throw py::value_error("an indexer needs q_b, proj and a compressor");
  h.i.comp = comp.cast<const CompressorHandle&>().k;
  h.keep.push_back(comp);
  h.i.n_head = n_head, h.i.head_dim = head_dim, h.i.top_k = top_k, h.i.w_scale = w_scale;
  return h;
}

struct AttentionHandle {
  DSV4Attention a;
  std::vector<py::object> keep;
};

AttentionHandle make_attention(const py::tuple& shape, const py::object& wq_a, const py::array& q_a_norm,
                               const py::object& wq_b, const py::object& wkv, const py::array& kv_norm,
                               const py::array& sinks, const py::object& wo_a, const py::object& wo_b,
                               const py::object& comp, const py::object& idx) {
  AttentionHandle h;
  DSV4Attention& a = h.a;
  if (shape.size() != 9)
    throw py::value_error("shape is (n_head, head_dim, n_rot, o_groups, window, ratio, eps, scale, kv_offset)");
  a.n_head = shape[0].cast<int>(), a.head_dim = shape[1].cast<int>(), a.n_rot = shape[2].cast<int>();
  a.o_groups = shape[3].cast<int>(), a.window = shape[4].cast<int>(), a.ratio = shape[5].cast<int>();
  a.eps = shape[6].cast<float>(), a.scale = shape[7].cast<float>(), a.kv = shape[8].cast<int>();
  a.wq_a = optional_weight(wq_a, h.keep), a.wq_b = optional_weight(wq_b, h.keep), a.wkv = optional_weight(wkv, h.keep);
  a.wo_a = optional_weight(wo_a, h.keep), a.wo_b = optional_weight(wo_b, h.keep);
  if (!a.wq_a || !a.wq_b || !a.wkv || !a.wo_a || !a.wo_b)
    throw py::value_error("a DeepSeek-V4 attention sublayer needs wq_a, wq_b, wkv, wo_a and wo_b");
  if (a.n_head <= 0 || a.head_dim <= 0 || a.window <= 0 || a.kv < 0)
    throw py::value_error("heads, head dims and the window must be positive");
  a.q_a_norm = kept_vector(q_a_norm, "q_a_norm", a.wq_a->rows, h.keep);
  a.kv_norm = kept_vector(kv_norm, "kv_norm", a.head_dim, h.keep);
  a.sinks = kept_vector(sinks, "sinks", a.n_head, h.keep);
  if (!comp.is_none()) a.comp = &comp.cast<const CompressorHandle&>().k, h.keep.push_back(comp);
  if (!idx.is_none()) a.idx = &idx.cast<const IndexerHandle&>().i, h.keep.push_back(idx);
  return h;
}

// x [T, D]; cache: the layer's rows [P, W]; the step's positions, seq, write_rows [T], page table [S, Pw]; the
// layer's rope tables [Pr, R] by position -> out [T, D].
py::array_t<float> attention_py(const AttentionHandle& h, const py::array& x, const py::array& cache,
                                const py::array& positions, const py::array& seq, const py::array& write_rows,
                                const py::array& table, int page, const py::array& cos2, const py::array& sin2) {
  const DSV4Attention& a = h.a;
  auto xa = rows_of(x, "x", a.wq_a->cols);
  const py::ssize_t n = xa.shape(0);
  const KVType type = kv_type_of(cache, 2, -1);
  auto ta = checked<int32_t>(table, "page_table", 2);
  auto c = rows_of(cos2, "cos2", a.n_rot), s = rows_of(sin2, "sin2", a.n_rot);
  if (c.shape(0) != s.shape(0)) throw py::value_error("cos2 and sin2 need the same rows");
  if (page <= 0) throw py::value_error("page must be positive");
  DSV4Step st;
  st.positions = ints_of(positions, "positions", n);
  st.kv = KVLayout{ints_of(seq, "seq", n), nullptr, ints_of(write_rows, "write_rows", n), ta.data(),
                   static_cast<int>(ta.shape(0)), static_cast<int>(ta.shape(1)), page, static_cast<int>(cache.shape(0)),
                   type};
  st.cos2 = c.data(), st.sin2 = s.data(), st.rope_rows = static_cast<int>(c.shape(0));
  py::array_t<float> out({n, static_cast<py::ssize_t>(a.wo_b->rows)});
  const float* xp = xa.data();
  void* cp = py::array(cache).mutable_data();
  float* op = out.mutable_data();
  const int width = static_cast<int>(cache.shape(1));
  run(size_t{1} << 20, [&] { dsv4_attention_sublayer(a, xp, static_cast<int>(n), cp, width, st, op); });
  return out;
}

// ---- MoE sublayer: router, hash table or bias, routed and shared experts bound once.
struct MoEHandle {
  DSV4MoE m;
  std::vector<py::object> keep;
};

MoEHandle make_moe(const py::object& gate, const py::object& tid2eid, const py::object& bias, int top_k, bool norm,
                   float scale, float weight_sum_min, const py::array& gate_e, int gate_type, const py::array& up,
                   int up_type, const py::array& down, int down_type, int n_experts, int ffn,
                   const py::object& shared_gate, const py::object& shared_up, const py::object& shared_down,
                   float shared_limit) {
  MoEHandle h;
  DSV4MoE& m = h.m;
  m.gate = optional_weight(gate, h.keep);
  if (m.gate == nullptr) throw py::value_error("a DeepSeek-V4 MoE sublayer needs its router weight");
  m.n_experts = n_experts, m.top_k = top_k, m.norm = norm, m.scale = scale, m.weight_sum_min = weight_sum_min;
  if (!tid2eid.is_none()) {
    auto t = checked<int32_t>(tid2eid.cast<py::array>(), "tid2eid", 2);
    if (t.shape(1) != top_k) throw py::value_error("tid2eid must be [vocab, " + std::to_string(top_k) + "]");
    m.tid2eid = t.data(), m.vocab = static_cast<int>(t.shape(0));
    h.keep.push_back(tid2eid);
  }
  m.bias = kept_vector(bias, "bias", n_experts, h.keep);
  m.gate_e = expert_weights(gate_e, "gate", gate_type);
  m.up = expert_weights(up, "up", up_type);
  m.down = expert_weights(down, "down", down_type);
  h.keep.push_back(gate_e), h.keep.push_back(up), h.keep.push_back(down);
  m.ffn = ffn, m.shared_limit = shared_limit;
  m.shared_gate = optional_weight(shared_gate, h.keep);
  m.shared_up = optional_weight(shared_up, h.keep);
  m.shared_down = optional_weight(shared_down, h.keep);
  const bool shared = m.shared_gate != nullptr;
  if (shared != (m.shared_up != nullptr) || shared != (m.shared_down != nullptr))
    throw py::value_error("a shared expert needs all of gate, up and down");
  return h;
}

// The routed experts' clamp comes with each call: it belongs to the expert bank, which may change it.
py::array_t<float> moe_py(const MoEHandle& h, const py::array& x, const py::array& tokens, float limit) {
  auto xa = rows_of(x, "x", h.m.gate->cols);
  const py::ssize_t n = xa.shape(0);
  auto ta = checked<int64_t>(tokens, "tokens", 1);
  if (ta.shape(0) != n) throw py::value_error("tokens must hold one id per row of x");
  py::array_t<float> y({n, static_cast<py::ssize_t>(h.m.gate->cols)});
  const float* xp = xa.data();
  const int64_t* tp = ta.data();
  float* yp = y.mutable_data();
  DSV4MoE m = h.m;
  m.limit = limit;
  {
    py::gil_scoped_release release;
    dsv4_moe(m, xp, tp, static_cast<int>(n), yp);
  }
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
  py::class_<HCSiteHandle>(m, "HCSite", "A DeepSeek-V4 mHC site (fn, scale, base): a sublayer's or the head's.")
      .def(py::init(&make_hc_site), py::arg("fn"), py::arg("scale"), py::arg("base"), py::arg("n"), py::arg("iters"),
           py::arg("eps"), py::arg("rms_eps"))
      .def("pre", &hc_pre_py, py::arg("x"),
           "streams [T, n, D] -> (sum_i pre_i x_i [T, D], post [T, n], comb [T, n, n])")
      .def("head", &hc_head_py, py::arg("x"), "streams [T, n, D] -> sum_i pre_i x_i [T, D]");
  py::class_<CompressorHandle>(m, "DSV4Compressor", "A DeepSeek-V4 compressor's weights and cache offsets.")
      .def(py::init(&make_compressor), py::arg("wkv"), py::arg("wgate"), py::arg("ape"), py::arg("norm"),
           py::arg("ratio"), py::arg("dim"), py::arg("eps"), py::arg("kv"), py::arg("score"), py::arg("entry"));
  py::class_<IndexerHandle>(m, "DSV4Indexer", "A DeepSeek-V4 lightning indexer's weights and compressor.")
      .def(py::init(&make_indexer), py::arg("wq_b"), py::arg("proj"), py::arg("compressor"), py::arg("n_head"),
           py::arg("head_dim"), py::arg("top_k"), py::arg("w_scale"));
  py::class_<AttentionHandle>(m, "DSV4AttentionSublayer", "A DeepSeek-V4 attention sublayer's weights.")
      .def(py::init(&make_attention), py::arg("shape"), py::arg("wq_a"), py::arg("q_a_norm"), py::arg("wq_b"),
           py::arg("wkv"), py::arg("kv_norm"), py::arg("sinks"), py::arg("wo_a"), py::arg("wo_b"),
           py::arg("compressor"), py::arg("indexer"))
      .def("__call__", &attention_py, py::arg("x"), py::arg("cache"), py::arg("positions"), py::arg("seq"),
           py::arg("write_rows"), py::arg("page_table"), py::arg("page"), py::arg("cos2"), py::arg("sin2"),
           "x [T, D] -> [T, D]; writes the rows' cache values and the entries of the blocks they complete.");
  py::class_<MoEHandle>(m, "DSV4MoESublayer", "A DeepSeek-V4 MoE sublayer's router, routed and shared experts.")
      .def(py::init(&make_moe), py::arg("gate"), py::arg("tid2eid"), py::arg("bias"), py::arg("top_k"), py::arg("norm"),
           py::arg("scale"), py::arg("weight_sum_min"), py::arg("gate_exps"), py::arg("gate_type"), py::arg("up_exps"),
           py::arg("up_type"), py::arg("down_exps"), py::arg("down_type"), py::arg("n_experts"), py::arg("ffn"),
           py::arg("shared_gate"), py::arg("shared_up"), py::arg("shared_down"),
           py::arg("shared_limit"))
      .def("__call__", &moe_py, py::arg("x"), py::arg("tokens"), py::arg("limit"),
           "x [T, D], tokens int64 [T], the routed experts' SwiGLU clamp (0: none) -> routed + shared [T, D]");
}

}  // namespace pocketmoe::bind
