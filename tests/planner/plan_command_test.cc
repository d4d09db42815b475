// `pdserve plan` for real on stories260K: it profiles this machine (decode
// worker steps in process, idle requests on real clusters), saves the
// profile, ranks layouts and prints flags `pdserve local` accepts; the saved
// profile plans the same ranking again without profiling; bad flags are
// precise errors.
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <regex>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "planner/perf_model.h"
#include "testing/shell.h"
#include "tools/load_generator.h"
#include "tools/local_cluster.h"

namespace pdserve::planner {
namespace {

const std::string kPdserve = PDSERVE_BINARY;
const std::string kModel = std::string(PDSERVE_MODELS_DIR) + "/stories260K";

std::string RunPlan(const std::string& args, int* code) {
  const auto r = testing::RunShell(kPdserve + " plan " + args, ".");
  *code = r.code;
  return r.output;
}

// The ranking table and what follows it (progress lines precede it).
std::string FromTable(const std::string& output) {
  const size_t at = output.find("workload:");
  return at == std::string::npos ? "" : output.substr(at);
}

TEST(PlanCommandTest, ProfilesRanksAndReplansFromTheSavedProfile) {
  const std::string perf = ::testing::TempDir() + "/stories_perf.json";
  const std::string workload =
      " --rate 20 --requests 100 --prompt 16:120 --output 8:32 "
      "--slo-ttft-ms 200 --slo-tpot-ms 10 --cores 2";
  int code = 0;
  const std::string profiled =
      RunPlan("--model " + kModel + " --profile-max-prompt 128 --perf-model " +
                  perf + workload,
              &code);
  ASSERT_EQ(code, 0) << profiled;
  EXPECT_NE(profiled.find("tp 1 × 2 threads"), std::string::npos) << profiled;
  EXPECT_NE(profiled.find("best: "), std::string::npos) << profiled;
  EXPECT_NE(profiled.find("pdserve local --model " + kModel + " "),
            std::string::npos);
  EXPECT_NE(profiled.find("ConfigMap pdserve-layout:"), std::string::npos);
  EXPECT_NE(profiled.find("Deployment decode: replicas "), std::string::npos);
  // Disaggregated best layouts come with the per-request threshold.
  if (profiled.find("best: colocated") == std::string::npos) {
    EXPECT_NE(profiled.find("router --local-prefill-max-tokens="),
              std::string::npos)
        << profiled;
  }
  // The co-running calibration measured each pair of kinds side by side.
  for (const char* pair :
       {"decode beside a prefill: ", "decode beside a decode: ",
        "prefill beside a decode: ", "prefill beside a prefill: "}) {
    EXPECT_NE(profiled.find(pair), std::string::npos) << pair << profiled;
  }

  auto model = PerfModel::Load(perf);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->steps.size(), 3u);  // tp1×1, tp1×2, tp2×1
  // Each configuration's steps were measured in three rounds, and the saved
  // fit is over all of them: its batch-1 decode step is the one printed, and
  // lies among the rounds' own (a pooled fit does not leave their range by
  // more than the fits' error).
  for (const auto& [config, cost] : model->steps) {
    const std::string head = "tp " + std::to_string(config.tp) + " × " +
                             std::to_string(config.threads_per_rank) +
                             " threads: ";
    const size_t line = profiled.find(head);
    ASSERT_NE(line, std::string::npos) << head << profiled;
    int steps = 0, rounds = 0;
    ASSERT_EQ(std::sscanf(profiled.c_str() + line + head.size(),
                          "%d steps in %d rounds", &steps, &rounds),
              2)
        << profiled.substr(line, 160);
    EXPECT_EQ(rounds, 3);
    const size_t b1 = profiled.find("decode b1 ", line);
    ASSERT_NE(b1, std::string::npos);
    double fitted_ms = 0, round_ms[3] = {0, 0, 0};
    ASSERT_EQ(std::sscanf(profiled.c_str() + b1,
                          "decode b1 %lf ms (rounds: %lf / %lf / %lf)",
                          &fitted_ms, &round_ms[0], &round_ms[1], &round_ms[2]),
              4)
        << profiled.substr(b1, 80);
    // Printed to 0.01 ms (stories260K's steps take hundredths of one).
    EXPECT_NEAR(cost.Seconds({1, 1, 64}) * 1e3, fitted_ms, 0.0051);
    const auto [low, high] =
        std::minmax({round_ms[0], round_ms[1], round_ms[2]});
    EXPECT_GE(fitted_ms, 0.8 * low - 0.01);
    EXPECT_LE(fitted_ms, 1.2 * high + 0.01);
  }
  // A one-thread configuration ran each round's mix pinned to each of the
  // first two CPUs this process may use, in turn (a VM's cores can differ in
  // speed by a third), and the round's fit over both lies between the cores'
  // own (within the fits' error). With one CPU there is nothing to pin.
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  ASSERT_EQ(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  const bool pinned = CPU_COUNT(&allowed) >= 2;
  EXPECT_EQ(profiled.find("(tp 1 × 1; cpu ") != std::string::npos, pinned)
      << profiled;
  int rounds_pinned = 0;
  for (size_t at = profiled.find("step round ");
       pinned && at != std::string::npos;
       at = profiled.find("step round ", at + 1)) {
    int round = 0, of = 0, cpu_a = -1, cpu_b = -1;
    double round_ms = 0, a_ms = 0, b_ms = 0;
    ASSERT_EQ(std::sscanf(profiled.c_str() + at,
                          "step round %d of %d: decode b1 %lf ms (tp 1 × 1; "
                          "cpu %d %lf, cpu %d %lf)",
                          &round, &of, &round_ms, &cpu_a, &a_ms, &cpu_b, &b_ms),
              7)
        << profiled.substr(at, 200);
    EXPECT_LT(cpu_a, cpu_b);
    ASSERT_TRUE(cpu_a >= 0 && cpu_b < CPU_SETSIZE) << cpu_a << " " << cpu_b;
    EXPECT_TRUE(CPU_ISSET(cpu_a, &allowed) && CPU_ISSET(cpu_b, &allowed));
    EXPECT_GE(round_ms, 0.8 * std::min(a_ms, b_ms) - 0.01);
    EXPECT_LE(round_ms, 1.2 * std::max(a_ms, b_ms) + 0.01);
    ++rounds_pinned;
  }
  EXPECT_EQ(rounds_pinned, pinned ? 3 : 0) << profiled;
  // The request calibrations (three colocated, one disaggregated) each
  // traced their decode worker's steps under an open-loop stream at the
  // workload's rate (20/s, or slower where the layout would be over half
  // busy), and fitted the TTFT offsets on at least 8 of its requests.
  int probe_readings = 0;
  size_t previous_summary = 0;
  std::vector<int> unqueued_by_calibration;
  for (size_t at = profiled.find("steps meanwhile at ");
       at != std::string::npos;
       at = profiled.find("steps meanwhile at ", at + 1)) {
    double slowness = 0, prompt_slowness = 0, rate = 0;
    int unqueued = 0, sent = 0;
    ASSERT_EQ(std::sscanf(profiled.c_str() + at,
                          "steps meanwhile at %lfx the fit's time (prompts "
                          "%lfx); requests at %lf/s, %d of %d unqueued",
                          &slowness, &prompt_slowness, &rate, &unqueued, &sent),
              5)
        << profiled.substr(at, 120);
    // Speeds, not a cluster's steps costing more than the in-process ones
    // (which stay in the offsets).
    EXPECT_GE(slowness, 0.66);
    EXPECT_LE(slowness, 1.5);
    EXPECT_GE(prompt_slowness, 0.66);
    EXPECT_LE(prompt_slowness, 1.5);
    EXPECT_GT(rate, 0);
    EXPECT_LE(rate, 20);
    EXPECT_EQ(sent, 48);
    EXPECT_GE(unqueued, 8);
    EXPECT_LE(unqueued, sent);
    // The scatter around the TTFT line, less the request's own prompt
    // steps: on the colocated layouts (the first three) the decode worker
    // traced them, on the disaggregated one its prefill stage.
    const size_t scatter_at = profiled.find("; scatter q10 ", at);
    ASSERT_NE(scatter_at, std::string::npos) << profiled.substr(at, 200);
    double q10 = 0, q50 = 0, q90 = 0;
    char how[64] = {};
    ASSERT_EQ(std::sscanf(profiled.c_str() + scatter_at,
                          "; scatter q10 %lf, q50 %lf, q90 %lf ms (%63[^)]",
                          &q10, &q50, &q90, how),
              4)
        << profiled.substr(scatter_at, 120);
    EXPECT_LE(q10, q50);
    EXPECT_LE(q50, q90);
    int traced = 0, cold = 0;
    ASSERT_EQ(std::sscanf(how,
                          "less %d requests' traced prompt steps, %d cold "
                          "ones kept",
                          &traced, &cold),
              2)
        << how;
    EXPECT_GE(traced, 1);
    EXPECT_LE(traced, unqueued);
    // The first request's prompt step follows the warm-up on an idle
    // worker: its time stays in the scatter.
    EXPECT_GE(cold, 1) << how;
    // A calibration read while the VM's speed moved is measured again, at
    // most twice; the one kept is among those made.
    const size_t kept_at = profiled.find("; measurement ", scatter_at);
    ASSERT_NE(kept_at, std::string::npos) << profiled.substr(scatter_at, 200);
    int kept = 0;
    ASSERT_EQ(
        std::sscanf(profiled.c_str() + kept_at, "; measurement %d", &kept), 1);
    int again = 0;
    for (size_t a = profiled.find("measuring again", previous_summary);
         a != std::string::npos && a < at;
         a = profiled.find("measuring again", a + 1)) {
      ++again;
    }
    EXPECT_LE(again, 2);
    EXPECT_GE(kept, 1);
    EXPECT_LE(kept, again + 1);
    previous_summary = at;
    unqueued_by_calibration.push_back(unqueued);
    ++probe_readings;
  }
  EXPECT_EQ(probe_readings, 4) << profiled;
  // Saved: one scatter quantile per unqueued request, ascending.
  ASSERT_EQ(unqueued_by_calibration.size(), 4u);
  ASSERT_EQ(model->calibrated.size(), 3u);
  for (const auto& [config, calibration] : model->calibrated) {
    const std::vector<double>& scatter = calibration.colocated_ttft.scatter;
    EXPECT_TRUE(std::is_sorted(scatter.begin(), scatter.end()));
    EXPECT_GE(scatter.size(), 8u);
  }
  EXPECT_EQ(model->disaggregated_ttft.scatter.size(),
            static_cast<size_t>(unqueued_by_calibration[3]));
  // The saved profile carries the slow-downs the calibration printed.
  int percent[4] = {-1, -1, -1, -1};
  const size_t printed = profiled.find("co-running slow-down: prefill stage");
  ASSERT_NE(printed, std::string::npos) << profiled;
  ASSERT_EQ(std::sscanf(profiled.c_str() + printed,
                        "co-running slow-down: prefill stage %d%%, decode "
                        "step %d%%, decode beside decode %d%%, prefill beside "
                        "prefill %d%%",
                        &percent[0], &percent[1], &percent[2], &percent[3]),
            4)
      << profiled.substr(printed, 120);
  EXPECT_EQ(percent[0], std::lround(model->co_running.prefill_stage * 100));
  EXPECT_EQ(percent[1], std::lround(model->co_running.decode_step * 100));
  ASSERT_TRUE(model->co_running.decode_beside_decode.has_value());
  ASSERT_TRUE(model->co_running.prefill_beside_prefill.has_value());
  EXPECT_EQ(percent[2],
            std::lround(*model->co_running.decode_beside_decode * 100));
  EXPECT_EQ(percent[3],
            std::lround(*model->co_running.prefill_beside_prefill * 100));
  // A TP 2 worker beside one one-thread worker oversubscribes 2 cores, and
  // more beside two: the profile measured the gang at both and saved the
  // exponent at each share processor sharing gives at most 0.9 (from the
  // profile's busy cores, which a machine busy with other tests reads low:
  // then a share can come out near 1 and that point is left out, its
  // exponent ill-conditioned).
  EXPECT_NE(profiled.find("tp 2 beside 1 prefilling: "), std::string::npos)
      << profiled;
  EXPECT_NE(profiled.find("tp 2 beside 2 prefilling: "), std::string::npos)
      << profiled;
  size_t at = profiled.find("gang-sharing exponents:");
  ASSERT_NE(at, std::string::npos) << profiled;
  at += std::strlen("gang-sharing exponents:");
  const std::string points_line =
      profiled.substr(at, profiled.find('\n', at) - at);
  std::vector<std::pair<double, double>> points;  // exponent, share
  for (size_t pos = 0; pos < points_line.size();) {
    double exponent = -1, share = -1;
    int consumed = 0;
    if (std::sscanf(points_line.c_str() + pos, " %lf at share %lf;%n",
                    &exponent, &share, &consumed) != 2) {
      break;
    }
    points.emplace_back(exponent, share);
    pos += consumed;
  }
  ASSERT_EQ(points.size(), model->gang_sharing_points.size()) << points_line;
  ASSERT_LE(points.size(), 2u);
  for (size_t i = 0; i < points.size(); ++i) {
    EXPECT_NEAR(model->gang_sharing_points[i].exponent, points[i].first, 0.005);
    EXPECT_NEAR(model->gang_sharing_points[i].share, points[i].second, 0.005);
    // The saved values, not the printed ones (two decimals: a saved 0.896
    // prints 0.90, and two shares can print the same).
    const planner::PerfModel::GangPoint& saved = model->gang_sharing_points[i];
    EXPECT_GE(saved.exponent, 0);
    EXPECT_LE(saved.exponent, 2);
    EXPECT_LE(saved.share, 0.9);
    if (i > 0) {
      EXPECT_LT(saved.share, model->gang_sharing_points[i - 1].share);
    }
  }
  if (!points.empty()) {
    EXPECT_EQ(model->gang_sharing_exponent,
              model->gang_sharing_points[0].exponent);
  }
  // And beside a second TP 2 worker decoding (two gangs, 4 threads on 2
  // cores): measured, printed and saved where processor sharing gives it a
  // share of at most 0.9; said to be left out otherwise (the busy cores read
  // low).
  const bool measured_beside_gang =
      profiled.find("tp 2 beside a tp 2 decoding: ") != std::string::npos;
  EXPECT_NE(measured_beside_gang,
            profiled.find("tp 2 beside a tp 2: not measured, two keep ") !=
                std::string::npos)
      << profiled;
  at = profiled.find("gang-beside-gang exponent: ");
  ASSERT_EQ(at != std::string::npos, measured_beside_gang) << profiled;
  ASSERT_EQ(measured_beside_gang, model->gang_beside_gang.has_value());
  if (model->gang_beside_gang) {
    double exponent = -1, share = -1;
    ASSERT_EQ(std::sscanf(profiled.c_str() + at,
                          "gang-beside-gang exponent: %lf at share %lf",
                          &exponent, &share),
              2)
        << profiled.substr(at, 80);
    EXPECT_NEAR(model->gang_beside_gang->exponent, exponent, 0.005);
    EXPECT_NEAR(model->gang_beside_gang->share, share, 0.005);
    EXPECT_GE(model->gang_beside_gang->exponent, -1);  // TP 2: full speed
    EXPECT_LE(model->gang_beside_gang->exponent, 2);
    EXPECT_LE(model->gang_beside_gang->share, 0.9);
  }
  EXPECT_GT(model->colocated_ttft.base, 0);
  for (const auto& [config, cost] : model->steps) {
    // More tokens never cost less per step than one.
    EXPECT_GE(cost.Seconds({128, 1, 8256}), cost.Seconds({1, 1, 1}));
  }

  const std::string replanned = RunPlan(
      "--profile 0 --model " + kModel + " --perf-model " + perf + workload,
      &code);
  ASSERT_EQ(code, 0) << replanned;
  EXPECT_EQ(FromTable(replanned), FromTable(profiled));
  EXPECT_GT(model->kv_bytes_per_token, 0);
  EXPECT_GT(model->activation_bytes_per_token, 0);

  // Across two nodes of this machine's kind: where the best layout's pods
  // go and the cpu requests that place them so; no `pdserve local` line
  // (it runs one machine).
  const std::string nodes =
      RunPlan("--profile 0 --model " + kModel + " --perf-model " + perf +
                  workload + " --nodes 2 --network-gbps 10",
              &code);
  ASSERT_EQ(code, 0) << nodes;
  EXPECT_NE(nodes.find("2 nodes × 2 cores, links 10 Gbit/s"), std::string::npos)
      << nodes;
  EXPECT_NE(nodes.find("placement: node 0: "), std::string::npos) << nodes;
  EXPECT_NE(nodes.find("resources.requests.cpu"), std::string::npos) << nodes;
  EXPECT_EQ(nodes.find("pdserve local"), std::string::npos) << nodes;

  // One simulation run per layout: every goodput's range over the runs is
  // that one run's value. The default runs 15 (the profile's step spread
  // gives them different draws).
  auto ranges = [](const std::string& table) {
    std::vector<std::pair<std::string, std::string>> out;
    static const std::regex kRange(R"(\[(\d+\.\d\d)-(\d+\.\d\d)\])");
    for (std::sregex_iterator it(table.begin(), table.end(), kRange), end;
         it != end; ++it) {
      out.emplace_back((*it)[1], (*it)[2]);
    }
    return out;
  };
  const std::string single =
      RunPlan("--profile 0 --replications 1 --model " + kModel +
                  " --perf-model " + perf + workload,
              &code);
  ASSERT_EQ(code, 0) << single;
  ASSERT_FALSE(ranges(single).empty()) << single;
  for (const auto& [lo, hi] : ranges(single)) EXPECT_EQ(lo, hi) << single;
  EXPECT_NE(single.find("medians of 1 simulation run(s)"), std::string::npos)
      << single;
  EXPECT_NE(profiled.find("medians of 15 simulation run(s)"), std::string::npos)
      << profiled;
}

TEST(PlanCommandTest, TakesTheWorkloadFromARunningRouter) {
  const std::string perf = ::testing::TempDir() + "/stories_perf_router.json";
  int code = 0;
  // At 6 requests/s: the four calibrations' 48 requests each take 8 s
  // instead of the default 1.5/s's 32 s (the workload here comes from the
  // router below, not from this profile's rate).
  const std::string profiled =
      RunPlan("--model " + kModel +
                  " --rate 6 --profile-max-prompt 64 --perf-model " + perf,
              &code);
  ASSERT_EQ(code, 0) << profiled;

  tools::LocalClusterOptions o;
  o.model_path = kModel;
  o.bin_dir = PDSERVE_BIN_DIR;
  o.colocated = true;
  o.tp = 1;
  o.speculation = "off";
  o.metrics_port_base = 0;
  auto cluster = tools::LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string metrics =
      "http://" + (*cluster)->metrics_addresses().at("router") + "/metrics";
  // Requests of 20-token prompts and 10 tokens out, for as long as the plan
  // watches the router.
  std::atomic<bool> stop{false};
  std::atomic<int> sent{0};
  std::thread load([&] {
    std::vector<int32_t> prompt(20, 5);
    prompt[0] = 1;
    while (!stop) {
      const auto r = tools::RunRequest((*cluster)->grpc_address(), prompt, 10);
      EXPECT_TRUE(r.ok) << r.error;
      ++sent;
    }
  });
  const std::string planned =
      RunPlan("--profile 0 --perf-model " + perf + " --router-metrics " +
                  metrics + " --window-s 3",
              &code);
  stop = true;
  load.join();
  ASSERT_EQ(code, 0) << planned;
  EXPECT_GT(sent.load(), 3);
  // Means 20 and 10 become the ranges [m/2, 3m/2].
  EXPECT_NE(planned.find("prompt 10..30, output 5..15 tokens"),
            std::string::npos)
      << planned;
  EXPECT_NE(planned.find("best: "), std::string::npos) << planned;

  const std::string not_router =
      RunPlan("--profile 0 --perf-model " + perf + " --router-metrics http://" +
                  (*cluster)->metrics_addresses().at("decode-0") +
                  "/metrics --window-s 0.1",
              &code);
  EXPECT_EQ(code, 1);
  EXPECT_NE(not_router.find("not a pdserve router"), std::string::npos)
      << not_router;
}

TEST(PlanCommandTest, BadFlagsArePreciseErrors) {
  int code = 0;
  std::string out = RunPlan("--profile 0", &code);
  EXPECT_EQ(code, 1);
  EXPECT_NE(out.find("--profile 0 needs --perf-model FILE"), std::string::npos)
      << out;
  out = RunPlan("--profile 0 --perf-model /nonexistent.json", &code);
  EXPECT_EQ(code, 1);
  EXPECT_NE(out.find("cannot read /nonexistent.json"), std::string::npos)
      << out;
  out = RunPlan("--prompt 9:3", &code);
  EXPECT_EQ(code, 1);
  EXPECT_NE(out.find("'9:3' is not a length range"), std::string::npos) << out;
  out = RunPlan("--cores 0", &code);
  EXPECT_EQ(code, 1);
  EXPECT_NE(out.find("must be positive"), std::string::npos) << out;
  out = RunPlan("--replications 0", &code);
  EXPECT_EQ(code, 1);
  EXPECT_NE(out.find("--replications"), std::string::npos) << out;
  out = RunPlan("--nodes 2", &code);
  EXPECT_EQ(code, 1);
  EXPECT_NE(out.find("--nodes 2 > 1 needs --network-gbps"), std::string::npos)
      << out;
  out = RunPlan("--nodes 0", &code);
  EXPECT_EQ(code, 1);
  EXPECT_NE(out.find("--nodes must be in 1..16, got 0"), std::string::npos)
      << out;
  out = RunPlan("--nodes 17 --network-gbps 10", &code);  // before profiling
  EXPECT_EQ(code, 1);
  EXPECT_NE(out.find("--nodes must be in 1..16, got 17"), std::string::npos)
      << out;
  out = RunPlan("--network-gbps 10", &code);
  EXPECT_EQ(code, 1);
  EXPECT_NE(out.find("--network-gbps is the link between nodes"),
            std::string::npos)
      << out;
}

}  // namespace
}  // namespace pdserve::planner
