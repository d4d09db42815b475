// The open-loop workload the planner predicts and load_bench measures: the
// same generator, so a prediction and a measurement see the same arrivals.
// Poisson arrivals at `rate` requests/s; prompt and output lengths uniform in
// their ranges; prompts are BOS + random ids (3.. skips unk/bos/eos).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace pdserve::planner {

struct LengthRange {
  int lo = 1;
  int hi = 1;
};

// "LO:HI" with 1 ≤ LO ≤ HI; INVALID_ARGUMENT otherwise.
absl::StatusOr<LengthRange> ParseLengthRange(const std::string& text);

struct WorkloadSpec {
  int requests = 40;
  double rate = 1.5;  // requests/s
  LengthRange prompt{16, 64};
  LengthRange output{16, 64};
  uint64_t seed = 1;
};

struct Arrival {
  double seconds = 0;  // offset from the run's start
  std::vector<int32_t> prompt;
  int max_tokens = 0;
};

// `vocab` ≥ 4.
std::vector<Arrival> MakeArrivals(const WorkloadSpec& spec, int vocab);

// A workload known only by its rate and mean lengths (what a router's
// counters give): lengths uniform in [m/2, 3m/2] around each mean.
WorkloadSpec WorkloadFromMeans(int requests, double rate, double prompt_mean,
                               double output_mean);

}  // namespace pdserve::planner
