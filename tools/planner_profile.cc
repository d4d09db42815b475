#include "tools/planner_profile.h"

#include <grpcpp/grpcpp.h>
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
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

// The first `count` CPUs this process may run on.
std::vector<int> AllowedCpus(int count) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE && static_cast<int>(cpus.size()) < count;
       ++cpu) {
    if (CPU_ISSET(cpu, &allowed)) cpus.push_back(cpu);
  }
  return cpus;
}

// Pins the calling thread to one CPU, and with it the threads it starts
// meanwhile (a new thread inherits its creator's mask); the mask it had is
// back when this goes.
class PinnedToCpu {
 public:
  static absl::StatusOr<std::unique_ptr<PinnedToCpu>> Pin(int cpu) {
    auto pin = std::unique_ptr<PinnedToCpu>(new PinnedToCpu());
    if (int e = pthread_getaffinity_np(pthread_self(), sizeof(pin->saved_),
                                       &pin->saved_);
        e != 0) {
      return absl::InternalError(
          absl::StrCat("cannot read this thread's CPU mask: ", strerror(e)));
    }
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    if (int e = pthread_setaffinity_np(pthread_self(), sizeof(one), &one);
        e != 0) {
      return absl::InternalError(absl::StrCat(
          "cannot pin the profiling thread to CPU ", cpu, ": ", strerror(e)));
    }
    return pin;
  }
  ~PinnedToCpu() {
    pthread_setaffinity_np(pthread_self(), sizeof(saved_), &saved_);
  }
  PinnedToCpu(const PinnedToCpu&) = delete;
  PinnedToCpu& operator=(const PinnedToCpu&) = delete;

 private:
  PinnedToCpu() = default;
  cpu_set_t saved_;
};

// One pass of `config`'s step mix on a fresh in-process worker, appended to
// `samples`, its CPU and wall time added to `record`.
absl::Status ProfileMix(const PlannerProfileOptions& o,
                        const model::WeightSource& weights,
                        planner::ComputeConfig config, uint64_t seed,
                        std::vector<planner::StepSample>* samples_out,
                        StepRecord* record) {
  const model::ModelConfig& mc = weights.config();
  std::vector<planner::StepSample>& samples = *samples_out;
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
  std::mt19937_64 rng(seed);
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
  return absl::OkStatus();
}

// One round of `config`'s step mix, appended to `record`. A one-thread
// configuration runs the mix once on each of `cpus` in turn, pinned there:
// on this project's 2-vCPU VM the two cores' speeds differ by up to 1.36x
// and trade places over minutes (the same one-thread engine's decode step
// took 14.9 ms pinned to one and 18.1-19.4 ms pinned to the other, minutes
// apart; bench/huge_page_bench --threads 1), so a lone profiling thread
// measured whichever core the scheduler gave it, while two one-thread
// workers serving side by side (colocated 2D(tp1×1t), a one-thread stage
// beside a one-thread decode worker) run on both: run 32's 2D(tp1×1t) steps
// ran 1.11-1.33x the fit (median round 1.17x) where the one-worker layouts
// beside it in the same rounds ran ~1.0-1.1x. The fit over every core is
// the machine's average core. A configuration of more threads spans the
// cores already (and its threads wait for the slowest at each layer).
// `core_b1_ms` gets each core's batch-1 decode step, in `cpus` order.
absl::Status ProfileRound(const PlannerProfileOptions& o,
                          const model::WeightSource& weights,
                          planner::ComputeConfig config, int round,
                          const std::vector<int>& cpus, StepRecord* record,
                          std::vector<double>* core_b1_ms) {
  std::vector<planner::StepSample> samples;
  if (config.threads() == 1 && cpus.size() >= 2) {
    for (size_t i = 0; i < cpus.size(); ++i) {
      auto pin = PinnedToCpu::Pin(cpus[i]);
      if (!pin.ok()) return pin.status();
      std::vector<planner::StepSample> on_core;
      PDS_RETURN_IF_ERROR(ProfileMix(o, weights, config, 11 + round + 100 * i,
                                     &on_core, record));
      auto core_cost = planner::StepCost::Fit(on_core);
      if (!core_cost.ok()) return core_cost.status();
      core_b1_ms->push_back(core_cost->Seconds({1, 1, 64}) * 1e3);
      samples.insert(samples.end(), on_core.begin(), on_core.end());
    }
  } else {
    PDS_RETURN_IF_ERROR(
        ProfileMix(o, weights, config, 11 + round, &samples, record));
  }
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
  // The cluster's decode steps and prompt steps over the fit during the
  // requests (medians).
  double slowness = 1;
  double prompt_slowness = 1;
  double stream_rate = 0;  // the requests' arrival rate, requests/s
  int requests = 0;        // requests sent
  int unqueued = 0;        // of them, those the TTFT offsets were fitted on
  // Requests whose prompt steps the decode worker traced (their own
  // deviations taken off their residuals); with none, the residuals' scale
  // kept in ttft.scatter, [0, 1] (1: the prompt steps' spread explains none
  // of them).
  int scatter_traced = 0;
  // Of their traced prompt steps, those that started on a worker idle for
  // kColdIdleSeconds or more, whose time stays in the residuals.
  int scatter_cold_steps = 0;
  double scatter_shrink = 0;
  // The steps' median time over the fit before the speed range's clamp
  // (0: none traced), and whether the decode step overhead came out at its
  // floor (the requests' TPOT far below what their traced steps say).
  double raw_slowness = 0;
  double raw_prompt_slowness = 0;
  bool overhead_at_floor = false;
  int attempt = 1;  // of the calibration's measurements, the one kept
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
  planner::LinearCost line;
  line.base = my - slope * mx;
  line.per_prompt_token = slope;
  return line;
}

