// Expert routing after the router GEMM (ops.reference.route): gating, selection bias, group-limited top-k,
// weight normalisation and scale.
//
// One warp per token (grid.x = T, blockDim.x = 32); dynamic shared memory holds 2 * n_experts + n_groups
// floats. gating 1: softmax, 2: sigmoid (layers.moe GATING_*). select = probs (+ bias when has_bias). With
// n_groups > 1 a group scores the sum of its two best selection scores (its best one when it holds one
// expert) and only the groups_used best groups keep their experts. The top_k ids come out in descending
// selection score; ties go to the smaller index (groups and experts alike), as the native route does.
// weights = probs[ids], divided by max(their sum, weight_sum_min) when norm, times scale unless it is 0 or 1.
#include "common.cuh"

extern "C" __global__ void route_f32(const float* __restrict__ logits, const float* __restrict__ bias,
                                     int has_bias, long long* __restrict__ ids, float* __restrict__ weights,
                                     int n_experts, int top_k, int gating, int n_groups, int groups_used,
                                     int norm, float scale, float weight_sum_min) {
  extern __shared__ float smem[];
  float* probs = smem;
  float* select = smem + n_experts;
  float* group_score = select + n_experts;
  const int lane = threadIdx.x, ne = n_experts;
  const float* lg = logits + (long long)blockIdx.x * ne;
  if (gating == 2) {
    for (int i = lane; i < ne; i += WARP) probs[i] = 1.0f / (1.0f + expf(-lg[i]));
  } else {
    float mx = NEG_INF;
    for (int i = lane; i < ne; i += WARP) mx = fmaxf(mx, lg[i]);
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int i = lane; i < ne; i += WARP) {
      const float e = expf(lg[i] - mx);
      probs[i] = e;
      sum += e;
    }
    sum = warp_sum(sum);
    for (int i = lane; i < ne; i += WARP) probs[i] = probs[i] / sum;
  }
  for (int i = lane; i < ne; i += WARP) select[i] = has_bias ? probs[i] + bias[i] : probs[i];
  __syncthreads();
  if (n_groups > 1) {
    const int per = ne / n_groups;
    for (int g = lane; g < n_groups; g += WARP) {
      float a = NEG_INF, b = NEG_INF;
      for (int i = g * per; i < (g + 1) * per; ++i) {
        const float v = select[i];
        if (v > a) {
          b = a;
          a = v;
        } else if (v > b) {
          b = v;
        }
      }
      group_score[g] = per >= 2 ? a + b : a;
    }
    __syncthreads();  // defensive: each lane reads back only the group scores it wrote
    for (int kept = 0; kept < groups_used; ++kept) {  // the best groups' scores become +inf
      float v = NEG_INF;
      int best = -1;
      for (int g = lane; g < n_groups; g += WARP)
        if (group_score[g] != POS_INF && (best < 0 || group_score[g] > v)) {
          v = group_score[g];
          best = g;
        }
      warp_argmax(v, best);
      __syncthreads();  // defensive: the lanes' reads of group_score are behind warp_argmax's shuffles
      if (lane == 0) group_score[best] = POS_INF;
      __syncthreads();
    }
    for (int i = lane; i < ne; i += WARP)
      if (group_score[i / per] != POS_INF) select[i] = NEG_INF;
    __syncthreads();  // defensive: each lane reads back only the select entries it wrote
  }
  long long* id = ids + (long long)blockIdx.x * top_k;
  float* wt = weights + (long long)blockIdx.x * top_k;
  float wsum = 0.0f;
  for (int j = 0; j < top_k; ++j) {
    float v = NEG_INF;
    int best = -1;
    for (int i = lane; i < ne; i += WARP) {
      bool taken = false;
      for (int m = 0; m < j; ++m) taken |= id[m] == i;
      if (!taken && (best < 0 || select[i] > v)) {
        v = select[i];
        best = i;
      }
    }
    warp_argmax(v, best);
    const float p = probs[best];
    if (lane == 0) {
      id[j] = best;
      wt[j] = p;
    }
    wsum += p;
    __syncthreads();
  }
  if (lane == 0) {
    const float div = norm ? fmaxf(wsum, weight_sum_min) : 1.0f;
    for (int j = 0; j < top_k; ++j) {
      float w = norm ? wt[j] / div : wt[j];
      if (scale != 0.0f && scale != 1.0f) w *= scale;
      wt[j] = w;
    }
  }
}

// The pairs of a step grouped by expert, for the grouped expert GEMM (ops.cuda.experts CudaExpertKernels.groups)
// when a step has few of them: one warp (grid 1, blockDim.x = 32), no shared memory. which[P] holds each pair's
// expert (or slot), in [0, n). offsets[n + 1] gets the start of each expert's group (offsets[n] = P) and order[P]
// the pair indices grouped by expert, ascending, in pair order within a group: a stable counting sort, the order
// torch.argsort(which, stable=True) gives. groups[m] (m = min(n, P): no more can be non-empty) gets the non-empty
// groups, ascending, then -1s: the grouped GEMM's grid takes those, not all n. With has_rows, tokens[P] gets
// rows[order[i]] beside it (the input row each grouped pair reads), which saves a gather launch; with has_used,
// *used (an int64 counter the statistics read back later) gains the number of non-empty groups, the distinct
// experts of the step. copies = 2 lays the grouping out twice, for one launch over two weights (gate, then up):
// offsets [2n + 1], order and tokens [2P], the second copy's groups and order entries P further on (the rows of
// its outputs), and groups [2m], the second copy's (group n + e for expert e) m further on. Lane l counts experts
// l, l + 32, ...; a warp scan of the counts places each round of 32 experts after the pairs of the rounds before,
// and one of the non-empty flags places each non-empty group after those of the rounds before.
extern "C" __global__ void group_pairs(const long long* __restrict__ which, int p, int n,
                                       int32_t* __restrict__ offsets, int32_t* __restrict__ order,
                                       const int32_t* __restrict__ rows, int has_rows, int32_t* __restrict__ tokens,
                                       long long* __restrict__ used, int has_used, int copies,
                                       int32_t* __restrict__ groups, int m) {
  const int lane = threadIdx.x;
  int base = 0, distinct = 0;
  for (int e0 = 0; e0 < n; e0 += WARP) {
    const int e = e0 + lane;
    int count = 0;
    if (e < n)
      for (int i = 0; i < p; ++i) count += which[i] == e;
    const int incl = warp_inclusive_sum(count);
    if (e < n) {
      int at = base + incl - count;
      for (int c = 0; c < copies; ++c) offsets[c * n + e] = c * p + at;
      for (int i = 0; i < p; ++i)
        if (which[i] == e) {
          for (int c = 0; c < copies; ++c) {
            if (has_rows) tokens[c * p + at] = rows[i];
            order[c * p + at] = c * p + i;
          }
          ++at;
        }
    }
    base += __shfl_sync(FULL_MASK, incl, WARP - 1);
    const int rank = warp_inclusive_sum(count > 0 ? 1 : 0);  // this expert's place among the non-empty ones
    if (count > 0)
      for (int c = 0; c < copies; ++c) groups[c * m + distinct + rank - 1] = c * n + e;
    distinct += __shfl_sync(FULL_MASK, rank, WARP - 1);
  }
  for (int r = distinct + lane; r < m; r += WARP)
    for (int c = 0; c < copies; ++c) groups[c * m + r] = -1;
  if (lane == 0) {
    offsets[copies * n] = copies * base;
    if (has_used) *used += distinct;
  }
}
