// The gated activation of the routed experts, vectorized and identical wherever it is used.
#pragma once

namespace pocketmoe {

// g[i] = silu(g[i]) * u[i] = g[i] / (1 + exp(-g[i])) * u[i]; exp is a degree-6 polynomial after
// range reduction (relative error ~2e-7), the same bits for any n and any position in the row.
void silu_mul(float* g, const float* u, int n);

// x[i] = exp(x[i] - shift) with the same polynomial; returns their sum, added in a fixed order for a
// given n (8 lanes over the full groups of 8, the lanes, then the tail one by one).
float exp_shifted(float* x, int n, float shift);

}  // namespace pocketmoe
