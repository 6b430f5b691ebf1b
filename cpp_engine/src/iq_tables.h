// Lookup tables of the IQ types, built once at load time from the GGUF codebooks.
#pragma once

#include <cstdint>

namespace pocketmoe::tables {

extern const uint64_t* const kIq2xxs;     // [256] grid rows, bytes 8 / 25 / 43
extern const uint64_t* const kIq1m;       // [4096] (grid index | delta bit << 11) -> bytes 8*g + 16 + delta
extern const uint64_t* const kIq2xs;      // [512] grid rows, bytes 8 / 25 / 43
extern const uint64_t* const kIq2s;       // [1024] grid rows, bytes 8 / 25 / 43
extern const uint32_t* const kIq3s;       // [512] grid rows of 4 bytes, odd 1 .. 15
extern const uint32_t* const kIq3xxs;     // [256] grid rows of 4 bytes, 4 .. 62
extern const uint64_t* const kIq1Grid;    // [2048] raw IQ1_S / IQ1_M grid rows, bytes -1 / 0 / 1

}  // namespace pocketmoe::tables
