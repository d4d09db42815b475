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
#include "common/status_macros.h"
#include "decode/decode_worker.h"
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

// One compute configuration's measured steps, over every round so far.
struct StepRecord {
  std::vector<planner::StepSample> samples;
  double cpu_seconds = 0;                 // this process's, while the steps ran
  double wall_seconds = 0;                // the steps' back-to-back wall time
  std::vector<double> decode_b1_seconds;  // per round, from its own fit
};

// One round of `config`'s step mix on a fresh in-process worker, appended to
// `record`.
absl::Status ProfileRound(const PlannerProfileOptions& o,
                          const model::WeightSource& weights,
                          planner::ComputeConfig config, int round,
                          StepRecord* record) {
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
  std::mt19937_64 rng(11 + round);
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
  record->cpu_seconds += ProcessCpuSecondsNow() - cpu_start;
  record->wall_seconds += std::chrono::duration<double>(
                              std::chrono::steady_clock::now() - wall_start)
                              .count();
  absl::MutexLock lock(&mu);
  // This round alone, to show how far the machine's speed moved between
  // rounds.
  auto round_cost = planner::StepCost::Fit(samples);
  if (!round_cost.ok()) return round_cost.status();
  record->decode_b1_seconds.push_back(round_cost->Seconds({1, 1, 64}));
  record->samples.insert(record->samples.end(), samples.begin(), samples.end());
  return absl::OkStatus();
}

// The fit over every round of `record`, and the cores its steps kept busy.
absl::Status FitRecord(planner::ComputeConfig config, const StepRecord& record,
                       planner::PerfModel* model) {
  auto cost = planner::StepCost::Fit(record.samples);
  if (!cost.ok()) return cost.status();
  model->steps[config] = *std::move(cost);
  model->busy_cores[config] =
      std::clamp(record.cpu_seconds / std::max(1e-9, record.wall_seconds), 0.1,
                 static_cast<double>(config.threads()));
  return absl::OkStatus();
}

struct Calibration {
  planner::LinearCost ttft;
  double step_overhead = 0;
  double handoff = 0;
  double delivery_cpu = 0;  // router + client CPU seconds per token
  // The speed probe's step time over the fit around the requests (their
  // median).
  double slowness = 1;
};

// How fast this machine runs steps right now against a fit: an in-process
// worker of the fitted configuration decodes a few tokens at batch 1, and
// its decode steps' measured seconds over their fitted seconds is the
// answer (above 1: slower than the fit). The calibration's idle requests
// run between probes, so each is measured against the fit at the speed of
// its moment.
class SpeedProbe {
 public:
  static absl::StatusOr<std::unique_ptr<SpeedProbe>> Create(
      const model::WeightSource& weights, planner::ComputeConfig config,
      const planner::StepCost& cost) {
    auto probe = std::unique_ptr<SpeedProbe>(new SpeedProbe(cost));
    decode::DecodeWorkerOptions wo;
    wo.tp_size = config.tp;
    wo.threads_per_rank = config.threads_per_rank;
    wo.max_running = 4;
    wo.num_blocks = 16;
    wo.step_observer = [p = probe.get()](const decode::StepStats& s) {
      if (s.tokens_fed != 1) return;  // the prompt's step
      absl::MutexLock lock(&p->mu_);
      p->measured_ += s.seconds;
      p->fitted_ +=
          p->cost_.Seconds({s.tokens_fed, s.logit_rows, s.attended_positions});
    };
    auto worker = decode::DecodeWorker::Create(weights, nullptr, wo);
    if (!worker.ok()) return worker.status();
    probe->worker_ = *std::move(worker);
    probe->vocab_ = weights.config().vocab_size;
    if (auto s = probe->Measure(); !s.ok()) return s.status();  // warm-up
    return probe;
  }

