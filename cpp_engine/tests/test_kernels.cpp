// Standalone tests of the native kernels against the scalar reference (dequant_ref.cpp):
//   cmake --build cpp_engine/build -j1 && cpp_engine/build/test_kernels
#include <immintrin.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "pocketmoe/act_quant.h"
#include "pocketmoe/runtime.h"
#include "pocketmoe/matmul.h"
#include "pocketmoe/ops.h"
#include "pocketmoe/samples.h"
#include "pocketmoe/silu.h"
#include "pocketmoe/thread_pool.h"
#include "pocketmoe/types.h"
#include "../src/kernels.h"
#include "../src/workspace.h"

using namespace pocketmoe;

#if PM_TEST_VNNI_EMU
namespace pocketmoe::vnni_emu {
MatmulFn integer_kernel(int ggml_type);
}  // namespace pocketmoe::vnni_emu
namespace pocketmoe::avx512_emu {
MatmulFn integer_kernel(int ggml_type);
}  // namespace pocketmoe::avx512_emu
namespace pocketmoe::amx_emu {
MatmulFn integer_kernel(int ggml_type);
}  // namespace pocketmoe::amx_emu
#endif

namespace {

int g_failures = 0;

#define CHECK(cond, ...)                                  \
  do {                                                    \
    if (!(cond)) {                                        \
      ++g_failures;                                       \
      std::printf("FAIL %s:%d: ", __FILE__, __LINE__);    \
      std::printf(__VA_ARGS__);                           \
      std::printf("\n");                                  \
    }                                                     \
  } while (0)

std::vector<float> gemm_vec(const std::vector<uint8_t>& w, int type, int rows, int cols, const std::vector<float>& x,
                            int n_tokens) {
  std::vector<float> y(static_cast<size_t>(n_tokens) * rows);
  gemm(w.data(), rows, weight_row_bytes(type_info(type), cols), type, x.data(), n_tokens, cols, y.data());
  return y;
}

// What a Q4_1 / Q5_1 row's min terms see besides the dequantized activations: per block, the min m
// multiplies the row's s (fp16(fp32 d * sum of q), llama.cpp's Q8_1 s) rather than d * sum of q.
// Returns sum_b m_b * (s_b - d_b * sum_b), 0 for other types.
double min_correction(int type, const uint8_t* wrow, const uint8_t* act, int cols) {
  if (type != kQ4_1 && type != kQ5_1) return 0.0;
  const int nb = cols / 32;
  const TypeInfo& t = type_info(type);
  const auto* d = reinterpret_cast<const float*>(act + cols);
  const auto* s = reinterpret_cast<const float*>(act + cols + 4 * nb);
  const auto* sums = reinterpret_cast<const int16_t*>(act + cols + 8 * nb);
  double c = 0;
  for (int b = 0; b < nb; ++b) {
    uint16_t m;
    std::memcpy(&m, wrow + static_cast<size_t>(b) * t.block_bytes + 2, 2);
    c += static_cast<double>(_cvtsh_ss(m)) * (static_cast<double>(s[b]) - static_cast<double>(d[b]) * sums[b]);
  }
  return c;
}

// Every output against sum_i w_i * a_i in double, where a is the activation the kernel sees (plus
// min_correction); the only difference left is float rounding: bounded by 1e-5 * sum_i |w_i a_i|.
void test_gemm_matches_reference() {
  std::mt19937 rng(7);
  for (int type : supported_types()) {
    const TypeInfo& t = type_info(type);
    const int cols = t.block_values == 1 ? 300 : 512;
    for (int rows : {1, 33, 257}) {
      const std::vector<uint8_t> w = samples::random_weight(type, rows, cols, rng);
      const size_t rb = weight_row_bytes(t, cols);
      std::vector<double> wf(static_cast<size_t>(rows) * cols);
      std::vector<float> row(cols);
      for (int r = 0; r < rows; ++r) {
        dequantize_row(type, w.data() + rb * r, cols, row.data());
        std::copy(row.begin(), row.end(), wf.begin() + static_cast<size_t>(r) * cols);
      }
      for (int n_tokens : {1, 3, 17, 64}) {
        const std::vector<float> x = samples::random_floats(static_cast<size_t>(n_tokens) * cols, rng);
        const std::vector<float> y = gemm_vec(w, type, rows, cols, x, n_tokens);
        std::vector<uint8_t> act(act_row_bytes(t.act, cols));
        std::vector<float> a(cols);
        double worst = 0;
        for (int tk = 0; tk < n_tokens; ++tk) {
          quantize_act_row(t.act, x.data() + static_cast<size_t>(tk) * cols, cols, act.data());
          dequantize_act_row(t.act, act.data(), cols, a.data());
          for (int r = 0; r < rows; ++r) {
            double ref = min_correction(type, w.data() + rb * r, act.data(), cols), mag = 0;
            for (int i = 0; i < cols; ++i) {
              ref += wf[static_cast<size_t>(r) * cols + i] * a[i];
              mag += std::fabs(wf[static_cast<size_t>(r) * cols + i] * a[i]);
            }
            worst = std::max(worst, std::fabs(y[static_cast<size_t>(tk) * rows + r] - ref) / (mag + 1e-30));
          }
        }
        CHECK(worst < 1e-5, "%s rows=%d T=%d: relative error %.3g", t.name, rows, n_tokens, worst);
      }
    }
  }
}

// A token's output is bitwise the same alone, inside a batch, and with 1 or 2 threads.
void test_gemm_bitwise_stable() {
  std::mt19937 rng(11);
  const int rows = 45, n_tokens = 19;
  for (int type : supported_types()) {
    const TypeInfo& t = type_info(type);
    const int cols = t.block_values == 1 ? 264 : 512;
    const std::vector<uint8_t> w = samples::random_weight(type, rows, cols, rng);
    const std::vector<float> x = samples::random_floats(static_cast<size_t>(n_tokens) * cols, rng);
    set_num_threads(2);
    const std::vector<float> batch = gemm_vec(w, type, rows, cols, x, n_tokens);
    set_num_threads(1);
    const std::vector<float> single_thread = gemm_vec(w, type, rows, cols, x, n_tokens);
    set_num_threads(2);
    CHECK(std::memcmp(batch.data(), single_thread.data(), batch.size() * 4) == 0, "%s: 1 vs 2 threads differ", t.name);
    for (int tk = 0; tk < n_tokens; ++tk) {
      const std::vector<float> xt(x.begin() + static_cast<size_t>(tk) * cols, x.begin() + static_cast<size_t>(tk + 1) * cols);
      const std::vector<float> alone = gemm_vec(w, type, rows, cols, xt, 1);
      CHECK(std::memcmp(alone.data(), batch.data() + static_cast<size_t>(tk) * rows, rows * 4) == 0,
            "%s: token %d alone differs from the batch", t.name, tk);
    }
  }
}

// moe_forward equals the same math spelled out with gemm calls, bit for bit.
void test_moe_matches_gemm_composition() {
  std::mt19937 rng(5);
  struct Case {
    int gate_type, down_type, hidden, ffn;
  };
  const Case cases[] = {{kQ4_K, kQ5_0, 512, 288}, {kQ4_K, kQ6_K, 256, 512}, {kQ8_0, kQ8_0, 96, 160},
                        {kF32, kF16, 40, 24}, {kIQ2_XXS, kQ4_K, 256, 256}};
  const int n_experts = 7, top_k = 3;
  for (const Case& c : cases) {
    const size_t grb = weight_row_bytes(type_info(c.gate_type), c.hidden);
    const size_t drb = weight_row_bytes(type_info(c.down_type), c.ffn);
    const auto gate = samples::random_weight(c.gate_type, n_experts * c.ffn, c.hidden, rng);
    const auto up = samples::random_weight(c.gate_type, n_experts * c.ffn, c.hidden, rng);
    const auto down = samples::random_weight(c.down_type, n_experts * c.hidden, c.ffn, rng);
    for (int n_tokens : {1, 2, 9, 40}) {
      const std::vector<float> x = samples::random_floats(static_cast<size_t>(n_tokens) * c.hidden, rng);
      std::vector<int32_t> ids(static_cast<size_t>(n_tokens) * top_k);
      std::vector<float> wts(ids.size());
      std::uniform_int_distribution<int> pick(0, n_experts - 1);
      std::uniform_real_distribution<float> weight(0.0f, 1.0f);
      for (size_t i = 0; i < ids.size(); ++i) ids[i] = pick(rng), wts[i] = weight(rng);
      std::vector<float> y(static_cast<size_t>(n_tokens) * c.hidden);
      for (int threads : {1, 2}) {
        set_num_threads(threads);
        std::vector<float> yt(y.size());
        moe_forward(x.data(), n_tokens, c.hidden, ids.data(), wts.data(), top_k,
                    {gate.data(), gate.size(), c.gate_type}, {up.data(), up.size(), c.gate_type},
                    {down.data(), down.size(), c.down_type}, n_experts, c.ffn, yt.data());
        if (threads == 1) y = yt;
        CHECK(std::memcmp(y.data(), yt.data(), y.size() * 4) == 0, "moe %d/%d: threads 1 vs 2 differ", c.gate_type,
              c.down_type);
      }
      double worst = 0;
      for (int tk = 0; tk < n_tokens; ++tk) {
        std::vector<float> acc(c.hidden, 0.0f), g(c.ffn), u(c.ffn), yd(c.hidden);
        for (int k = 0; k < top_k; ++k) {
          const int e = ids[tk * top_k + k];
          const float* xt = x.data() + static_cast<size_t>(tk) * c.hidden;
          gemm(gate.data() + grb * c.ffn * e, c.ffn, grb, c.gate_type, xt, 1, c.hidden, g.data());
          gemm(up.data() + grb * c.ffn * e, c.ffn, grb, c.gate_type, xt, 1, c.hidden, u.data());
          silu_mul(g.data(), u.data(), c.ffn);
          gemm(down.data() + drb * c.hidden * e, c.hidden, drb, c.down_type, g.data(), 1, c.ffn, yd.data());
          for (int i = 0; i < c.hidden; ++i) acc[i] = std::fma(wts[tk * top_k + k], yd[i], acc[i]);
        }
        for (int i = 0; i < c.hidden; ++i)
          worst = std::max(worst, static_cast<double>(std::fabs(acc[i] - y[static_cast<size_t>(tk) * c.hidden + i])));
      }
      CHECK(worst == 0, "moe gate %d down %d T=%d: differs from the gemm composition by %.3g", c.gate_type,
            c.down_type, n_tokens, worst);
    }
  }
}

// A shared expert run inside moe_forward's dispatches leaves the routed sum as it was and gives bitwise
// gated_ffn's output, or with its down's input made by the caller, the gemm of that input.
void test_moe_shared_expert() {
  std::mt19937 rng(8);
  struct Case {
    int routed_type, gate_type, up_type, down_type, hidden, ffn, sffn;
  };
  const Case cases[] = {{kQ4_K, kQ8_0, kIQ4_XS, kF16, 256, 256, 512}, {kQ5_0, kQ4_K, kQ4_K, kQ6_K, 512, 288, 256},
                        {kF32, kF32, kF32, kF32, 40, 24, 48}};
  const int n_experts = 7, top_k = 3;
  for (const Case& c : cases) {
    const auto gate = samples::random_weight(c.routed_type, n_experts * c.ffn, c.hidden, rng);
    const auto up = samples::random_weight(c.routed_type, n_experts * c.ffn, c.hidden, rng);
    const auto down = samples::random_weight(c.routed_type, n_experts * c.hidden, c.ffn, rng);
    const MoEWeights mg{gate.data(), gate.size(), c.routed_type}, mu{up.data(), up.size(), c.routed_type};
    const MoEWeights md{down.data(), down.size(), c.routed_type};
    const auto sg = samples::random_weight(c.gate_type, c.sffn, c.hidden, rng);
    const auto su = samples::random_weight(c.up_type, c.sffn, c.hidden, rng);
    const auto sd = samples::random_weight(c.down_type, c.hidden, c.sffn, rng);
    const auto weight = [](const std::vector<uint8_t>& w, int type, int rows, int cols) {
      return Weight{w.data(), type, 1, rows, cols, weight_row_bytes(type_info(type), cols)};
    };
    const Weight wg = weight(sg, c.gate_type, c.sffn, c.hidden), wu = weight(su, c.up_type, c.sffn, c.hidden);
    const Weight wd = weight(sd, c.down_type, c.hidden, c.sffn);
    for (int n : {1, 9, 300}) {
      const std::vector<float> x = samples::random_floats(static_cast<size_t>(n) * c.hidden, rng);
      const std::vector<float> h = samples::random_floats(static_cast<size_t>(n) * c.sffn, rng);
      std::vector<int32_t> ids(static_cast<size_t>(n) * top_k);
      std::vector<float> wts(ids.size());
      std::uniform_int_distribution<int> pick(0, n_experts - 1);
      for (size_t i = 0; i < ids.size(); ++i) ids[i] = pick(rng), wts[i] = 0.25f + 0.1f * static_cast<float>(i % 5);
      const size_t out = static_cast<size_t>(n) * c.hidden;
      std::vector<float> alone(out), routed(out), shared(out), want(out);
      moe_forward(x.data(), n, c.hidden, ids.data(), wts.data(), top_k, mg, mu, md, n_experts, c.ffn, alone.data());
      for (int form = 0; form < 2; ++form) {
        SharedFFN sh{form == 0 ? &wg : nullptr, form == 0 ? &wu : nullptr, &wd, shared.data(), h.data()};
        {
          std::unique_lock<std::mutex> lock;
          moe_forward(acquire_runtime(lock), x.data(), n, c.hidden, ids.data(), wts.data(), top_k, mg, mu, md,
                      n_experts, c.ffn, routed.data(), 0.0f, &sh);
        }
        if (form == 0)
          gated_ffn(wg, wu, wd, x.data(), n, want.data());
        else
          gemm(sd.data(), c.hidden, wd.row_bytes, c.down_type, h.data(), n, c.sffn, want.data());
        CHECK(std::memcmp(alone.data(), routed.data(), out * 4) == 0,
              "moe shared %d/%d T=%d form %d: routed sum changed", c.gate_type, c.down_type, n, form);
        CHECK(std::memcmp(want.data(), shared.data(), out * 4) == 0,
              "moe shared %d/%d T=%d form %d: shared output differs", c.gate_type, c.down_type, n, form);
      }
    }
  }
}

void test_activation_quantization() {
  std::mt19937 rng(3);
  for (ActFormat f : {ActFormat::kQ8_0, ActFormat::kQ8_K}) {
    const int cols = 1024, bv = act_block_values(f);
    std::vector<float> x = samples::random_floats(cols, rng);
    std::fill(x.begin() + bv, x.begin() + 2 * bv, 0.0f);   // an all-zero block
    std::vector<uint8_t> row(act_row_bytes(f, cols));
    std::vector<float> back(cols);
    quantize_act_row(f, x.data(), cols, row.data());
    dequantize_act_row(f, row.data(), cols, back.data());
    const auto* d = reinterpret_cast<const float*>(row.data() + cols);
    for (int b = 0; b < cols / bv; ++b) {
      float amax = 0;
      for (int i = 0; i < bv; ++i) amax = std::max(amax, std::fabs(x[b * bv + i]));
      // Half a step of rounding; a Q8_0 scale is then rounded to fp16 (as llama.cpp stores it), which moves
      // q * d by at most 2^-11 relative, that is amax * 2^-11.
      const float fp16_slack = f == ActFormat::kQ8_0 ? amax * 0x1p-11f : 0.0f;
      if (f == ActFormat::kQ8_0)
        CHECK(d[b] == _cvtsh_ss(_cvtss_sh(d[b], 0)), "format %d block %d: scale %g is not an fp16 value",
              static_cast<int>(f), b, d[b]);
      for (int i = 0; i < bv; ++i)
        CHECK(std::fabs(back[b * bv + i] - x[b * bv + i]) <= amax / 254 * 1.0001f + fp16_slack,
              "format %d block %d value %d", static_cast<int>(f), b, i);
    }
    if (f == ActFormat::kQ8_K) {
      const auto* qs = reinterpret_cast<const int8_t*>(row.data());
      const auto* bsums = reinterpret_cast<const int16_t*>(row.data() + cols + 4 * (cols / 256));
      for (int i = 0; i < cols / 16; ++i) {
        int s = 0;
        for (int j = 0; j < 16; ++j) s += qs[16 * i + j];
        CHECK(s == bsums[i], "bsum %d", i);
      }
    }
  }
}

// silu_mul against the libm formula, and the same bits wherever a value sits in the row.
void test_silu() {
  std::mt19937 rng(9);
  std::vector<float> g = samples::random_floats(1003, rng, 6.0f), u = samples::random_floats(1003, rng);
  g[0] = -100.0f, g[1] = 100.0f, g[2] = 0.0f, g[3] = -87.5f;
  std::vector<float> out = g;
  silu_mul(out.data(), u.data(), static_cast<int>(g.size()));
  for (size_t i = 0; i < g.size(); ++i) {
    const double want = g[i] / (1.0 + std::exp(-static_cast<double>(g[i]))) * u[i];
    CHECK(std::fabs(out[i] - want) <= 1e-6 * std::fabs(want) + 1e-30, "silu(%g) * %g = %g, want %g", g[i], u[i], out[i], want);
  }
  for (size_t i = 0; i + 1 < g.size(); i += 97) {
    float one = g[i];
    silu_mul(&one, &u[i], 1);
    CHECK(std::memcmp(&one, &out[i], 4) == 0, "silu at position %zu depends on its neighbours", i);
  }
}

void test_thread_pool() {
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    for (int n_items : {0, 1, 2, 7, 1000}) {
      for (int rep = 0; rep < 50; ++rep) {
        std::vector<std::atomic<int>> hits(n_items);
        pool.parallel_for(n_items, [&](int item, int thread) {
          CHECK(thread >= 0 && thread < threads, "thread id %d", thread);
          hits[item].fetch_add(1);
        });
        for (int i = 0; i < n_items; ++i) CHECK(hits[i].load() == 1, "item %d ran %d times", i, hits[i].load());
      }
    }
  }
}

