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
//     within seconds, and one round is a snapshot of it.
//  2. What happens outside the steps. Real clusters (router + workers as
//     processes, tools/local_cluster.h), colocated and disaggregated, serve
//     requests one at a time; what they measure minus what the simulator
//     predicts for the same idle request is the per-request cost: TTFT
//     overhead as a + b·prompt (router, gRPC, the KV hand-off), the stream
//     delay, and the prefill→decode hand-off. Between the requests an
//     in-process worker of the same configuration decodes a few tokens (a
//     speed probe), and each request is simulated with the fitted steps
//     slowed to the probe's speed around it, so the machine's speed in those
//     seconds stays out of the per-request costs.
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
  // Told how it goes, a line at a time.
  std::function<void(const std::string&)> progress;
};

// Sets the layout's knobs on `options` (the rest — model, ports, KV sizes —
// stays as given). Speculation: n-gram when the layout has γ > 0, else off.
void ApplyLayout(const planner::Layout& layout, LocalClusterOptions* options);

absl::StatusOr<planner::PerfModel> ProfileForPlanner(
    const PlannerProfileOptions& options);

}  // namespace pdserve::tools
