// The layout planner against measurement. Profiles this machine (or loads a
// saved profile), then for short and long prompts × a tight-TTFT and a
// tight-TPOT SLO asks the planner for its ranking, and measures the top 3 of
// each and today's `pdserve local` default with the same open-loop arrivals
// (load_bench's generator) on real clusters. Each distinct layout runs once
// per prompt range and round (--repeats, rounds alternating their order);
// its goodput under each SLO comes from the same requests, and with several
// rounds every measured figure is the median of the rounds (the range is
// printed beside it: this VM's speed moves by ±25% within minutes). With
// --reprofile 1 each prompt range is planned on a profile made just before
// its layouts are measured.
//
// Printed per workload: predicted vs measured TTFT p99, TPOT p99 and goodput
// for every measured layout with the relative errors (target: within 20%),
// the machine's speed before its runs relative to the start of measuring
// (a fixed computation timed on every core: below 1, the VM was slower; and
// a fixed memory read, which the decode steps are bound by), and whether the
// planner's first choice is the measured best (or within 10% of its goodput).
//
//   build/bench/planner_bench [--model M --format F] [--perf-model FILE]
//                             [--requests 60] [--rate 1.5] [--long-rate R]
//                             [--repeats 1]
//   (`planner_bench --help` lists every flag)
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/command_line_flags.h"
#include "model/weight_source.h"
#include "planner/planner.h"
#include "tools/load_generator.h"
#include "tools/local_cluster.h"
#include "tools/planner_profile.h"

namespace pdserve::bench {
namespace {

struct Workload {
  std::string name;
  planner::LengthRange prompt;
  planner::Slo slo;
};

// The median of a metric over the measured rounds, and its range.
struct Spread {
  double median = 0, lo = 0, hi = 0;
  size_t rounds = 0;
  // " [lo–hi]" with `decimals` after scaling, or nothing for one round.
  std::string Range(double scale, int decimals) const {
    if (rounds < 2) return "";
    return absl::StrFormat(" [%.*f–%.*f]", decimals, lo * scale, decimals,
                           hi * scale);
  }
};

Spread OverRounds(const std::vector<double>& values) {
  Spread s;
  s.rounds = values.size();
  if (values.empty()) return s;
  s.median = planner::Median(values);
  const auto [lo, hi] = std::minmax_element(values.begin(), values.end());
  s.lo = *lo;
  s.hi = *hi;
  return s;
}

double RelativeError(double predicted, double measured) {
  if (measured == 0) return predicted == 0 ? 0 : INFINITY;
  return (predicted - measured) / measured;
}

// Median over 5 repetitions of the seconds `threads` threads take to run
// `work(thread)` at once; a work's result is kept so it is not optimised
// away.
double MedianSecondsOnThreads(int threads,
                              const std::function<float(int)>& work) {
  std::vector<double> times;
  for (int rep = 0; rep < 5; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::thread> workers;
    std::vector<float> results(threads);
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back([&work, &results, t] { results[t] = work(t); });
    }
    for (std::thread& w : workers) w.join();
    times.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count());
    if (results.front() < 0) std::printf("unreachable\n");  // keeps the work
  }
  return planner::Median(std::move(times));
}

// Seconds a fixed amount of arithmetic takes on `threads` threads at once
// (median of 5): this VM's speed right now. Its cores are shared with other
// tenants and its speed drifts by ±20% over minutes, so the bench takes it
// before every measured run to tell the machine's drift from the model's
// error.
double ReferenceSeconds(int threads) {
  return MedianSecondsOnThreads(threads, [](int) {
    std::vector<float> values(64 * 1024, 1.0f);  // 256 KiB: in L2
    for (int pass = 0; pass < 20000; ++pass) {   // ~50-100 ms
      for (float& v : values) v = v * 0.999f + 0.001f;
    }
    return values.front();
  });
}

// Seconds `threads` threads take to read a 256 MiB buffer each (median of
// 5): the memory bandwidth a CPU decode step is bound by, which other
// tenants' traffic moves independently of the arithmetic above.
double MemoryReferenceSeconds(int threads) {
  constexpr size_t kFloats = size_t{64} << 20;  // 256 MiB
  std::vector<std::vector<float>> buffers(threads,
                                          std::vector<float>(kFloats, 1.0f));
  return MedianSecondsOnThreads(threads, [&buffers](int t) {
    float sum = 0;
    for (float v : buffers[t]) sum += v;
    return sum;
  });
}

