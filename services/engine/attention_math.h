// The online-softmax algebra the CUDA attention kernels use, as host+device
// functions so the CPU tests check the same code the GPU runs.
//
// A "run" summarizes attention over a subset of keys for one query:
//   max = max_j s_j,  sum = Σ_j exp(s_j - max),  acc[d] = Σ_j exp(s_j - max)
//   v_j[d].
// Two runs over disjoint key sets merge exactly (up to rounding) into the run
// over their union; the attention output is acc / sum. Split-K decode
// attention computes one run per context partition and merges them.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define PDS_HOST_DEVICE __host__ __device__
#else
#define PDS_HOST_DEVICE
#endif

namespace pdserve::engine {

// Scale factors that bring runs with maxima `max_a` and `max_b` to their
// common maximum; an empty run (max = -inf) gets factor 0.
struct RunRescale {
  float max;
  float scale_a;
  float scale_b;
};

PDS_HOST_DEVICE inline RunRescale RescaleRuns(float max_a, float max_b) {
  RunRescale r;
  r.max = max_a > max_b ? max_a : max_b;
  if (r.max == -INFINITY) {
    r.scale_a = 0.0f;
    r.scale_b = 0.0f;
    return r;
  }
  r.scale_a = max_a == -INFINITY ? 0.0f : expf(max_a - r.max);
  r.scale_b = max_b == -INFINITY ? 0.0f : expf(max_b - r.max);
  return r;
}

// Folds run b into run a (acc arrays of `dims` floats).
PDS_HOST_DEVICE inline void MergeRunInto(float& max_a, float& sum_a,
                                         float* acc_a, float max_b, float sum_b,
                                         const float* acc_b, int dims) {
  const RunRescale r = RescaleRuns(max_a, max_b);
  for (int d = 0; d < dims; ++d) {
    acc_a[d] = acc_a[d] * r.scale_a + acc_b[d] * r.scale_b;
  }
  sum_a = sum_a * r.scale_a + sum_b * r.scale_b;
  max_a = r.max;
}

// Partitions of `context` keys in pieces of `partition` keys.
PDS_HOST_DEVICE inline int NumPartitions(int context, int partition) {
  return (context + partition - 1) / partition;
}

}  // namespace pdserve::engine
