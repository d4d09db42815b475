// The router's online planner: what it exports for an observed window, read
// back through the Prometheus text format.
#include "router/planner_monitor.h"

#include <cmath>

#include "gtest/gtest.h"
#include "metrics/exposition.h"
#include "prometheus/text_serializer.h"

namespace pdserve::router {
namespace {

// A step cost written out by hand: 20 ms up to 8 tokens (bandwidth bound),
// then 0.5 ms a token; 0.4 ms a logits row; 20 ns an attended position.
planner::PerfModel HandWrittenModel() {
  const nlohmann::json step = {{"knots", {1, 8, 512}},
                               {"knot_seconds", {0.020, 0.020, 0.272}},
                               {"seconds_per_logit_row", 0.0004},
                               {"seconds_per_attended_position", 2e-8}};
  nlohmann::json json = {
      {"model", "hand-written"},
      {"num_layers", 12},
      {"block_size", 16},
      {"cores", 2},
      {"configs",
       {{{"tp", 1}, {"threads_per_rank", 1}, {"step", step}},
        {{"tp", 1}, {"threads_per_rank", 2}, {"step", step}}}},
      {"colocated_ttft", {{"base", 0.01}, {"per_prompt_token", 0}}},
      {"disaggregated_ttft", {{"base", 0.015}, {"per_prompt_token", 0}}},
      {"handoff_seconds", 0.005},
      {"decode_step_overhead_seconds", 0.001}};
  auto model = planner::PerfModel::FromJson(json);
  EXPECT_TRUE(model.ok()) << model.status();
  return *model;
}

std::vector<metrics::Sample> Scrape(metrics::MetricsRegistry& registry) {
  prometheus::TextSerializer serializer;
  auto samples =
      metrics::ParseExposition(serializer.Serialize(registry.Collect()));
  EXPECT_TRUE(samples.ok()) << samples.status();
  return *samples;
}

std::vector<metrics::Sample> Named(const std::vector<metrics::Sample>& all,
                                   const std::string& name) {
  std::vector<metrics::Sample> out;
  for (const auto& s : all) {
    if (s.name == name) out.push_back(s);
  }
  return out;
}

double Value(const std::vector<metrics::Sample>& all, const std::string& name) {
  auto v = Named(all, name);
  EXPECT_EQ(v.size(), 1u) << name;
  return v.empty() ? NAN : v[0].value;
}

TEST(PlannerMonitorTest, ExportsTheRecommendationForTheObservedWindow) {
  metrics::MetricsRegistry registry(metrics::Layout{"router", "test", 0, 1, 1});
  metrics::ServedTotals totals;
  absl::Time now = absl::FromUnixSeconds(1000);
  PlannerMonitorOptions options;
  options.model = HandWrittenModel();
  options.slo = {2.0, 0.06};
  options.interval = absl::Hours(1);  // evaluations come from the test
  options.clock = [&now] { return now; };
  auto monitor = PlannerMonitor::Start(
      options, [&totals] { return totals; }, registry);
  ASSERT_TRUE(monitor.ok()) << monitor.status();

  now += absl::Seconds(20);
  EXPECT_EQ((*monitor)->EvaluateNow().code(),
            absl::StatusCode::kFailedPrecondition);

  // 30 requests in 20 s: 1.5/s, 40 prompt and 32 output tokens each.
  totals = {30, 30 * 40.0, 30 * 32.0};
  now += absl::Seconds(20);
  ASSERT_TRUE((*monitor)->EvaluateNow().ok());
  auto samples = Scrape(registry);
  EXPECT_DOUBLE_EQ(Value(samples, "pdserve_planner_observed_request_rate"),
                   1.5);
  EXPECT_DOUBLE_EQ(
      Value(samples, "pdserve_planner_observed_prompt_tokens_mean"), 40);
  EXPECT_DOUBLE_EQ(
      Value(samples, "pdserve_planner_observed_output_tokens_mean"), 32);
  auto layout = Named(samples, "pdserve_planner_recommended_layout");
  ASSERT_EQ(layout.size(), 1u);
  EXPECT_EQ(layout[0].value, 1);
  EXPECT_NE(layout[0].Label("local_flags").find("--decode-workers"),
            std::string::npos);
  const double capacity =
      Value(samples, "pdserve_planner_capacity_requests_per_second");
  EXPECT_GT(capacity, 1.5);  // 20 ms steps serve 1.5/s with room
  EXPECT_NEAR(Value(samples, "pdserve_planner_headroom_ratio"), capacity / 1.5,
              1e-9);
  EXPECT_EQ(Value(samples, "pdserve_planner_desired_replicas"), 1);
  EXPECT_EQ(Value(samples, "pdserve_planner_layout_nodes"), 1);  // one node
  EXPECT_GT(Value(samples, "pdserve_planner_predicted_slo_attainment"), 0.95);
  EXPECT_EQ(Value(samples, "pdserve_planner_evaluations_total"), 1);

  // Ten times the capacity in the next window: more replicas, still one
  // recommended-layout series.
  const int64_t burst = static_cast<int64_t>(std::ceil(capacity * 10 * 20));
  totals = {30 + burst, totals.prompt_tokens + burst * 40.0,
            totals.output_tokens + burst * 32.0};
  now += absl::Seconds(20);
  ASSERT_TRUE((*monitor)->EvaluateNow().ok());
  samples = Scrape(registry);
  const double copies = Value(samples, "pdserve_planner_desired_replicas");
  EXPECT_GE(copies, 2);
  // The autoscalers' targets: the layout's workers times its copies.
  EXPECT_GE(Value(samples, "pdserve_planner_desired_decode_workers"), copies);
  EXPECT_EQ(std::fmod(Value(samples, "pdserve_planner_desired_decode_workers"),
                      copies),
            0);
  EXPECT_EQ(std::fmod(Value(samples, "pdserve_planner_desired_prefill_groups"),
                      copies),
            0);
  EXPECT_LT(Value(samples, "pdserve_planner_headroom_ratio"), 1);
  EXPECT_EQ(Named(samples, "pdserve_planner_recommended_layout").size(), 1u);
}

TEST(PlannerMonitorTest, RefusesImpossibleOptions) {
  metrics::MetricsRegistry registry(metrics::Layout{"router", "test", 0, 1, 1});
  PlannerMonitorOptions options;
  options.model = HandWrittenModel();
  options.slo = {0, 0.06};
  EXPECT_EQ(PlannerMonitor::Start(
                options, [] { return metrics::ServedTotals{}; }, registry)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  options.slo = {2, 0.06};
  options.replications = 0;
  auto none = PlannerMonitor::Start(
      options, [] { return metrics::ServedTotals{}; }, registry);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(none.status().message().find("replications"), std::string::npos);
  // A link bandwidth on one node is refused, not ignored; spanning nodes
  // needs their link bandwidth, and a profile that says how many bytes a
  // token sends (the hand-written one predates them).
  options.replications = 5;
  options.resources.network_bytes_per_second = 1.25e9;
  auto lone_link = PlannerMonitor::Start(
      options, [] { return metrics::ServedTotals{}; }, registry);
  EXPECT_EQ(lone_link.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(lone_link.status().message().find("more than one node"),
            std::string::npos);
  options.resources.network_bytes_per_second = 0;
  options.resources.nodes = 2;
  auto no_link = PlannerMonitor::Start(
      options, [] { return metrics::ServedTotals{}; }, registry);
  EXPECT_EQ(no_link.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(no_link.status().message().find("link bandwidth"),
            std::string::npos);
  options.resources.network_bytes_per_second = 1.25e9;
  EXPECT_EQ(PlannerMonitor::Start(
                options, [] { return metrics::ServedTotals{}; }, registry)
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace pdserve::router
