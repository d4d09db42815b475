#include "tools/planner_profile.h"

#include <grpcpp/grpcpp.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <ctime>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "decode/decode_worker.h"
#include "metrics/exposition.h"
#include "model/weight_source.h"
#include "planner/planner.h"
#include "planner/simulator.h"
#include "tools/load_generator.h"
#include "tools/local_cluster.h"

namespace pdserve::tools {
namespace {

void Say(const PlannerProfileOptions& o, const std::string& line) {
  if (o.progress) o.progress(line);
}

std::vector<int32_t> RandomPrompt(int length, int vocab, std::mt19937_64& rng) {
  std::uniform_int_distribution<int32_t> token(3, vocab - 1);
  std::vector<int32_t> prompt = {1};
  while (static_cast<int>(prompt.size()) < length) prompt.push_back(token(rng));
  return prompt;
}

// Runs `prompts` (each to `new_tokens` tokens) through `worker` at once and
// waits for all of them.
absl::Status RunBatch(decode::DecodeWorker& worker, uint64_t* next_id,
                      const std::vector<std::vector<int32_t>>& prompts,
                      int new_tokens) {
  absl::Mutex mu;
  size_t finished = 0;
  absl::Status failure;
  decode::RequestParams params;
  params.max_new_tokens = new_tokens;
  params.ignore_eos = true;
  for (const auto& prompt : prompts) {
    auto callback = [&](const decode::TokenDelta& d) {
      if (!d.finished) return;
      absl::MutexLock lock(&mu);
      ++finished;
      if (!d.status.ok()) failure = d.status;
    };
    if (auto s = worker.Submit((*next_id)++, prompt, params, callback);
        !s.ok()) {
      return s;
    }
  }
  absl::MutexLock lock(&mu);
  auto done = [&] { return finished == prompts.size(); };
  if (!mu.AwaitWithTimeout(absl::Condition(&done), absl::Minutes(10))) {
    return absl::DeadlineExceededError("profiling batch did not finish");
  }
  return failure;
}

double ProcessCpuSecondsNow() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

struct ProfiledConfig {
  planner::StepCost cost;
  double busy_cores = 1;  // process CPU seconds per wall second of steps
};

absl::StatusOr<ProfiledConfig> ProfileConfig(const PlannerProfileOptions& o,
                                             const model::WeightSource& weights,
                                             planner::ComputeConfig config) {
  const model::ModelConfig& mc = weights.config();
  std::vector<planner::StepSample> samples;
  absl::Mutex mu;
  bool recording = false;
  decode::DecodeWorkerOptions wo;
  wo.tp_size = config.tp;
  wo.threads_per_rank = config.threads_per_rank;
  wo.max_running = 64;
  wo.max_step_tokens = std::max(512, o.max_prompt);
  const int max_context = std::min(mc.max_position_embeddings, o.max_prompt);
  wo.num_blocks = 40 * (max_context / wo.block_size + 2);
  wo.step_observer = [&](const decode::StepStats& s) {
    absl::MutexLock lock(&mu);
    if (!recording) return;
    samples.push_back(
        {{s.tokens_fed, s.logit_rows, s.attended_positions}, s.seconds});
  };
  auto worker = decode::DecodeWorker::Create(weights, nullptr, wo);
  if (!worker.ok()) return worker.status();
  std::mt19937_64 rng(11);
  uint64_t next_id = 1;
  // Warm-up: first touches of weights and KV pages are not what a serving
  // worker sees.
  if (auto s = RunBatch(**worker, &next_id,
                        {RandomPrompt(64, mc.vocab_size, rng)}, 8);
      !s.ok()) {
    return s;
  }
  {
    absl::MutexLock lock(&mu);
    recording = true;
  }
  // The worker runs steps back to back from here: the process's CPU time
  // over the wall time is the cores a step keeps busy.
  const double cpu_start = ProcessCpuSecondsNow();
  const auto wall_start = std::chrono::steady_clock::now();
  const int long_context = std::max(32, max_context * 3 / 4);
  // Decode batches at a short and a long context.
  for (int context : {16, long_context}) {
    for (int batch : {1, 2, 4, 8, 16, 32}) {
      if (context == long_context && batch > 8) break;
      std::vector<std::vector<int32_t>> prompts;
      for (int i = 0; i < batch; ++i) {
        prompts.push_back(RandomPrompt(context, mc.vocab_size, rng));
      }
      if (auto s = RunBatch(**worker, &next_id, prompts, 10); !s.ok()) return s;
    }
  }
  // Prompts prefilled alone (one step each), twice.
  for (int rep = 0; rep < 2; ++rep) {
    for (int length = 16; length <= max_context; length *= 2) {
      if (auto s = RunBatch(**worker, &next_id,
                            {RandomPrompt(length, mc.vocab_size, rng)}, 1);
          !s.ok()) {
        return s;
      }
    }
  }
  const double busy_cores = std::clamp(
      (ProcessCpuSecondsNow() - cpu_start) /
          std::max(1e-9, std::chrono::duration<double>(
                             std::chrono::steady_clock::now() - wall_start)
                             .count()),
      0.1, static_cast<double>(config.threads()));
  absl::MutexLock lock(&mu);
  auto cost = planner::StepCost::Fit(samples);
  if (!cost.ok()) return cost.status();
  const auto error = cost->Error(samples);
  Say(o,
      absl::StrFormat(
          "  tp %d × %d threads: %zu steps, fit error median %.1f%%, max "
          "%.1f%%; decode b1 %.1f ms, prefill 256 %.0f ms; %.2f cores busy",
          config.tp, config.threads_per_rank, samples.size(),
          error.median * 100, error.max * 100, cost->Seconds({1, 1, 64}) * 1e3,
          cost->Seconds({256, 1, planner::AttendedPositions(0, 256)}) * 1e3,
          busy_cores));
  return ProfiledConfig{*std::move(cost), busy_cores};
}

struct Calibration {
  planner::LinearCost ttft;
  double step_overhead = 0;
  double handoff = 0;
  double delivery_cpu = 0;  // router + client CPU seconds per token
};

// CPU seconds (user + system) process `pid` used so far; 0 if unreadable.
double ProcessCpuSeconds(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string stat((std::istreambuf_iterator<char>(in)), {});
  const size_t name_end = stat.rfind(')');  // the name may hold spaces
  if (name_end == std::string::npos) return 0;
  std::istringstream fields(stat.substr(name_end + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && fields >> field; ++i) {  // utime 14, stime 15
    if (i >= 14) ticks += std::strtod(field.c_str(), nullptr);
  }
  return ticks / sysconf(_SC_CLK_TCK);
}

double OwnCpuSeconds() {
  rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& t) { return t.tv_sec + t.tv_usec * 1e-6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

// Least squares line through (x, y).
planner::LinearCost FitLine(const std::vector<double>& x,
                            const std::vector<double>& y) {
  double mx = 0, my = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    mx += x[i] / x.size();
    my += y[i] / y.size();
  }
  double sxy = 0, sxx = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    sxy += (x[i] - mx) * (y[i] - my);
    sxx += (x[i] - mx) * (x[i] - mx);
  }
  const double slope = sxx > 0 ? sxy / sxx : 0;
  return {my - slope * mx, slope};
}

// A real cluster of `layout` on the profiled model; with `worker_metrics`
// every process serves /metrics on a free port.
absl::StatusOr<std::unique_ptr<LocalCluster>> StartCluster(
    const PlannerProfileOptions& o, const planner::Layout& layout,
    bool worker_metrics) {
  LocalClusterOptions lo;
  lo.model_path = o.model_path;
  lo.format = o.format;
  lo.bin_dir = o.bin_dir;
  lo.refresh_ms = 100;
  if (worker_metrics) lo.metrics_port_base = 0;
  ApplyLayout(layout, &lo);
  return LocalCluster::Start(lo);
}

// Idle-cluster requests on `layout`: measured minus simulated. Without
// `step_overhead` the decode step overhead of the layout's decode
// configuration is measured here (colocated calibrations); else it is taken
// as given.
absl::StatusOr<Calibration> Calibrate(const PlannerProfileOptions& o,
                                      const planner::PerfModel& model,
                                      const planner::Layout& layout, int vocab,
                                      std::optional<double> step_overhead) {
  auto cluster = StartCluster(o, layout, /*worker_metrics=*/false);
  if (!cluster.ok()) return cluster.status();
  auto stub = v1::Generation::NewStub(grpc::CreateChannel(
      (*cluster)->grpc_address(), grpc::InsecureChannelCredentials()));
  std::mt19937_64 rng(5);
  // As many tokens as a typical answer, so per-request costs (channel,
  // stream set-up) weigh on the per-token CPU as they do in serving.
  constexpr int kTokens = 24;
  struct Measured {
    int prompt;
    RequestResult result;
  };
  std::vector<Measured> measured;
  RunRequest(*stub, RandomPrompt(32, vocab, rng), 2);  // warm the path
  // Router + this client's CPU over the requests: what streaming costs
  // outside the workers.
  const pid_t router_pid = (*cluster)->pids().front();
  const double cpu_before = ProcessCpuSeconds(router_pid) + OwnCpuSeconds();
  int delivered = 0;
  const int long_prompt = std::max(32, std::min(384, o.max_prompt * 3 / 4));
  for (int rep = 0; rep < 3; ++rep) {
    for (int length : {16, 128, long_prompt}) {
      RequestResult r =
          RunRequest(*stub, RandomPrompt(length, vocab, rng), kTokens);
      if (!r.ok || r.tokens != kTokens) {
        return absl::InternalError(absl::StrCat(
            "calibration request on ", layout.Name(), " failed: ", r.error));
      }
      delivered += r.tokens;
      measured.push_back({length, std::move(r)});
    }
  }
  const double cpu_after = ProcessCpuSeconds(router_pid) + OwnCpuSeconds();
  // What the steps alone predict (no per-request costs yet).
  Calibration c;
  c.delivery_cpu = std::max(0.0, (cpu_after - cpu_before) / delivered);
  planner::PerfModel bare = model;
  bare.colocated_ttft = bare.disaggregated_ttft = {};
  bare.decode_step_overhead_seconds = bare.handoff_seconds = 0;
  bare.calibrated.clear();
  bare.delivery_cpu_seconds = c.delivery_cpu;  // it competes here too
  // Idle requests against the fitted step times: the offsets calibrate the
  // typical step (the spread's median is ~1), and a handful of random
  // spread draws would only add noise to them.
  planner::SimOptions fitted_steps;
  fitted_steps.step_spread = false;
  if (!step_overhead.has_value()) {
    std::vector<double> extra;
    for (const Measured& m : measured) {
      auto all = planner::Simulate(bare, layout, {{0, m.prompt, kTokens}}, {},
                                   fitted_steps);
      if (!all.ok()) return all.status();
      extra.push_back(m.result.tpot - all->tpot_p50);
    }
    // A step never takes less than half its profiled time, whatever the
    // noise in a handful of idle requests says.
    auto cost = model.Step({layout.tp, layout.decode_threads});
    if (!cost.ok()) return cost.status();
    step_overhead = std::max(planner::Percentile(extra, 0.5),
                             -0.5 * (*cost)->Seconds({1, 1, 16}));
  }
  c.step_overhead = *step_overhead;
  bare.decode_step_overhead_seconds = *step_overhead;
  std::vector<double> prompts, ttft_extra, gap_extra;
  for (const Measured& m : measured) {
    auto one =
        planner::Simulate(bare, layout, {{0, m.prompt, 1}}, {}, fitted_steps);
    auto two =
        planner::Simulate(bare, layout, {{0, m.prompt, 2}}, {}, fitted_steps);
    if (!one.ok() || !two.ok()) return one.ok() ? two.status() : one.status();
    prompts.push_back(m.prompt);
    ttft_extra.push_back(m.result.ttft - one->ttft_p50);
    // Every token carries the same delivery offset, so the first gap is
    // the simulated one plus the hand-off.
    gap_extra.push_back(m.result.first_gap - two->tpot_p50);
  }
  c.ttft = FitLine(prompts, ttft_extra);
  c.handoff = std::max(0.0, planner::Percentile(gap_extra, 0.5));
  return c;
}

// The busy seconds a cluster's workers have counted so far, summed over
// its processes of each kind.
struct BusySeconds {
  double prefill = 0;  // pdserve_prefill_stage_busy_seconds_total
  double decode = 0;   // pdserve_decode_step_seconds_sum
};

absl::StatusOr<BusySeconds> ScrapeBusySeconds(const LocalCluster& cluster) {
  BusySeconds busy;
  bool prefill_seen = false, decode_seen = false;
  for (const auto& [name, address] : cluster.metrics_addresses()) {
    auto samples =
        metrics::Scrape(absl::StrCat("http://", address, "/metrics"));
    if (!samples.ok()) {
      return absl::Status(samples.status().code(),
                          absl::StrCat(name, ": ", samples.status().message()));
    }
    for (const metrics::Sample& sample : *samples) {
      if (sample.name == "pdserve_prefill_stage_busy_seconds_total") {
        busy.prefill += sample.value;
        prefill_seen = true;
      } else if (sample.name == "pdserve_decode_step_seconds_sum") {
        busy.decode += sample.value;
        decode_seen = true;
      }
    }
  }
  if (!prefill_seen || !decode_seen) {
    return absl::FailedPreconditionError(
        "co-running calibration: the cluster's metrics lack the prefill "
        "stages' or the decode workers' busy seconds");
  }
  return busy;
}

// What a real cluster of `layout` counted in its workers' busy-seconds
// metrics under load, scaled to the speed its steps ran at idle.
struct LoadedBusySeconds {
  planner::WorkloadSpec load;
  // Measured / simulated busy seconds of idle requests: what a worker
  // process does differently from the in-process profile.
  double idle_prefill_ratio = 0, idle_decode_ratio = 0;
  // The loaded busy seconds over those ratios: what the steps took under
  // load, had they run idle as fast as simulated. What is left over the
  // simulator's figure for the same arrivals is the load's own effect.
  double prefill = 0, decode = 0;
};

// Starts `layout` as a real cluster (each worker's metrics on), runs six
// idle requests one at a time, then an open-loop load of 40 requests that
// keeps one one-thread prefill stage about 60% busy.
absl::StatusOr<LoadedBusySeconds> MeasureLoadedBusySeconds(
    const PlannerProfileOptions& o, const planner::PerfModel& model,
    const planner::Layout& layout, int vocab, const std::string& what) {
  auto cluster = StartCluster(o, layout, /*worker_metrics=*/true);
  if (!cluster.ok()) return cluster.status();
  auto stub = v1::Generation::NewStub(grpc::CreateChannel(
      (*cluster)->grpc_address(), grpc::InsecureChannelCredentials()));
  std::mt19937_64 rng(7);
  RunRequest(*stub, RandomPrompt(32, vocab, rng), 2);  // warm the path
  const int long_prompt = std::max(32, std::min(384, o.max_prompt * 3 / 4));
  const planner::LengthRange prompts{std::max(1, long_prompt / 3), long_prompt};
  const planner::LengthRange outputs{16, 64};
  planner::SimOptions fitted_steps;
  fitted_steps.step_spread = false;
  fitted_steps.cores = o.cores;

  // Idle: one request at a time.
  auto before = ScrapeBusySeconds(**cluster);
  if (!before.ok()) return before.status();
  std::vector<planner::SimRequest> idle;
  for (int rep = 0; rep < 2; ++rep) {
    for (int length : {prompts.lo, (prompts.lo + prompts.hi) / 2, prompts.hi}) {
      constexpr int kTokens = 40;
      RequestResult r =
          RunRequest(*stub, RandomPrompt(length, vocab, rng), kTokens);
      if (!r.ok || r.tokens != kTokens) {
        return absl::InternalError(
            absl::StrCat(what, ": idle request failed: ", r.error));
      }
      // Far apart in simulated time: nothing overlaps.
      idle.push_back({1000.0 * idle.size(), length, kTokens});
    }
  }
  auto after_idle = ScrapeBusySeconds(**cluster);
  if (!after_idle.ok()) return after_idle.status();
  auto idle_sim = planner::Simulate(model, layout, idle, {}, fitted_steps);
  if (!idle_sim.ok()) return idle_sim.status();
  if (!(after_idle->prefill > before->prefill) ||
      !(after_idle->decode > before->decode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": ", idle.size(),
        " idle requests added no busy seconds to the workers' metrics "
        "(prefill ",
        after_idle->prefill - before->prefill, " s, decode ",
        after_idle->decode - before->decode, " s)"));
  }
  LoadedBusySeconds measured;
  measured.idle_prefill_ratio =
      (after_idle->prefill - before->prefill) / idle_sim->prefill_busy_seconds;
  measured.idle_decode_ratio =
      (after_idle->decode - before->decode) / idle_sim->decode_busy_seconds;

