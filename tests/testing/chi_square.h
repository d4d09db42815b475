// Pearson chi-square goodness of fit for the sampling tests: observed token
// counts against exact probabilities.
#pragma once

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

namespace pdserve::testing {

// The chi-square critical value for `df` degrees of freedom at z = 4
// (p ~ 3e-5), by the Wilson–Hilferty approximation.
inline double ChiSquareCritical(double df) {
  df = std::max(1.0, df);
  return df * std::pow(1 - 2 / (9 * df) + 4.0 * std::sqrt(2 / (9 * df)), 3);
}

// Statistic / critical value of `counts` (token -> draws, out of n) against
// `probs`, bins expected below 5 pooled: < 1 passes. A token of probability 0
// that was drawn lands in the pool and fails the test.
inline double ChiSquareRatio(const std::map<int, int>& counts,
                             const std::vector<double>& probs, int n) {
  double stat = 0, pooled_e = 0, pooled_o = 0;
  int bins = 0;
  for (size_t v = 0; v < probs.size(); ++v) {
    const double e = probs[v] * n;
    auto it = counts.find(static_cast<int>(v));
    const double o = it == counts.end() ? 0 : it->second;
    if (e < 5) {
      pooled_e += e;
      pooled_o += o;
      continue;
    }
    stat += (o - e) * (o - e) / e;
    ++bins;
  }
  if (pooled_e > 0 || pooled_o > 0) {
    stat +=
        (pooled_o - pooled_e) * (pooled_o - pooled_e) / std::max(pooled_e, 1.0);
    ++bins;
  }
  return stat / ChiSquareCritical(bins - 1);
}

}  // namespace pdserve::testing
