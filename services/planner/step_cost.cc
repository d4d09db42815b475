#include "planner/step_cost.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pdserve::planner {

namespace {

// Quantiles kept of a fit's measured / fitted step times.
constexpr int kSpreadQuantiles = 32;

// Weights of the hat functions at `knots` for x: two neighbours share 1
// (linear interpolation); past the ends the last segment is extended, so a
// step larger than any profiled is extrapolated along the largest slope.
void HatWeights(const std::vector<double>& knots, double x,
                std::vector<double>* weights) {
  weights->assign(knots.size(), 0.0);
  if (knots.size() == 1) {
    (*weights)[0] = 1;
    return;
  }
  size_t hi = std::upper_bound(knots.begin(), knots.end(), x) - knots.begin();
  hi = std::clamp<size_t>(hi, 1, knots.size() - 1);
  const size_t lo = hi - 1;
  const double f = (x - knots[lo]) / (knots[hi] - knots[lo]);
  (*weights)[lo] = 1 - f;
  (*weights)[hi] = f;
}

// Solves the normal equations A x = b (A symmetric positive definite after a
// tiny ridge) by Cholesky. `n` unknowns; A is row-major n × n.
std::vector<double> SolveSymmetric(std::vector<double> a, std::vector<double> b,
                                   int n) {
  double trace = 0;
  for (int i = 0; i < n; ++i) trace += a[i * n + i];
  // A ridge of 1e-12 of the mean diagonal keeps a column no sample reaches
  // (weight 0 everywhere) from making the system singular; it is far below
  // anything a real feature contributes.
  for (int i = 0; i < n; ++i) a[i * n + i] += 1e-12 * trace / n + 1e-300;
  for (int j = 0; j < n; ++j) {
    double d = a[j * n + j];
    for (int k = 0; k < j; ++k) d -= a[j * n + k] * a[j * n + k];
    d = std::sqrt(std::max(d, 1e-300));
    a[j * n + j] = d;
    for (int i = j + 1; i < n; ++i) {
      double s = a[i * n + j];
      for (int k = 0; k < j; ++k) s -= a[i * n + k] * a[j * n + k];
      a[i * n + j] = s / d;
    }
  }
  for (int i = 0; i < n; ++i) {  // L y = b
    double s = b[i];
    for (int k = 0; k < i; ++k) s -= a[i * n + k] * b[k];
    b[i] = s / a[i * n + i];
  }
  for (int i = n - 1; i >= 0; --i) {  // Lᵀ x = y
    double s = b[i];
    for (int k = i + 1; k < n; ++k) s -= a[k * n + i] * b[k];
    b[i] = s / a[i * n + i];
  }
  return b;
}

}  // namespace

int64_t AttendedPositions(int start, int tokens) {
  return static_cast<int64_t>(tokens) * start +
         static_cast<int64_t>(tokens) * (tokens + 1) / 2;
}

