// The layout planner's parts against independent expectations: the step-cost
// fit recovers a known cost function; the simulator matches closed forms
// where they exist (an idle request, M/D/1 waiting, a pipeline's fill,
// processor sharing); enumeration stays within the cores.
#include "planner/planner.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <random>

#include "gtest/gtest.h"
#include "planner/layout.h"

namespace pdserve::planner {
namespace {

// A cost function of the fitted family, written out by hand: flat to 8
// tokens (bandwidth bound), then 0.5 ms a token.
double TrueSeconds(const StepShape& s) {
  const double linear = s.tokens <= 8 ? 0.020 : 0.020 + 0.0005 * (s.tokens - 8);
  return linear + 0.0004 * s.logit_rows + 2e-8 * s.attended_positions;
}

std::vector<StepSample> Samples(double noise, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> jitter(0, noise);
  std::vector<StepSample> out;
  for (int batch : {1, 2, 4, 8, 16, 32, 64}) {  // decode: a row per token
    for (int context : {16, 384}) {
      StepShape s{batch, batch, static_cast<int64_t>(batch) * context};
      out.push_back({s, TrueSeconds(s) * (1 + jitter(rng))});
    }
  }
  for (int prompt : {16, 32, 64, 128, 256, 512}) {  // prefill: one row
    StepShape s{prompt, 1, AttendedPositions(0, prompt)};
    out.push_back({s, TrueSeconds(s) * (1 + jitter(rng))});
  }
  return out;
}

TEST(StepCostTest, FitRecoversAKnownCostFunction) {
  auto cost = StepCost::Fit(Samples(0, 1));
  ASSERT_TRUE(cost.ok()) << cost.status();
  // Shapes the fit never saw, inside the profiled range.
  for (StepShape s : {StepShape{3, 3, 3 * 200}, StepShape{48, 48, 48 * 100},
                      StepShape{200, 1, AttendedPositions(100, 200)},
                      StepShape{300, 20, 300 * 50}}) {
    EXPECT_NEAR(cost->Seconds(s), TrueSeconds(s), 0.03 * TrueSeconds(s))
        << s.tokens << " tokens";
  }
  EXPECT_NEAR(cost->seconds_per_logit_row(), 0.0004, 0.0001);
}

TEST(StepCostTest, NoisyFitStaysClose) {
  auto cost = StepCost::Fit(Samples(0.03, 2));
  ASSERT_TRUE(cost.ok()) << cost.status();
  const StepCost::FitError e = cost->Error(Samples(0, 3));
  EXPECT_LT(e.median, 0.05);
  EXPECT_LT(e.max, 0.15);
}

TEST(StepCostTest, JsonRoundTrip) {
  auto cost = StepCost::Fit(Samples(0, 1));
  ASSERT_TRUE(cost.ok());
  auto back = StepCost::FromJson(cost->ToJson());
  ASSERT_TRUE(back.ok()) << back.status();
  StepShape s{77, 5, 4000};
  EXPECT_DOUBLE_EQ(back->Seconds(s), cost->Seconds(s));
}

TEST(StepCostTest, ScaledIsTheSameFitOnASlowerMachine) {
  auto cost = StepCost::Fit(Samples(0.03, 5));
  ASSERT_TRUE(cost.ok()) << cost.status();
  // Fitted from the same steps each taking 1.3x as long: the same cost.
  std::vector<StepSample> slower = Samples(0.03, 5);
  for (StepSample& s : slower) s.seconds *= 1.3;
  auto slower_fit = StepCost::Fit(slower);
  ASSERT_TRUE(slower_fit.ok()) << slower_fit.status();
  const StepCost scaled = cost->Scaled(1.3);
  for (StepShape s : {StepShape{1, 1, 16}, StepShape{8, 8, 8 * 300},
                      StepShape{384, 1, AttendedPositions(0, 384)}}) {
    EXPECT_NEAR(scaled.Seconds(s), 1.3 * cost->Seconds(s),
                1e-12 * cost->Seconds(s));
    EXPECT_NEAR(scaled.Seconds(s), slower_fit->Seconds(s),
                1e-6 * slower_fit->Seconds(s));
  }
  EXPECT_EQ(scaled.spread(), cost->spread());
}

TEST(StepCostTest, SpreadIsTheMeasuredOverFittedQuantiles) {
  const std::vector<StepSample> samples = Samples(0.05, 4);
  auto cost = StepCost::Fit(samples);
  ASSERT_TRUE(cost.ok()) << cost.status();
  std::vector<double> ratios;
  for (const StepSample& s : samples) {
    ratios.push_back(s.seconds / cost->Seconds(s.shape));
  }
  std::sort(ratios.begin(), ratios.end());
  const std::vector<double>& spread = cost->spread();
  ASSERT_EQ(spread.size(), 32u);
  EXPECT_TRUE(std::is_sorted(spread.begin(), spread.end()));
  EXPECT_EQ(spread.front(), ratios.front());  // the lowest share's midpoint
  EXPECT_EQ(spread.back(), ratios.back());
  EXPECT_LT(spread.front(), 1.0);
  EXPECT_GT(spread.back(), 1.0);
  EXPECT_EQ(cost->SpreadAt(0.0), spread.front());
  EXPECT_EQ(cost->SpreadAt(0.9999), spread.back());
  EXPECT_EQ(cost->SpreadAt(0.5), spread[16]);

  auto back = StepCost::FromJson(cost->ToJson());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->spread(), spread);
  // A profile from before the spread was measured loads without one.
  nlohmann::json old = cost->ToJson();
  old.erase("spread");
  auto without = StepCost::FromJson(old);
  ASSERT_TRUE(without.ok()) << without.status();
  EXPECT_EQ(without->SpreadAt(0.7), 1.0);
  for (const nlohmann::json& bad :
       {nlohmann::json::array({1.2, 0.9}), nlohmann::json::array({-1.0}),
        nlohmann::json::array({0.0, 1.0})}) {
    nlohmann::json j = cost->ToJson();
    j["spread"] = bad;
    EXPECT_EQ(StepCost::FromJson(j).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad.dump();
  }
}

PerfModel ModelWith(const StepCost& cost) {
  PerfModel m;
  m.model = "synthetic";
  m.num_layers = 12;
  m.cores = 2;
  m.steps[{1, 1}] = cost;
  m.steps[{1, 2}] = cost;
  m.steps[{2, 1}] = cost;
  return m;
}

// ModelWith the fit of the hand-written cost function, each step scaled by
// a draw from `quantiles`.
PerfModel ModelWithSpread(std::vector<double> quantiles) {
  auto fitted = StepCost::Fit(Samples(0, 1));
  EXPECT_TRUE(fitted.ok()) << fitted.status();
  StepCost cost = fitted.ok() ? *fitted : StepCost();
  EXPECT_TRUE(cost.SetSpread(std::move(quantiles)).ok());
  return ModelWith(cost);
}

TEST(SimulatorTest, IdleRequestIsItsSteps) {
  auto cost = StepCost::Fit(Samples(0, 1));
  ASSERT_TRUE(cost.ok());
  PerfModel model = ModelWith(*cost);
  model.colocated_ttft.base = 0.003;
  model.colocated_ttft.per_prompt_token = 1e-5;
  model.decode_step_overhead_seconds = 0.001;
  Layout coloc;
  coloc.colocated = true;
  auto p = Simulate(model, coloc, {{0.5, 100, 5}}, Slo{});
  ASSERT_TRUE(p.ok()) << p.status();
  // The prefill is a worker step too (with its overhead); every delivery
  // carries the request's TTFT offset, so TPOT is the decode steps alone.
  const double prefill =
      cost->Seconds({100, 1, AttendedPositions(0, 100)}) + 0.001;
  EXPECT_NEAR(p->ttft_p50, prefill + 0.003 + 1e-5 * 100, 1e-9);
  double decode = 0;  // four steps at contexts 101..104
  for (int k = 0; k < 4; ++k) decode += cost->Seconds({1, 1, 101 + k}) + 0.001;
  EXPECT_NEAR(p->tpot_p50, decode / 4, 1e-9);
}

TEST(SimulatorTest, PipelineOfStagesAddsUpToTheWholeModel) {
  auto cost = StepCost::Fit(Samples(0, 1));
  ASSERT_TRUE(cost.ok());
  PerfModel model = ModelWith(*cost);
  for (int stages : {1, 2, 3}) {
    Layout l;
    l.stages = stages;
    l.chunk_tokens = 512;  // one chunk
    auto p = Simulate(model, l, {{0, 200, 1}}, Slo{}, {.cores = 4});
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_NEAR(p->ttft_p50, cost->Seconds({200, 1, AttendedPositions(0, 200)}),
                1e-9)
        << stages << " stages";
  }
}

// A colocated worker that runs one 1-token step at a time, and requests of
// prompt 1 and output 1 arriving at `rate`: each request is one step,
// served FIFO.
Layout OneStepAtATime() {
  Layout l;
  l.colocated = true;
  l.max_step_tokens = 1;
  l.max_running = 1;
  return l;
}

std::vector<SimRequest> SingleStepRequests(double rate) {
  WorkloadSpec w;
  w.requests = 40000;
  w.rate = rate;
  w.prompt = {1, 1};
  w.output = {1, 1};
  return SimRequests(w);
}

TEST(SimulatorTest, QueueingMatchesMD1) {
  // Prompt 1, output 1, a token budget of 1: every request is one step of
  // the same length S, served FIFO — an M/D/1 queue, whose mean wait is
  // Pollaczek–Khinchine's ρ·S / (2(1 − ρ)).
  auto cost = StepCost::Fit(Samples(0, 1));
  ASSERT_TRUE(cost.ok());
  PerfModel model = ModelWith(*cost);
  const double s = cost->Seconds({1, 1, 1});
  for (double rho : {0.3, 0.7}) {
    auto p =
        Simulate(model, OneStepAtATime(), SingleStepRequests(rho / s), Slo{});
    ASSERT_TRUE(p.ok()) << p.status();
    const double wait = rho * s / (2 * (1 - rho));
    EXPECT_NEAR(p->ttft_mean, s + wait, 0.03 * (s + wait)) << "rho " << rho;
  }
}

TEST(SimulatorTest, StepSpreadMatchesMG1) {
  // The M/D/1 queue above with every step taking 0.5 S or 1.5 S at even odds
  // (a spread of two quantiles): an M/G/1 queue, whose mean wait is
  // λ·E[S²] / (2(1 − ρ)) = ρ·S·1.25 / (2(1 − ρ)), 1.25x the deterministic
  // wait. With the spread switched off it is M/D/1 again.
  auto fitted = StepCost::Fit(Samples(0, 1));
  ASSERT_TRUE(fitted.ok());
  StepCost cost = *fitted;
  ASSERT_TRUE(cost.SetSpread({0.5, 1.5}).ok());
  PerfModel model = ModelWith(cost);
  const double s = cost.Seconds({1, 1, 1});
  const double rho = 0.7;
  const std::vector<SimRequest> requests = SingleStepRequests(rho / s);
  auto p = Simulate(model, OneStepAtATime(), requests, Slo{});
  ASSERT_TRUE(p.ok()) << p.status();
  const double wait = rho * s * 1.25 / (2 * (1 - rho));
  EXPECT_NEAR(p->ttft_mean, s + wait, 0.03 * (s + wait));
  SimOptions off;
  off.step_spread = false;
  auto fixed = Simulate(model, OneStepAtATime(), requests, Slo{}, off);
  ASSERT_TRUE(fixed.ok()) << fixed.status();
  const double fixed_wait = rho * s / (2 * (1 - rho));
  EXPECT_NEAR(fixed->ttft_mean, s + fixed_wait, 0.03 * (s + fixed_wait));
  EXPECT_GT(p->ttft_p99, fixed->ttft_p99);
}

Layout Colocated() {
  Layout coloc;
  coloc.colocated = true;
  return coloc;
}

// `n` requests at 4/s, prompts of 16..300 tokens.
std::vector<SimRequest> PoissonRequests(int n, LengthRange output) {
  WorkloadSpec w;
  w.requests = n;
  w.rate = 4;
  w.prompt = {16, 300};
  w.output = output;
  return SimRequests(w);
}

TEST(SimulatorTest, TtftScatterMovesEachRequestsTtftNotItsTpot) {
  // Requests far apart (no queue), steps at their fitted times: a request's
  // TTFT is its steps plus the offset's line plus one draw from the scatter,
  // and every token of it carries the same draw, so its TPOT is the
  // scatter-free one.
  auto cost = StepCost::Fit(Samples(0, 1));
  ASSERT_TRUE(cost.ok());
  PerfModel model = ModelWith(*cost);
  model.colocated_ttft = {
      .base = 0.01, .per_prompt_token = 0, .scatter = {-0.005, 0.04}};
  std::vector<SimRequest> requests;
  for (int i = 0; i < 200; ++i) requests.push_back({10.0 * i, 16, 8});
  const Layout coloc = Colocated();
  const SimOptions steps_fitted{
      .step_spread = false, .ttft_scatter = true, .per_request = true};
  SimOptions no_scatter = steps_fitted;
  no_scatter.ttft_scatter = false;
  auto with = Simulate(model, coloc, requests, Slo{}, steps_fitted);
  auto without = Simulate(model, coloc, requests, Slo{}, no_scatter);
  ASSERT_TRUE(with.ok()) << with.status();
  ASSERT_TRUE(without.ok()) << without.status();
  int low = 0, high = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const double moved = with->request_ttft[i] - without->request_ttft[i];
    if (std::abs(moved + 0.005) < 1e-9) ++low;
    if (std::abs(moved - 0.04) < 1e-9) ++high;
    EXPECT_NEAR(with->request_tpot[i], without->request_tpot[i], 1e-12) << i;
  }
  EXPECT_EQ(low + high, 200);
  EXPECT_GT(low, 70);  // each quantile half of the draws
  EXPECT_GT(high, 70);
  EXPECT_NEAR(with->ttft_p99 - without->ttft_p99, 0.04, 1e-9);
  // Without the flag (the default), the line alone: every request the same.
  auto by_default = Simulate(model, coloc, requests, Slo{},
                             {.step_spread = false, .per_request = true});
  ASSERT_TRUE(by_default.ok());
  EXPECT_EQ(by_default->request_ttft, without->request_ttft);
  EXPECT_NEAR(without->ttft_p99, without->ttft_p50, 1e-9);
  // Saved with the profile, in the per-configuration calibrations too; an
  // older profile has none.
  model.calibrated[{1, 1}] = {0.001, model.colocated_ttft};
  auto loaded = PerfModel::FromJson(model.ToJson());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->colocated_ttft.scatter, model.colocated_ttft.scatter);
  EXPECT_EQ(loaded->ColocatedTtft({1, 1}).scatter,
            model.colocated_ttft.scatter);
  EXPECT_TRUE(loaded->disaggregated_ttft.scatter.empty());
  EXPECT_FALSE(model.ToJson()["disaggregated_ttft"].contains("scatter"));
  model.calibrated.clear();

