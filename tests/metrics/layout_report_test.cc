// The layout analysis on exposition text written here (two scrapes of a
// 3-stage prefill group, a TP-2 decode worker and a router), checking each
// finding's number and the knob it points at.
#include "metrics/layout_report.h"

#include <cmath>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "metrics/exposition.h"

namespace pdserve::metrics {
namespace {

std::string Stage(int stage, double busy, double idle, int queue) {
  const std::string l = absl::StrFormat(
      "role=\"prefill\",worker_id=\"g0\",stage=\"%d\",num_stages=\"3\","
      "tp=\"1\"",
      stage);
  std::string text = absl::StrFormat(
      "pdserve_prefill_stage_busy_seconds_total{%s} %g\n"
      "pdserve_prefill_stage_idle_seconds_total{%s} %g\n"
      "pdserve_prefill_kv_transfer_seconds_sum{%s} %g\n",
      l, busy, l, idle, l, busy / 10);
  if (stage == 0) {
    absl::StrAppend(
        &text,
        absl::StrFormat("pdserve_prefill_queue_depth{%s} %d\n", l, queue));
  }
  return text;
}

std::string Decode(double step_sum, double steps, double batch_sum,
                   double uptime, double proposed, double accepted,
                   double allreduce) {
  const std::string l =
      "role=\"decode\",worker_id=\"d0\",stage=\"0\",num_stages=\"1\",tp=\"2\"";
  return absl::StrFormat(
      "pdserve_decode_step_seconds_sum{%s} %g\n"
      "pdserve_decode_step_seconds_count{%s} %g\n"
      "pdserve_decode_batch_size_sum{%s} %g\n"
      "pdserve_decode_batch_size_count{%s} %g\n"
      "pdserve_process_uptime_seconds{%s} %g\n"
      "pdserve_decode_spec_proposed_tokens_total{%s} %g\n"
      "pdserve_decode_spec_accepted_tokens_total{%s} %g\n"
      "pdserve_decode_spec_acceptance_length_sum{%s} %g\n"
      "pdserve_decode_spec_acceptance_length_count{%s} %g\n"
      "pdserve_decode_allreduce_seconds_total{%s} %g\n"
      "pdserve_decode_kv_blocks_used{%s} 100\n"
      "pdserve_decode_kv_blocks_capacity{%s} 1000\n"
      "pdserve_decode_preemptions_total{%s} 0\n",
      l, step_sum, l, steps, l, batch_sum, l, steps, l, uptime, l, proposed, l,
      accepted, l, accepted + proposed / 4, l, proposed / 4, l, allreduce, l, l,
      l);
}

std::string Router(double ttft_sum, double kv_sum) {
  const std::string l =
      "role=\"router\",worker_id=\"r0\",stage=\"0\",num_stages=\"3\",tp=\"2\"";
  return absl::StrFormat(
      "# TYPE pdserve_router_ttft_seconds histogram\n"
      "pdserve_router_ttft_seconds_sum{%s} %g\n"
      "pdserve_router_ttft_phase_seconds_sum{%s,phase=\"kv_transfer\"} %g\n"
      "pdserve_router_ttft_phase_seconds_count{%s,phase=\"kv_transfer\"} %g\n"
      "pdserve_router_ttft_phase_seconds_sum{%s,phase=\"prefill\"} %g\n",
      l, ttft_sum, l, kv_sum, l, ttft_sum, l, ttft_sum - kv_sum);
}

std::vector<Sample> Parse(const std::string& text) {
  auto samples = ParseExposition(text);
  EXPECT_TRUE(samples.ok()) << samples.status();
  return samples.ok() ? *samples : std::vector<Sample>{};
}

TEST(LayoutReportTest, WindowBetweenTwoScrapesDrivesEveryFinding) {
  // Window (after - before): stage busy 10 / 16 / 10 s, idle 10 / 4 / 10 s;
  // decode 18 s of steps in 20 s, batches of 3, 40 of 100 drafts accepted,
  // all-reduce 9 s of 18; router TTFT 10 s of which 4 s KV transfer.
  const std::string before =
      Stage(0, 5, 5, 0) + Stage(1, 5, 5, 0) + Stage(2, 5, 5, 0) +
      Decode(2, 100, 300, 10, 100, 50, 1) + Router(1, 0.5);
  const std::string after =
      Stage(0, 15, 15, 4) + Stage(1, 21, 9, 4) + Stage(2, 15, 15, 4) +
      Decode(20, 1100, 3300, 30, 200, 90, 10) + Router(11, 4.5);
  const LayoutReport report = AnalyzeLayout(Parse(after), Parse(before));
  const std::string text = report.ToText();

  const Finding* imbalance = report.Find("stage imbalance (g0)");
  ASSERT_NE(imbalance, nullptr) << text;
  EXPECT_NEAR(imbalance->value, 16.0 / 12.0, 1e-9);
  EXPECT_TRUE(absl::StrContains(imbalance->knob, "--layer-split"));
  EXPECT_TRUE(absl::StrContains(imbalance->why, "stage 1")) << imbalance->why;

  const Finding* bubble = report.Find("bubble ratio (g0)");
  ASSERT_NE(bubble, nullptr);
  EXPECT_NEAR(bubble->value, 24.0 / 60.0, 1e-9);
  // Idle stages with requests queued (the gauge is read as is: 4).
  EXPECT_TRUE(absl::StrContains(bubble->knob, "--chunk-tokens")) << text;

  const Finding* transfer = report.Find("KV transfer share of TTFT");
  ASSERT_NE(transfer, nullptr);
  EXPECT_NEAR(transfer->value, 0.4, 1e-9);
  EXPECT_FALSE(transfer->knob.empty());

  const Finding* pd = report.Find("prefill vs decode utilisation");
  ASSERT_NE(pd, nullptr);
  EXPECT_TRUE(absl::StrContains(pd->shown, "prefill 60.0%")) << pd->shown;
  EXPECT_TRUE(absl::StrContains(pd->shown, "decode 90.0%")) << pd->shown;

  const Finding* spec = report.Find("speculative acceptance");
  ASSERT_NE(spec, nullptr);
  EXPECT_NEAR(spec->value, 0.4, 1e-9);
  EXPECT_TRUE(spec->knob.empty()) << spec->why;  // 40%: adaptive range

  const Finding* batch = report.Find("decode batch size");
  ASSERT_NE(batch, nullptr);
  EXPECT_NEAR(batch->value, 3.0, 1e-9);
  // All-reduce took half of every step at TP 2.
  EXPECT_TRUE(absl::StrContains(batch->knob, "--tp")) << batch->why;
}

// Requests waiting in the router's admission queue for decode KV: 6 s of
// waiting in 20 s of end-to-end latency points at decode KV.
TEST(LayoutReportTest, AdmissionWaitsPointAtDecodeKv) {
  const std::string l =
      "role=\"router\",worker_id=\"r0\",stage=\"0\",num_stages=\"1\","
      "tp=\"1\"";
  auto router = [&](double wait_sum, double waits, double e2e_sum, int depth) {
    return absl::StrFormat(
        "pdserve_router_admission_wait_seconds_sum{%s} %g\n"
        "pdserve_router_admission_wait_seconds_count{%s} %g\n"
        "pdserve_router_e2e_seconds_sum{%s} %g\n"
        "pdserve_router_admission_queue_depth{%s} %d\n",
        l, wait_sum, l, waits, l, e2e_sum, l, depth);
  };
  LayoutReport report =
      AnalyzeLayout(Parse(router(7, 12, 30, 3)), Parse(router(1, 2, 10, 0)));
  const Finding* admission = report.Find("admission queue");
  ASSERT_NE(admission, nullptr) << report.ToText();
  EXPECT_NEAR(admission->value, 6.0 / 20.0, 1e-9);
  EXPECT_TRUE(absl::StrContains(admission->knob, "decode")) << admission->why;
  EXPECT_TRUE(absl::StrContains(admission->shown, "0.6 s mean wait"))
      << admission->shown;
  EXPECT_TRUE(absl::StrContains(admission->shown, "3 waiting now"))
      << admission->shown;
  // Little waiting: no knob.
  report =
      AnalyzeLayout(Parse(router(1.1, 3, 30, 0)), Parse(router(1, 2, 10, 0)));
  ASSERT_NE(report.Find("admission queue"), nullptr);
  EXPECT_TRUE(report.Find("admission queue")->knob.empty());
}

TEST(LayoutReportTest, BalancedLayoutSuggestsNoKnob) {
  const std::string after = Stage(0, 9, 1, 0) + Stage(1, 9.5, 0.5, 0) +
                            Stage(2, 9, 1, 0) +
                            Decode(5, 100, 800, 10, 100, 90, 0.1);
  const LayoutReport report = AnalyzeLayout(Parse(after));
  EXPECT_TRUE(report.Find("stage imbalance")->knob.empty());
  EXPECT_TRUE(report.Find("bubble ratio")->knob.empty());
  // No router: the transfer share falls back to prefill stage time.
  EXPECT_TRUE(absl::StrContains(report.Find("KV transfer")->shown,
                                "no router metrics"));
  // 90% acceptance: longer drafts would pay.
  EXPECT_TRUE(absl::StrContains(report.Find("speculative")->knob, "gamma"));
  EXPECT_TRUE(report.Find("decode batch size")->knob.empty());
}

TEST(LayoutReportTest, NoTrafficSaysSoInsteadOfGuessing) {
  const LayoutReport report = AnalyzeLayout({});
  ASSERT_NE(report.Find("prefill vs decode"), nullptr);
  EXPECT_TRUE(report.Find("prefill vs decode")->knob.empty());
  EXPECT_TRUE(std::isnan(report.Find("speculative")->value));
  EXPECT_TRUE(report.Find("decode batch size")->knob.empty());
}

}  // namespace
}  // namespace pdserve::metrics