// `text` with every character but letters, digits, '.' and '-' as '_'.
std::string FileSafe(const std::string& text) {
  std::string out = text;
  for (char& c : out) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-') {
      c = '_';
    }
  }
  return out;
}

// A worker's step trace against the profile's fit for its compute
// configuration (a decode worker's, or a one-stage prefill group's): each
// step's seconds over the fitted cost of its shape (without the spread), for
// steps that only decode and steps that carry a prompt, as median and 90th
// percentile, and the seconds the worker computed.
std::string StepTraceSummary(const std::string& path,
                             const planner::PerfModel& model,
                             const planner::ComputeConfig& config) {
  auto cost = model.Step(config);
  if (!cost.ok()) return cost.status().ToString();
  auto steps = tools::ReadStepTrace(path);
  if (!steps.ok()) return steps.status().ToString();
  std::vector<double> decode_only, with_prompt;
  double busy = 0;
  for (const planner::StepSample& step : *steps) {
    const double fitted = (*cost)->Seconds(step.shape);
    if (!(fitted > 0)) continue;
    (tools::CarriesPrompt(step.shape) ? with_prompt : decode_only)
        .push_back(step.seconds / fitted);
    busy += step.seconds;
  }
  auto describe = [](const char* what, std::vector<double> ratios) {
    if (ratios.empty()) return absl::StrCat("0 ", what);
    return absl::StrFormat("%zu %s at %.2fx (p90 %.2fx)", ratios.size(), what,
                           planner::Percentile(ratios, 0.5),
                           planner::Percentile(ratios, 0.9));
  };
  return absl::StrCat(
      "steps over the fit: ", describe("decode-only", decode_only), ", ",
      describe("with a prompt", with_prompt),
      absl::StrFormat("; %.1f s busy", busy));
}

// One CSV row per request of a measured run, beside the prediction of the
// same request on the same arrivals. Returns a process exit code.
int WriteRequests(std::FILE* csv, const std::string& key, int round,
                  const planner::PerfModel& model,
                  const planner::Layout& layout,
                  const std::vector<planner::Arrival>& arrivals,
                  const tools::LoadReport& report, const planner::Slo& slo,
                  int cores, uint64_t seed, int replications,
                  bool ttft_scatter) {
  const std::vector<planner::SimRequest> requests =
      planner::SimRequests(arrivals);
  auto p = planner::Simulate(model, layout, requests, slo,
                             {.cores = cores,
                              .seed = seed,
                              .ttft_scatter = ttft_scatter,
                              .replications = replications,
                              .per_request = true});
  if (!p.ok()) {
    std::fprintf(stderr, "%s\n", p.status().ToString().c_str());
    return 1;
  }
  for (size_t i = 0; i < arrivals.size() && i < report.requests.size(); ++i) {
    const tools::RequestResult& r = report.requests[i];
    std::fprintf(csv, "\"%s\",%d,%zu,%.4f,%zu,%d,%.5f,%.5f,%.5f,%.5f\n",
                 key.c_str(), round, i, arrivals[i].seconds,
                 arrivals[i].prompt.size(), arrivals[i].max_tokens,
                 r.ok ? r.ttft : -1.0, r.ok ? r.tpot : -1.0, p->request_ttft[i],
                 p->request_tpot[i]);
  }
  std::fflush(csv);
  return 0;
}