  // Loaded: open-loop arrivals keeping a one-thread prefill stage about 60%
  // busy, the decode worker as busy as their answers make it.
  auto stage_cost = model.Step({1, 1});
  if (!stage_cost.ok()) return stage_cost.status();
  const int mean_prompt = (prompts.lo + prompts.hi) / 2;
  const double prefill_seconds =
      (*stage_cost)
          ->Seconds(
              {mean_prompt, 1, planner::AttendedPositions(0, mean_prompt)});
  planner::WorkloadSpec& load = measured.load;
  load.requests = 40;
  load.rate = 0.6 / prefill_seconds;
  load.prompt = prompts;
  load.output = outputs;
  load.seed = 3;
  LoadReport report = RunLoad(what, (*cluster)->grpc_address(),
                              planner::MakeArrivals(load, vocab), 1e9, 1e9);
  if (report.failed > 0) {
    return absl::InternalError(absl::StrCat(what, ": ", report.failed, " of ",
                                            load.requests,
                                            " loaded requests failed"));
  }
  auto after_load = ScrapeBusySeconds(**cluster);
  if (!after_load.ok()) return after_load.status();
  measured.prefill =
      (after_load->prefill - after_idle->prefill) / measured.idle_prefill_ratio;
  measured.decode =
      (after_load->decode - after_idle->decode) / measured.idle_decode_ratio;
  return measured;
}

// How much longer prefill stage and decode steps take under load than idle
// on a real 1P(1t)+1D(tp1×1t) cluster, beyond what `model` (with no
// co-running slow-down) predicts for the same arrivals: each kind's busy
// seconds measured / simulated under load, over the same ratio for idle
// requests (which cancels what a worker process does differently from the
// in-process profile, so only the load's effect is left), then refined
// through the simulator (only the time the two actually overlap is slowed).
absl::StatusOr<planner::PerfModel::CoRunning> CalibrateCoRunning(
    const PlannerProfileOptions& o, const planner::PerfModel& model,
    int vocab) {
  const planner::Layout layout;  // 1P(1s×1t, chunk 256)+1D(tp1×1t)
  planner::PerfModel alone = model;
  alone.co_running = {};
  auto measured = MeasureLoadedBusySeconds(o, alone, layout, vocab,
                                           "co-running calibration");
  if (!measured.ok()) return measured.status();
  planner::SimOptions fitted_steps;
  fitted_steps.step_spread = false;
  fitted_steps.cores = o.cores;
  const std::vector<planner::SimRequest> loaded =
      planner::SimRequests(measured->load);
  planner::PerfModel fitted = alone;
  // Loaded over idle, both against the simulator without slow-downs (how
  // much the load added; below 1 where the machine sped up meanwhile).
  double loaded_prefill_ratio = 0, loaded_decode_ratio = 0;
  // Each round scales a slow-down by what is still missing; the overlap
  // moves a little with it, so a few rounds settle it.
  for (int round = 0; round < 4; ++round) {
    auto sim = planner::Simulate(fitted, layout, loaded, {}, fitted_steps);
    if (!sim.ok()) return sim.status();
    if (round == 0) {
      loaded_prefill_ratio = measured->prefill / sim->prefill_busy_seconds;
      loaded_decode_ratio = measured->decode / sim->decode_busy_seconds;
    }
    auto refine = [](double slowdown, double target, double simulated) {
      if (!(simulated > 0) || !(target > 0)) return slowdown;
      return std::clamp((1 + slowdown) * target / simulated - 1, 0.0, 3.0);
    };
    fitted.co_running.prefill_stage =
        refine(fitted.co_running.prefill_stage, measured->prefill,
               sim->prefill_busy_seconds);
    fitted.co_running.decode_step =
        refine(fitted.co_running.decode_step, measured->decode,
               sim->decode_busy_seconds);
  }
  Say(o, absl::StrFormat(
             "  busy seconds measured / simulated, idle: prefill %.2f, decode "
             "%.2f; loaded (%.2f req/s) over idle: prefill %.2f, decode %.2f",
             measured->idle_prefill_ratio, measured->idle_decode_ratio,
             measured->load.rate, loaded_prefill_ratio, loaded_decode_ratio));
  return fitted.co_running;
}

// The largest TP degree of one thread per rank profiled, where a decode
// worker of it and a one-thread prefill stage oversubscribe the cores
// (0: none does, and the gang exponent cannot be measured here).
int GangCalibrationTp(const planner::PerfModel& model, int cores) {
  int tp = 0;
  for (const auto& [config, cost] : model.steps) {
    if (config.threads_per_rank == 1 && config.tp >= 2 &&
        config.tp + 1 > cores) {
      tp = std::max(tp, config.tp);
    }
  }
  return tp;
}

// The gang-sharing exponent (PerfModel::gang_sharing_exponent) of this
// machine, measured side by side: an in-process TP N worker (one thread per
// rank) decodes batches of 4 in twelve alternating phases of 96 steps,
// alone and beside a one-thread worker that prefills 256-token prompts back
// to back (N + 1 busy threads on N cores). Each phase's steps are summed
// against their fitted times, so the decode context growing within a phase
// cancels, and alternating cancels the machine's drift between phases (on the
// dev VM its speed moves by ±25% within minutes — a first try that compared a
// loaded cluster's busy seconds with idle requests a minute earlier read
// that drift as the effect: exponents of 1.33 and 0 twenty minutes apart).
// Loaded over alone is r; the simulator runs the gang at share / max(
// share^-(N−1)·e, 1 + co-running) of full speed, so e = ln(r · share) /
// (−(N − 1) · ln share), 0 where the co-running slow-down explains r, at
// most 2.
absl::StatusOr<double> CalibrateGangSharing(const PlannerProfileOptions& o,
                                            const planner::PerfModel& model,
                                            const model::WeightSource& weights,
                                            int tp) {
  const model::ModelConfig& mc = weights.config();
  auto gang_cost = model.Step({tp, 1});
  if (!gang_cost.ok()) return gang_cost.status();
  // Per phase kind (0 alone, 1 beside the neighbour): measured and fitted
  // seconds of the gang's steps.
  absl::Mutex mu;
  int phase = -1;  // -1: not recording
  double measured[2] = {0, 0}, fitted[2] = {0, 0};
  int steps[2] = {0, 0};
  decode::DecodeWorkerOptions gang_options;
  gang_options.tp_size = tp;
  gang_options.threads_per_rank = 1;
  gang_options.max_running = 8;
  gang_options.num_blocks = 8 * (256 / gang_options.block_size + 2);
  gang_options.step_observer = [&](const decode::StepStats& s) {
    absl::MutexLock lock(&mu);
    if (phase < 0) return;
    measured[phase] += s.seconds;
    fitted[phase] +=
        (*gang_cost)
            ->Seconds({s.tokens_fed, s.logit_rows, s.attended_positions});
    ++steps[phase];
  };
  auto gang = decode::DecodeWorker::Create(weights, nullptr, gang_options);
  if (!gang.ok()) return gang.status();
  decode::DecodeWorkerOptions neighbour_options;
  neighbour_options.max_step_tokens = 512;
  neighbour_options.num_blocks = 4 * (256 / neighbour_options.block_size + 2);
  auto neighbour =
      decode::DecodeWorker::Create(weights, nullptr, neighbour_options);
  if (!neighbour.ok()) return neighbour.status();

  std::mt19937_64 rng(13);
  uint64_t gang_id = 1;
  auto decode_batch = [&]() {
    std::vector<std::vector<int32_t>> prompts;
    for (int i = 0; i < 4; ++i) {
      prompts.push_back(RandomPrompt(32, mc.vocab_size, rng));
    }
    return RunBatch(**gang, &gang_id, prompts, 96);
  };
  if (auto s = decode_batch(); !s.ok()) return s;  // warm-up

  std::atomic<bool> neighbour_busy{false}, stop{false};
  absl::Status neighbour_status;
  std::thread neighbour_thread([&] {
    std::mt19937_64 neighbour_rng(17);
    uint64_t id = 1;
    while (!stop.load()) {
      if (!neighbour_busy.load()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        continue;
      }
      absl::Status s =
          RunBatch(**neighbour, &id,
                   {RandomPrompt(256, mc.vocab_size, neighbour_rng)}, 1);
      if (!s.ok()) {
        neighbour_status = s;
        return;
      }
    }
  });
  absl::Status status;
  for (int round = 0; round < 6 && status.ok(); ++round) {
    for (int kind : {0, 1}) {
      neighbour_busy = kind == 1;
      // Let the neighbour's first prefill start before the gang's steps
      // count (and, alone, its last one finish).
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      {
        absl::MutexLock lock(&mu);
        phase = kind;
      }
      status = decode_batch();
      {
        absl::MutexLock lock(&mu);
        phase = -1;
      }
      if (!status.ok()) break;
    }
  }
  neighbour_busy = false;
  stop = true;
  neighbour_thread.join();
  if (!status.ok()) return status;
  if (!neighbour_status.ok()) return neighbour_status;
  if (!(fitted[0] > 0) || !(fitted[1] > 0) || !(measured[0] > 0)) {
    return absl::InternalError(
        "gang-sharing calibration: the TP worker reported no steps");
  }
  const double ratio =
      (measured[1] / fitted[1]) / (measured[0] / fitted[0]);  // r
  const double demand = model.BusyCores({tp, 1}) + model.BusyCores({1, 1});
  const double share = std::min(1.0, o.cores / demand);
  double exponent = 0;
  if (share < 1 && ratio * share > 1 + model.co_running.decode_step) {
    exponent = std::clamp(
        std::log(ratio * share) / (-(tp - 1) * std::log(share)), 0.0, 2.0);
  }
  Say(o, absl::StrFormat(
             "  tp %d steps beside a prefilling neighbour over alone: %.2fx "
             "(%d and %d steps); processor sharing gives %.2fx, co-running "
             "%.2fx",
             tp, ratio, steps[1], steps[0], 1 / share,
             (1 + model.co_running.decode_step) / share));
  return exponent;
}

}  // namespace