  // A draw below the line never takes a non-negative offset below 0 (the
  // client cannot have a token before it is emitted), and leaves a negative
  // line where it is.
  model.colocated_ttft = {
      .base = 0.004, .per_prompt_token = 0, .scatter = {-0.01, 0.01}};
  auto clamped = Simulate(model, coloc, requests, Slo{}, steps_fitted);
  model.colocated_ttft = {
      .base = -0.002, .per_prompt_token = 0, .scatter = {-0.01, 0.01}};
  auto negative = Simulate(model, coloc, requests, Slo{}, steps_fitted);
  model.colocated_ttft = {};
  auto zero = Simulate(model, coloc, requests, Slo{}, steps_fitted);
  ASSERT_TRUE(clamped.ok() && negative.ok() && zero.ok());
  for (size_t i = 0; i < requests.size(); ++i) {
    const double moved = clamped->request_ttft[i] - zero->request_ttft[i];
    EXPECT_TRUE(std::abs(moved) < 1e-9 || std::abs(moved - 0.014) < 1e-9)
        << moved;
    const double below = negative->request_ttft[i] - zero->request_ttft[i];
    EXPECT_TRUE(std::abs(below + 0.002) < 1e-9 ||
                std::abs(below - 0.008) < 1e-9)
        << below;
  }

