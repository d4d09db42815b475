#include "engine/expert_routing.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace pdserve::engine {

void RouteToken(const float* logits, int num_experts, int k, bool normalize,
                int32_t* experts, float* weights) {
  double max = logits[0];
  for (int e = 1; e < num_experts; ++e) max = std::max(max, double{logits[e]});
  thread_local std::vector<double> probs;
  thread_local std::vector<int32_t> order;
  probs.resize(num_experts);
  order.resize(num_experts);
  double sum = 0;
  for (int e = 0; e < num_experts; ++e) {
    probs[e] = std::exp(double{logits[e]} - max);
    sum += probs[e];
    order[e] = e;
  }
  std::partial_sort(
      order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
        return probs[a] > probs[b] || (probs[a] == probs[b] && a < b);
      });
  double chosen = 0;
  for (int j = 0; j < k; ++j) chosen += probs[order[j]];
  const double scale = normalize ? 1.0 / chosen : 1.0 / sum;
  for (int j = 0; j < k; ++j) {
    experts[j] = order[j];
    weights[j] = static_cast<float>(probs[order[j]] * scale);
  }
}

}  // namespace pdserve::engine