// Runs back to back, each larger than the last and then small again, with items that take no time: a
// worker still leaving drain() of one run must never claim an item of the next (it did, and counted it
// twice, and the caller waited forever). A watchdog turns a hang into a failure.
void test_thread_pool_back_to_back_runs() {
  ThreadPool pool(2);
  std::atomic<bool> finished{false};
  std::atomic<int> bad{0};
  std::thread watchdog([&] {
    for (int i = 0; i < 600 && !finished.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (!finished.load()) {
      std::fprintf(stderr, "FAIL thread pool: back-to-back runs hung (an item counted twice)\n");
      std::_Exit(1);
    }
  });
  std::vector<std::atomic<int>> hits(64);
  for (int rep = 0; rep < 1000000; ++rep) {
    const int n_items = rep % 3 == 0 ? 1 : (rep % 3 == 1 ? 2 : 64);
    for (int i = 0; i < n_items; ++i) hits[i].store(0);
    pool.parallel_for(n_items, [&](int item, int) { hits[item].fetch_add(1); });
    for (int i = 0; i < n_items; ++i) bad += hits[i].load() != 1;
  }
  finished.store(true);
  watchdog.join();
  CHECK(bad.load() == 0, "%d items ran other than once in back-to-back runs", bad.load());
}

void test_errors() {
  auto throws = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const std::invalid_argument&) {
      return true;
    }
    return false;
  };
  std::vector<uint8_t> w(144);
  std::vector<float> x(256), y(1);
  CHECK(throws([&] { gemm(w.data(), 1, 144, 3, x.data(), 1, 256, y.data()); }), "Q4_1 has no kernel");
  CHECK(throws([&] { gemm(w.data(), 1, 143, kQ4_K, x.data(), 1, 256, y.data()); }), "row bytes mismatch");
  CHECK(throws([&] { gemm(w.data(), 1, 144, kQ4_K, x.data(), 1, 250, y.data()); }), "cols not a block multiple");
}