  // The draws make replications differ, spread or not.
  model.colocated_ttft = {
      .base = 0.01, .per_prompt_token = 0, .scatter = {-0.005, 0.04}};
  auto five =
      Simulate(model, coloc, requests, Slo{},
               {.step_spread = false, .ttft_scatter = true, .replications = 5});
  ASSERT_TRUE(five.ok());
  EXPECT_EQ(five->replications, 5);
}

TEST(SimulatorTest, ReplicationsReportEachFiguresMedian) {
  // Five runs with different step-time draws: every figure is the median of
  // the five single runs with seeds seed .. seed + 4, and the goodput range
  // is theirs.
  const PerfModel model = ModelWithSpread({0.6, 0.9, 1.0, 1.3, 2.5});
  const Layout coloc = Colocated();
  const std::vector<SimRequest> requests = PoissonRequests(60, {8, 32});
  const Slo slo{0.3, 0.04};
  std::vector<Prediction> runs;
  for (uint64_t seed = 7; seed < 12; ++seed) {
    auto p = Simulate(model, coloc, requests, slo, {.seed = seed});
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->replications, 1);
    runs.push_back(*p);
  }
  auto five =
      Simulate(model, coloc, requests, slo, {.seed = 7, .replications = 5});
  ASSERT_TRUE(five.ok()) << five.status();
  EXPECT_EQ(five->replications, 5);
  auto sorted = [&runs](double Prediction::*field) {
    std::vector<double> v;
    for (const Prediction& p : runs) v.push_back(p.*field);
    std::sort(v.begin(), v.end());
    return v;
  };
  for (double Prediction::*field :
       {&Prediction::ttft_p50, &Prediction::ttft_p99, &Prediction::tpot_p99,
        &Prediction::goodput, &Prediction::duration}) {
    EXPECT_DOUBLE_EQ((*five).*field, sorted(field)[2]);
  }
  EXPECT_DOUBLE_EQ(five->goodput_low, sorted(&Prediction::goodput).front());
  EXPECT_DOUBLE_EQ(five->goodput_high, sorted(&Prediction::goodput).back());
  // The draws differ from run to run (a replication that reused its seed
  // would show one value five times).
  EXPECT_LT(sorted(&Prediction::ttft_p99).front(),
            sorted(&Prediction::ttft_p99).back());
  // Without draws (no spread, no speculation) one run is all of them.
  auto fixed = Simulate(model, coloc, requests, slo,
                        {.step_spread = false, .replications = 5});
  ASSERT_TRUE(fixed.ok()) << fixed.status();
  EXPECT_EQ(fixed->replications, 1);
  EXPECT_EQ(fixed->goodput_low, fixed->goodput_high);
}

TEST(SimulatorTest, PerRequestTimingsAreEachRequestsMedianOverTheRuns) {
  const PerfModel model = ModelWithSpread({0.6, 0.9, 1.0, 1.3, 2.5});
  const Layout coloc = Colocated();
  const std::vector<SimRequest> requests = PoissonRequests(30, {1, 32});
  // Asked for only.
  auto plain = Simulate(model, coloc, requests, Slo{}, {.seed = 7});
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_TRUE(plain->request_ttft.empty());
  std::vector<Prediction> runs;
  for (uint64_t seed = 7; seed < 10; ++seed) {
    auto p = Simulate(model, coloc, requests, Slo{},
                      {.seed = seed, .per_request = true});
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_EQ(p->request_ttft.size(), requests.size());
    ASSERT_EQ(p->request_tpot.size(), requests.size());
    ASSERT_EQ(p->request_first_gap.size(), requests.size());
    // One run's per-request figures are its summary's samples.
    EXPECT_DOUBLE_EQ(Percentile(p->request_ttft, 0.99), p->ttft_p99);
    for (size_t i = 0; i < requests.size(); ++i) {
      if (requests[i].output_tokens == 1) {
        EXPECT_EQ(p->request_tpot[i], 0);
        EXPECT_EQ(p->request_first_gap[i], 0);
      } else {
        EXPECT_GT(p->request_first_gap[i], 0);
      }
    }
    runs.push_back(*p);
  }
  auto three = Simulate(model, coloc, requests, Slo{},
                        {.seed = 7, .replications = 3, .per_request = true});
  ASSERT_TRUE(three.ok()) << three.status();
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_DOUBLE_EQ(three->request_ttft[i],
                     Median({runs[0].request_ttft[i], runs[1].request_ttft[i],
                             runs[2].request_ttft[i]}));
    EXPECT_DOUBLE_EQ(three->request_tpot[i],
                     Median({runs[0].request_tpot[i], runs[1].request_tpot[i],
                             runs[2].request_tpot[i]}));
  }
}

// TTFT of two workers of 2 threads each, one prompt each, on 2 cores over
// the same on 4 (-1 if a simulation fails); `gang_sharing` as
// SimOptions::gang_sharing.
double TwoWorkersOnTwoCoresSlowdown(const PerfModel& model,
                                    bool gang_sharing = false) {
  Layout two;
  two.colocated = true;
  two.decode_workers = 2;
  two.decode_threads = 2;
  const std::vector<SimRequest> both = {{0, 64, 1}, {0, 64, 1}};
  auto shared = Simulate(model, two, both, Slo{},
                         {.cores = 2, .gang_sharing = gang_sharing});
  auto alone = Simulate(model, two, both, Slo{},
                        {.cores = 4, .gang_sharing = gang_sharing});
  EXPECT_TRUE(shared.ok() && alone.ok());
  if (!shared.ok() || !alone.ok()) return -1;
  return shared->ttft_p50 / alone->ttft_p50;
}

TEST(SimulatorTest, OversubscribedCoresAreShared) {
  auto cost = StepCost::Fit(Samples(0, 1));
  ASSERT_TRUE(cost.ok());
  EXPECT_NEAR(TwoWorkersOnTwoCoresSlowdown(ModelWith(*cost)), 2.0, 1e-9);
}