  absl::StatusOr<double> Measure() {
    {
      absl::MutexLock lock(&mu_);
      measured_ = fitted_ = 0;
    }
    PDS_RETURN_IF_ERROR(
        RunBatch(*worker_, &next_id_, {RandomPrompt(16, vocab_, rng_)}, 8));
    absl::MutexLock lock(&mu_);
    if (!(fitted_ > 0) || !(measured_ > 0)) {
      return absl::InternalError("the speed probe ran no decode steps");
    }
    // Within a factor of 2: a reading beyond is a stall, not a speed.
    return std::clamp(measured_ / fitted_, 0.5, 2.0);
  }

 private:
  explicit SpeedProbe(const planner::StepCost& cost) : cost_(cost) {}
  const planner::StepCost cost_;
  int vocab_ = 0;
  uint64_t next_id_ = 1;
  std::mt19937_64 rng_{17};
  absl::Mutex mu_;
  double measured_ = 0, fitted_ = 0;
  // Last: it stops (its observer reads the members above) before they go.
  std::unique_ptr<decode::DecodeWorker> worker_;
};

// `model` with every step cost `factor` times slower.
planner::PerfModel SlowedBy(const planner::PerfModel& model, double factor) {
  planner::PerfModel slowed = model;
  for (auto& [config, cost] : slowed.steps) cost = cost.Scaled(factor);
  return slowed;
}

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

// A real cluster of `layout` on the profiled model.
absl::StatusOr<std::unique_ptr<LocalCluster>> StartCluster(
    const PlannerProfileOptions& o, const planner::Layout& layout) {
  LocalClusterOptions lo;
  lo.model_path = o.model_path;
  lo.format = o.format;
  lo.bin_dir = o.bin_dir;
  lo.refresh_ms = 100;
  ApplyLayout(layout, &lo);
  return LocalCluster::Start(lo);
}