absl::StatusOr<StepCost> StepCost::Fit(const std::vector<StepSample>& samples) {
  std::set<int> token_counts;
  for (const StepSample& s : samples) {
    if (!(s.seconds > 0) || !std::isfinite(s.seconds) || s.shape.tokens < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step sample of ", s.shape.tokens, " tokens took ", s.seconds,
          " s: every sample needs ≥ 1 token and a positive time"));
    }
    token_counts.insert(s.shape.tokens);
  }
  if (token_counts.size() < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fitting a step cost needs steps of at least 2 different token "
        "counts; got ",
        token_counts.size()));
  }
  // Knots at powers of two spanning the samples.
  StepCost cost;
  const int lo = *token_counts.begin();
  const int hi = *token_counts.rbegin();
  std::vector<double> knots = {static_cast<double>(lo)};
  for (int k = 1; k < hi; k *= 2) {
    if (k > lo) knots.push_back(k);
  }
  knots.push_back(hi);
  // A knot no sample reaches would only be pinned by the ridge: keep a knot
  // once a sample lies after the previous kept one and not past it (the
  // last knot, hi, is a sample itself).
  std::vector<double> kept = {knots.front()};
  for (size_t i = 1; i < knots.size(); ++i) {
    auto next = token_counts.upper_bound(static_cast<int>(kept.back()));
    if (next != token_counts.end() && *next <= knots[i]) {
      kept.push_back(knots[i]);
    }
  }
  cost.knots_ = kept;
  const int num_knots = static_cast<int>(cost.knots_.size());
  const int n = num_knots + 2;  // + logit row + attended position

  // Feature scales so the normal equations are well conditioned.
  double max_rows = 1, max_attended = 1;
  for (const StepSample& s : samples) {
    max_rows = std::max(max_rows, static_cast<double>(s.shape.logit_rows));
    max_attended =
        std::max(max_attended, static_cast<double>(s.shape.attended_positions));
  }
  std::vector<bool> pinned(n, false);
  std::vector<double> x(n, 0.0);
  std::vector<double> hat;
  for (int round = 0; round <= n; ++round) {
    std::vector<double> a(n * n, 0.0), b(n, 0.0), row(n);
    for (const StepSample& s : samples) {
      HatWeights(cost.knots_, s.shape.tokens, &hat);
      // Unknown i is the rise from knot i-1 to knot i (i = 0: knot 0's
      // value), so the non-negativity below keeps L non-decreasing: a
      // step of more tokens never costs less (noisy samples of a small
      // model fitted a 128-token step below a 1-token one otherwise).
      double suffix = 0;
      for (int i = num_knots - 1; i >= 0; --i) {
        suffix += hat[i];
        row[i] = suffix;
      }
      row[num_knots] = s.shape.logit_rows / max_rows;
      row[num_knots + 1] = s.shape.attended_positions / max_attended;
      for (int i = 0; i < n; ++i) {
        if (pinned[i]) row[i] = 0;
      }
      const double w = 1.0 / (s.seconds * s.seconds);  // relative error²
      for (int i = 0; i < n; ++i) {
        b[i] += w * row[i] * s.seconds;
        for (int j = 0; j < n; ++j) a[i * n + j] += w * row[i] * row[j];
      }
    }
    for (int i = 0; i < n; ++i) {
      if (pinned[i]) {
        for (int j = 0; j < n; ++j) a[i * n + j] = a[j * n + i] = 0;
        a[i * n + i] = 1;
        b[i] = 0;
      }
    }
    x = SolveSymmetric(a, b, n);
    int most_negative = -1;
    for (int i = 0; i < n; ++i) {
      if (!pinned[i] && x[i] < 0 &&
          (most_negative < 0 || x[i] < x[most_negative])) {
        most_negative = i;
      }
    }
    if (most_negative < 0) break;
    pinned[most_negative] = true;
  }
  cost.knot_seconds_.assign(num_knots, 0.0);
  double level = 0;
  for (int i = 0; i < num_knots; ++i) {
    level += std::max(x[i], 0.0);
    cost.knot_seconds_[i] = level;
  }
  cost.seconds_per_logit_row_ = std::max(x[num_knots], 0.0) / max_rows;
  cost.seconds_per_attended_position_ =
      std::max(x[num_knots + 1], 0.0) / max_attended;
  std::vector<double> ratios;
  for (const StepSample& s : samples) {
    const double fitted = cost.Seconds(s.shape);
    if (fitted > 0) ratios.push_back(s.seconds / fitted);
  }
  std::sort(ratios.begin(), ratios.end());
  // kSpreadQuantiles evenly spaced quantiles (the midpoints of as many
  // equal shares of the samples).
  std::vector<double> quantiles;
  for (int i = 0; i < kSpreadQuantiles && !ratios.empty(); ++i) {
    const size_t at = std::min(
        ratios.size() - 1,
        static_cast<size_t>((i + 0.5) / kSpreadQuantiles * ratios.size()));
    quantiles.push_back(ratios[at]);
  }
  PDS_RETURN_IF_ERROR(cost.SetSpread(std::move(quantiles)));
  return cost;
}

double EvenQuantileAt(const std::vector<double>& quantiles, double u,
                      double none) {
  if (quantiles.empty()) return none;
  const size_t i =
      std::min(quantiles.size() - 1,
               static_cast<size_t>(std::max(0.0, u) *
                                   static_cast<double>(quantiles.size())));
  return quantiles[i];
}

