// The time one forward step takes on one compute configuration (a decode
// worker of T ranks × H threads, or a prefill stage of H threads), as a
// function of what the step feeds — fitted from measured steps, never from
// constants:
//
//   seconds = L(tokens) + c_row · logit_rows + c_att · attended_positions
//
// L is piecewise linear in the tokens fed, between knots (1, 2, 4, … 1024):
// on a CPU a step is weight-bandwidth bound at a few tokens (L flat) and
// compute bound at hundreds (L linear), and a single line cannot hold both.
// The logits rows are the LM head (vocab × hidden per row: a third of a
// token's layers at llama-110m, and prefill steps need one row where decode
// needs one per token); attended positions are the attention work
// (Σ over fed tokens of the positions each attends to).
//
// Fitting is linear least squares weighted by 1/seconds (relative error, so
// 20 ms decode steps count as much as 3 s prefill steps), with coefficients
// kept ≥ 0 (an active set: a negative one is pinned to 0 and the rest
// refitted), since no feature makes a step faster; L's unknowns are its rises
// from knot to knot, so L never falls as the tokens grow.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace pdserve::planner {

// What a step feeds.
struct StepShape {
  int tokens = 0;
  int logit_rows = 0;
  int64_t attended_positions = 0;
};

// The quantile at u ∈ [0, 1) of evenly spaced quantiles (ascending, each the
// midpoint of an equal share: StepCost's spread, LinearCost's scatter), or
// `none` for none.
double EvenQuantileAt(const std::vector<double>& quantiles, double u,
                      double none);

// A step as measured.
struct StepSample {
  StepShape shape;
  double seconds = 0;
};

// Attended positions of `tokens` query tokens after `start` cached positions:
// Σ_{i<tokens} (start + i + 1).
int64_t AttendedPositions(int start, int tokens);

class StepCost {
 public:
  StepCost() = default;
  // Least squares over `samples` (see the file comment). INVALID_ARGUMENT
  // when there are fewer distinct token counts than needed to pin L between
  // the knots they span, or a sample is not a positive time.
  static absl::StatusOr<StepCost> Fit(const std::vector<StepSample>& samples);

  double Seconds(const StepShape& shape) const;

  // The same cost `factor` times slower (every step's time × factor; the
  // spread, relative to the fit, unchanged): a machine running at 1/factor
  // of the speed the steps were measured at.
  StepCost Scaled(double factor) const;

  // Relative error of the fit on `samples`: the median and the largest
  // |predicted − measured| / measured.
  struct FitError {
    double median = 0;
    double max = 0;
  };
  FitError Error(const std::vector<StepSample>& samples) const;

  // How measured steps spread around the fit: `spread()` holds quantiles
  // (evenly spaced, ascending) of measured / fitted seconds over the fitting
  // samples, and SpreadAt(u) the one at u ∈ [0, 1) — 1 with none. The
  // simulator scales each step by a draw from it, so its p99s carry the
  // step-to-step variation a serving machine shows (a fit alone predicts
  // every step at its typical time, and short-prompt TTFT p99s came out
  // 14-40% low).
  double SpreadAt(double u) const;
  const std::vector<double>& spread() const { return spread_; }
  // Fit() fills it from its samples; tests and hand-written models set it.
  absl::Status SetSpread(std::vector<double> quantiles);

  nlohmann::json ToJson() const;
  static absl::StatusOr<StepCost> FromJson(const nlohmann::json& json);

  const std::vector<double>& knots() const { return knots_; }
  const std::vector<double>& knot_seconds() const { return knot_seconds_; }
  double seconds_per_logit_row() const { return seconds_per_logit_row_; }
  double seconds_per_attended_position() const {
    return seconds_per_attended_position_;
  }

 private:
  std::vector<double> spread_;
  std::vector<double> knots_;         // token counts, ascending
  std::vector<double> knot_seconds_;  // L at each knot
  double seconds_per_logit_row_ = 0;
  double seconds_per_attended_position_ = 0;
};

}  // namespace pdserve::planner
