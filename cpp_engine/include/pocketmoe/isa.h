// Which instruction set the integer kernels run on, chosen once per process.
//
// The widest set this CPU (and its OS) supports is taken: AVX-512 VNNI, then AVX-VNNI, then the
// AVX2 baseline; the POCKETMOE_ISA environment variable (auto, avx512vnni, avxvnni, avx2) caps it.
// A wider set is used only after its kernels gave bitwise the AVX2 kernels' outputs on random
// blocks of every integer type at start-up; otherwise the next set down is used and the note says why.
#pragma once

#include <string>

namespace pocketmoe {

struct KernelIsa {
  std::string name;   // "avx512vnni", "avxvnni" or "avx2"
  std::string note;   // why a wider set the CPU has is not used; "" when none is left out
};

// Throws std::invalid_argument when POCKETMOE_ISA names no set.
const KernelIsa& kernel_isa();

}  // namespace pocketmoe