int Main(int argc, char** argv) {
  CommandLineFlags flags;
  if (auto s = flags.Parse(argc, argv); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 2;
  }
  tools::PlannerProfileOptions profile;
  flags.Group("Model");
  profile.model_path =
      flags.Str("model", PDSERVE_MODELS_DIR "/bench-configs/llama-110m.json",
                "Model every cluster loads.");
  profile.format = flags.Str("format", "dummy",
                             "Model format: auto|gguf|safetensors|dummy.");
  const std::string perf_path =
      flags.Str("perf-model", "",
                "A saved profile to plan with instead of profiling now.",
                "(profile now)");
  const std::string save_path = flags.Str(
      "save-perf-model", "",
      "Where to save the profile made now (to re-plan the same run later).",
      "(not saved)");
  profile.bin_dir = PDSERVE_BINARY_DIR;
  flags.Group("Load");
  const int requests =
      flags.Num<int>("requests", 60, "Requests per measured run.");
  const double short_rate = flags.Num<double>(
      "rate", 1.5, "Poisson arrival rate of the short prompts, requests/s.");
  const double long_rate = flags.Num<double>(
      "long-rate", 0,
      "Arrival rate of the long prompts, requests/s, where this machine's "
      "speed makes --rate an overload (every layout then misses most SLOs and "
      "a p99 TTFT is the backlog at the end of the run).",
      "(--rate)");
  const uint64_t seed = flags.Num<uint64_t>("seed", 1, "Arrivals' seed.");
  const int top = flags.Num<int>("top", 3, "Predicted best layouts measured.");
  const std::string also_measure = flags.Str(
      "layouts", "",
      "Also measure these enumerated layouts wherever the planner ranks them "
      "(names as the ranking prints them, separated by ';'), e.g. to see a "
      "layout the planner ranks low or one that matters on another machine.",
      "(none)");
  const int repeats = flags.Num<int>(
      "repeats", 1,
      "Measured runs per layout; figures are their medians (odd: a run's own "
      "value).");
  const int replications = flags.Num<int>(
      "replications", 15,
      "Simulation runs per predicted layout (different step-time draws); "
      "predictions are their medians.");
  profile.cores = flags.Num<int>("cores", 2, "Cores the layouts may use.");
  const bool ttft_scatter = flags.Bool(
      "ttft-scatter", false,
      "1: predict with each request's TTFT offset drawn from the profile's "
      "measured scatter (pdserve plan --ttft-scatter).");
  const bool default_ngram = flags.Bool(
      "default-ngram", false,
      "1: measure today's default with n-gram speculation, as shipped (it is "
      "predicted without: the planner plans speculation only given an "
      "acceptance).");
  const bool oversubscribe = flags.Bool(
      "oversubscribe", false,
      "1: also rank layouts with up to twice as many compute threads as "
      "cores, one per decode rank and prefill stage (today's default has 4 "
      "on 2).");
  const bool reprofile = flags.Bool(
      "reprofile", false,
      "1: profile again before each prompt range is planned and measured "
      "(short, then long), so that a prediction's profile is minutes old "
      "when its layouts run rather than up to an hour: this VM's step times "
      "drift by up to a third over an hour. Not with --perf-model.");
  const std::string requests_csv = flags.Str(
      "requests-csv", "",
      "Write every measured request beside its prediction to this CSV (run, "
      "round, request, arrival s, prompt and output tokens, measured and "
      "predicted TTFT and TPOT s; the prediction is each request's median "
      "over the replications): where a layout's p99 comes from.",
      "(not written)");
  const std::string step_traces = flags.Str(
      "step-traces", "",
      "Every measured decode worker and prefill stage writes its forward "
      "steps to a CSV in this folder, made if missing (decode_worker and "
      "prefill_worker --step-trace), and each run prints its steps' time over "
      "the profile's fitted time for the same shapes (decode workers, and the "
      "stage of one-stage prefill groups): whether a loaded cluster's steps "
      "are the profile's.",
      "(none)");
  const std::string only_prompts = flags.Str(
      "prompts", "",
      "Plan and measure only the workloads of this prompt range LO:HI (16:64 "
      "or 256:400).",
      "(both)");
  const bool worker_metrics = flags.Bool(
      "worker-metrics", false,
      "1: every measured cluster's processes export Prometheus metrics on "
      "ephemeral ports (each written to a *.metrics file in the cluster's "
      "/tmp/pdserve-local.* folder), to scrape beside a run.");
  if (flags.help_requested()) {
    std::fputs(flags
                   .Usage("planner_bench [flags]\nThe layout planner's "
                          "predictions against measured load "
                          "(bench/planner_bench.cc).\n")
                   .c_str(),
               stdout);
    return 0;
  }
  if (auto s = flags.Check(); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 2;
  }
  if (!(short_rate > 0) || !(long_rate >= 0)) {
    std::fprintf(stderr,
                 "--rate must be positive and --long-rate positive (or 0: "
                 "--rate), got %g and %g\n",
                 short_rate, long_rate);
    return 2;
  }
  if (repeats < 1 || replications < 1) {
    std::fprintf(stderr,
                 "--repeats and --replications must be at least 1, got %d "
                 "and %d\n",
                 repeats, replications);
    return 2;
  }
  auto format = model::ParseLoadFormat(profile.format);
  if (!format.ok()) {
    std::fprintf(stderr, "%s\n", format.status().ToString().c_str());
    return 2;
  }
  auto weights = model::OpenModel(profile.model_path, *format);
  if (!weights.ok()) {
    std::fprintf(stderr, "%s\n", weights.status().ToString().c_str());
    return 1;
  }
  const int vocab = (*weights)->config().vocab_size;
  weights->reset();

  if (reprofile && !perf_path.empty()) {
    std::fprintf(stderr,
                 "--reprofile 1 profiles again before each prompt range; it "
                 "takes no --perf-model\n");
    return 2;
  }
  // Profiles this machine now; with --reprofile once per prompt range (the
  // saved file then gets the range as a suffix).
  auto profile_now =
      [&](const std::string& save_as) -> absl::StatusOr<planner::PerfModel> {
    profile.progress = [](const std::string& line) {
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
    };
    auto m = tools::ProfileForPlanner(profile);
    if (!m.ok()) return m.status();
    if (!save_as.empty()) {
      if (auto s = m->Save(save_as); !s.ok()) return s;
    }
    return m;
  };

  // Today's `pdserve local` default: 2 stages, TP 2 (4 compute threads on
  // these cores), measured as predicted: without speculation unless
  // --default-ngram. As shipped it runs n-gram, which drafts from the dummy
  // model's repetitive output, so a speculation-free prediction of it
  // measured its TPOT p99 48-83% high (run 9).
  planner::Layout default_layout;
  default_layout.stages = 2;
  default_layout.tp = 2;
  const std::vector<Workload> workloads = {
      {"short, tight TTFT", {16, 64}, {0.2, 0.06}},
      {"short, tight TPOT", {16, 64}, {2.0, 0.02}},
      {"long, tight TTFT", {256, 400}, {1.0, 0.06}},
      {"long, tight TPOT", {256, 400}, {3.0, 0.03}},
  };
  const planner::LengthRange output{16, 64};
  // The long prompts' rate (256..400) where --long-rate gives one.
  auto RateFor = [&](const planner::LengthRange& prompts) {
    return prompts.lo >= 256 && long_rate > 0 ? long_rate : short_rate;
  };
  struct Row {
    planner::Layout layout;
    planner::Prediction predicted;  // under this workload's SLO
    int rank = 0;                   // 0 = today's default only
  };
  std::map<std::string, std::vector<Row>> rows_by_workload;
  // prompts|layout → one report per round
  std::map<std::string, std::vector<tools::LoadReport>> measured;

  // The planner's ranking for `w`: its top layouts, the --layouts ones and
  // today's default become w's rows. Returns a process exit code, 0 = ok.
  auto plan_workload = [&](const planner::PerfModel& model,
                           const Workload& w) -> int {
    planner::PlanRequest request;
    request.workload = {requests, RateFor(w.prompt), w.prompt, output, seed};
    request.slo = w.slo;
    request.resources.cores = profile.cores;
    request.resources.allow_oversubscription = oversubscribe;
    request.replications = replications;
    request.ttft_scatter = ttft_scatter;
    auto ranked = planner::Plan(model, request);
    if (!ranked.ok()) {
      std::fprintf(stderr, "%s\n", ranked.status().ToString().c_str());
      return 1;
    }
    std::printf(
        "\n== %s: prompts %d..%d, SLO TTFT p99 ≤ %.0f ms, TPOT ≤ %.0f "
        "ms — planner's ranking ==\n%s",
        w.name.c_str(), w.prompt.lo, w.prompt.hi, w.slo.ttft_seconds * 1e3,
        w.slo.tpot_seconds * 1e3, planner::FormatPlan(*ranked, 6).c_str());
    std::vector<Row>& rows = rows_by_workload[w.name];
    for (int i = 0; i < top && i < static_cast<int>(ranked->size()); ++i) {
      rows.push_back({(*ranked)[i].layout, (*ranked)[i].prediction, i + 1});
    }
    for (absl::string_view name :
         absl::StrSplit(also_measure, ';', absl::SkipWhitespace())) {
      bool found = false;
      for (size_t i = 0; i < ranked->size(); ++i) {
        // The named layout, or one folded into this row (predicted the
        // same): measured as itself.
        const planner::RankedLayout& r = (*ranked)[i];
        const planner::Layout* named =
            r.layout.Name() == name ? &r.layout : nullptr;
        for (const planner::Layout& same : r.same_prediction) {
          if (same.Name() == name) named = &same;
        }
        if (named == nullptr) continue;
        found = true;
        if (static_cast<int>(i) >= top || named != &r.layout) {
          rows.push_back({*named, r.prediction, static_cast<int>(i) + 1});
        }
      }
      if (!found) {
        std::fprintf(stderr,
                     "--layouts: \"%s\" is not among the %zu layouts the "
                     "planner enumerated for %s (see the ranking above; "
                     "oversubscribed ones need --oversubscribe 1)\n",
                     std::string(name).c_str(), ranked->size(), w.name.c_str());
        return 2;
      }
    }
    bool has_default = false;
    for (const Row& r : rows) {
      has_default |= r.layout.Name() == default_layout.Name();
    }
    if (!has_default) {
      auto p = planner::Simulate(model, default_layout,
                                 planner::SimRequests(request.workload), w.slo,
                                 {.cores = profile.cores,
                                  .seed = seed,
                                  .ttft_scatter = ttft_scatter,
                                  .replications = replications});
      if (!p.ok()) {
        std::fprintf(stderr, "%s\n", p.status().ToString().c_str());
        return 1;
      }
      rows.push_back({default_layout, *p, 0});
    }
    return 0;
  };

  // The prompt ranges in the workloads' order; each is planned (after its
  // own profile with --reprofile) and then measured before the next.
  std::vector<planner::LengthRange> prompt_ranges;
  for (const Workload& w : workloads) {
    if (!only_prompts.empty() &&
        only_prompts != absl::StrCat(w.prompt.lo, ":", w.prompt.hi)) {
      continue;
    }
    bool seen = false;
    for (const planner::LengthRange& r : prompt_ranges) {
      seen |= r.lo == w.prompt.lo && r.hi == w.prompt.hi;
    }
    if (!seen) prompt_ranges.push_back(w.prompt);
  }
  if (prompt_ranges.empty()) {
    std::fprintf(stderr,
                 "--prompts %s: no workload has that prompt range "
                 "(16:64 or 256:400)\n",
                 only_prompts.c_str());
    return 2;
  }
  // Made before the profile, not found missing by the first measured
  // cluster's decode worker 10 minutes in.
  if (!step_traces.empty()) {
    std::error_code error;
    std::filesystem::create_directories(step_traces, error);
    if (error) {
      std::fprintf(stderr, "--step-traces: cannot make %s: %s\n",
                   step_traces.c_str(), error.message().c_str());
      return 1;
    }
  }
  std::FILE* csv = nullptr;
  if (!requests_csv.empty()) {
    csv = std::fopen(requests_csv.c_str(), "w");
    if (csv == nullptr) {
      std::fprintf(stderr, "--requests-csv: cannot write %s\n",
                   requests_csv.c_str());
      return 1;
    }
    std::fprintf(csv,
                 "run,round,request,arrival_s,prompt_tokens,output_tokens,"
                 "ttft_s,tpot_s,predicted_ttft_s,predicted_tpot_s\n");
  }
  struct Run {
    std::string key;
    planner::LengthRange prompt;
    Row row;
    const Workload* workload;
  };
  // By run key, per round: the machine's arithmetic and memory-read speed
  // before the run, relative to the start of measuring.
  std::map<std::string, std::vector<double>> speed, memory_speed;
  double reference_start = 0, memory_reference_start = 0;
  planner::PerfModel model;
  if (!perf_path.empty()) {
    auto m = planner::PerfModel::Load(perf_path);
    if (!m.ok()) {
      std::fprintf(stderr, "%s\n", m.status().ToString().c_str());
      return 1;
    }
    model = *std::move(m);
  }
  for (size_t range = 0; range < prompt_ranges.size(); ++range) {
    const planner::LengthRange prompts = prompt_ranges[range];
    if (perf_path.empty() && (range == 0 || reprofile)) {
      if (reprofile) {
        std::printf("\n== profile for prompts %d..%d ==\n", prompts.lo,
                    prompts.hi);
      }
      profile.rate = RateFor(prompts);
      auto m = profile_now(
          save_path.empty() || !reprofile
              ? save_path
              : absl::StrCat(save_path, ".", prompts.lo, "-", prompts.hi));
      if (!m.ok()) {
        std::fprintf(stderr, "profile: %s\n", m.status().ToString().c_str());
        return 1;
      }
      model = *std::move(m);
    }
    std::vector<Run> runs;
    for (const Workload& w : workloads) {
      if (w.prompt.lo != prompts.lo || w.prompt.hi != prompts.hi) continue;
      if (int rc = plan_workload(model, w); rc != 0) return rc;
      for (const Row& row : rows_by_workload[w.name]) {
        const std::string key =
            absl::StrCat(w.prompt.lo, ":", w.prompt.hi, "|", row.layout.Name());
        bool seen = false;
        for (const Run& r : runs) seen |= r.key == key;
        if (!seen) runs.push_back({key, w.prompt, row, &w});
      }
    }

    // Measure each distinct layout once per round; odd rounds go through
    // them in reverse, so the VM's drift over a run falls on every layout
    // alike.
    std::printf(
        "\n== measured, prompts %d..%d (load_bench's open loop, %d requests "
        "at %.2f/s, %d round%s) ==\n",
        prompts.lo, prompts.hi, requests, RateFor(prompts), repeats,
        repeats == 1 ? "" : "s");
    tools::PrintLoadHeader();
    if (range == 0) {
      // The machine's speed when the measuring starts; each run's is
      // printed relative to it.
      reference_start = ReferenceSeconds(profile.cores);
      memory_reference_start = MemoryReferenceSeconds(profile.cores);
    }
    for (int round = 0; round < repeats; ++round) {
      for (size_t i = 0; i < runs.size(); ++i) {
        const Run& run = runs[round % 2 == 0 ? i : runs.size() - 1 - i];
        const std::vector<planner::Arrival> arrivals = planner::MakeArrivals(
            {requests, RateFor(run.prompt), run.prompt, output, seed}, vocab);
        tools::LocalClusterOptions o;
        o.model_path = profile.model_path;
        o.format = profile.format;
        o.bin_dir = PDSERVE_BINARY_DIR;
        o.refresh_ms = 100;
        o.decode_blocks = 2048;
        o.prefill_blocks = 1024;
        tools::ApplyLayout(run.row.layout, &o);
        if (worker_metrics) o.metrics_port_base = 0;
        std::string trace_prefix;
        if (!step_traces.empty()) {
          trace_prefix = absl::StrCat(step_traces, "/", FileSafe(run.key), "-r",
                                      round, "-");
          o.step_trace_prefix = trace_prefix;
        }
        if (run.row.rank == 0 && default_ngram) o.speculation = "ngram";
        // Before the cluster starts, so that nothing else computes.
        speed[run.key].push_back(reference_start /
                                 ReferenceSeconds(profile.cores));
        memory_speed[run.key].push_back(memory_reference_start /
                                        MemoryReferenceSeconds(profile.cores));
        auto cluster = tools::LocalCluster::Start(o);
        if (!cluster.ok()) {
          std::fprintf(stderr, "cluster %s: %s\n",
                       run.row.layout.Name().c_str(),
                       cluster.status().ToString().c_str());
          return 1;
        }
        tools::LoadReport report = tools::RunLoad(
            run.key, (*cluster)->grpc_address(), arrivals,
            run.workload->slo.ttft_seconds, run.workload->slo.tpot_seconds);
        tools::PrintLoad(report);
        for (int w = 0;
             w < run.row.layout.decode_workers && !trace_prefix.empty(); ++w) {
          std::printf(
              "  decode-%d %s\n", w,
              StepTraceSummary(
                  absl::StrCat(trace_prefix, "decode-", w, ".csv"), model,
                  {run.row.layout.tp, run.row.layout.decode_threads})
                  .c_str());
        }
        // A deeper pipeline's stage computes a share of the layers, which its
        // trace does not say: only one-stage groups are set beside the fit.
        for (int g = 0;
             g < run.row.layout.prefill_groups && !run.row.layout.colocated &&
             run.row.layout.stages == 1 && !trace_prefix.empty();
             ++g) {
          std::printf(
              "  prefill-%d %s\n", g,
              StepTraceSummary(
                  absl::StrCat(trace_prefix, "prefill-", g, "-stage-0.csv"),
                  model, {1, run.row.layout.prefill_threads})
                  .c_str());
        }
        if (csv != nullptr) {
          if (int rc = WriteRequests(csv, run.key, round, model, run.row.layout,
                                     arrivals, report, run.workload->slo,
                                     profile.cores, seed, replications,
                                     ttft_scatter);
              rc != 0) {
            return rc;
          }
        }
        measured[run.key].push_back(std::move(report));
        std::printf(
            "  machine speed before this run: %.2fx the start's (memory "
            "reads %.2fx)\n",
            speed[run.key].back(), memory_speed[run.key].back());
      }
    }
  }

  std::printf(
      "\n== predicted vs measured (error = (predicted − measured) / "
      "measured; target |error| ≤ 20%%) ==\n");
  double worst = 0;
  int first_choice_ok = 0;
  int compared = 0;
  for (const Workload& w : workloads) {
    if (!rows_by_workload.contains(w.name)) continue;  // --prompts
    ++compared;
    std::printf(
        "\n%s (SLO TTFT ≤ %.0f ms, TPOT ≤ %.0f ms)\n"
        "| rank | layout | TTFT p99 pred / meas | err | TPOT p99 pred / meas "
        "| err | goodput pred / meas | err | machine speed | memory reads "
        "|\n"
        "|---|---|---|---|---|---|---|---|---|---|\n",
        w.name.c_str(), w.slo.ttft_seconds * 1e3, w.slo.tpot_seconds * 1e3);
    double best_measured = 0, first_measured = 0;
    for (const Row& row : rows_by_workload[w.name]) {
      const std::string key =
          absl::StrCat(w.prompt.lo, ":", w.prompt.hi, "|", row.layout.Name());
      const std::vector<tools::LoadReport>& reports = measured[key];
      const Spread machine = OverRounds(speed[key]);
      const Spread memory = OverRounds(memory_speed[key]);
      std::vector<double> ttfts, tpots, goodputs;
      for (const tools::LoadReport& m : reports) {
        ttfts.push_back(m.ttft_p99);
        tpots.push_back(m.tpot_p99);
        goodputs.push_back(
            m.GoodputFor(w.slo.ttft_seconds, w.slo.tpot_seconds));
      }
      const Spread ttft = OverRounds(ttfts), tpot = OverRounds(tpots),
                   goodput_spread = OverRounds(goodputs);
      const double goodput = goodput_spread.median;
      const double e_ttft = RelativeError(row.predicted.ttft_p99, ttft.median);
      const double e_tpot = RelativeError(row.predicted.tpot_p99, tpot.median);
      const double e_good = RelativeError(row.predicted.goodput, goodput);
      worst = std::max(
          {worst, std::abs(e_ttft), std::abs(e_tpot), std::abs(e_good)});
      best_measured = std::max(best_measured, goodput);
      if (row.rank == 1) first_measured = goodput;
      std::printf(
          "| %s | %s | %.0f / %.0f ms%s | %+.0f%% | %.1f / %.1f ms%s | %+.0f%% "
          "| %.2f / %.2f /s%s | %+.0f%% | %.2fx%s | %.2fx%s |\n",
          row.rank ? absl::StrCat(row.rank).c_str() : "default",
          row.layout.Name().c_str(), row.predicted.ttft_p99 * 1e3,
          ttft.median * 1e3, ttft.Range(1e3, 0).c_str(), e_ttft * 100,
          row.predicted.tpot_p99 * 1e3, tpot.median * 1e3,
          tpot.Range(1e3, 1).c_str(), e_tpot * 100, row.predicted.goodput,
          goodput, goodput_spread.Range(1, 2).c_str(), e_good * 100,
          machine.median, machine.Range(1, 2).c_str(), memory.median,
          memory.Range(1, 2).c_str());
    }
    if (top < 1) {
      std::printf("no first choice measured (--top %d)\n", top);
      continue;
    }
    const bool ok = first_measured >= 0.9 * best_measured;
    first_choice_ok += ok;
    std::printf("first choice measured %.2f/s, best measured %.2f/s: %s\n",
                first_measured, best_measured,
                ok ? "within 10%" : "NOT within 10%");
  }
  std::printf(
      "\nworst |error| %.0f%%; first choice within 10%% of the "
      "measured best on %d/%d workloads\n",
      worst * 100, first_choice_ok, compared);
  return 0;
}

}  // namespace
}  // namespace pdserve::bench

int main(int argc, char** argv) { return pdserve::bench::Main(argc, argv); }