// A real cluster of `layout` on the profiled model.
absl::StatusOr<std::unique_ptr<LocalCluster>> StartCluster(
    const PlannerProfileOptions& o, const planner::Layout& layout,
    const std::string& step_trace_prefix = "") {
  LocalClusterOptions lo;
  lo.step_trace_prefix = step_trace_prefix;
  lo.model_path = o.model_path;
  lo.format = o.format;
  lo.bin_dir = o.bin_dir;
  lo.refresh_ms = 100;
  ApplyLayout(layout, &lo);
  return LocalCluster::Start(lo);
}

// A step that starts after its worker sat idle this long runs cold: in the
// traced steps of run 31's measured clusters (bench/planner_runs), a
// colocated decode worker's steps after 0.5-1 s idle took a median 6-16 ms
// more than busy steps of the same shape, after 1-2 s 14-20 ms more; after
// 0.05-0.2 s, 2-4 ms.
constexpr double kColdIdleSeconds = 0.2;

// Seconds each traced step's worker sat idle before it: from the previous
// step's end to this one's start (end − seconds); the first step, which
// follows the warm-up, an hour.
std::vector<double> IdleBefore(const std::vector<planner::StepSample>& steps,
                               const std::vector<double>& ends) {
  std::vector<double> idle(steps.size(), 3600);
  for (size_t j = 1; j < steps.size() && j < ends.size(); ++j) {
    idle[j] = std::max(0.0, ends[j] - steps[j].seconds - ends[j - 1]);
  }
  return idle;
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
  // The decode worker traces its steps: their time over the fit during the
  // requests is the speed the simulation replays them at.
  char trace_dir[] = "/tmp/pdserve-calibration.XXXXXX";
  if (mkdtemp(trace_dir) == nullptr) {
    return absl::UnavailableError("cannot create a folder in /tmp");
  }
  const std::string trace_path = absl::StrCat(trace_dir, "/decode-0.csv");
  // A disaggregated layout's prefill stage traces its microbatches too: the
  // TTFT offsets are what is left beside the stage's own speed. (A stage of
  // a deeper pipeline computes a share of the layers, which its trace does
  // not say; calibrations run one stage.)
  const bool stage_traced = !layout.colocated && layout.stages == 1;
  const std::string stage_trace_path =
      absl::StrCat(trace_dir, "/prefill-0-stage-0.csv");
  struct RemoveTrace {
    std::string dir;
    std::vector<std::string> files;
    ~RemoveTrace() {
      for (const std::string& file : files) std::remove(file.c_str());
      rmdir(dir.c_str());
    }
  } remove_trace{trace_dir, {trace_path, stage_trace_path}};
  auto cluster = StartCluster(o, layout, absl::StrCat(trace_dir, "/"));
  if (!cluster.ok()) return cluster.status();
  auto stub = v1::Generation::NewStub(grpc::CreateChannel(
      (*cluster)->grpc_address(), grpc::InsecureChannelCredentials()));
  std::mt19937_64 rng(5);
  const int vocab = weights.config().vocab_size;
  // As many tokens as a typical answer, so per-request costs (channel,
  // stream set-up) weigh on the per-token CPU as they do in serving.
  constexpr int kTokens = 24;
  // 24 requests (12-19 unqueued) left the TTFT line's level 20-30 ms apart
  // between two profiles of the same machine (runs 27 and 28,
  // bench/planner_runs): twice as many average the VM's speed over twice the
  // time and give the scatter's quantiles twice the requests.
  constexpr int kRequests = 48;
  RunRequest(*stub, RandomPrompt(32, vocab, rng), 2);  // warm the path

  // What the steps alone predict (no per-request costs yet).
  planner::PerfModel bare = model;
  bare.colocated_ttft = bare.disaggregated_ttft = {};
  bare.decode_step_overhead_seconds = bare.handoff_seconds = 0;
  bare.calibrated.clear();
  // Requests against the fitted step times: the offsets calibrate the
  // typical step (the spread's median is ~1), and the spread's draws would
  // only add noise to them.
  planner::SimOptions fitted_steps;
  fitted_steps.step_spread = false;
  fitted_steps.per_request = true;

  // The requests arrive open loop at the workload's rate, as a measured
  // run's do, with prompts of 16..long_prompt tokens (a line's worth of
  // lengths): what a request pays outside the steps depends on the state
  // it finds the path's threads in. Sent one at a time right after the
  // speed probe's computation, the offsets came out 5-17 ms (median) below
  // what requests of measured runs paid; each sent after an idle pause of
  // 0.25-1 s, 10-20 ms above (planner_bench --requests-csv,
  // docs/PERFORMANCE.md). The rate is capped where the simulation puts the
  // calibrated layout at half busy, so that queueing the model might get
  // wrong stays small beside the offsets.
  const int long_prompt = std::max(32, std::min(384, o.max_prompt * 3 / 4));
  planner::WorkloadSpec stream{
      kRequests, o.rate, {16, long_prompt}, {kTokens, kTokens}, 5};
  {
    auto at_rate = planner::Simulate(bare, layout, planner::SimRequests(stream),
                                     {}, fitted_steps);
    if (!at_rate.ok()) return at_rate.status();
    const double busy =
        std::max(at_rate->decode_utilisation, at_rate->prefill_utilisation);
    if (busy > 0.5) stream.rate *= 0.5 / busy;
  }
  const std::vector<planner::Arrival> arrivals =
      planner::MakeArrivals(stream, vocab);
  const std::vector<planner::SimRequest> requests =
      planner::SimRequests(arrivals);
  // Router + this client's CPU over the requests: what streaming costs
  // outside the workers.
  const pid_t router_pid = (*cluster)->pids().front();
  auto traced_before = ReadStepTrace(trace_path);
  if (!traced_before.ok()) return traced_before.status();
  size_t stage_traced_before = 0;
  if (stage_traced) {
    auto steps = ReadStepTrace(stage_trace_path);
    if (!steps.ok()) return steps.status();
    stage_traced_before = steps->size();
  }
  const double cpu_before = ProcessCpuSeconds(router_pid) + OwnCpuSeconds();
  const LoadReport load = RunLoad(layout.Name(), (*cluster)->grpc_address(),
                                  arrivals, /*slo_ttft=*/1e9, /*slo_tpot=*/1e9);
  const double cpu_seconds =
      ProcessCpuSeconds(router_pid) + OwnCpuSeconds() - cpu_before;
  std::vector<double> traced_ends;
  auto traced = ReadStepTrace(trace_path, &traced_ends);
  if (!traced.ok()) return traced.status();
  traced->erase(traced->begin(), traced->begin() + traced_before->size());
  traced_ends.erase(traced_ends.begin(),
                    traced_ends.begin() + traced_before->size());
  // The steps that computed prompts during the requests, and their cost:
  // the decode worker's own where it prefills (colocated), else the stage's.
  const planner::ComputeConfig prompt_config =
      layout.colocated ? decode_config
                       : planner::ComputeConfig{1, layout.prefill_threads};
  auto prompt_cost = model.Step(prompt_config);
  if (!prompt_cost.ok()) return prompt_cost.status();
  std::vector<planner::StepSample> prompt_steps;
  std::vector<double> prompt_step_ends;
  // Seconds the worker sat idle before each prompt step.
  std::vector<double> prompt_step_idle;
  if (stage_traced) {
    auto steps = ReadStepTrace(stage_trace_path, &prompt_step_ends);
    if (!steps.ok()) return steps.status();
    prompt_steps.assign(steps->begin() + stage_traced_before, steps->end());
    prompt_step_ends.erase(prompt_step_ends.begin(),
                           prompt_step_ends.begin() + stage_traced_before);
    prompt_step_idle = IdleBefore(prompt_steps, prompt_step_ends);
  } else if (layout.colocated) {
    const std::vector<double> idle = IdleBefore(*traced, traced_ends);
    for (size_t j = 0; j < traced->size(); ++j) {
      if (!CarriesPrompt((*traced)[j].shape)) continue;
      prompt_steps.push_back((*traced)[j]);
      prompt_step_ends.push_back(traced_ends[j]);
      prompt_step_idle.push_back(idle[j]);
    }
  }
  int delivered = 0;
  for (const RequestResult& r : load.requests) {
    if (!r.ok || r.tokens != kTokens) {
      return absl::InternalError(absl::StrCat(
          "calibration request on ", layout.Name(), " failed: ", r.error));
    }
    delivered += r.tokens;
  }
  Calibration c;
  c.delivery_cpu = std::max(0.0, cpu_seconds / delivered);
  c.stream_rate = stream.rate;
  c.requests = kRequests;
  bare.delivery_cpu_seconds = c.delivery_cpu;  // it competes here too
  // The stream against the fitted steps slowed to the speed its own steps
  // ran at: what is left over is the time outside the steps, whatever this
  // VM's speed was during these seconds. Decode steps and prompt steps each
  // at their own (the TPOT and hand-off against the first, the TTFT
  // against the second): one factor for both, the decode steps' 0.84-0.88x
  // against prompt steps nearer 1x, left 30-40 ms of prefill time in the TTFT
  // offsets. A disaggregated layout's prompt steps are its prefill stage's:
  // untraced, its steps were taken at the fit, and one calibration read in
  // a slow spell of the VM put 154 ms in the TTFT offset where 19 others
  // read 13-81 (run 29, bench/planner_runs). (An in-process speed probe
  // before and after the requests read 1.14-1.16x while the steps ran at
  // 0.95-1.10x.)
  const StepsOverFit over_fit = OverFit(*traced, **cost);
  const double prompt_over_fit = OverFit(prompt_steps, **prompt_cost).prompt;
  if (!(over_fit.decode > 0)) {
    return absl::InternalError(
        absl::StrCat("calibration on ", layout.Name(),
                     ": the decode worker traced no decode step"));
  }
  // Within the speeds this VM has been seen to move between (0.7-1.4x of
  // the fit, profile rounds and traced clusters alike): beyond, the ratio is
  // not the machine's speed but a cluster's steps costing more than the
  // in-process ones (stories260K's 0.06 ms steps ran 1.5-2.8x the fit in a
  // cluster), which belongs in the offsets, where predictions keep it.
  auto speed_range = [](double ratio) {
    return std::clamp(ratio, 2.0 / 3, 1.5);
  };
  c.raw_slowness = over_fit.decode;
  c.raw_prompt_slowness = prompt_over_fit;
  c.slowness = speed_range(over_fit.decode);
  c.prompt_slowness = prompt_over_fit > 0 ? speed_range(prompt_over_fit) : 1.0;
  const planner::PerfModel slowed = SlowedBy(bare, c.slowness);
  if (!step_overhead.has_value()) {
    auto all = planner::Simulate(slowed, layout, requests, {}, fitted_steps);
    if (!all.ok()) return all.status();
    std::vector<double> extra;
    for (size_t i = 0; i < requests.size(); ++i) {
      extra.push_back(load.requests[i].tpot - all->request_tpot[i]);
    }
    // A step never takes less than half its profiled time, whatever the
    // noise in a handful of requests says.
    const double floor = -0.5 * (*cost)->Seconds({1, 1, 16});
    const double median = planner::Percentile(extra, 0.5);
    c.overhead_at_floor = median <= floor;
    step_overhead = std::max(median, floor);
  }
  c.step_overhead = *step_overhead;
  planner::PerfModel with_overhead = slowed;
  with_overhead.decode_step_overhead_seconds = *step_overhead;
  planner::PerfModel prompts_slowed = SlowedBy(bare, c.prompt_slowness);
  prompts_slowed.decode_step_overhead_seconds = *step_overhead;
  auto all =
      planner::Simulate(with_overhead, layout, requests, {}, fitted_steps);
  auto all_prompts =
      planner::Simulate(prompts_slowed, layout, requests, {}, fitted_steps);
  if (!all.ok()) return all.status();
  if (!all_prompts.ok()) return all_prompts.status();
  // The TTFT offsets from the requests the simulation has finding no queue
  // (their simulated TTFT within 2 ms of the same request alone): where it
  // has one, an error in the simulated wait would pass for a per-request
  // cost — a first version fitted over every request read -85 ms
  // +1.37 ms/token on the disaggregated layout, its prefill stage's queue at
  // the long prompts. At least kFewest requests, the least queued.
  constexpr int kFewest = 8;
  std::vector<std::pair<double, size_t>> by_wait;
  std::vector<double> alone_ttft(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    auto alone = planner::Simulate(prompts_slowed, layout,
                                   {{0, requests[i].prompt_tokens, kTokens}},
                                   {}, fitted_steps);
    if (!alone.ok()) return alone.status();
    alone_ttft[i] = alone->ttft_p50;
    by_wait.push_back({all_prompts->request_ttft[i] - alone->ttft_p50, i});
  }
  std::sort(by_wait.begin(), by_wait.end());
  std::vector<double> prompts, ttft_extra, gap_extra, prompt_seconds;
  std::vector<size_t> unqueued;  // their indices
  for (size_t k = 0; k < by_wait.size(); ++k) {
    const auto [wait, i] = by_wait[k];
    if (wait > 0.002 && static_cast<int>(k) >= kFewest) break;
    const RequestResult& r = load.requests[i];
    prompt_seconds.push_back(alone_ttft[i]);
    unqueued.push_back(i);
    prompts.push_back(requests[i].prompt_tokens);
    ttft_extra.push_back(r.ttft - all_prompts->request_ttft[i]);
    // Every token carries the same delivery offset, so the first gap is
    // the simulated one plus the hand-off.
    gap_extra.push_back(r.first_gap - all->request_first_gap[i]);
  }
  c.unqueued = static_cast<int>(prompts.size());
  c.ttft = FitLine(prompts, ttft_extra);
  // The requests' scatter around the line, less the prompt steps' own
  // spread, which the simulator draws per step itself. Where the decode
  // worker traced a request's prompt steps (colocated: those that started
  // after it was sent and ended by its first token), their measured time
  // over the fit at the stream's prompt speed comes off its residual: what
  // is left is what the request paid outside the steps (a disaggregated
  // layout's stage traces its microbatches likewise). Where none were
  // traced (a pipeline of several stages), the residuals shrink
  // towards the line's 0 by the share of their variance the spread
  // explains, Var(t · x) over the requests for prompt steps of t seconds
  // (an upper bound where a prompt runs in several steps, each drawn on its
  // own). The first calibrations, by variance alone, kept 90-96% of the
  // residuals in one profile and none in the next. A prompt step that
  // started on a worker idle for kColdIdleSeconds or more keeps its time in
  // the residual: such a step runs longer than the same step on a busy
  // worker (the idle cores' wake-up, page translations the host dropped;
  // bench/huge_page_bench), which the profile's back-to-back steps and
  // their spread do not show, so the simulator draws it with the scatter.
  std::vector<double> residuals;
  double residual_variance = 0, step_variance = 0;
  const std::vector<double>& spread = (*prompt_cost)->spread();
  double spread_mean = 0, spread_variance = 0;
  for (double x : spread) spread_mean += x / spread.size();
  for (double x : spread) {
    spread_variance += (x - spread_mean) * (x - spread_mean) / spread.size();
  }
  for (size_t k = 0; k < prompts.size(); ++k) {
    double residual = ttft_extra[k] - c.ttft.At(prompts[k]);
    const RequestResult& r = load.requests[unqueued[k]];
    const double sent =
        absl::ToDoubleSeconds(r.end - absl::UnixEpoch()) - r.e2e;
    double off_fit = 0;
    int steps_in_request = 0;
    for (size_t j = 0; j < prompt_steps.size(); ++j) {
      const planner::StepSample& step = prompt_steps[j];
      const double end = prompt_step_ends[j];
      if (!CarriesPrompt(step.shape) || end - step.seconds < sent ||
          end > sent + r.ttft) {
        continue;
      }
      ++steps_in_request;
      if (prompt_step_idle[j] >= kColdIdleSeconds) {
        ++c.scatter_cold_steps;
        continue;
      }
      off_fit += step.seconds -
                 (*prompt_cost)->Seconds(step.shape) * c.prompt_slowness;
    }
    if (steps_in_request > 0) {
      residual -= off_fit;
      ++c.scatter_traced;
    }
    residuals.push_back(residual);
    residual_variance += residual * residual / prompts.size();
    step_variance += prompt_seconds[k] * prompt_seconds[k] * spread_variance /
                     prompts.size();
  }
  if (c.scatter_traced > 0) {
    // Centred on the line again (the steps' deviations need not average 0).
    double mean = 0;
    for (double e : residuals) mean += e / residuals.size();
    for (double& e : residuals) e -= mean;
    c.scatter_shrink = 1;
  } else {
    c.scatter_shrink =
        residual_variance > 0
            ? std::sqrt(std::max(0.0, 1 - step_variance / residual_variance))
            : 0;
    for (double& e : residuals) e *= c.scatter_shrink;
  }
  std::sort(residuals.begin(), residuals.end());
  // As many quantiles as requests (each the midpoint of an equal share).
  c.ttft.scatter = std::move(residuals);
  c.handoff = std::max(0.0, planner::Percentile(gap_extra, 0.5));
  return c;
}