// Idle-cluster requests on `layout`: measured minus simulated. Without
// `step_overhead` the decode step overhead of the layout's decode
// configuration is measured here (colocated calibrations); else it is taken
// as given.
absl::StatusOr<Calibration> Calibrate(const PlannerProfileOptions& o,
                                      const model::WeightSource& weights,
                                      const planner::PerfModel& model,
                                      const planner::Layout& layout,
                                      std::optional<double> step_overhead) {
  const planner::ComputeConfig decode_config{layout.tp, layout.decode_threads};
  auto cost = model.Step(decode_config);
  if (!cost.ok()) return cost.status();
  auto probe = SpeedProbe::Create(weights, decode_config, **cost);
  if (!probe.ok()) return probe.status();
  auto cluster = StartCluster(o, layout);
  if (!cluster.ok()) return cluster.status();
  auto stub = v1::Generation::NewStub(grpc::CreateChannel(
      (*cluster)->grpc_address(), grpc::InsecureChannelCredentials()));
  std::mt19937_64 rng(5);
  const int vocab = weights.config().vocab_size;
  // As many tokens as a typical answer, so per-request costs (channel,
  // stream set-up) weigh on the per-token CPU as they do in serving.
  constexpr int kTokens = 24;
  struct Measured {
    int prompt;
    RequestResult result;
    double slowness;  // the probes' around it
  };
  std::vector<Measured> measured;
  RunRequest(*stub, RandomPrompt(32, vocab, rng), 2);  // warm the path
  // Router + this client's CPU over the requests: what streaming costs
  // outside the workers.
  const pid_t router_pid = (*cluster)->pids().front();
  double cpu_seconds = 0;
  int delivered = 0;
  const int long_prompt = std::max(32, std::min(384, o.max_prompt * 3 / 4));
  auto before = (*probe)->Measure();
  if (!before.ok()) return before.status();
  for (int rep = 0; rep < 3; ++rep) {
    for (int length : {16, 128, long_prompt}) {
      const double cpu_before = ProcessCpuSeconds(router_pid) + OwnCpuSeconds();
      RequestResult r =
          RunRequest(*stub, RandomPrompt(length, vocab, rng), kTokens);
      cpu_seconds +=
          ProcessCpuSeconds(router_pid) + OwnCpuSeconds() - cpu_before;
      if (!r.ok || r.tokens != kTokens) {
        return absl::InternalError(absl::StrCat(
            "calibration request on ", layout.Name(), " failed: ", r.error));
      }
      auto after = (*probe)->Measure();
      if (!after.ok()) return after.status();
      delivered += r.tokens;
      measured.push_back({length, std::move(r), (*before + *after) / 2});
      before = after;
    }
  }
  // What the steps alone predict (no per-request costs yet).
  Calibration c;
  c.delivery_cpu = std::max(0.0, cpu_seconds / delivered);
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
  // Each request against the fitted steps slowed to the probe's speed around
  // it: what is left over is the time outside the steps, whatever this VM's
  // speed was during these few seconds. Against the fit alone a fast or slow
  // moment went into the offsets, and into every prediction made with them.
  std::vector<double> slowness;
  for (const Measured& m : measured) slowness.push_back(m.slowness);
  c.slowness = planner::Median(slowness);
  if (!step_overhead.has_value()) {
    std::vector<double> extra;
    for (const Measured& m : measured) {
      auto all = planner::Simulate(SlowedBy(bare, m.slowness), layout,
                                   {{0, m.prompt, kTokens}}, {}, fitted_steps);
      if (!all.ok()) return all.status();
      extra.push_back(m.result.tpot - all->tpot_p50);
    }
    // A step never takes less than half its profiled time, whatever the
    // noise in a handful of idle requests says.
    step_overhead = std::max(planner::Percentile(extra, 0.5),
                             -0.5 * (*cost)->Seconds({1, 1, 16}));
  }
  c.step_overhead = *step_overhead;
  bare.decode_step_overhead_seconds = *step_overhead;
  std::vector<double> prompts, ttft_extra, gap_extra;
  for (const Measured& m : measured) {
    const planner::PerfModel slowed = SlowedBy(bare, m.slowness);
    auto one =
        planner::Simulate(slowed, layout, {{0, m.prompt, 1}}, {}, fitted_steps);
    auto two =
        planner::Simulate(slowed, layout, {{0, m.prompt, 2}}, {}, fitted_steps);
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

// A piece of work on an in-process worker: one phase of the measured
// worker's, or one unit of a neighbour's (short, so that a neighbour asked to
// stop does so soon).
using Work = std::function<absl::Status()>;

// How much slower a worker's steps run beside busy neighbours than alone,
// measured side by side in this process: rounds of a phase alone and a phase
// beside the neighbours running their units back to back. Each phase's steps
// are summed against their fitted times (the worker's StepCost), so a context
// growing within a phase cancels, and alternating the phases cancels the
// machine's drift between them — on the dev VM its speed moves by ±25% within
// minutes, and a first calibration that compared a loaded cluster's busy
// seconds with idle requests a minute earlier read that drift as the effect
// (gang exponents of 1.33 and 0 twenty minutes apart, docs/PERFORMANCE.md
// run 20).
class SideBySide {
 public:
  // Worker `who`'s DecodeWorkerOptions::step_observer: records into the
  // measurement running on that worker (a worker that is another's
  // neighbour meanwhile records nothing).
  std::function<void(const decode::StepStats&)> Observer(int who) {
    return [this, who](const decode::StepStats& s) {
      absl::MutexLock lock(&mu_);
      if (phase_ < 0 || cost_ == nullptr || who != measured_worker_) return;
      measured_[phase_] += s.seconds;
      fitted_[phase_] +=
          cost_->Seconds({s.tokens_fed, s.logit_rows, s.attended_positions});
      ++steps_[phase_];
    };
  }

  struct Result {
    double ratio = 0;  // beside over alone, each against the fitted times
    int steps_alone = 0, steps_beside = 0;
  };

  // `rounds` × (`phase` alone, `phase` beside every neighbour's unit run
  // back to back on a thread of its own); `phase` runs on worker `who`,
  // whose steps `cost` fits.
  absl::StatusOr<Result> Measure(int who, const planner::StepCost& cost,
                                 const Work& phase,
                                 const std::vector<Work>& neighbours,
                                 int rounds = 6) {
    {
      absl::MutexLock lock(&mu_);
      cost_ = &cost;
      measured_worker_ = who;
      phase_ = -1;
      measured_[0] = measured_[1] = fitted_[0] = fitted_[1] = 0;
      steps_[0] = steps_[1] = 0;
    }
    std::atomic<bool> busy{false}, stop{false};
    std::atomic<int> running{0}, failed{0};
    std::vector<absl::Status> failures(neighbours.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < neighbours.size(); ++i) {
      threads.emplace_back([&, i] {
        while (!stop.load()) {
          if (!busy.load()) {
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
            continue;
          }
          ++running;
          absl::Status s = neighbours[i]();
          --running;
          if (!s.ok()) {
            failures[i] = std::move(s);  // read after the join
            ++failed;
            return;
          }
        }
      });
    }
    absl::Status status;
    const int n = static_cast<int>(neighbours.size());
    for (int round = 0; round < rounds && status.ok(); ++round) {
      for (int kind : {0, 1}) {
        busy = kind == 1;
        // Alone: the neighbours' last units have ended; beside: every one
        // has started its first.
        const auto deadline =
            std::chrono::steady_clock::now() + std::chrono::seconds(60);
        while ((kind == 0 ? running.load() > 0 : running.load() < n) &&
               failed.load() == 0 &&
               std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        if (failed.load() > 0) break;
        if (std::chrono::steady_clock::now() >= deadline) {
          status = absl::DeadlineExceededError(
              "side-by-side calibration: a neighbour did not start or stop "
              "within 60 s");
          break;
        }
        {
          absl::MutexLock lock(&mu_);
          phase_ = kind;
        }
        status = phase();
        {
          absl::MutexLock lock(&mu_);
          phase_ = -1;
        }
        if (!status.ok()) break;
      }
      if (failed.load() > 0) break;
    }
    busy = false;
    stop = true;
    for (std::thread& t : threads) t.join();
    for (absl::Status& f : failures) {
      if (!f.ok()) return f;
    }
    if (!status.ok()) return status;
    absl::MutexLock lock(&mu_);
    cost_ = nullptr;
    if (!(fitted_[0] > 0) || !(fitted_[1] > 0) || !(measured_[0] > 0)) {
      return absl::InternalError(
          "side-by-side calibration: the measured worker reported no steps");
    }
    return Result{(measured_[1] / fitted_[1]) / (measured_[0] / fitted_[0]),
                  steps_[0], steps_[1]};
  }

 private:
  absl::Mutex mu_;
  const planner::StepCost* cost_ ABSL_GUARDED_BY(mu_) = nullptr;
  int phase_ ABSL_GUARDED_BY(mu_) = -1;  // 0 alone, 1 beside; -1 neither
  int measured_worker_ ABSL_GUARDED_BY(mu_) = -1;
  double measured_[2] ABSL_GUARDED_BY(mu_) = {0, 0};
  double fitted_[2] ABSL_GUARDED_BY(mu_) = {0, 0};
  int steps_[2] ABSL_GUARDED_BY(mu_) = {0, 0};
};

// The workers and the work the side-by-side calibrations run: one-thread
// workers (the measured one and two neighbours) and, where the machine has a
// TP degree to measure, a TP worker of one thread per rank. Lengths fit the
// model's context (a short-context model gets shorter prompts, not the
// worker's context error).
class CalibrationBench {
 public:
  static absl::StatusOr<std::unique_ptr<CalibrationBench>> Create(
      const PlannerProfileOptions& o, const model::WeightSource& weights,
      int gang_tp) {
    auto bench = std::unique_ptr<CalibrationBench>(new CalibrationBench());
    const model::ModelConfig& mc = weights.config();
    bench->vocab_ = mc.vocab_size;
    const int context =
        std::max(16, std::min(mc.max_position_embeddings, o.max_prompt));
    bench->prefill_tokens_ = std::min(256, context);
    bench->decode_prompt_ = std::max(1, std::min(32, context / 4));
    bench->decode_tokens_ =
        std::max(4, std::min(64, context - bench->decode_prompt_ - 1));
    // Observer ids: the one-thread worker kOneThread, the TP worker kGang.
    auto make = [&](int tp, std::optional<int> measured)
        -> absl::StatusOr<std::unique_ptr<decode::DecodeWorker>> {
      decode::DecodeWorkerOptions wo;
      wo.tp_size = tp;
      wo.threads_per_rank = 1;
      wo.max_running = 8;
      wo.max_step_tokens = std::max(512, bench->prefill_tokens_);
      wo.num_blocks = 8 * (context / wo.block_size + 2);
      if (measured) wo.step_observer = bench->recorder_.Observer(*measured);
      return decode::DecodeWorker::Create(weights, nullptr, wo);
    };
    auto one = make(1, kOneThread);
    if (!one.ok()) return one.status();
    bench->one_thread_ = *std::move(one);
    for (int i = 0; i < 2; ++i) {
      auto neighbour = make(1, std::nullopt);
      if (!neighbour.ok()) return neighbour.status();
      bench->neighbours_.push_back(*std::move(neighbour));
    }
    if (gang_tp > 1) {
      auto gang = make(gang_tp, kGang);
      if (!gang.ok()) return gang.status();
      bench->gang_ = *std::move(gang);
    }
    // First touches of weights and KV pages are not what a serving worker
    // sees.
    for (decode::DecodeWorker* w :
         {bench->one_thread_.get(), bench->neighbours_[0].get(),
          bench->neighbours_[1].get(), bench->gang_.get()}) {
      if (w == nullptr) continue;
      if (auto s = bench->Decode(*w, 8)(); !s.ok()) return s;
      if (auto s = bench->Prefill(*w, 1)(); !s.ok()) return s;
    }
    return bench;
  }

  // A batch of 4 short prompts decoded `tokens` tokens each.
  Work Decode(decode::DecodeWorker& worker, int tokens) {
    return [this, &worker, tokens, rng = std::mt19937_64(next_seed_++),
            id = uint64_t{1}]() mutable {
      std::vector<std::vector<int32_t>> prompts;
      for (int i = 0; i < 4; ++i) {
        prompts.push_back(RandomPrompt(decode_prompt_, vocab_, rng));
      }
      return RunBatch(worker, &id, prompts, tokens);
    };
  }
  // `count` prompts prefilled one at a time (one step each).
  Work Prefill(decode::DecodeWorker& worker, int count) {
    return [this, &worker, count, rng = std::mt19937_64(next_seed_++),
            id = uint64_t{1}]() mutable {
      for (int i = 0; i < count; ++i) {
        absl::Status s = RunBatch(
            worker, &id, {RandomPrompt(prefill_tokens_, vocab_, rng)}, 1);
        if (!s.ok()) return s;
      }
      return absl::OkStatus();
    };
  }
  // The measured one-thread worker's phases and the neighbours' units.
  Work DecodePhase() { return Decode(*one_thread_, decode_tokens_); }
  Work PrefillPhase() { return Prefill(*one_thread_, 4); }
  Work GangPhase() { return Decode(*gang_, decode_tokens_); }
  Work DecodeUnit(int neighbour) {
    return Decode(*neighbours_[neighbour], std::max(4, decode_tokens_ / 4));
  }
  Work PrefillUnit(int neighbour) {
    return Prefill(*neighbours_[neighbour], 1);
  }
  SideBySide& recorder() { return recorder_; }
  static constexpr int kOneThread = 0, kGang = 1;  // SideBySide worker ids

 private:
  CalibrationBench() = default;

  SideBySide recorder_;  // outlives the workers that call its observer
  std::unique_ptr<decode::DecodeWorker> one_thread_, gang_;
  std::vector<std::unique_ptr<decode::DecodeWorker>> neighbours_;
  int vocab_ = 0;
  int prefill_tokens_ = 256, decode_prompt_ = 32, decode_tokens_ = 64;
  uint64_t next_seed_ = 13;
};

// How much longer a one-thread step runs while another one-thread worker
// computes beside it (two threads on two or more cores: nothing is
// time-sliced, what is left is the shared memory bus and last-level cache),
// for each pair of kinds: PerfModel::co_running. Measured per pair because
// decode steps stream the weights from memory and prefill steps mostly
// compute, so on a machine whose memory bus the two share unevenly the pairs
// differ (on the dev VM all four measure within noise of nothing).
absl::StatusOr<planner::PerfModel::CoRunning> CalibrateCoRunning(
    const PlannerProfileOptions& o, const planner::PerfModel& model,
    CalibrationBench& bench) {
  auto cost = model.Step({1, 1});
  if (!cost.ok()) return cost.status();
  struct Pair {
    const char* name;
    Work phase;
    Work unit;
    double* slowdown;
  };
  planner::PerfModel::CoRunning co;
  double decode_beside_decode = 0, prefill_beside_prefill = 0;
  const Pair pairs[] = {
      {"decode beside a prefill", bench.DecodePhase(), bench.PrefillUnit(0),
       &co.decode_step},
      {"decode beside a decode", bench.DecodePhase(), bench.DecodeUnit(0),
       &decode_beside_decode},
      {"prefill beside a decode", bench.PrefillPhase(), bench.DecodeUnit(0),
       &co.prefill_stage},
      {"prefill beside a prefill", bench.PrefillPhase(), bench.PrefillUnit(0),
       &prefill_beside_prefill},
  };
  for (const Pair& p : pairs) {
    auto r = bench.recorder().Measure(CalibrationBench::kOneThread, **cost,
                                      p.phase, {p.unit});
    if (!r.ok()) return r.status();
    *p.slowdown = std::clamp(r->ratio - 1, 0.0, 3.0);
    Say(o, absl::StrFormat("  %s: %.2fx alone's step time (%d and %d steps)",
                           p.name, r->ratio, r->steps_beside, r->steps_alone));
  }
  co.decode_beside_decode = decode_beside_decode;
  co.prefill_beside_prefill = prefill_beside_prefill;
  return co;
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

// The gang-sharing exponent of this machine at two shares
// (PerfModel::gang_sharing_points): the TP worker decodes alone and beside
// one, then two, one-thread workers prefilling back to back (SideBySide).
// Beside over alone is r; the simulator runs the gang at share / max(
// share^-(N−1)·e, 1 + co-running) of full speed, so e = ln(r · share) /
// (−(N − 1) · ln share), 0 where the co-running slow-down explains r, at
// most 2. Two points because one does not carry over: where the TP ranks
// block at their all-reduces, the scheduler favours them as they wake, and
// how much that wins back depends on how many busy threads they wake
// beside.
absl::StatusOr<std::vector<planner::PerfModel::GangPoint>> CalibrateGangSharing(
    const PlannerProfileOptions& o, const planner::PerfModel& model,
    CalibrationBench& bench, int tp) {
  auto cost = model.Step({tp, 1});
  if (!cost.ok()) return cost.status();
  std::vector<planner::PerfModel::GangPoint> points;
  for (int neighbours : {1, 2}) {
    std::vector<Work> units;
    for (int i = 0; i < neighbours; ++i) units.push_back(bench.PrefillUnit(i));
    auto r = bench.recorder().Measure(CalibrationBench::kGang, **cost,
                                      bench.GangPhase(), units);
    if (!r.ok()) return r.status();
    const double demand =
        model.BusyCores({tp, 1}) + neighbours * model.BusyCores({1, 1});
    const double share = std::min(1.0, o.cores / demand);
    double exponent = 0;
    if (share < 1 && r->ratio * share > 1 + model.co_running.decode_step) {
      exponent = std::clamp(
          std::log(r->ratio * share) / (-(tp - 1) * std::log(share)), 0.0, 2.0);
    }
    Say(o, absl::StrFormat("  tp %d beside %d prefilling: %.2fx alone's step "
                           "time (%d and %d steps); processor sharing gives "
                           "%.2fx, co-running %.2fx: exponent %.2f at share "
                           "%.2f",
                           tp, neighbours, r->ratio, r->steps_beside,
                           r->steps_alone, 1 / share,
                           (1 + model.co_running.decode_step) / share, exponent,
                           share));
    if (share < 1 && (points.empty() || share < points.back().share)) {
      points.push_back({share, exponent});
    }
  }
  return points;
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
  std::vector<planner::ComputeConfig> configs;
  for (int tp = 1; tp <= options.cores; tp *= 2) {
    if (mc.num_heads % tp != 0) continue;
    for (int threads = 1; tp * threads <= options.cores; ++threads) {
      configs.push_back({tp, threads});
    }
  }
  // The step mix runs in kStepRounds rounds spread over the profile (first,
  // after the colocated calibrations, and last), each round every
  // configuration, and the fit takes all of them: this VM's speed moves by
  // ±30% within tens of seconds, and one round's few seconds per
  // configuration is a snapshot of it. Run 22's short-prompt profile
  // measured the tp 2 decode step at 9.4 ms where runs 20 and 21 measured
  // 13.3 and 11.8, and predicted run 22's TPOT p99s 16-27% low; run 21's
  // profile predicts the same measurements within 20% on 43 of 48 figures,
  // against 36. (Runs 23-24, with rounds, counted 46 and 36: the runs'
  // spread, not the rounds, sets the count; docs/PERFORMANCE.md.)
  constexpr int kStepRounds = 3;
  std::map<planner::ComputeConfig, StepRecord> records;
  int rounds_done = 0;
  auto step_round = [&]() -> absl::Status {
    ++rounds_done;
    std::string line = absl::StrFormat("step round %d of %d: decode b1",
                                       rounds_done, kStepRounds);
    for (const planner::ComputeConfig& config : configs) {
      StepRecord& record = records[config];
      if (auto s =
              ProfileRound(options, **weights, config, rounds_done, &record);
          !s.ok()) {
        return absl::Status(
            s.code(),
            absl::StrCat("profiling tp ", config.tp, " × ",
                         config.threads_per_rank, " threads: ", s.message()));
      }
      PDS_RETURN_IF_ERROR(FitRecord(config, record, &model));
      absl::StrAppend(&line,
                      absl::StrFormat(" %.2f ms (tp %d × %d)",
                                      record.decode_b1_seconds.back() * 1e3,
                                      config.tp, config.threads_per_rank));
    }
    Say(options, line);
    return absl::OkStatus();
  };
  PDS_RETURN_IF_ERROR(step_round());
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
    auto c = Calibrate(options, **weights, model, colocated, std::nullopt);
    if (!c.ok()) return c.status();
    model.calibrated[config] = {c->step_overhead, c->ttft};
    delivery_cpu += c->delivery_cpu / model.steps.size();
    Say(options,
        absl::StrFormat("  TTFT extra %.1f ms %+.3f ms/token; decode step "
                        "overhead %+.2f ms; router + client CPU %.3f ms/token; "
                        "steps meanwhile at %.2fx the fit's time",
                        c->ttft.base * 1e3, c->ttft.per_prompt_token * 1e3,
                        c->step_overhead * 1e3, c->delivery_cpu * 1e3,
                        c->slowness));
  }
  // Configurations not calibrated (none today) fall back on tp 1 × 1.
  const planner::PerfModel::Calibration& base =
      model.calibrated.begin()->second;
  model.colocated_ttft = base.colocated_ttft;
  model.decode_step_overhead_seconds = base.step_overhead_seconds;
  model.delivery_cpu_seconds = delivery_cpu;
  PDS_RETURN_IF_ERROR(step_round());
  if (options.cores >= 2) {
    planner::Layout disaggregated;
    Say(options, "calibrating request costs on " + disaggregated.Name());
    auto d = Calibrate(options, **weights, model, disaggregated,
                       model.StepOverhead({1, 1}));
    if (!d.ok()) return d.status();
    model.disaggregated_ttft = d->ttft;
    model.handoff_seconds = d->handoff;
    Say(options,
        absl::StrFormat("  disaggregated TTFT extra %.1f ms %+.3f ms/token; "
                        "hand-off %.2f ms; steps meanwhile at %.2fx the "
                        "fit's time",
                        model.disaggregated_ttft.base * 1e3,
                        model.disaggregated_ttft.per_prompt_token * 1e3,
                        model.handoff_seconds * 1e3, d->slowness));
  } else {
    model.disaggregated_ttft = model.colocated_ttft;
  }
  // Side by side in this process: co-running needs two cores, a gang more
  // threads than cores beside a one-thread worker.
  const int gang_tp = GangCalibrationTp(model, options.cores);
  if (options.cores >= 2 || gang_tp > 0) {
    auto bench = CalibrationBench::Create(options, **weights, gang_tp);
    if (!bench.ok()) return bench.status();
    if (options.cores >= 2) {
      Say(options,
          "calibrating co-running: a one-thread worker's steps alone and "
          "beside another's, alternately");
      auto co_running = CalibrateCoRunning(options, model, **bench);
      if (!co_running.ok()) return co_running.status();
      model.co_running = *co_running;
      Say(options,
          absl::StrFormat(
              "  co-running slow-down: prefill stage %+.0f%%, decode step "
              "%+.0f%%, decode beside decode %+.0f%%, prefill beside "
              "prefill %+.0f%%",
              model.co_running.prefill_stage * 100,
              model.co_running.decode_step * 100,
              model.co_running.DecodeBesideDecode() * 100,
              model.co_running.PrefillBesidePrefill() * 100));
    }
    if (gang_tp > 0) {
      Say(options, absl::StrCat("calibrating gang sharing: tp ", gang_tp,
                                " × 1 thread decoding alone and beside "
                                "prefilling workers, alternately"));
      auto points = CalibrateGangSharing(options, model, **bench, gang_tp);
      if (!points.ok()) return points.status();
      model.gang_sharing_points = *points;
      // The first point's exponent, for readers of the scalar (older
      // routers' profiles).
      if (!points->empty()) {
        model.gang_sharing_exponent = points->front().exponent;
      }
      std::string line = "  gang-sharing exponents:";
      for (const planner::PerfModel::GangPoint& p : *points) {
        absl::StrAppend(&line, absl::StrFormat(" %.2f at share %.2f;",
                                               p.exponent, p.share));
      }
      Say(options, line);
    }
  }
  if (gang_tp == 0) {
    Say(options,
        absl::StrFormat("no TP worker oversubscribes %d cores beside a "
                        "prefill stage: gang-sharing exponent %.2f as given",
                        options.cores, model.gang_sharing_exponent));
  }
  PDS_RETURN_IF_ERROR(step_round());
  static_assert(kStepRounds == 3, "step_round() is called three times above");
  for (const planner::ComputeConfig& config : configs) {
    const StepRecord& record = records[config];
    const planner::StepCost& cost = model.steps.at(config);
    const auto error = cost.Error(record.samples);
    std::string rounds;
    for (double b1 : record.decode_b1_seconds) {
      absl::StrAppend(&rounds, rounds.empty() ? "" : " / ",
                      absl::StrFormat("%.2f", b1 * 1e3));
    }
    Say(options,
        absl::StrFormat(
            "  tp %d × %d threads: %zu steps in %d rounds, fit error median "
            "%.1f%%, max %.1f%%; decode b1 %.2f ms (rounds: %s), prefill 256 "
            "%.0f ms; %.2f cores busy",
            config.tp, config.threads_per_rank, record.samples.size(),
            rounds_done, error.median * 100, error.max * 100,
            cost.Seconds({1, 1, 64}) * 1e3, rounds,
            cost.Seconds({256, 1, planner::AttendedPositions(0, 256)}) * 1e3,
            model.busy_cores.at(config)));
  }
  return model;
}

}  // namespace pdserve::tools
