// Rotary embedding (pocketmoe/ops.h): y[i] = x[i] * cos2[i] + x[partner(i)] * sin2[i], the partner of a
// dim being the other member of its pair. The tables carry the signs, so both modes are one formula.
#include <stdexcept>
#include <string>

#include "pocketmoe/ops.h"

namespace pocketmoe {

void rope(float* x, int n_rows, size_t row_stride, int heads, int head_dim, int rot, bool neox, const float* cos2,
          const float* sin2) {
  if (rot <= 0 || rot % 2 || rot > head_dim)
    throw std::invalid_argument("rope: " + std::to_string(rot) + " rotated dims in heads of " +
                                std::to_string(head_dim) + " (must be even and at most the head)");
  const int half = rot / 2;
  for (int t = 0; t < n_rows; ++t) {
    const float* c = cos2 + static_cast<size_t>(t) * rot;
    const float* s = sin2 + static_cast<size_t>(t) * rot;
    for (int h = 0; h < heads; ++h) {
      float* v = x + t * row_stride + static_cast<size_t>(h) * head_dim;
      if (neox) {
        for (int i = 0; i < half; ++i) {
          const float x0 = v[i], x1 = v[i + half];
          v[i] = x0 * c[i] + x1 * s[i];
          v[i + half] = x1 * c[i + half] + x0 * s[i + half];
        }
      } else {
        for (int i = 0; i < rot; i += 2) {
          const float x0 = v[i], x1 = v[i + 1];
          v[i] = x0 * c[i] + x1 * s[i];
          v[i + 1] = x1 * c[i + 1] + x0 * s[i + 1];
        }
      }
    }
  }
}

}  // namespace pocketmoe
