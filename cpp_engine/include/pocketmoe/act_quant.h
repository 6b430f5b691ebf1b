// Activation rows as the integer dot products read them.
//
// Q8_K row (cols % 256 == 0): int8 qs[cols] | float d[cols/256] | int16 bsums[cols/16]
// Q8_0 row (cols % 32 == 0):  int8 qs[cols] | float d[cols/32] (fp16-exact, as llama.cpp stores it) |
//                             float s[cols/32] (fp16(fp32 d * sum of q), llama.cpp's Q8_1 s) | int16 sums[cols/32] |
//                             int16 half_sums[cols/16] (each 16 values' sum, for NVFP4's scale per 16)
// F32 row:                    float x[cols]
// Each value is x ~= d * q with d = max|x| / 127 over its block; bsums / sums / half_sums add up q's.
#pragma once

#include <cstdint>

#include "pocketmoe/types.h"

namespace pocketmoe {

// Quantizes blocks [block_begin, block_end) of one row; src points at the first value of block_begin.
void quantize_act_blocks(ActFormat format, const float* src, int cols, int block_begin, int block_end,
                         uint8_t* row);

inline void quantize_act_row(ActFormat format, const float* src, int cols, uint8_t* row) {
  quantize_act_blocks(format, src, cols, 0, cols / act_block_values(format), row);
}

// The float values an activation row stands for (tests and references).
void dequantize_act_row(ActFormat format, const uint8_t* row, int cols, float* dst);

}  // namespace pocketmoe
