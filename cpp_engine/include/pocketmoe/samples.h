// Random but valid GGUF blocks and activations: for the kernels' start-up self-check, the C++ tests
// and the benchmark.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace pocketmoe::samples {

// rows x cols values of ggml_type as raw blocks: random bytes, with every scale field set to a
// finite value of sane magnitude (fp16 d/dmin near 0.01, MXFP4 exponents near 2^-5).
std::vector<uint8_t> random_weight(int ggml_type, int rows, int cols, std::mt19937& rng);

std::vector<float> random_floats(size_t n, std::mt19937& rng, float scale = 1.0f);

}  // namespace pocketmoe::samples