// How far a calibration's traced steps ran from the fit, as |log ratio|, the
// larger of decode and prompt steps: ratios within the speeds this VM moves
// between (Calibrate's speed range) count; beyond it a ratio is a small
// model's steps costing more in a cluster than in process (stories260K's
// 1.5-2.8x), which a second measurement would read again.
double SpeedExcursion(const Calibration& c) {
  double excursion = 0;
  for (double ratio : {c.raw_slowness, c.raw_prompt_slowness}) {
    if (ratio >= 2.0 / 3 && ratio <= 1.5) {
      excursion = std::max(excursion, std::abs(std::log(ratio)));
    }
  }
  return excursion;
}

// Calibrate, measured again (up to kAttempts in all) while the VM's speed
// moved during the requests: their traced steps more than 1.2x off the fit,
// or a decode step overhead at its floor. The speed correction takes a
// steady slowness off the offsets, not one that changed under the requests
// (run 30's short-prompt profile: tp 1 × 1's steps read 1.37x the fit, its
// requests' TPOT sat so far below that the overhead hit its floor, -7.3 ms
// where 30 earlier calibrations read -2.5 to +4.3, and every tp 1 × 1
// layout was predicted at a third of its measured TPOT). Keeps the steadiest
// measurement.
absl::StatusOr<Calibration> CalibrateSteadily(
    const PlannerProfileOptions& o, const model::WeightSource& weights,
    const planner::PerfModel& model, const planner::Layout& layout,
    std::optional<double> step_overhead) {
  constexpr int kAttempts = 3;
  const double kSteady = std::log(1.2);
  // An overhead at its floor is worse than any excursion.
  auto unsteadiness = [](const Calibration& c) {
    return std::make_pair(c.overhead_at_floor, SpeedExcursion(c));
  };
  std::optional<Calibration> kept;
  for (int attempt = 1; attempt <= kAttempts; ++attempt) {
    auto c = Calibrate(o, weights, model, layout, step_overhead);
    if (!c.ok()) return c.status();
    c->attempt = attempt;
    if (!kept.has_value() || unsteadiness(*c) < unsteadiness(*kept)) kept = *c;
    if (unsteadiness(*c) <= std::make_pair(false, kSteady)) break;
    if (attempt < kAttempts) {
      Say(o, absl::StrFormat("  steps ran at %.2fx the fit's time (prompts "
                             "%.2fx)%s: measuring again",
                             c->raw_slowness, c->raw_prompt_slowness,
                             c->overhead_at_floor
                                 ? ", decode step overhead at its floor"
                                 : ""));
    }
  }
  return *kept;
}