// gemm_batched: every head bitwise equal to gemm on that head alone, for 1 and 2 threads.
void test_gemm_batched_matches_gemm() {
  std::mt19937 rng(12);
  for (int type : supported_types()) {
    const TypeInfo& t = type_info(type);
    for (const auto& [heads, rows, cols, n_tokens] :
         {std::array<int, 4>{16, 128, 512, 1}, std::array<int, 4>{4, 40, 256, 3}, std::array<int, 4>{3, 24, 512, 17}}) {
      const size_t rb = weight_row_bytes(t, cols);
      const std::vector<uint8_t> w = samples::random_weight(type, heads * rows, cols, rng);
      const std::vector<float> x = samples::random_floats(static_cast<size_t>(heads) * n_tokens * cols, rng);
      for (int threads : {1, 2}) {
        set_num_threads(threads);
        std::vector<float> y(static_cast<size_t>(heads) * n_tokens * rows);
        gemm_batched(w.data(), heads, rows, rb, type, x.data(), n_tokens, cols, y.data());
        for (int h = 0; h < heads; ++h) {
          std::vector<float> yh(static_cast<size_t>(n_tokens) * rows);
          gemm(w.data() + rb * rows * h, rows, rb, type, x.data() + static_cast<size_t>(h) * n_tokens * cols, n_tokens,
               cols, yh.data());
          CHECK(std::memcmp(yh.data(), y.data() + static_cast<size_t>(h) * n_tokens * rows, yh.size() * 4) == 0,
                "%s H=%d T=%d threads=%d: head %d differs from gemm", t.name, heads, n_tokens, threads, h);
        }
      }
    }
  }
  set_num_threads(2);
}

