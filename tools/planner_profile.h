// The planner's short profiling run on the target machine (`pdserve plan
// --profile`, bench/planner_bench):
//
//  1. Step costs. For every compute configuration that fits the cores
//     (tp × threads per rank), an in-process decode worker — the same
//     scheduler, TP ranks and engine a decode_worker process runs — serves a
//     fixed mix: decode batches of 1..32 at short and long context, and
//     prompts of 16..512 tokens prefilled alone. Every step it reports
//     (StepStats: tokens fed, logit rows, attended positions, seconds) is a
//     sample; planner::StepCost::Fit fits them. A prefill stage of H threads
//     uses the tp-1 × H fit scaled by its share of the layers. The mix runs
//     in three rounds spread over the profile (first, after the colocated
//     calibrations, last) and the fit takes all of them: a VM's speed moves
//     within seconds, and one round is a snapshot of it. A one-thread
//     configuration runs each round's mix pinned to each core in turn: a
//     VM's cores can differ in speed by a third (and trade places), and two
//     one-thread workers serving side by side run on both, where a lone
//     profiling thread ran on whichever the scheduler gave it.
//  2. What happens outside the steps. Real clusters (router + workers as
//     processes, tools/local_cluster.h), colocated and disaggregated, serve
//     48 requests arriving open loop at the workload's rate (slower where
//     the simulation has the layout over half busy); what they measure minus
//     what the simulator predicts for the same arrivals is the per-request
//     cost: TTFT overhead as a + b·prompt (router, gRPC, the KV hand-off;
//     fitted on the requests the simulation has finding no queue, so a
//     queueing error is not read as a cost), the decode step overhead, and
//     the prefill→decode hand-off. The cluster's decode worker traces its
//     steps (decode_worker --step-trace), a disaggregated layout's prefill
//     stage its microbatches (prefill_worker --step-trace), and the stream
//     is simulated with the fitted steps slowed to the speed those steps ran
//     at, so the machine's speed in those seconds stays out of the
//     per-request costs. A calibration whose steps ran more than 1.2x off
//     the fit, or whose decode step overhead hit its floor, is measured
//     again (up to three times; the steadiest is kept).
//     Open loop, because a request's cost outside the steps depends on the
//     state it finds the path's threads in: requests sent one at a time
//     right after a computation paid 5-17 ms less than a measured run's,
//     each after an idle pause 10-20 ms more (docs/PERFORMANCE.md).
//  3. Co-running, side by side in this process: a one-thread worker runs
//     a fixed piece of work (a decode batch, or four prompts prefilled) in
//     twelve alternating phases, alone and beside another one-thread
//     worker running decode batches or prefills back to back — each pair of
//     kinds. Its steps summed against their fitted times, beside over alone,
//     is how much slower a step runs beside that kind
//     (PerfModel::co_running). Alternating phases cancel this VM's drift,
//     which a loaded cluster compared with idle requests a minute earlier
//     read as the effect.
//  4. Gang sharing, the same way. Where a TP worker of one thread per rank
//     and a one-thread worker oversubscribe the cores (tp 2 on 2 cores), the
//     TP worker decodes alone and beside one, then two, workers prefilling
//     back to back; the exponent at which the simulator gives it that
//     slow-down at each share is a PerfModel::gang_sharing_points entry.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/layout.h"
#include "planner/perf_model.h"
#include "tools/local_cluster.h"

namespace pdserve::tools {

struct PlannerProfileOptions {
  std::string model_path;
  std::string format = "auto";
  std::string bin_dir;  // where router/prefill_worker/decode_worker are
  int cores = 2;
  // Largest prompt profiled (and the context of the long decode batches is
  // 3/4 of it); prompts beyond it are extrapolated.
  int max_prompt = 512;
  // The workload's arrival rate, requests/s: the calibrations' requests
  // arrive open loop at it (or slower, where a calibrated layout would be
  // more than half busy).
  double rate = 1.5;
  // Told how it goes, a line at a time.
  std::function<void(const std::string&)> progress;
};

// Sets the layout's knobs on `options` (the rest — model, ports, KV sizes —
// stays as given). Speculation: n-gram when the layout has γ > 0, else off.
void ApplyLayout(const planner::Layout& layout, LocalClusterOptions* options);

absl::StatusOr<planner::PerfModel> ProfileForPlanner(
    const PlannerProfileOptions& options);

// A decode worker's step trace (decode_worker --step-trace): each step's
// shape and seconds, in order, and with `end_unix_seconds` when each ended
// (Unix time, one per step). A last line cut short (the worker stopped
// mid-write) is skipped; NOT_FOUND without the file.
absl::StatusOr<std::vector<planner::StepSample>> ReadStepTrace(
    const std::string& path, std::vector<double>* end_unix_seconds = nullptr);

// A step that carries a prompt (or a chunk of one): more tokens fed than
// logit rows. A decode step, drafts included, makes a row per token.
inline bool CarriesPrompt(const planner::StepShape& shape) {
  return shape.tokens > shape.logit_rows;
}

// The traced steps' seconds over `cost`'s fitted seconds for their shapes
// (without the spread), the median of the steps that only decode and of
// those that carry a prompt (CarriesPrompt); 0 where there are none.
struct StepsOverFit {
  double decode = 0;
  double prompt = 0;
};
StepsOverFit OverFit(const std::vector<planner::StepSample>& steps,
                     const planner::StepCost& cost);

}  // namespace pdserve::tools
