// Reading a decode worker's step trace (decode_worker --step-trace) and
// setting its steps against a fitted cost, as the profile's calibrations do.
#include "planner/step_trace.h"

#include <cstdio>
#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "planner/step_cost.h"
#include "tools/planner_profile.h"

namespace pdserve::tools {
namespace {

// A cost of 1 ms per fed token, nothing else.
planner::StepCost MillisecondPerToken() {
  auto cost =
      planner::StepCost::FromJson({{"knots", {1.0, 128.0}},
                                   {"knot_seconds", {1e-3, 128e-3}},
                                   {"seconds_per_logit_row", 0.0},
                                   {"seconds_per_attended_position", 0.0}});
  EXPECT_TRUE(cost.ok()) << cost.status();
  return cost.ok() ? *cost : planner::StepCost();
}

TEST(StepTraceTest, ReadsEveryWholeLineAndSplitsDecodeFromPromptSteps) {
  const std::string path = ::testing::TempDir() + "/steps.csv";
  {
    std::ofstream out(path);
    out << "end_unix_s,seconds,sequences,tokens_fed,logit_rows,"
           "attended_positions,output_tokens\n"
        // Decode steps (one token per logit row) at 1.1x, 1.2x, 0.9x.
        << "100.0,0.0011,1,1,1,20,1\n"
        << "100.1,0.0024,2,2,2,40,2\n"
        << "100.2,0.0036,4,4,4,80,4\n"
        // Prompt steps (more tokens than logit rows) at 1.5x, 0.5x, 2x.
        << "100.3,0.0480,1,32,1,528,1\n"
        << "100.4,0.0080,2,16,2,200,2\n"
        << "100.5,0.1280,2,64,2,900,2\n"
        // Cut short by the worker's stop: skipped.
        << "100.6,0.00";
  }
  auto steps = ReadStepTrace(path);
  ASSERT_TRUE(steps.ok()) << steps.status();
  ASSERT_EQ(steps->size(), 6u);
  EXPECT_EQ((*steps)[3].shape.tokens, 32);
  EXPECT_EQ((*steps)[3].shape.logit_rows, 1);
  EXPECT_EQ((*steps)[3].shape.attended_positions, 528);
  EXPECT_DOUBLE_EQ((*steps)[3].seconds, 0.048);
  const planner::StepCost cost = MillisecondPerToken();
  ASSERT_NEAR(cost.Seconds({4, 4, 80}), 4e-3, 1e-6);
  const StepsOverFit over = OverFit(*steps, cost);
  EXPECT_NEAR(over.decode, 1.1, 0.01);
  EXPECT_NEAR(over.prompt, 1.5, 0.01);
  EXPECT_EQ(OverFit({}, cost).decode, 0);
  std::remove(path.c_str());
  EXPECT_EQ(ReadStepTrace(path).status().code(), absl::StatusCode::kNotFound);
}

// A worker restarted on the same --step-trace path continues the file: one
// header, every step of both, readable as one trace.
TEST(StepTraceTest, WriterAppendsAcrossRestartsUnderOneHeader) {
  const std::string path = ::testing::TempDir() + "/appended.csv";
  std::remove(path.c_str());
  for (int life = 0; life < 2; ++life) {
    auto writer = planner::StepTraceWriter::Open(path);
    ASSERT_TRUE(writer.ok()) << writer.status();
    (*writer)->Record({0.002 * (life + 1), 1, 32, 1, 528, 1});
    (*writer)->Record({0.001, 2, 2, 2, 40, 2});
  }
  std::vector<double> ends;
  auto steps = ReadStepTrace(path, &ends);
  ASSERT_TRUE(steps.ok()) << steps.status();
  ASSERT_EQ(steps->size(), 4u);
  EXPECT_DOUBLE_EQ((*steps)[2].seconds, 0.004);
  EXPECT_EQ((*steps)[2].shape.tokens, 32);
  EXPECT_EQ((*steps)[2].shape.attended_positions, 528);
  EXPECT_EQ((*steps)[3].shape.logit_rows, 2);
  ASSERT_EQ(ends.size(), 4u);
  EXPECT_LE(ends[0], ends[3]);
  std::ifstream in(path);
  int headers = 0;
  for (std::string line; std::getline(in, line);) {
    headers += line.rfind("end_unix_s,", 0) == 0;
  }
  EXPECT_EQ(headers, 1);
  EXPECT_EQ(planner::StepTraceWriter::Open("/nonexistent-dir/steps.csv")
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace pdserve::tools