double StepCost::SpreadAt(double u) const {
  return EvenQuantileAt(spread_, u, 1.0);
}

absl::Status StepCost::SetSpread(std::vector<double> quantiles) {
  for (double q : quantiles) {
    if (!(q > 0) || !std::isfinite(q)) {
      return absl::InvalidArgumentError(
          "step cost: spread quantiles must be finite and > 0");
    }
  }
  if (!std::is_sorted(quantiles.begin(), quantiles.end())) {
    return absl::InvalidArgumentError(
        "step cost: spread quantiles must be ascending");
  }
  spread_ = std::move(quantiles);
  return absl::OkStatus();
}

double StepCost::Seconds(const StepShape& shape) const {
  if (knots_.empty()) return 0;
  std::vector<double> hat;
  HatWeights(knots_, std::max(shape.tokens, 1), &hat);
  double linear = 0;
  for (size_t i = 0; i < knots_.size(); ++i)
    linear += hat[i] * knot_seconds_[i];
  // Extrapolating below the first knot could go negative; a step never
  // costs less than the smallest one measured.
  linear = std::max(linear, knot_seconds_.front() * 0.5);
  return linear + seconds_per_logit_row_ * shape.logit_rows +
         seconds_per_attended_position_ * shape.attended_positions;
}

StepCost StepCost::Scaled(double factor) const {
  StepCost scaled = *this;
  for (double& s : scaled.knot_seconds_) s *= factor;
  scaled.seconds_per_logit_row_ *= factor;
  scaled.seconds_per_attended_position_ *= factor;
  return scaled;
}

StepCost::FitError StepCost::Error(
    const std::vector<StepSample>& samples) const {
  std::vector<double> errors;
  for (const StepSample& s : samples) {
    errors.push_back(std::abs(Seconds(s.shape) - s.seconds) / s.seconds);
  }
  FitError e;
  if (errors.empty()) return e;
  std::sort(errors.begin(), errors.end());
  e.median = errors[errors.size() / 2];
  e.max = errors.back();
  return e;
}

nlohmann::json StepCost::ToJson() const {
  return {{"knots", knots_},
          {"knot_seconds", knot_seconds_},
          {"seconds_per_logit_row", seconds_per_logit_row_},
          {"seconds_per_attended_position", seconds_per_attended_position_},
          {"spread", spread_}};
}

absl::StatusOr<StepCost> StepCost::FromJson(const nlohmann::json& json) {
  StepCost cost;
  try {
    cost.knots_ = json.at("knots").get<std::vector<double>>();
    cost.knot_seconds_ = json.at("knot_seconds").get<std::vector<double>>();
    cost.seconds_per_logit_row_ =
        json.at("seconds_per_logit_row").get<double>();
    cost.seconds_per_attended_position_ =
        json.at("seconds_per_attended_position").get<double>();
    // Profiles written before the spread was measured have none.
    if (json.contains("spread")) {
      PDS_RETURN_IF_ERROR(
          cost.SetSpread(json.at("spread").get<std::vector<double>>()));
    }
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("step cost: ", e.what()));
  }
  if (cost.knots_.empty() || cost.knots_.size() != cost.knot_seconds_.size() ||
      !std::is_sorted(cost.knots_.begin(), cost.knots_.end())) {
    return absl::InvalidArgumentError(
        "step cost: knots must be ascending, non-empty and match "
        "knot_seconds one for one");
  }
  for (double v : cost.knot_seconds_) {
    if (!(v >= 0) || !std::isfinite(v)) {
      return absl::InvalidArgumentError(
          "step cost: knot_seconds must be finite and ≥ 0");
    }
  }
  if (!(cost.seconds_per_logit_row_ >= 0) ||
      !(cost.seconds_per_attended_position_ >= 0)) {
    return absl::InvalidArgumentError(
        "step cost: per-row and per-position seconds must be ≥ 0");
  }
  return cost;
}

}  // namespace pdserve::planner
