#include "pocketmoe/isa.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>

#include "kernels.h"
#include "pocketmoe/act_quant.h"
#include "pocketmoe/runtime.h"
#include "pocketmoe/samples.h"
#include "pocketmoe/types.h"
#include "workspace.h"

namespace pocketmoe {
namespace {

struct Candidate {
  const char* name;    // as POCKETMOE_ISA spells it
  const char* label;   // as notes spell it
  KernelTable table;
  bool (*cpu_has)();
};

bool cpu_has_avx512vnni() {
  __builtin_cpu_init();
  // The kernels are compiled for F + BW + DQ + VL + VNNI and may use any of them. libgcc's check also
  // asks the OS (XCR0) whether it saves the AVX-512 state.
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

// AMX also needs the kernel's leave to use the tile state (Linux 5.16+): asked for once, for the
// whole process, here.
bool cpu_has_amx() {
#if defined(__clang__) ? __clang_major__ < 14 : __GNUC__ < 12
  return false;
#endif
  __builtin_cpu_init();
  if (!cpu_has_avx512vnni() || !__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-int8")) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

bool cpu_has_avxvnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avxvnni");
}

bool cpu_has_avx2() { return cpu_supported(); }

// Widest first.
const Candidate kCandidates[] = {
    {"amx", "AMX-INT8", amx::integer_kernel, cpu_has_amx},
    {"avx512vnni", "AVX-512 VNNI", avx512vnni::integer_kernel, cpu_has_avx512vnni},
    {"avxvnni", "AVX-VNNI", avxvnni::integer_kernel, cpu_has_avxvnni},
    {"avx2", "AVX2", avx2::integer_kernel, cpu_has_avx2},
};
constexpr int kNumCandidates = sizeof(kCandidates) / sizeof(kCandidates[0]);

struct Chosen {
  KernelIsa isa;
  KernelTable table;
};

void add_note(std::string& note, const std::string& s) { note += (note.empty() ? "" : "; ") + s; }

Chosen choose() {
  const char* env = std::getenv("POCKETMOE_ISA");
  const std::string want = env != nullptr && *env != '\0' ? env : "auto";
  int first = 0;
  if (want != "auto") {
    while (first < kNumCandidates && want != kCandidates[first].name) ++first;
    if (first == kNumCandidates)
      throw std::invalid_argument("POCKETMOE_ISA=" + want +
                                  " names no instruction set; use auto, amx, avx512vnni, avxvnni or avx2");
  }
  std::string note;
  if (want != "auto" && !kCandidates[first].cpu_has())
    add_note(note, "POCKETMOE_ISA=" + want + " asks for " + kCandidates[first].label + ", which this CPU lacks");
  for (int i = 0; i < kNumCandidates; ++i) {
    const Candidate& c = kCandidates[i];
    if (!c.cpu_has()) continue;
    if (i < first) {
      add_note(note, std::string(c.label) + " left out by POCKETMOE_ISA=" + want);
      continue;
    }
    if (c.table != avx2::integer_kernel) {
      if (c.table(kQ4_K) == nullptr) {
        add_note(note, std::string(c.label) + " kernels not built (the compiler could not target them)");
        continue;
      }
      const std::string diff = compare_with_avx2(c.table, {1, 3, 8, 17, 30}, 17, 20261130u);
      if (!diff.empty()) {
        add_note(note, std::string(c.label) + " kernels failed the start-up check against AVX2 (" + diff + ")");
        continue;
      }
    }
    return {{c.name, note}, c.table};
  }
  // No set at all: the CPU lacks AVX2; acquire_runtime() refuses to run, this only names it.
  return {{"none", note}, avx2::integer_kernel};
}

const Chosen& chosen() {
  static const Chosen c = choose();
  return c;
}

}  // namespace

const KernelIsa& kernel_isa() { return chosen().isa; }

bool cpu_has_isa(const std::string& name) {
  for (const Candidate& c : kCandidates)
    if (name == c.name) return c.cpu_has();
  return false;
}

MatmulFn active_integer_kernel(int ggml_type) { return chosen().table(ggml_type); }

std::string compare_with_avx2(KernelTable candidate, const std::vector<int>& token_counts, int rows, uint32_t seed) {
  constexpr int kCols = 512;
  std::mt19937 rng(seed);
  Buffer acts, scratch;
  std::string diffs;
  for (int type : supported_types()) {
    const MatmulFn reference = avx2::integer_kernel(type);
    if (reference == nullptr) continue;
    const TypeInfo& t = type_info(type);
    const MatmulFn fn = candidate(type);
    if (fn == nullptr) {
      add_note(diffs, std::string(t.name) + " has no kernel");
      continue;
    }
    const std::vector<uint8_t> w = samples::random_weight(type, rows, kCols, rng);
    const size_t act_bytes = act_row_bytes(t.act, kCols);
    uint8_t* const scratch_area = scratch.get(avx2::scratch_bytes(type, kCols));
    for (int n : token_counts) {
      const std::vector<float> x = samples::random_floats(static_cast<size_t>(n) * kCols, rng);
      uint8_t* a = acts.get(n * act_bytes);
      std::vector<const uint8_t*> act_rows(n);
      for (int i = 0; i < n; ++i) {
        act_rows[i] = a + i * act_bytes;
        quantize_act_row(t.act, x.data() + static_cast<size_t>(i) * kCols, kCols, a + i * act_bytes);
      }
      std::vector<float> y[2];
      for (int k = 0; k < 2; ++k) {
        y[k].assign(static_cast<size_t>(n) * rows, 0.0f);
        const MatmulTask task{w.data(), weight_row_bytes(t, kCols), kCols, 0, rows, act_rows.data(), n,
                              y[k].data(), rows, scratch_area};
        (k == 0 ? reference : fn)(task);
      }
      size_t i = 0;
      while (i < y[0].size() && std::memcmp(&y[0][i], &y[1][i], sizeof(float)) == 0) ++i;
      if (i < y[0].size()) {
        add_note(diffs, std::string(t.name) + " with " + std::to_string(n) + " tokens gives " + std::to_string(y[1][i]) +
                            " at token " + std::to_string(i / rows) + ", row " + std::to_string(i % rows) +
                            " where AVX2 gives " + std::to_string(y[0][i]));
        break;   // one difference per type is enough to name it
      }
    }
  }
  return diffs;
}

}  // namespace pocketmoe
