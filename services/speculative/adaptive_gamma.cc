#include "speculative/adaptive_gamma.h"

#include <algorithm>
#include <cmath>

namespace pdserve::speculative {

AdaptiveGamma::AdaptiveGamma(const AdaptiveGammaOptions& options)
    : options_(options),
      // Prior α = 0.7 worth two trials: optimistic enough to start
      // speculating, weak enough that two bad steps turn it down.
      successes_(1.4),
      trials_(2.0),
      gamma_(0) {
  Recompute();
}

double AdaptiveGamma::ExpectedTokens(double alpha, int gamma) {
  if (alpha >= 1.0) return gamma + 1.0;
  return (1.0 - std::pow(alpha, gamma + 1)) / (1.0 - alpha);
}

void AdaptiveGamma::Recompute() {
  const double alpha = acceptance_rate();
  double best = 1.0;
  gamma_ = 0;
  for (int g = 1; g <= options_.max_gamma; ++g) {
    const double score =
        ExpectedTokens(alpha, g) / (1.0 + options_.cost_per_draft_token * g);
    if (score > best + 1e-9) {
      best = score;
      gamma_ = g;
    }
  }
}

int AdaptiveGamma::NextGamma() {
  if (gamma_ > 0 || options_.max_gamma <= 0) return gamma_;
  if (++steps_since_probe_ >= options_.probe_interval) {
    steps_since_probe_ = 0;
    return 1;
  }
  return 0;
}

void AdaptiveGamma::Record(int proposed, int accepted) {
  if (proposed <= 0) return;
  successes_ = options_.decay * successes_ + accepted;
  trials_ = options_.decay * trials_ + accepted + (accepted < proposed ? 1 : 0);
  Recompute();
}

}  // namespace pdserve::speculative