// "scatter q10 X, q50 Y, q90 Z ms (less N requests' traced prompt steps, M cold
// ones kept)", or
// "(S of the residuals)" where none were traced.
std::string ScatterSummary(const Calibration& c) {
  const planner::LinearCost& t = c.ttft;
  const std::string less =
      c.scatter_traced > 0
          ? absl::StrFormat(
                "less %d requests' traced prompt steps, %d cold "
                "ones kept",
                c.scatter_traced, c.scatter_cold_steps)
          : absl::StrFormat("%.0f%% of the residuals", c.scatter_shrink * 100);
  return absl::StrFormat("scatter q10 %+.1f, q50 %+.1f, q90 %+.1f ms (%s)",
                         t.ScatterAt(0.1) * 1e3, t.ScatterAt(0.5) * 1e3,
                         t.ScatterAt(0.9) * 1e3, less);
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
      // The neighbour of the gang-beside-gang calibration: as much a gang.
      auto other = make(gang_tp, std::nullopt);
      if (!other.ok()) return other.status();
      bench->other_gang_ = *std::move(other);
    }
    // First touches of weights and KV pages are not what a serving worker
    // sees.
    for (decode::DecodeWorker* w :
         {bench->one_thread_.get(), bench->neighbours_[0].get(),
          bench->neighbours_[1].get(), bench->gang_.get(),
          bench->other_gang_.get()}) {
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
  // The second TP worker's unit: decoding, as the gang's phase does.
  Work GangUnit() {
    return Decode(*other_gang_, std::max(4, decode_tokens_ / 4));
  }
  SideBySide& recorder() { return recorder_; }
  static constexpr int kOneThread = 0, kGang = 1;  // SideBySide worker ids

 private:
  CalibrationBench() = default;

  SideBySide recorder_;  // outlives the workers that call its observer
  std::unique_ptr<decode::DecodeWorker> one_thread_, gang_, other_gang_;
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

// The largest share an exponent is saved at. Near 1 the exponent is
// ill-conditioned: e = ln(r · share) / (−(N − 1) · ln share), so at share
// 0.99 a 5% noise in r moves e by 5, and the clamped 2 a busy machine
// gave at 0.996 (CI, 2026-12-06) would be taken at every share above the
// next point. At 0.9 the same noise moves e by 0.46.
constexpr double kMostShareMeasured = 0.9;

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
//
// Then beside a second TP worker decoding (PerfModel::gang_beside_gang),
// where the cores are oversubscribed by the two: gangs beside gangs lose
// less than beside one-thread workers that never block (a rank waiting
// at its all-reduce yields its core to the other gang's rank; on the dev VM
// 1.56-1.81x alone's step time where processor sharing gives 1.79-1.90x),
// and the points above over-predicted two TP 2 workers' TPOT p99 by 62%
// (run 25).
struct GangSharing {
  std::vector<planner::PerfModel::GangPoint> points;
  std::optional<planner::PerfModel::GangPoint> beside_gang;
};
absl::StatusOr<GangSharing> CalibrateGangSharing(
    const PlannerProfileOptions& o, const planner::PerfModel& model,
    CalibrationBench& bench, int tp) {
  auto cost = model.Step({tp, 1});
  if (!cost.ok()) return cost.status();
  // The measured r at processor sharing's `share` (< 1) as an exponent,
  // unclamped (above).
  auto exponent_of = [tp](double ratio, double share) {
    return std::log(ratio * share) / (-(tp - 1) * std::log(share));
  };
  GangSharing sharing;
  for (int neighbours : {1, 2}) {
    std::vector<Work> units;
    for (int i = 0; i < neighbours; ++i) units.push_back(bench.PrefillUnit(i));
    auto r = bench.recorder().Measure(CalibrationBench::kGang, **cost,
                                      bench.GangPhase(), units);
    if (!r.ok()) return r.status();
    const double demand =
        model.BusyCores({tp, 1}) + neighbours * model.BusyCores({1, 1});
    const double share = std::min(1.0, o.cores / demand);
    const bool measurable = share <= kMostShareMeasured;
    const double exponent =
        measurable && r->ratio * share > 1 + model.co_running.decode_step
            ? std::clamp(exponent_of(r->ratio, share), 0.0, 2.0)
            : 0.0;
    Say(o, absl::StrFormat(
               "  tp %d beside %d prefilling: %.2fx alone's step "
               "time (%d and %d steps); processor sharing gives "
               "%.2fx, co-running %.2fx: exponent %.2f at share "
               "%.2f%s",
               tp, neighbours, r->ratio, r->steps_beside, r->steps_alone,
               1 / share, (1 + model.co_running.decode_step) / share, exponent,
               share,
               measurable ? ""
                          : absl::StrFormat(" (not saved: above %.2f)",
                                            kMostShareMeasured)));
    if (measurable &&
        (sharing.points.empty() || share < sharing.points.back().share)) {
      sharing.points.push_back({share, exponent});
    }
  }
  const double share = std::min(1.0, o.cores / (2 * model.BusyCores({tp, 1})));
  if (share <= kMostShareMeasured) {
    auto r = bench.recorder().Measure(CalibrationBench::kGang, **cost,
                                      bench.GangPhase(), {bench.GangUnit()});
    if (!r.ok()) return r.status();
    // The whole measured r, below processor sharing's 1 / share too (e < 0:
    // each gang's ranks fill the other's waits), down to full speed (e =
    // −1 / (tp − 1)); the simulator takes it in place of co-running.
    const double exponent =
        std::clamp(exponent_of(r->ratio, share), -1.0 / (tp - 1), 2.0);
    Say(o, absl::StrFormat("  tp %d beside a tp %d decoding: %.2fx alone's "
                           "step time (%d and %d steps); processor sharing "
                           "gives %.2fx: exponent %.2f at share %.2f",
                           tp, tp, r->ratio, r->steps_beside, r->steps_alone,
                           1 / share, exponent, share));
    sharing.beside_gang = planner::PerfModel::GangPoint{share, exponent};
  } else {
    // Where the profile's steps kept too few cores busy (another load on
    // the machine), two gangs fit the cores or nearly: nothing to measure
    // (above), and the simulator shares little between them either.
    Say(o, absl::StrFormat("  tp %d beside a tp %d: not measured, two keep "
                           "%.2f cores busy of %d (share %.3f, above %.2f)",
                           tp, tp, 2 * model.BusyCores({tp, 1}), o.cores, share,
                           kMostShareMeasured));
  }
  return sharing;
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

absl::StatusOr<std::vector<planner::StepSample>> ReadStepTrace(
    const std::string& path, std::vector<double>* end_unix_seconds) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("no step trace at ", path));
  std::vector<planner::StepSample> steps;
  if (end_unix_seconds != nullptr) end_unix_seconds->clear();
  std::string line;
  std::getline(in, line);  // the header
  while (std::getline(in, line)) {
    double end = 0, seconds = 0;
    int sequences = 0, tokens = 0, rows = 0, output = 0;
    long long attended = 0;
    if (std::sscanf(line.c_str(), "%lf,%lf,%d,%d,%d,%lld,%d", &end, &seconds,
                    &sequences, &tokens, &rows, &attended, &output) != 7) {
      continue;
    }
    steps.push_back({{tokens, rows, attended}, seconds});
    if (end_unix_seconds != nullptr) end_unix_seconds->push_back(end);
  }
  return steps;
}

