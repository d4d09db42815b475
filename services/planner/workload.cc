#include "planner/workload.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace pdserve::planner {

absl::StatusOr<LengthRange> ParseLengthRange(const std::string& text) {
  std::vector<std::string> parts = absl::StrSplit(text, ':');
  LengthRange r;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &r.lo) ||
      !absl::SimpleAtoi(parts[1], &r.hi) || r.lo < 1 || r.hi < r.lo) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", text, "' is not a length range LO:HI with 1 <= LO <= HI"));
  }
  return r;
}

WorkloadSpec WorkloadFromMeans(int requests, double rate, double prompt_mean,
                               double output_mean) {
  auto around = [](double mean) {
    const int m = std::max(1, static_cast<int>(std::lround(mean)));
    return LengthRange{std::max(1, m / 2), std::max(1, m * 3 / 2)};
  };
  WorkloadSpec spec;
  spec.requests = requests;
  spec.rate = rate;
  spec.prompt = around(prompt_mean);
  spec.output = around(output_mean);
  return spec;
}

std::vector<Arrival> MakeArrivals(const WorkloadSpec& spec, int vocab) {
  std::mt19937_64 rng(spec.seed);
  std::exponential_distribution<double> gap(spec.rate);
  std::uniform_int_distribution<int> prompt_len(spec.prompt.lo, spec.prompt.hi);
  std::uniform_int_distribution<int> output_len(spec.output.lo, spec.output.hi);
  std::uniform_int_distribution<int32_t> token(3, vocab - 1);
  std::vector<Arrival> arrivals(spec.requests);
  double t = 0;
  for (Arrival& a : arrivals) {
    t += gap(rng);
    a.seconds = t;
    a.prompt.push_back(1);  // BOS
    const int n = prompt_len(rng);
    for (int i = 1; i < n; ++i) a.prompt.push_back(token(rng));
    a.max_tokens = output_len(rng);
  }
  return arrivals;
}

}  // namespace pdserve::planner