// gemm_multi: each weight's output bitwise equal to gemm on it alone, with mixed activation formats.
void test_gemm_multi_matches_gemm() {
  std::mt19937 rng(13);
  const int cols = 512;
  const int types[4] = {kQ4_K, kQ8_0, kF32, kQ6_K};
  const int rows[4] = {40, 17, 9, 64};
  std::vector<std::vector<uint8_t>> w;
  for (int i = 0; i < 4; ++i) w.push_back(samples::random_weight(types[i], rows[i], cols, rng));
  for (int n_tokens : {1, 3, 17}) {
    const std::vector<float> x = samples::random_floats(static_cast<size_t>(n_tokens) * cols, rng);
    for (int threads : {1, 2}) {
      set_num_threads(threads);
      std::vector<std::vector<float>> y(4);
      GemmOp ops[4];
      for (int i = 0; i < 4; ++i) {
        y[i].resize(static_cast<size_t>(n_tokens) * rows[i]);
        ops[i] = {w[i].data(), rows[i], weight_row_bytes(type_info(types[i]), cols), types[i], y[i].data()};
      }
      {
        std::unique_lock<std::mutex> lock;
        gemm_multi(acquire_runtime(lock), ops, 4, x.data(), n_tokens, cols);
      }
      for (int i = 0; i < 4; ++i) {
        const std::vector<float> alone = gemm_vec(w[i], types[i], rows[i], cols, x, n_tokens);
        CHECK(std::memcmp(alone.data(), y[i].data(), alone.size() * 4) == 0, "%s T=%d threads=%d: differs from gemm",
              type_info(types[i]).name, n_tokens, threads);
      }
    }
  }
  set_num_threads(2);
}

}  // namespace