StepsOverFit OverFit(const std::vector<planner::StepSample>& steps,
                     const planner::StepCost& cost) {
  std::vector<double> decode, prompt;
  for (const planner::StepSample& s : steps) {
    const double fitted = cost.Seconds(s.shape);
    if (!(fitted > 0)) continue;
    (CarriesPrompt(s.shape) ? prompt : decode).push_back(s.seconds / fitted);
  }
  return {planner::Median(std::move(decode)),
          planner::Median(std::move(prompt))};
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
  const std::vector<int> cpus = AllowedCpus(options.cores);
  auto step_round = [&]() -> absl::Status {
    ++rounds_done;
    std::string line = absl::StrFormat("step round %d of %d: decode b1",
                                       rounds_done, kStepRounds);
    for (const planner::ComputeConfig& config : configs) {
      StepRecord& record = records[config];
      std::vector<double> core_b1_ms;
      if (auto s = ProfileRound(options, **weights, config, rounds_done, cpus,
                                &record, &core_b1_ms);
          !s.ok()) {
        return absl::Status(
            s.code(),
            absl::StrCat("profiling tp ", config.tp, " × ",
                         config.threads_per_rank, " threads: ", s.message()));
      }
      PDS_RETURN_IF_ERROR(FitRecord(config, record, &model));
      std::string cores;
      for (size_t i = 0; i < core_b1_ms.size(); ++i) {
        absl::StrAppend(&cores, i == 0 ? "; cpu " : ", cpu ", cpus[i], " ",
                        absl::StrFormat("%.2f", core_b1_ms[i]));
      }
      absl::StrAppend(
          &line, absl::StrFormat(" %.2f ms (tp %d × %d%s)",
                                 record.decode_b1_seconds.back() * 1e3,
                                 config.tp, config.threads_per_rank, cores));
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
    auto c =
        CalibrateSteadily(options, **weights, model, colocated, std::nullopt);
    if (!c.ok()) return c.status();
    model.calibrated[config] = {c->step_overhead, c->ttft};
    delivery_cpu += c->delivery_cpu / model.steps.size();
    Say(options, absl::StrFormat(
                     "  TTFT extra %.1f ms %+.3f ms/token; decode step "
                     "overhead %+.2f ms; router + client CPU %.3f ms/token; "
                     "steps meanwhile at %.2fx the fit's time (prompts "
                     "%.2fx); requests at %.2f/s, %d of %d unqueued; %s; "
                     "measurement %d",
                     c->ttft.base * 1e3, c->ttft.per_prompt_token * 1e3,
                     c->step_overhead * 1e3, c->delivery_cpu * 1e3, c->slowness,
                     c->prompt_slowness, c->stream_rate, c->unqueued,
                     c->requests, ScatterSummary(*c), c->attempt));
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
    auto d = CalibrateSteadily(options, **weights, model, disaggregated,
                               model.StepOverhead({1, 1}));
    if (!d.ok()) return d.status();
    model.disaggregated_ttft = d->ttft;
    model.handoff_seconds = d->handoff;
    Say(options,
        absl::StrFormat("  disaggregated TTFT extra %.1f ms %+.3f ms/token; "
                        "hand-off %.2f ms; steps meanwhile at %.2fx the "
                        "fit's time (prompts %.2fx); requests at %.2f/s, %d "
                        "of %d unqueued; %s; measurement %d",
                        model.disaggregated_ttft.base * 1e3,
                        model.disaggregated_ttft.per_prompt_token * 1e3,
                        model.handoff_seconds * 1e3, d->slowness,
                        d->prompt_slowness, d->stream_rate, d->unqueued,
                        d->requests, ScatterSummary(*d), d->attempt));
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
                                "prefilling workers, then beside another "
                                "TP worker, alternately"));
      auto sharing = CalibrateGangSharing(options, model, **bench, gang_tp);
      if (!sharing.ok()) return sharing.status();
      model.gang_sharing_points = sharing->points;
      model.gang_beside_gang = sharing->beside_gang;
      // The first point's exponent, for readers of the scalar (older
      // routers' profiles).
      if (!sharing->points.empty()) {
        model.gang_sharing_exponent = sharing->points.front().exponent;
      }
      std::string line = "  gang-sharing exponents:";
      for (const planner::PerfModel::GangPoint& p : sharing->points) {
        absl::StrAppend(&line, absl::StrFormat(" %.2f at share %.2f;",
                                               p.exponent, p.share));
      }
      Say(options, line);
      if (sharing->beside_gang) {
        Say(options,
            absl::StrFormat("  gang-beside-gang exponent: %.2f at share %.2f",
                            sharing->beside_gang->exponent,
                            sharing->beside_gang->share));
      }
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
