// Malformed planner input — perf-model JSON, step samples, layouts, length
// ranges — gets a precise error, never a crash (runs under ASan/UBSan).
#include <fstream>

#include "gtest/gtest.h"
#include "planner/planner.h"

namespace pdserve::planner {
namespace {

TEST(PlannerBadInputTest, StepSamplesNeedTimesAndTwoTokenCounts) {
  EXPECT_EQ(StepCost::Fit({}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      StepCost::Fit({{{4, 4, 16}, 0.01}, {{4, 4, 16}, 0.011}}).status().code(),
      absl::StatusCode::kInvalidArgument);
  auto nan = StepCost::Fit({{{1, 1, 1}, 0.01}, {{2, 2, 3}, std::nan("")}});
  EXPECT_EQ(nan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(nan.status().message().find("positive time"), std::string::npos);
}

TEST(PlannerBadInputTest, MalformedPerfModelJson) {
  for (const char* text :
       {"{}", "[]", "{\"model\": 3}",
        "{\"model\":\"m\",\"num_layers\":0,\"block_size\":16,\"cores\":2,"
        "\"configs\":[],\"colocated_ttft\":{\"base\":0,\"per_prompt_token\":0},"
        "\"disaggregated_ttft\":{\"base\":0,\"per_prompt_token\":0},"
        "\"handoff_seconds\":0,\"decode_step_overhead_seconds\":0}",
        "{\"model\":\"m\",\"num_layers\":2,\"block_size\":16,\"cores\":2,"
        "\"configs\":[{\"tp\":1,\"threads_per_rank\":1,\"step\":{\"knots\":[2,"
        "1],\"knot_seconds\":[0.1,0.2],\"seconds_per_logit_row\":0,"
        "\"seconds_per_attended_position\":0}}],"
        "\"colocated_ttft\":{\"base\":0,\"per_prompt_token\":0},"
        "\"disaggregated_ttft\":{\"base\":0,\"per_prompt_token\":0},"
        "\"handoff_seconds\":0,\"decode_step_overhead_seconds\":0}"}) {
    auto m = PerfModel::FromJson(nlohmann::json::parse(text));
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << text;
  }
  // The side-by-side calibrations' fields: wrong types, out of range, out of
  // order.
  const std::string valid =
      "{\"model\":\"m\",\"num_layers\":2,\"block_size\":16,\"cores\":2,"
      "\"configs\":[{\"tp\":1,\"threads_per_rank\":1,\"step\":{\"knots\":[1,"
      "2],\"knot_seconds\":[0.1,0.2],\"seconds_per_logit_row\":0,"
      "\"seconds_per_attended_position\":0}}],"
      "\"colocated_ttft\":{\"base\":0,\"per_prompt_token\":0},"
      "\"disaggregated_ttft\":{\"base\":0,\"per_prompt_token\":0},"
      "\"handoff_seconds\":0,\"decode_step_overhead_seconds\":0}";
  ASSERT_TRUE(PerfModel::FromJson(nlohmann::json::parse(valid)).ok());
  for (const char* field :
       {R"({"co_running":{"prefill_stage":0,"decode_step":0,
            "decode_beside_decode":"fast"}})",
        R"({"co_running":{"prefill_stage":0,"decode_step":0,
            "prefill_beside_prefill":-1}})",
        R"({"gang_sharing_points":{"share":0.5}})",
        R"({"gang_sharing_points":[{"share":"half","exponent":0.5}]})",
        R"({"gang_sharing_points":[{"share":0.5}]})",
        R"({"gang_sharing_points":[{"share":0,"exponent":0.5}]})",
        R"({"gang_sharing_points":[{"share":0.5,"exponent":9}]})",
        R"({"gang_sharing_points":[{"share":0.5,"exponent":0.5},
                                   {"share":0.5,"exponent":0.4}]})",
        R"({"gang_beside_gang":0.5})", R"({"gang_beside_gang":{"share":0.5}})",
        R"({"gang_beside_gang":{"share":2,"exponent":0.5}})",
        R"({"gang_beside_gang":{"share":0.5,"exponent":-1.5}})",
        R"({"colocated_ttft":{"base":0,"per_prompt_token":0,
            "scatter":0.01}})",
        R"({"colocated_ttft":{"base":0,"per_prompt_token":0,
            "scatter":[0.02,-0.01]}})",
        R"({"disaggregated_ttft":{"base":0,"per_prompt_token":0,
            "scatter":[-0.01,1e9]}})",
        R"({"calibrated":[{"tp":1,"threads_per_rank":1,
            "step_overhead_seconds":0,"colocated_ttft":{"base":0,
            "per_prompt_token":0,"scatter":["late"]}}]})"}) {
    nlohmann::json bad = nlohmann::json::parse(valid);
    bad.update(nlohmann::json::parse(field));
    auto m = PerfModel::FromJson(bad);
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << field;
  }
  const std::string path = ::testing::TempDir() + "/not_json.json";
  std::ofstream(path) << "{ not json";
  EXPECT_EQ(PerfModel::Load(path).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PerfModel::Load(path + ".missing").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(PlannerBadInputTest, LayoutsAndWorkloadsOutOfRange) {
  PerfModel m;
  m.num_layers = 2;
  auto cost = StepCost::Fit({{{1, 1, 1}, 0.01}, {{64, 1, 2080}, 0.1}});
  ASSERT_TRUE(cost.ok());
  m.steps[{1, 1}] = *cost;
  Layout l;
  l.stages = 3;  // more than the layers
  EXPECT_EQ(Simulate(m, l, {{0, 8, 2}}, Slo{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  l.stages = 1;
  l.tp = 4;  // never profiled
  auto missing = Simulate(m, l, {{0, 8, 2}}, Slo{});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("tp1x1t"), std::string::npos);
  EXPECT_EQ(Simulate(m, Layout{}, {}, Slo{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  for (const char* text : {"", "5", "0:3", "4:2", "a:b", "1:2:3"}) {
    EXPECT_EQ(ParseLengthRange(text).status().code(),
              absl::StatusCode::kInvalidArgument)
        << text;
  }
  PlanRequest empty;
  empty.workload.requests = 0;
  EXPECT_EQ(Plan(m, empty).status().code(), absl::StatusCode::kInvalidArgument);
  auto none = Simulate(m, l, {{0, 8, 2}}, Slo{}, {.replications = 0});
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(none.status().message().find("replication"), std::string::npos);
}

}  // namespace
}  // namespace pdserve::planner