void ApplyLayout(const planner::Layout& layout, LocalClusterOptions* o) {
  o->colocated = layout.colocated;
  o->prefill_groups = layout.prefill_groups;
  o->stages = layout.stages;
  o->prefill_threads = layout.prefill_threads;
  o->chunk_tokens = layout.chunk_tokens;
  o->decode_workers = layout.decode_workers;
  o->tp = layout.tp;
  o->decode_threads = layout.decode_threads;
  o->max_step_tokens = layout.max_step_tokens;
  o->max_running = layout.max_running;
  o->speculation = layout.gamma > 0 ? "ngram" : "off";
}

absl::StatusOr<planner::PerfModel> ProfileForPlanner(
    const PlannerProfileOptions& options) {
  auto format = model::ParseLoadFormat(options.format);
  if (!format.ok()) return format.status();
  auto weights = model::OpenModel(options.model_path, *format);
  if (!weights.ok()) return weights.status();
  const model::ModelConfig& mc = (*weights)->config();
  planner::PerfModel model;
  model.model = options.model_path;
  model.num_layers = mc.num_layers;
  model.cores = options.cores;
  // What a stage sends across nodes (measured on one node only as part of
  // the hand-off): K and V of every layer in the CPU engine's own KV type
  // (f32, which the profiled workers run), and f32 hidden states.
  model.kv_bytes_per_token =
      2.0 * mc.num_layers * mc.num_kv_heads * mc.head_dim * sizeof(float);
  model.activation_bytes_per_token = 1.0 * mc.hidden_size * sizeof(float);
  Say(options,
      absl::StrCat("profiling steps on ", options.model_path, " (",
                   mc.num_layers, " layers), ", options.cores, " cores"));
  for (int tp = 1; tp <= options.cores; tp *= 2) {
    if (mc.num_heads % tp != 0) continue;
    for (int threads = 1; tp * threads <= options.cores; ++threads) {
      auto profiled = ProfileConfig(options, **weights, {tp, threads});
      if (!profiled.ok()) {
        return absl::Status(
            profiled.status().code(),
            absl::StrCat("profiling tp ", tp, " × ", threads,
                         " threads: ", profiled.status().message()));
      }
      model.steps[{tp, threads}] = std::move(profiled->cost);
      model.busy_cores[{tp, threads}] = profiled->busy_cores;
    }
  }
  // Colocated: one worker of each profiled decode configuration (each
  // has its own step overhead); disaggregated: one prefill stage and one
  // decode worker of one thread each (the smallest such layout).
  double delivery_cpu = 0;
  for (const auto& [config, cost] : model.steps) {
    planner::Layout colocated;
    colocated.colocated = true;
    colocated.tp = config.tp;
    colocated.decode_threads = config.threads_per_rank;
    Say(options, "calibrating request costs on " + colocated.Name());
    auto c = Calibrate(options, model, colocated, mc.vocab_size, std::nullopt);
    if (!c.ok()) return c.status();
    model.calibrated[config] = {c->step_overhead, c->ttft};
    delivery_cpu += c->delivery_cpu / model.steps.size();
    Say(options,
        absl::StrFormat("  TTFT extra %.1f ms %+.3f ms/token; decode step "
                        "overhead %+.2f ms; router + client CPU %.3f ms/token",
                        c->ttft.base * 1e3, c->ttft.per_prompt_token * 1e3,
                        c->step_overhead * 1e3, c->delivery_cpu * 1e3));
  }
  // Configurations not calibrated (none today) fall back on tp 1 × 1.
  const planner::PerfModel::Calibration& base =
      model.calibrated.begin()->second;
  model.colocated_ttft = base.colocated_ttft;
  model.decode_step_overhead_seconds = base.step_overhead_seconds;
  model.delivery_cpu_seconds = delivery_cpu;
  if (options.cores >= 2) {
    planner::Layout disaggregated;
    Say(options, "calibrating request costs on " + disaggregated.Name());
    auto d = Calibrate(options, model, disaggregated, mc.vocab_size,
                       model.StepOverhead({1, 1}));
    if (!d.ok()) return d.status();
    model.disaggregated_ttft = d->ttft;
    model.handoff_seconds = d->handoff;
  } else {
    model.disaggregated_ttft = model.colocated_ttft;
  }
  Say(options,
      absl::StrFormat("  disaggregated TTFT extra %.1f ms %+.3f ms/token; "
                      "hand-off %.2f ms",
                      model.disaggregated_ttft.base * 1e3,
                      model.disaggregated_ttft.per_prompt_token * 1e3,
                      model.handoff_seconds * 1e3));
  if (options.cores >= 2) {
    Say(options,
        "calibrating co-running on 1P(1s×1t, chunk 256)+1D(tp1×1t) under "
        "load");
    auto co_running = CalibrateCoRunning(options, model, mc.vocab_size);
    if (!co_running.ok()) return co_running.status();
    model.co_running = *co_running;
    Say(options, absl::StrFormat("  co-running slow-down: prefill stage "
                                 "%+.0f%%, decode step %+.0f%%",
                                 model.co_running.prefill_stage * 100,
                                 model.co_running.decode_step * 100));
  }
  if (const int tp = GangCalibrationTp(model, options.cores); tp > 0) {
    Say(options,
        absl::StrCat("calibrating gang sharing: tp ", tp,
                     " × 1 thread decoding alone and beside a prefill, "
                     "alternately"));
    auto exponent = CalibrateGangSharing(options, model, **weights, tp);
    if (!exponent.ok()) return exponent.status();
    model.gang_sharing_exponent = *exponent;
    Say(options, absl::StrFormat("  gang-sharing exponent %.2f",
                                 model.gang_sharing_exponent));
  } else {
    Say(options,
        absl::StrFormat("no TP worker oversubscribes %d cores beside a "
                        "prefill stage: gang-sharing exponent %.2f as given",
                        options.cores, model.gang_sharing_exponent));
  }
  return model;
}

}  // namespace pdserve::tools
