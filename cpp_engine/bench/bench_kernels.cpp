// Microbenchmark of the native kernels: memory read bandwidth (the physical bound), GEMV GB/s and
// GEMM GFLOP/s per weight type, and MoE layers, with and without shared experts (decode and 128-token prefill).
//   bench_kernels [threads] [--cpu-time] [--only TYPE[,TYPE...]] [--moe]
//   (--only: those GEMV / GEMM rows, nothing else; --moe: the MoE rows alone)
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <ctime>
#include <vector>

#include "pocketmoe/ops.h"
#include "pocketmoe/runtime.h"
#include "pocketmoe/samples.h"
#include "pocketmoe/thread_pool.h"
#include "pocketmoe/types.h"
#include "../src/workspace.h"

using namespace pocketmoe;
using Clock = std::chrono::steady_clock;

namespace {

// Wall seconds, or with --cpu-time this process's CPU seconds (meaningful with 1 thread on a busy machine).
bool g_cpu_time = false;

struct Stamp {
  Clock::time_point wall;
  double cpu;
};

double process_cpu() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

Stamp now() { return {Clock::now(), process_cpu()}; }

double seconds_since(const Stamp& t0) {
  return g_cpu_time ? process_cpu() - t0.cpu : std::chrono::duration<double>(Clock::now() - t0.wall).count();
}

// Streaming read of a 512 MiB buffer split over the threads: the best of plain loads and loads
// with software prefetch (as the kernels do) at a few distances, best of 3 runs each.
double read_bandwidth(int threads) {
  const size_t n = (512u << 20) / sizeof(float);
  std::vector<float> buf(n, 1.0f);
  ThreadPool pool(threads);
  std::vector<float> sums(threads * 16);
  double best = 1e30;
  for (int distance : {0, 1024, 2048, 4096}) {
    for (int rep = 0; rep < 3; ++rep) {
      const Stamp t0 = now();
      pool.parallel_for(threads, [&](int part, int) {
        const size_t begin = n / threads * part, end = part + 1 == threads ? n : n / threads * (part + 1);
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (size_t i = begin; i + 32 <= end; i += 32) {
          if (distance > 0) {
            _mm_prefetch(reinterpret_cast<const char*>(&buf[i]) + distance, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(&buf[i]) + distance + 64, _MM_HINT_T0);
          }
          a0 = _mm256_add_ps(a0, _mm256_loadu_ps(&buf[i]));
          a1 = _mm256_add_ps(a1, _mm256_loadu_ps(&buf[i + 8]));
          a2 = _mm256_add_ps(a2, _mm256_loadu_ps(&buf[i + 16]));
          a3 = _mm256_add_ps(a3, _mm256_loadu_ps(&buf[i + 24]));
        }
        float tmp[8];
        _mm256_storeu_ps(tmp, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        sums[part * 16] = std::accumulate(tmp, tmp + 8, 0.0f);
      });
      best = std::min(best, seconds_since(t0));
    }
  }
  return n * sizeof(float) / best / 1e9;
}

struct Shape {
  int type;
  int rows;
  int cols;
};

void bench_gemm(const Shape& s, std::mt19937& rng) {
  const TypeInfo& t = type_info(s.type);
  const size_t row_bytes = weight_row_bytes(t, s.cols);
  const size_t bytes = row_bytes * s.rows;
  const int copies = static_cast<int>(std::max<size_t>(1, (384u << 20) / bytes));
  std::vector<uint8_t> one = samples::random_weight(s.type, s.rows, s.cols, rng);
  std::vector<uint8_t> many(bytes * copies);
  for (int c = 0; c < copies; ++c) std::copy(one.begin(), one.end(), many.begin() + bytes * c);
  const std::vector<float> x = samples::random_floats(static_cast<size_t>(128) * s.cols, rng);
  std::vector<float> y(static_cast<size_t>(128) * s.rows);

  // Best of many calls: other processes on a shared machine only ever slow a call down.
  auto best_of = [&](int reps, auto&& call) {
    double best = 1e30;
    for (int i = 0; i < reps; ++i) {
      const Stamp t0 = now();
      call(i);
      best = std::min(best, seconds_since(t0));
    }
    return best;
  };
  gemm(many.data(), s.rows, row_bytes, s.type, x.data(), 1, s.cols, y.data());   // copy 0 is now cached: start at 1
  const double cold = best_of(copies * 2, [&](int i) {
    gemm(many.data() + bytes * ((i + 1) % copies), s.rows, row_bytes, s.type, x.data(), 1, s.cols, y.data());
  });
  const double hot = best_of(1000, [&](int) { gemm(one.data(), s.rows, row_bytes, s.type, x.data(), 1, s.cols, y.data()); });
  const double prefill =
      best_of(12, [&](int) { gemm(one.data(), s.rows, row_bytes, s.type, x.data(), 128, s.cols, y.data()); });
  const double flop = 2.0 * 128 * s.rows * s.cols;
  std::printf("%-8s %5d x %-5d  GEMV %7.1f us %5.1f GB/s (in cache %6.1f us %5.1f GB/s) | GEMM T=128 %6.2f ms %5.1f GFLOP/s\n",
              t.name, s.rows, s.cols, cold * 1e6, bytes / cold / 1e9, hot * 1e6, bytes / hot / 1e9, prefill * 1e3,
              flop / prefill / 1e9);
}

struct MoEShape {
  const char* name;
  int hidden, ffn, n_experts, top_k, gate_type, down_type, layers;
  int shared_ffn;  // the shared experts' width (gate_type gate/up, down_type down), run inside the same call; 0: none
};

void bench_moe(const MoEShape& m, std::mt19937& rng) {
  const size_t gate_bytes = weight_row_bytes(type_info(m.gate_type), m.hidden) * m.ffn * m.n_experts;
  const size_t down_bytes = weight_row_bytes(type_info(m.down_type), m.ffn) * m.hidden * m.n_experts;
  const int sf = m.shared_ffn;
  std::vector<std::vector<uint8_t>> gate, up, down, sgate, sup, sdown;
  for (int l = 0; l < m.layers; ++l) {
    gate.push_back(samples::random_weight(m.gate_type, m.ffn * m.n_experts, m.hidden, rng));
    up.push_back(samples::random_weight(m.gate_type, m.ffn * m.n_experts, m.hidden, rng));
    down.push_back(samples::random_weight(m.down_type, m.hidden * m.n_experts, m.ffn, rng));
    if (sf == 0) continue;
    sgate.push_back(samples::random_weight(m.gate_type, sf, m.hidden, rng));
    sup.push_back(samples::random_weight(m.gate_type, sf, m.hidden, rng));
    sdown.push_back(samples::random_weight(m.down_type, m.hidden, sf, rng));
  }
  const size_t sgate_rb = sf ? weight_row_bytes(type_info(m.gate_type), m.hidden) : 0;
  const size_t sdown_rb = sf ? weight_row_bytes(type_info(m.down_type), sf) : 0;
  const int max_tokens = 128;
  const std::vector<float> x = samples::random_floats(static_cast<size_t>(max_tokens) * m.hidden, rng);
  std::vector<float> y(static_cast<size_t>(max_tokens) * m.hidden), ys(y.size());
  std::vector<int32_t> ids(static_cast<size_t>(max_tokens) * m.top_k);
  std::vector<float> w(ids.size(), 1.0f / m.top_k);
  std::vector<int> perm(m.n_experts);
  std::iota(perm.begin(), perm.end(), 0);
  auto route = [&](int n_tokens) {
    for (int t = 0; t < n_tokens; ++t) {
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int k = 0; k < m.top_k; ++k) ids[t * m.top_k + k] = perm[k];
    }
  };
  auto run = [&](int layer, int n_tokens) {
    const Weight wg{sf ? sgate[layer].data() : nullptr, m.gate_type, 1, sf, m.hidden, sgate_rb};
    const Weight wu{sf ? sup[layer].data() : nullptr, m.gate_type, 1, sf, m.hidden, sgate_rb};
    const Weight wd{sf ? sdown[layer].data() : nullptr, m.down_type, 1, m.hidden, sf, sdown_rb};
    const SharedFFN shared{&wg, &wu, &wd, ys.data()};
    std::unique_lock<std::mutex> lock;
    moe_forward(acquire_runtime(lock), x.data(), n_tokens, m.hidden, ids.data(), w.data(), m.top_k,
                {gate[layer].data(), gate_bytes, m.gate_type}, {up[layer].data(), gate_bytes, m.gate_type},
                {down[layer].data(), down_bytes, m.down_type}, m.n_experts, m.ffn, y.data(), 0.0f,
                sf ? &shared : nullptr);
  };
  // Bytes one token reads: its k routed experts and the shared ones.
  const double token_bytes = static_cast<double>(2 * gate_bytes + down_bytes) / m.n_experts * m.top_k +
                             static_cast<double>(2 * sgate_rb * sf + sdown_rb * m.hidden);
  auto timed = [&](int reps, int n_tokens, std::vector<double>& times) {
    for (int i = 0; i < reps; ++i) {
      route(n_tokens);
      const Stamp t0 = now();
      run(i % m.layers, n_tokens);
      times.push_back(seconds_since(t0));
    }
    std::sort(times.begin(), times.end());
  };
  std::vector<double> dec, pre;
  timed(300, 1, dec);
  timed(8, max_tokens, pre);
  const double decode = dec[dec.size() / 2], prefill = pre[pre.size() / 2];
  std::printf("%s\n  decode median %7.1f us/layer (best %6.1f) = %5.1f GB/s of experts | prefill 128 median %7.2f ms/layer "
              "(best %6.2f) = %6.0f tok/s per layer\n",
              m.name, decode * 1e6, dec[0] * 1e6, token_bytes / decode / 1e9, prefill * 1e3, pre[0] * 1e3,
              max_tokens / prefill);
}

}  // namespace

