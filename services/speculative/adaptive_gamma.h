// Per-request draft length γ from the request's running acceptance.
//
// Model: each draft token is accepted independently with probability α (the
// usual speculative-decoding analysis), so a verify step with γ drafts emits
// E(γ) = (1 − α^(γ+1)) / (1 − α) tokens, and costs 1 + c·γ target-step units,
// where c is the marginal cost of one more verified token plus the
// proposer's cost per token. γ maximizes E(γ) / (1 + c·γ) over [0, max]; γ = 0
// (no speculation) scores 1. α is estimated from exponentially decayed counts
// (accepted drafts over draft "trials": a accepted of γ proposed is a
// successes and, when a < γ, one failure). While γ is 0 the request still
// probes with γ = 1 every `probe_interval` steps so α can recover.
#pragma once

#include <cstdint>

namespace pdserve::speculative {

struct AdaptiveGammaOptions {
  int max_gamma = 4;
  // c above: marginal verify cost per extra token + proposer cost per token,
  // in units of one decode step.
  double cost_per_draft_token = 0.1;
  double decay = 0.9;  // weight of history per update
  int probe_interval = 16;
};

class AdaptiveGamma {
 public:
  explicit AdaptiveGamma(const AdaptiveGammaOptions& options = {});

  // γ for the next step (recomputed by Record).
  int gamma() const { return gamma_; }
  // Steps at γ = 0 count towards the next probe; call once per decode step.
  int NextGamma();
  // Outcome of a verify step: `accepted` of `proposed` drafts (proposed > 0).
  void Record(int proposed, int accepted);
  double acceptance_rate() const { return successes_ / trials_; }
  // Expected emitted tokens per verify at acceptance `alpha` and `gamma`.
  static double ExpectedTokens(double alpha, int gamma);

 private:
  void Recompute();

  AdaptiveGammaOptions options_;
  double successes_;
  double trials_;
  int gamma_;
  int steps_since_probe_ = 0;
};

}  // namespace pdserve::speculative