// `table` against the AVX2 kernels, bit for bit: every integer type, the fused (T <= 4) and the
// repacked paths, and row counts that leave tails of the 8-row groups.
void check_matches_avx2(const char* name, KernelTable table, uint32_t seed) {
  for (int rows : {1, 7, 33, 257}) {
    const std::string diff = compare_with_avx2(table, {1, 2, 3, 4, 5, 17, 30, 64, 80}, rows, seed++);
    CHECK(diff.empty(), "%s, %d rows: %s", name, rows, diff.c_str());
  }
}

// The VNNI kernel source with SIMDe standing in for vpdpbusd and vpdpwssd, on any CPU.
#if PM_TEST_VNNI_EMU
void test_vnni_kernels_match_avx2() { check_matches_avx2("vnni_emu", vnni_emu::integer_kernel, 11); }

// The AVX-512 set's source (512-bit repacked tiles) with SIMDe standing in for every AVX-512 instruction.
void test_avx512_kernels_match_avx2() { check_matches_avx2("avx512_emu", avx512_emu::integer_kernel, 13); }

// The AMX set's source with the tile instructions emulated (and SIMDe's AVX-512).
void test_amx_kernels_match_avx2() { check_matches_avx2("amx_emu", amx_emu::integer_kernel, 17); }
#endif

