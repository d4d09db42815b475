#include "tools/planner_profile.h"

#include <grpcpp/grpcpp.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
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
#include "model/weight_source.h"
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

// Idle-cluster requests on `layout`: measured minus simulated. Without
// `step_overhead` the decode step overhead of the layout's decode
// configuration is measured here (colocated calibrations); else it is taken
// as given.
absl::StatusOr<Calibration> Calibrate(const PlannerProfileOptions& o,
                                      const planner::PerfModel& model,
                                      const planner::Layout& layout, int vocab,
                                      std::optional<double> step_overhead) {
  LocalClusterOptions lo;
  lo.model_path = o.model_path;
  lo.format = o.format;
  lo.bin_dir = o.bin_dir;
  lo.refresh_ms = 100;
  ApplyLayout(layout, &lo);
  auto cluster = LocalCluster::Start(lo);
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
  return model;
}

}  // namespace pdserve::tools