// Threads that wait for each other at every layer run at share^(1 + (g − 1)
// · exponent) on an oversubscribed node: two 2-thread steps on 2 cores at
// 1/2 share each take 2^1.5 as long, not 2; exponent 0 is processor
// sharing. The router's streaming beside one step (compute alone within
// the cores) is plain sharing.
TEST(SimulatorTest, GangsLoseMoreThanTheirShareWhereComputeOversubscribes) {
  auto cost = StepCost::Fit(Samples(0, 1));
  ASSERT_TRUE(cost.ok());
  PerfModel model = ModelWith(*cost);
  EXPECT_NEAR(TwoWorkersOnTwoCoresSlowdown(model, true), std::pow(2, 1.5),
              1e-9);
  model.gang_sharing_exponent = 1;
  EXPECT_NEAR(TwoWorkersOnTwoCoresSlowdown(model, true), 4, 1e-9);
  model.gang_sharing_exponent = 0;
  EXPECT_NEAR(TwoWorkersOnTwoCoresSlowdown(model, true), 2, 1e-9);

  // Beside a busy neighbour a gang takes the larger of its gang and its
  // co-running slow-down, not both (the exponent is fitted to the two at
  // once). On 4 cores the two steps co-run too, unshared: × (1 + c).
  model.gang_sharing_exponent = 0.5;
  model.co_running.decode_step = 0.2;  // below the gang's 2^0.5
  EXPECT_NEAR(TwoWorkersOnTwoCoresSlowdown(model, true),
              2 * std::sqrt(2.0) / 1.2, 1e-9);
  model.co_running.decode_step = 0.6;  // above it: sharing alone on top
  EXPECT_NEAR(TwoWorkersOnTwoCoresSlowdown(model, true), 2, 1e-9);
  model.co_running = {};

  model.delivery_cpu_seconds = 0.001;
  Layout one;
  one.colocated = true;
  one.tp = 2;  // a 2-thread step and the router's streaming: 3 on 2 cores
  const std::vector<SimRequest> request = {{0, 64, 8}};
  auto gang = Simulate(model, one, request, Slo{}, {.cores = 2});
  auto plain =
      Simulate(model, one, request, Slo{}, {.cores = 2, .gang_sharing = false});
  ASSERT_TRUE(gang.ok() && plain.ok());
  EXPECT_EQ(gang->tpot_p50, plain->tpot_p50);

  // Saved with the profile; out of range refused.
  auto loaded = PerfModel::FromJson(model.ToJson());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->gang_sharing_exponent, 0.5);
  nlohmann::json bad = model.ToJson();
  bad["gang_sharing_exponent"] = -1;
  EXPECT_EQ(PerfModel::FromJson(bad).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The gang exponent measured at two shares: interpolated linearly in the
// share between them, the nearest one's beyond; the simulator takes the
// exponent at the share a step gets (two 2-thread steps on 2 cores: 1/2).
TEST(SimulatorTest, GangExponentFollowsTheMeasuredPoints) {
  auto cost = StepCost::Fit(Samples(0, 1));
  ASSERT_TRUE(cost.ok());
  PerfModel model = ModelWith(*cost);
  model.gang_sharing_exponent = 2;  // ignored once points are measured
  model.gang_sharing_points = {{0.8, 1.0}, {0.4, 0.2}};
  EXPECT_DOUBLE_EQ(model.GangExponentAt(0.9), 1.0);
  EXPECT_DOUBLE_EQ(model.GangExponentAt(0.8), 1.0);
  EXPECT_DOUBLE_EQ(model.GangExponentAt(0.6), 0.6);
  EXPECT_DOUBLE_EQ(model.GangExponentAt(0.5), 0.4);
  EXPECT_DOUBLE_EQ(model.GangExponentAt(0.1), 0.2);
  EXPECT_NEAR(TwoWorkersOnTwoCoresSlowdown(model, true), std::pow(2, 1.4),
              1e-9);

  auto loaded = PerfModel::FromJson(model.ToJson());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->gang_sharing_points.size(), 2u);
  EXPECT_EQ(loaded->gang_sharing_points[1].share, 0.4);
  EXPECT_EQ(loaded->gang_sharing_points[1].exponent, 0.2);
  nlohmann::json old = model.ToJson();
  old.erase("gang_sharing_points");
  auto old_loaded = PerfModel::FromJson(old);
  ASSERT_TRUE(old_loaded.ok()) << old_loaded.status();
  EXPECT_DOUBLE_EQ(old_loaded->GangExponentAt(0.5), 2);
  // Out of order, or a share outside (0, 1], is refused.
  nlohmann::json unordered = model.ToJson();
  std::swap(unordered["gang_sharing_points"][0],
            unordered["gang_sharing_points"][1]);
  auto refused = PerfModel::FromJson(unordered);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("gang_sharing_points"),
            std::string::npos);
  nlohmann::json outside = model.ToJson();
  outside["gang_sharing_points"][0]["share"] = 1.5;
  EXPECT_EQ(PerfModel::FromJson(outside).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A gang whose only compute neighbours are other gangs takes the exponent
// measured there (PerfModel::gang_beside_gang), at any share, as its whole
// slow-down (co-running not on top, and below processor sharing's for a
// negative exponent); beside a one-thread prefill stage the points still
// hold.
TEST(SimulatorTest, GangBesideGangsTakesItsOwnExponent) {
  auto cost = StepCost::Fit(Samples(0, 1));
  ASSERT_TRUE(cost.ok());
  PerfModel model = ModelWith(*cost);
  model.gang_sharing_points = {{0.5, 1.0}};
  EXPECT_NEAR(TwoWorkersOnTwoCoresSlowdown(model, true), 4, 1e-9);
  model.gang_beside_gang = PerfModel::GangPoint{0.5, 0.0};
  EXPECT_DOUBLE_EQ(model.GangExponentAt(0.5, /*beside_gangs_only=*/true), 0);
  EXPECT_DOUBLE_EQ(model.GangExponentAt(0.5), 1.0);
  EXPECT_NEAR(TwoWorkersOnTwoCoresSlowdown(model, true), 2, 1e-9);
  model.gang_beside_gang = PerfModel::GangPoint{0.5, 0.5};
  EXPECT_NEAR(TwoWorkersOnTwoCoresSlowdown(model, true), std::pow(2, 1.5),
              1e-9);
  // Each gang filling the other's waits: 2^0.5, under sharing's 2; at −1
  // (g = 2) full speed.
  model.gang_beside_gang = PerfModel::GangPoint{0.5, -0.5};
  EXPECT_NEAR(TwoWorkersOnTwoCoresSlowdown(model, true), std::sqrt(2.0), 1e-9);
  model.gang_beside_gang = PerfModel::GangPoint{0.5, -1.0};
  EXPECT_NEAR(TwoWorkersOnTwoCoresSlowdown(model, true), 1, 1e-9);
  // The co-running slow-down is in the measured exponent: not on top of it
  // on 2 cores, where 4 cores (no sharing) still co-run at 1.6x.
  model.gang_beside_gang = PerfModel::GangPoint{0.5, 0.0};
  model.co_running.decode_step = 0.6;
  EXPECT_NEAR(TwoWorkersOnTwoCoresSlowdown(model, true), 2 / 1.6, 1e-9);
  model.co_running = {};
  model.gang_beside_gang = PerfModel::GangPoint{0.5, 0.5};

  // A TP 2 decode worker beside a one-thread prefill stage on 2 cores (3
  // threads): the requests' prompts overlap the others' decode steps, where
  // the points' exponent applies whatever the gang-beside-gang one says.
  Layout beside_stage;
  beside_stage.tp = 2;
  const std::vector<SimRequest> requests = {
      {0, 256, 32}, {0.05, 256, 32}, {0.1, 256, 32}, {0.15, 256, 32}};
  auto predict = [&](const PerfModel& m) {
    auto p = Simulate(m, beside_stage, requests, Slo{}, {.cores = 2});
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? p->tpot_p99 : -1;
  };
  const double with_beside_gang = predict(model);
  model.gang_beside_gang.reset();
  EXPECT_EQ(predict(model), with_beside_gang);
  model.gang_sharing_points = {{0.5, 0.0}};  // the test can see the points
  EXPECT_LT(predict(model), with_beside_gang);

  // Saved with the profile; without it (older profiles) the points hold.
  model.gang_beside_gang = PerfModel::GangPoint{0.52, 0.1};
  auto loaded = PerfModel::FromJson(model.ToJson());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_TRUE(loaded->gang_beside_gang.has_value());
  EXPECT_EQ(loaded->gang_beside_gang->share, 0.52);
  EXPECT_EQ(loaded->gang_beside_gang->exponent, 0.1);
  nlohmann::json old = model.ToJson();
  old.erase("gang_beside_gang");
  auto old_loaded = PerfModel::FromJson(old);
  ASSERT_TRUE(old_loaded.ok()) << old_loaded.status();
  EXPECT_FALSE(old_loaded->gang_beside_gang.has_value());
  nlohmann::json outside = model.ToJson();
  outside["gang_beside_gang"]["exponent"] = 5;
  auto refused = PerfModel::FromJson(outside);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("gang_beside_gang"),
            std::string::npos);
}

