// A worker's forward steps, one CSV line each, written as they end: the
// decode worker's steps and a prefill stage's microbatches alike
// (decode_worker/prefill_worker --step-trace). The layout planner's profile
// sets a loaded cluster's steps beside its fitted step costs with them
// (tools/planner_profile.h ReadStepTrace), and planner_bench --step-traces
// keeps them for each measured run.
#ifndef PDSERVE_SERVICES_PLANNER_STEP_TRACE_H_
#define PDSERVE_SERVICES_PLANNER_STEP_TRACE_H_

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace pdserve::planner {

// One step's shape and time (the fields of planner::StepShape, plus what the
// step ran over and what it produced).
struct TracedStep {
  double seconds = 0;
  int sequences = 0;  // a stage's microbatch: its chunks
  int tokens_fed = 0;
  int logit_rows = 0;
  int64_t attended_positions = 0;
  int output_tokens = 0;
};

// Line-buffered, so that a trace of a worker stopped by a signal ends at its
// last whole line. Appends: a restarted worker given the same path continues
// its predecessor's trace (the header is written once, into an empty file).
class StepTraceWriter {
 public:
  static absl::StatusOr<std::unique_ptr<StepTraceWriter>> Open(
      const std::string& path);
  ~StepTraceWriter();
  StepTraceWriter(const StepTraceWriter&) = delete;
  StepTraceWriter& operator=(const StepTraceWriter&) = delete;

  // The line's end time is now. Thread-safe.
  void Record(const TracedStep& step);

 private:
  explicit StepTraceWriter(std::FILE* file) : file_(file) {}
  absl::Mutex mu_;
  std::FILE* const file_ ABSL_PT_GUARDED_BY(mu_);
};

}  // namespace pdserve::planner

#endif  // PDSERVE_SERVICES_PLANNER_STEP_TRACE_H_