// The VNNI kernels on this CPU's own vpdpbusd / vpdpwssd, where it has them (and the dispatcher then
// runs every other test here on them too).
void test_native_vnni_kernels_match_avx2() {
  const std::pair<const char*, KernelTable> sets[] = {
      {"amx", amx::integer_kernel},
      {"avx512vnni", avx512vnni::integer_kernel},
      {"avxvnni", avxvnni::integer_kernel},
  };
  for (const auto& [name, table] : sets) {
    if (!cpu_has_isa(name) || table(kQ4_K) == nullptr) {
      std::printf("  (%s: not on this CPU or not built, skipped)\n", name);
      continue;
    }
    check_matches_avx2(name, table, 23);
  }
}

int main() {
  std::printf("%s\n", describe().c_str());
  const std::pair<const char*, void (*)()> tests[] = {
      {"thread_pool", test_thread_pool},
      {"thread_pool_back_to_back_runs", test_thread_pool_back_to_back_runs},
      {"activation_quantization", test_activation_quantization},
      {"silu", test_silu},
      {"gemm_matches_reference", test_gemm_matches_reference},
      {"gemm_bitwise_stable", test_gemm_bitwise_stable},
      {"gemm_batched_matches_gemm", test_gemm_batched_matches_gemm},
      {"gemm_multi_matches_gemm", test_gemm_multi_matches_gemm},
      {"moe_matches_gemm_composition", test_moe_matches_gemm_composition},
      {"moe_shared_expert", test_moe_shared_expert},
      {"errors", test_errors},
#if PM_TEST_VNNI_EMU
      {"vnni_kernels_match_avx2", test_vnni_kernels_match_avx2},
      {"avx512_kernels_match_avx2", test_avx512_kernels_match_avx2},
      {"amx_kernels_match_avx2", test_amx_kernels_match_avx2},
#endif
      {"native_vnni_kernels_match_avx2", test_native_vnni_kernels_match_avx2},
  };
  for (const auto& [name, fn] : tests) {
    const int before = g_failures;
    fn();
    std::printf("%-32s %s\n", name, g_failures == before ? "ok" : "FAILED");
  }
#if !PM_TEST_VNNI_EMU
  std::printf("%-32s %s\n", "vnni_kernels_match_avx2", "skipped (SIMDe not found)");
  std::printf("%-32s %s\n", "avx512_kernels_match_avx2", "skipped (SIMDe not found)");
  std::printf("%-32s %s\n", "amx_kernels_match_avx2", "skipped (SIMDe not found)");
#endif
  std::printf("%s\n", g_failures ? "FAILED" : "all passed");
  return g_failures ? 1 : 0;
}