// A configuration whose threads wait on each other (TP ranks at an
// all-reduce) keeps fewer cores busy than it has threads; sharing charges
// the measured demand: two workers of 2 threads at 1.5 busy cores each on
// 2 cores run at 2 / 3 speed, not 1 / 2.
TEST(SimulatorTest, SharingChargesTheMeasuredBusyCores) {
  auto cost = StepCost::Fit(Samples(0, 1));
  ASSERT_TRUE(cost.ok());
  PerfModel model = ModelWith(*cost);
  model.busy_cores[{1, 2}] = 1.5;
  EXPECT_EQ(model.BusyCores({1, 2}), 1.5);
  EXPECT_EQ(model.BusyCores({2, 1}), 2.0);  // not measured: its threads
  EXPECT_NEAR(TwoWorkersOnTwoCoresSlowdown(model), 1.5, 1e-9);
  // With gang sharing the two threads of each step, which wait for each
  // other, lose more: share (2 / 3)^(1 + 1 · 0.5).
  EXPECT_NEAR(TwoWorkersOnTwoCoresSlowdown(model, /*gang_sharing=*/true),
              std::pow(1.5, 1.5), 1e-9);
  // Kept in the saved model; a demand above the threads is refused.
  auto loaded = PerfModel::FromJson(model.ToJson());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->BusyCores({1, 2}), 1.5);
  nlohmann::json bad = model.ToJson();
  for (auto& c : bad["configs"]) {
    if (c["threads_per_rank"] == 2) c["busy_cores"] = 2.5;
  }
  auto refused = PerfModel::FromJson(bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("busy_cores"), std::string::npos);
}

// Steps on neighbouring cores slow each other by the measured co-running
// slow-down, each kind by its own, and only while they overlap.
TEST(SimulatorTest, CoRunningSlowsOnlyOverlappingSteps) {
  auto cost = StepCost::Fit(Samples(0, 1));
  ASSERT_TRUE(cost.ok());
  PerfModel model = ModelWith(*cost);
  model.co_running.prefill_stage = 0.5;
  model.co_running.decode_step = 0.25;
  Layout two;  // two one-thread workers: no sharing of 2 cores
  two.colocated = true;
  two.decode_workers = 2;
  const std::vector<SimRequest> both = {{0, 64, 1}, {0, 64, 1}};
  const SimOptions exact{.cores = 2, .step_spread = false};
  auto overlapping = Simulate(model, two, both, Slo{}, exact);
  auto one = Simulate(model, two, {{0, 64, 1}}, Slo{}, exact);
  ASSERT_TRUE(overlapping.ok() && one.ok());
  EXPECT_NEAR(overlapping->ttft_p50, one->ttft_p50 * 1.25, 1e-9);
  // On one core the two take turns (processor sharing), never side by side.
  SimOptions one_core = exact;
  one_core.cores = 1;
  auto turns = Simulate(model, two, both, Slo{}, one_core);
  ASSERT_TRUE(turns.ok());
  EXPECT_NEAR(turns->ttft_p50, one->ttft_p50 * 2, 1e-9);
  // Two decode steps side by side take the decode-beside-decode slow-down
  // where it was measured (both stream the weights from memory), not the
  // decode-beside-prefill one.
  PerfModel same_kind = model;
  same_kind.co_running.decode_beside_decode = 0.6;
  auto both_decoding = Simulate(same_kind, two, both, Slo{}, exact);
  ASSERT_TRUE(both_decoding.ok());
  EXPECT_NEAR(both_decoding->ttft_p50, one->ttft_p50 * 1.6, 1e-9);

  // Disaggregated: a lone request's prefill and decode never overlap.
  Layout disaggregated;
  PerfModel alone = model;
  alone.co_running = {};
  auto lone = Simulate(model, disaggregated, {{0, 200, 8}}, Slo{}, exact);
  auto lone_alone = Simulate(alone, disaggregated, {{0, 200, 8}}, Slo{}, exact);
  ASSERT_TRUE(lone.ok() && lone_alone.ok());
  EXPECT_NEAR(lone->ttft_p50, lone_alone->ttft_p50, 1e-9);
  EXPECT_NEAR(lone->tpot_p50, lone_alone->tpot_p50, 1e-9);
  // A prompt arriving while another request decodes prefills 1.5x slower
  // for as long as the decode runs beside it.
  const std::vector<SimRequest> staggered = {{0, 16, 64}, {0.1, 200, 1}};
  auto beside = Simulate(model, disaggregated, staggered, Slo{}, exact);
  auto beside_alone = Simulate(alone, disaggregated, staggered, Slo{}, exact);
  ASSERT_TRUE(beside.ok() && beside_alone.ok());
  EXPECT_GT(beside->ttft_mean, beside_alone->ttft_mean * 1.1);
  EXPECT_GT(beside->prefill_busy_seconds,
            beside_alone->prefill_busy_seconds * 1.2);
  EXPECT_GT(beside->decode_busy_seconds, beside_alone->decode_busy_seconds);

  // ... and beside a decode step a prefill one takes its own beside-decode
  // slow-down, whatever the same-kind pairs measured.
  same_kind.co_running.prefill_beside_prefill = 2;
  auto beside_same =
      Simulate(same_kind, disaggregated, staggered, Slo{}, exact);
  ASSERT_TRUE(beside_same.ok());
  EXPECT_NEAR(beside_same->ttft_mean, beside->ttft_mean, 1e-9);

  // Kept in the saved model; older profiles without it load with none; a
  // negative slow-down is refused.
  auto loaded = PerfModel::FromJson(model.ToJson());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->co_running.prefill_stage, 0.5);
  EXPECT_EQ(loaded->co_running.decode_step, 0.25);
  EXPECT_FALSE(loaded->co_running.decode_beside_decode.has_value());
  EXPECT_EQ(loaded->co_running.DecodeBesideDecode(), 0.25);
  auto same_loaded = PerfModel::FromJson(same_kind.ToJson());
  ASSERT_TRUE(same_loaded.ok()) << same_loaded.status();
  EXPECT_EQ(same_loaded->co_running.DecodeBesideDecode(), 0.6);
  EXPECT_EQ(same_loaded->co_running.PrefillBesidePrefill(), 2);
  nlohmann::json bad_same = same_kind.ToJson();
  bad_same["co_running"]["decode_beside_decode"] = -0.5;
  EXPECT_EQ(PerfModel::FromJson(bad_same).status().code(),
            absl::StatusCode::kInvalidArgument);
  nlohmann::json old = model.ToJson();
  old.erase("co_running");
  auto old_loaded = PerfModel::FromJson(old);
  ASSERT_TRUE(old_loaded.ok()) << old_loaded.status();
  EXPECT_EQ(old_loaded->co_running.decode_step, 0);
  nlohmann::json bad = model.ToJson();
  bad["co_running"]["decode_step"] = -0.1;
  auto refused = PerfModel::FromJson(bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("co_running"), std::string::npos);
}

TEST(SimulatorTest, StreamingCpuSlowsWorkersOnlyOnSharedCores) {
  auto cost = StepCost::Fit(Samples(0, 1));
  ASSERT_TRUE(cost.ok());
  PerfModel model = ModelWith(*cost);
  model.delivery_cpu_seconds = 0.005;  // a quarter of a decode step
  Layout coloc;                        // one worker on both cores
  coloc.colocated = true;
  coloc.decode_threads = 2;
  const std::vector<SimRequest> one = {{0, 16, 20}};
  auto shared = Simulate(model, coloc, one, Slo{}, {.cores = 2});
  auto own = Simulate(model, coloc, one, Slo{},
                      {.cores = 2, .router_shares_cores = false});
  ASSERT_TRUE(shared.ok() && own.ok());
  // Each token's 5 ms of streaming overlaps the next 20 ms step and takes a
  // third of the cores meanwhile (3 threads on 2): the step stretches.
  EXPECT_GT(shared->tpot_p50, own->tpot_p50 * 1.1);
  // With a spare core it would not.
  auto spare = Simulate(model, coloc, one, Slo{}, {.cores = 3});
  ASSERT_TRUE(spare.ok());
  EXPECT_NEAR(spare->tpot_p50, own->tpot_p50, 1e-9);
}