int main(int argc, char** argv) {
  int threads = physical_core_count();
  std::string only;
  bool moe_only = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--cpu-time") {
      g_cpu_time = true;
    } else if (std::string(argv[i]) == "--moe") {
      moe_only = true;
    } else if (std::string(argv[i]) == "--only" && i + 1 < argc) {
      only = "," + std::string(argv[++i]) + ",";
    } else {
      threads = std::atoi(argv[i]);
    }
  }
  set_num_threads(threads);
  std::printf("%s%s\n", describe().c_str(), g_cpu_time ? "; times are process CPU time" : "");
  if (only.empty() && !moe_only)
    std::printf("memory read bandwidth (%d threads, 512 MiB): %.1f GB/s\n", threads, read_bandwidth(threads));
  std::mt19937 rng(1234);
  const Shape shapes[] = {
      {kQ4_K, 1408, 2048}, {kQ6_K, 1408, 2048}, {kQ4_K, 2048, 2048}, {kQ5_0, 2048, 1408},
      {kQ8_0, 2048, 1408}, {kQ5_K, 1408, 2048}, {kQ4_0, 2048, 1408}, {kQ2_K, 1408, 2048},
      {kQ3_K, 1408, 2048}, {kIQ2_XXS, 1536, 3072}, {kIQ1_M, 1536, 3072}, {kIQ4_XS, 1408, 2048},
      {kIQ1_S, 1536, 3072}, {kIQ2_XS, 1536, 3072}, {kIQ2_S, 1536, 3072}, {kIQ3_XXS, 1536, 3072},
      {kIQ3_S, 1536, 3072}, {kTQ2_0, 1408, 2048}, {kTQ1_0, 1408, 2048}, {kQ1_0, 2048, 2048},
      {kMXFP4, 2048, 2048}, {kNVFP4, 2048, 2048}, {kF16, 1408, 2048}, {kBF16, 1408, 2048}, {kF32, 64, 2048},
  };
  for (const Shape& s : shapes)
    if (!moe_only && (only.empty() || only.find("," + std::string(type_info(s.type).name) + ",") != std::string::npos))
      bench_gemm(s, rng);
  if (!only.empty()) return 0;
  const MoEShape moes[] = {
      {"DeepSeek-V2-Lite (Q4_K gate/up, Q5_0 down)", 2048, 1408, 64, 6, kQ4_K, kQ5_0, 2, 0},
      {"DeepSeek-V2-Lite (Q4_K gate/up, Q8_0 down)", 2048, 1408, 64, 6, kQ4_K, kQ8_0, 2, 0},
      {"DeepSeek-V2-Lite with its 2 shared experts (Q4_K gate/up, Q5_0 down)", 2048, 1408, 64, 6, kQ4_K, kQ5_0, 2,
       2816},
      {"452M bench MoE (Q4_K gate/up, Q6_K down)", 1024, 512, 32, 4, kQ4_K, kQ6_K, 8, 0},
      {"452M bench MoE with its shared expert (Q4_K gate/up, Q6_K down)", 1024, 512, 32, 4, kQ4_K, kQ6_K, 8, 512},
  };
  for (const MoEShape& m : moes) bench_moe(m, rng);
  return 0;
}
