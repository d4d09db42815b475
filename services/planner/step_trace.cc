#include "planner/step_trace.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace pdserve::planner {

absl::StatusOr<std::unique_ptr<StepTraceWriter>> StepTraceWriter::Open(
    const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "a");
  if (file == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--step-trace: cannot write ", path));
  }
  std::setvbuf(file, nullptr, _IOLBF, 0);
  std::fseek(file, 0, SEEK_END);
  if (std::ftell(file) == 0) {
    std::fprintf(file,
                 "end_unix_s,seconds,sequences,tokens_fed,logit_rows,"
                 "attended_positions,output_tokens\n");
  }
  return std::unique_ptr<StepTraceWriter>(new StepTraceWriter(file));
}

StepTraceWriter::~StepTraceWriter() { std::fclose(file_); }

void StepTraceWriter::Record(const TracedStep& s) {
  const double end = absl::ToUnixMicros(absl::Now()) * 1e-6;
  absl::MutexLock lock(&mu_);
  std::fprintf(file_, "%.6f,%.6f,%d,%d,%d,%lld,%d\n", end, s.seconds,
               s.sequences, s.tokens_fed, s.logit_rows,
               static_cast<long long>(s.attended_positions), s.output_tokens);
}

}  // namespace pdserve::planner