TEST(SimulatorTest, LongPromptsStallYoungerDecodesInAColocatedWorker) {
  // A decode admitted after a long prompt waits for the prompt's chunk:
  // the ITL spike disaggregation exists to remove.
  auto cost = StepCost::Fit(Samples(0, 1));
  ASSERT_TRUE(cost.ok());
  PerfModel model = ModelWith(*cost);
  Layout coloc;
  coloc.colocated = true;
  const std::vector<SimRequest> reqs = {{0, 400, 1}, {0.001, 16, 40}};
  auto p = Simulate(model, coloc, reqs, Slo{});
  ASSERT_TRUE(p.ok());
  Layout disagg;
  auto d = Simulate(model, disagg, reqs, Slo{});
  ASSERT_TRUE(d.ok());
  EXPECT_GT(p->ttft_p99, cost->Seconds({400, 1, AttendedPositions(0, 400)}));
  EXPECT_LT(d->itl_p99, p->ttft_p99);
}

TEST(PlacementTest, SpreadsLikeLeastAllocatedAndKeepsPipelinesTogether) {
  Layout l;  // 1P(2s×1t)+1D(tp2×1t), today's default
  l.stages = 2;
  l.tp = 2;
  const Placement one = PlaceLayout(l, 1);
  EXPECT_EQ(one.decode_node, std::vector<int>{0});
  EXPECT_EQ(one.stage_node, (std::vector<std::vector<int>>{{0, 0}}));
  EXPECT_EQ(one.node_threads, std::vector<int>{4});
  EXPECT_FALSE(one.CrossesNodes());
  // Two nodes: the decode worker on one, the pipeline kept together on the
  // other (stage 1 ties 2 threads against 2 and follows stage 0).
  const Placement two = PlaceLayout(l, 2);
  EXPECT_EQ(two.decode_node, std::vector<int>{0});
  EXPECT_EQ(two.stage_node, (std::vector<std::vector<int>>{{1, 1}}));
  EXPECT_EQ(two.node_threads, (std::vector<int>{2, 2}));
  EXPECT_TRUE(two.CrossesNodes());
  EXPECT_EQ(FormatPlacement(l, two),
            "node 0: decode 0 (tp2×1t) — 2 thread(s); node 1: group 0 stage "
            "0 (1t), group 0 stage 1 (1t) — 2 thread(s)");
  // Three nodes: the least-loaded node wins over keeping the pipeline.
  const Placement three = PlaceLayout(l, 3);
  EXPECT_EQ(three.stage_node, (std::vector<std::vector<int>>{{1, 2}}));
  // Colocated workers spread and send nothing between nodes.
  Layout coloc;
  coloc.colocated = true;
  coloc.decode_workers = 2;
  const Placement spread = PlaceLayout(coloc, 2);
  EXPECT_EQ(spread.decode_node, (std::vector<int>{0, 1}));
  EXPECT_FALSE(spread.CrossesNodes());
}

// Compute jobs on different nodes neither share cores nor slow each other
// (the co-running slow-down is for neighbouring cores of one machine).
TEST(SimulatorTest, NodesShareNoCores) {
  auto cost = StepCost::Fit(Samples(0, 1));
  ASSERT_TRUE(cost.ok());
  PerfModel model = ModelWith(*cost);
  model.co_running.decode_step = 0.5;
  Layout two;
  two.colocated = true;
  two.decode_workers = 2;
  two.decode_threads = 2;
  const std::vector<SimRequest> both = {{0, 64, 1}, {0, 64, 1}};
  auto apart = Simulate(model, two, both, Slo{}, {.nodes = 2, .cores = 2});
  auto together = Simulate(model, two, both, Slo{}, {.cores = 4});
  auto shared =
      Simulate(model, two, both, Slo{}, {.cores = 2, .gang_sharing = false});
  ASSERT_TRUE(apart.ok() && together.ok() && shared.ok());
  const double step = cost->Seconds({64, 1, AttendedPositions(0, 64)});
  EXPECT_NEAR(apart->ttft_p50, step, 1e-9);
  EXPECT_NEAR(together->ttft_p50, step * 1.5, 1e-9);    // co-running
  EXPECT_NEAR(shared->ttft_p50, step * 2 * 1.5, 1e-9);  // and sharing
}

PerfModel ModelWithBytes(const StepCost& cost) {
  PerfModel m = ModelWith(cost);
  m.kv_bytes_per_token = 1000;
  m.activation_bytes_per_token = 100;
  return m;
}

Layout Disaggregated(int groups, int stages) {
  Layout l;
  l.prefill_groups = groups;
  l.stages = stages;
  l.chunk_tokens = 512;  // one chunk per prompt
  return l;
}

// A stage on another node than the decode worker sends the request's KV
// over the link; the decode worker takes the request when it has arrived.
// The first token comes from the last stage, so TTFT does not wait for it.
TEST(SimulatorTest, KvCrossesTheLinkBeforeTheDecodeWorkerTakesTheRequest) {
  auto cost = StepCost::Fit(Samples(0, 1));
  ASSERT_TRUE(cost.ok());
  const PerfModel model = ModelWithBytes(*cost);
  const Layout l = Disaggregated(1, 1);
  const std::vector<SimRequest> one = {{0, 200, 3}};
  auto local = Simulate(model, l, one, Slo{}, {.cores = 2});
  auto remote =
      Simulate(model, l, one, Slo{},
               {.nodes = 2, .cores = 1, .network_bytes_per_second = 1e6});
  ASSERT_TRUE(local.ok()) << local.status();
  ASSERT_TRUE(remote.ok()) << remote.status();
  EXPECT_NEAR(remote->ttft_p50, local->ttft_p50, 1e-9);
  // 200 tokens × 1000 bytes at 1 MB/s: 0.2 s more before the 2 decode
  // steps, over 2 token gaps.
  EXPECT_NEAR(remote->tpot_p50 - local->tpot_p50, 0.2 / 2, 1e-9);
}

// Transfers arriving at one node share its receiving side: two groups on
// two nodes sending two prompts' KV at once to one decode worker take twice
// as long as one.
TEST(SimulatorTest, TransfersIntoOneNodeShareItsLink) {
  auto cost = StepCost::Fit(Samples(0, 1));
  ASSERT_TRUE(cost.ok());
  const PerfModel model = ModelWithBytes(*cost);
  const Layout l = Disaggregated(2, 1);  // decode on node 0, groups on 1, 2
  ASSERT_EQ(PlaceLayout(l, 3).stage_node,
            (std::vector<std::vector<int>>{{1}, {2}}));
  auto tpot = [&](std::vector<SimRequest> requests, double bandwidth) {
    auto p = Simulate(
        model, l, requests, Slo{},
        {.nodes = 3, .cores = 1, .network_bytes_per_second = bandwidth});
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? p->tpot_p50 : -1;
  };
  const std::vector<SimRequest> one = {{0, 200, 2}};
  const std::vector<SimRequest> both = {{0, 200, 2}, {0, 200, 2}};
  // Halving the bandwidth adds one transfer time (0.2 s at 1 MB/s) to the
  // gap before the second token of a lone request, two when two share it.
  EXPECT_NEAR(tpot(one, 1e6) - tpot(one, 2e6), 0.1, 1e-9);
  EXPECT_NEAR(tpot(both, 1e6) - tpot(both, 2e6), 0.2, 1e-9);
}

// Stages of one pipeline on different nodes pass the hidden states over the
// link, sharing it with the KV the first stage sends at the same time: the
// first token comes that much later.
TEST(SimulatorTest, HiddenStatesCrossTheLinkBetweenStages) {
  auto cost = StepCost::Fit(Samples(0, 1));
  ASSERT_TRUE(cost.ok());
  const PerfModel model = ModelWithBytes(*cost);
  const Layout l = Disaggregated(1, 2);
  ASSERT_EQ(PlaceLayout(l, 3).stage_node,
            (std::vector<std::vector<int>>{{1, 2}}));
  const std::vector<SimRequest> one = {{0, 200, 1}};
  auto local = Simulate(model, l, one, Slo{}, {.cores = 3});
  auto remote =
      Simulate(model, l, one, Slo{},
               {.nodes = 3, .cores = 1, .network_bytes_per_second = 1e6});
  ASSERT_TRUE(local.ok()) << local.status();
  ASSERT_TRUE(remote.ok()) << remote.status();
  // 200 tokens × 100 bytes at 1 MB/s is 0.02 s, at half speed: stage 0's
  // KV for the decode worker (200 × 1000 × 1/2 bytes, 0.1 s) leaves its
  // node at the same time and shares the sending side throughout.
  EXPECT_NEAR(remote->ttft_p50 - local->ttft_p50, 2 * 0.02, 1e-9);
}

TEST(SimulatorTest, SpanningNodesNeedsTheLinkAndTheBytes) {
  auto cost = StepCost::Fit(Samples(0, 1));
  ASSERT_TRUE(cost.ok());
  const Layout l = Disaggregated(1, 1);
  auto no_link =
      Simulate(ModelWithBytes(*cost), l, {{0, 20, 2}}, Slo{}, {.nodes = 2});
  EXPECT_EQ(no_link.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(no_link.status().message().find("link bandwidth"),
            std::string::npos)
      << no_link.status();
  auto old_profile = Simulate(ModelWith(*cost), l, {{0, 20, 2}}, Slo{},
                              {.nodes = 2, .network_bytes_per_second = 1e9});
  EXPECT_EQ(old_profile.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(old_profile.status().message().find("profile again"),
            std::string::npos);
  auto too_many_nodes = Simulate(
      ModelWithBytes(*cost), l, {{0, 20, 2}}, Slo{},
      {.nodes = kMaxPlannedNodes + 1, .network_bytes_per_second = 1e9});
  EXPECT_EQ(too_many_nodes.status().code(), absl::StatusCode::kInvalidArgument);
  // A layout that stays on one node needs neither.
  Layout coloc;
  coloc.colocated = true;
  EXPECT_TRUE(
      Simulate(ModelWith(*cost), coloc, {{0, 20, 2}}, Slo{}, {.nodes = 2})
          .ok());
  // Planning across nodes asks for both up front, and for a number of
  // nodes whose layouts can be enumerated.
  PlanRequest request;
  request.resources.nodes = kMaxPlannedNodes + 1;
  request.resources.network_bytes_per_second = 1e9;
  auto too_many = Plan(ModelWithBytes(*cost), request);
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_many.status().message().find("copy of the layout"),
            std::string::npos)
      << too_many.status();
  request.resources.network_bytes_per_second = 0;
  request.resources.nodes = 2;
  auto plan = Plan(ModelWithBytes(*cost), request);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  request.resources.network_bytes_per_second = 1e9;
  EXPECT_EQ(Plan(ModelWith(*cost), request).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // The byte counts are kept in the saved model.
  auto loaded = PerfModel::FromJson(ModelWithBytes(*cost).ToJson());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->kv_bytes_per_token, 1000);
  EXPECT_EQ(loaded->activation_bytes_per_token, 100);
}

TEST(PlannerTest, EnumerationAcrossNodesStaysWithinEachNode) {
  auto cost = StepCost::Fit(Samples(0, 1));
  ASSERT_TRUE(cost.ok());
  const PerfModel model = ModelWithBytes(*cost);
  Resources two_nodes;
  two_nodes.nodes = 2;
  two_nodes.cores = 2;
  two_nodes.network_bytes_per_second = 1e9;
  int most = 0;
  bool spans = false;
  for (const Layout& l : EnumerateLayouts(two_nodes, model, 0)) {
    const Placement p = PlaceLayout(l, 2);
    for (int threads : p.node_threads) EXPECT_LE(threads, 2) << l.Name();
    most = std::max(most, l.Threads());
    spans |= p.CrossesNodes();
  }
  EXPECT_EQ(most, 4);
  EXPECT_TRUE(spans);
  // And the planner ranks them, the spanning ones included.
  PlanRequest request;
  request.workload.requests = 40;
  request.workload.rate = 4;
  request.workload.prompt = {64, 256};
  request.resources = two_nodes;
  request.replications = 1;
  auto ranked = Plan(model, request);
  ASSERT_TRUE(ranked.ok()) << ranked.status();
  bool ranked_spanning = false;
  for (const RankedLayout& r : *ranked) {
    ranked_spanning |= PlaceLayout(r.layout, 2).CrossesNodes();
  }
  EXPECT_TRUE(ranked_spanning);
  // A load every layout serves within the SLO: all tie, and the first is
  // one that needs only one of the nodes.
  request.workload.rate = 0.5;
  request.slo = {10, 1};
  auto light = Plan(model, request);
  ASSERT_TRUE(light.ok()) << light.status();
  EXPECT_EQ(light->front().nodes_used, 1) << FormatPlan(*light, 8);
  EXPECT_GT(light->back().nodes_used, 1);
}

TEST(PlannerTest, EnumerationStaysWithinTheCores) {
  auto cost = StepCost::Fit(Samples(0, 1));
  ASSERT_TRUE(cost.ok());
  const PerfModel model = ModelWith(*cost);
  for (int cores : {2, 4}) {
    const std::vector<Layout> layouts =
        EnumerateLayouts(Resources{cores}, model, 0);
    bool colocated = false, disaggregated = false;
    for (const Layout& l : layouts) {
      EXPECT_LE(l.Threads(), cores) << l.Name();
      (l.colocated ? colocated : disaggregated) = true;
    }
    EXPECT_TRUE(colocated && disaggregated);
  }
  // With oversubscription, up to twice the cores' threads: among them
  // today's default, 2 prefill stages + a TP 2 decode worker on 2 cores.
  Resources shared{2};
  shared.allow_oversubscription = true;
  int most = 0;
  bool default_layout = false;
  for (const Layout& l : EnumerateLayouts(shared, model, 0)) {
    EXPECT_LE(l.Threads(), 4) << l.Name();
    if (l.Threads() > 2) {  // sharing: no thread pools
      EXPECT_EQ(l.decode_threads, 1) << l.Name();
      if (!l.colocated) {
        EXPECT_EQ(l.prefill_threads, 1) << l.Name();
      }
    }
    most = std::max(most, l.Threads());
    default_layout |= !l.colocated && l.stages == 2 && l.prefill_threads == 1 &&
                      l.tp == 2 && l.decode_threads == 1;
  }
  EXPECT_EQ(most, 4);
  EXPECT_TRUE(default_layout);
}

TEST(PlannerTest, RanksByGoodputThenWorstRunThenHeadroom) {
  const PerfModel model = ModelWithSpread({0.7, 0.9, 1.0, 1.1, 1.8});
  PlanRequest request;
  request.workload.requests = 60;
  request.workload.rate = 3;
  request.workload.prompt = {16, 600};  // chunk sizes and step budgets matter
  request.slo = {1.0, 0.05};
  request.replications = 5;
  auto ranked = Plan(model, request);
  ASSERT_TRUE(ranked.ok()) << ranked.status();
  ASSERT_GT(ranked->size(), 3u);
  const double best = ranked->front().prediction.goodput;
  double best_low = 0;
  for (const RankedLayout& r : *ranked) {
    EXPECT_LE(r.prediction.goodput, best * 1.02 + 1e-12) << r.layout.Name();
    EXPECT_EQ(r.prediction.replications, 5) << r.layout.Name();
    if (r.prediction.goodput >= 0.98 * best) {
      best_low = std::max(best_low, r.prediction.goodput_low);
    }
  }
  // Goodput ties (within 2% of the best) are ordered: those whose worst run
  // is within 2% of the best worst run first, then by headroom.
  bool robust_seen_after_fragile = false, fragile_seen = false;
  for (const RankedLayout& r : *ranked) {
    if (r.prediction.goodput < 0.98 * best) break;
    const bool robust = r.prediction.goodput_low >= 0.98 * best_low;
    robust_seen_after_fragile |= robust && fragile_seen;
    fragile_seen |= !robust;
  }
  EXPECT_FALSE(robust_seen_after_fragile);
  EXPECT_GE(ranked->front().prediction.goodput_low, 0.98 * best_low);
  request.replications = 0;
  EXPECT_EQ(Plan(model, request).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_NE(FormatPlan(*ranked, 3).find(ranked->front().layout.Name()),
            std::string::npos);
}

// PlanRequest::ttft_scatter reaches every simulated layout: with a scatter
// of {0, +0.5 s} drawn, each layout's TTFT p99 is no lower and some higher,
// its TPOT p99 the same; without it, as if the profile had none.
TEST(PlannerTest, TtftScatterIsDrawnOnlyWhereAsked) {
  auto cost = StepCost::Fit(Samples(0, 1));
  ASSERT_TRUE(cost.ok());
  PerfModel model = ModelWith(*cost);
  model.colocated_ttft.scatter = {0, 0.5};
  model.disaggregated_ttft.scatter = {0, 0.5};
  PlanRequest request;
  request.workload.requests = 40;
  request.workload.rate = 2;
  request.replications = 3;
  auto off = Plan(model, request);
  request.ttft_scatter = true;
  auto on = Plan(model, request);
  PerfModel plain = model;
  plain.colocated_ttft.scatter.clear();
  plain.disaggregated_ttft.scatter.clear();
  request.ttft_scatter = false;
  auto none = Plan(plain, request);
  ASSERT_TRUE(off.ok() && on.ok() && none.ok());
  std::map<std::string, Prediction> by_name;
  for (const RankedLayout& r : *off) by_name[r.layout.Name()] = r.prediction;
  ASSERT_EQ(on->size(), off->size());
  int higher = 0;
  for (const RankedLayout& r : *on) {
    const Prediction& without = by_name.at(r.layout.Name());
    EXPECT_GE(r.prediction.ttft_p99, without.ttft_p99) << r.layout.Name();
    EXPECT_DOUBLE_EQ(r.prediction.tpot_p99, without.tpot_p99)
        << r.layout.Name();
    higher += r.prediction.ttft_p99 > without.ttft_p99 + 0.25;
  }
  EXPECT_GT(higher, 0);
  for (size_t i = 0; i < none->size(); ++i) {
    EXPECT_EQ((*none)[i].layout.Name(), (*off)[i].layout.Name());
    EXPECT_DOUBLE_EQ((*none)[i].prediction.ttft_p99,
                     (*off)[i].prediction.ttft_p99);
  }
}

// Prompts that fit the smallest chunk and step budget make the budgets
// identical work: the planner ranks them as one row that names the others,
// and no two rows are predicted the same.
TEST(PlannerTest, FoldsLayoutsPredictedTheSame) {
  const PerfModel model = ModelWithSpread({0.7, 0.9, 1.0, 1.1, 1.8});
  PlanRequest request;
  request.workload.requests = 60;
  request.workload.rate = 3;
  request.workload.prompt = {16, 64};
  request.replications = 5;
  auto ranked = Plan(model, request);
  ASSERT_TRUE(ranked.ok()) << ranked.status();
  size_t layouts = 0;
  for (size_t i = 0; i < ranked->size(); ++i) {
    const RankedLayout& r = (*ranked)[i];
    layouts += 1 + r.same_prediction.size();
    for (const Layout& same : r.same_prediction) {
      auto p = Simulate(model, same, SimRequests(request.workload), request.slo,
                        {.cores = 2, .seed = 1, .replications = 5});
      ASSERT_TRUE(p.ok()) << p.status();
      EXPECT_EQ(p->ttft_p99, r.prediction.ttft_p99) << same.Name();
      EXPECT_EQ(p->tpot_p99, r.prediction.tpot_p99) << same.Name();
      EXPECT_EQ(p->goodput, r.prediction.goodput) << same.Name();
    }
    for (size_t j = 0; j < i; ++j) {
      const Prediction& a = r.prediction;
      const Prediction& b = (*ranked)[j].prediction;
      EXPECT_FALSE(a.ttft_p99 == b.ttft_p99 && a.tpot_p99 == b.tpot_p99 &&
                   a.goodput == b.goodput && a.duration == b.duration &&
                   a.ttft_mean == b.ttft_mean)
          << r.layout.Name() << " and " << (*ranked)[j].layout.Name();
    }
  }
  EXPECT_EQ(layouts, EnumerateLayouts(request.resources, model, 0).size());
  // The colocated worker's three step budgets are one row.
  bool folded_steps = false;
  for (const RankedLayout& r : *ranked) {
    if (r.layout.colocated && r.same_prediction.size() >= 2) {
      folded_steps = true;
      const std::string table = FormatPlan(*ranked, ranked->size());
      EXPECT_NE(
          table.find("predicted the same: " + r.same_prediction.front().Name()),
          std::string::npos)
          << table;
    }
  }
  EXPECT_TRUE(folded_steps);
}

}  // namespace
}  // namespace pdserve::planner

namespace pdserve::planner {
namespace {

// The Kubernetes values name the objects deploy/kubernetes/base ships, and
// the counts that build the layout there.
TEST(LayoutTest, KubernetesValuesNameTheShippedObjects) {
  Layout l;
  l.prefill_groups = 3;
  l.stages = 2;
  l.decode_workers = 4;
  l.tp = 2;
  const std::string values = l.KubernetesValues();
  EXPECT_NE(values.find("PREFILL_STAGES: \"2\""), std::string::npos) << values;
  EXPECT_NE(values.find("Deployment decode: replicas 4"), std::string::npos)
      << values;
  EXPECT_NE(values.find("ScaledObject decode: minReplicaCount 4"),
            std::string::npos)
      << values;
  EXPECT_NE(values.find("LeaderWorkerSet prefill: replicas 3 (groups), "
                        "leaderWorkerTemplate.size 2"),
            std::string::npos)
      << values;
  EXPECT_NE(values.find("ScaledObject prefill: minReplicaCount 3"),
            std::string::npos)
      << values;
  l.colocated = true;
  EXPECT_NE(l.KubernetesValues().find("LeaderWorkerSet prefill: none"),
            std::string::npos);
}

}  // namespace
}  // namespace pdserve::planner

namespace pdserve::planner {
namespace {

// The per-request disaggregation threshold: where prefilling on the decode
// worker stops being the sooner first token.
TEST(PerfModelTest, LocalPrefillCrossoverIsWhereTheGroupBecomesFaster) {
  auto fitted = StepCost::Fit(Samples(0, 1));
  ASSERT_TRUE(fitted.ok()) << fitted.status();
  PerfModel m = ModelWith(*fitted);
  m.block_size = 16;
  // Same step costs on both sides: only the fixed costs differ. Local:
  // 5 ms + 0.1 ms a token; remote: 30 ms + 5 ms hand-off. Equal at 300.
  m.colocated_ttft = {0.005, 0.0001, {}};
  m.disaggregated_ttft = {0.030, 0, {}};
  m.handoff_seconds = 0.005;
  EXPECT_EQ(m.LocalPrefillCrossover({1, 1}, {1, 2}, 512), 288);
  // A decode worker twice as slow at prompt steps: the group wins past a
  // block (the step itself is ~24 ms at 16 tokens, ~32 ms at 32).
  m.steps[{2, 1}] = fitted->Scaled(2.0);
  EXPECT_EQ(m.LocalPrefillCrossover({2, 1}, {1, 1}, 512), 16);
  // The bound holds; an unprofiled configuration gives no threshold.
  EXPECT_EQ(m.LocalPrefillCrossover({1, 1}, {1, 2}, 100), 96);
  EXPECT_EQ(m.LocalPrefillCrossover({4, 1}, {1, 1}, 512), 0);
}

}  // namespace
}  // namespace pdserve::planner
