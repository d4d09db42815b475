// What the layout planner knows about one model on one machine: the step
// cost of each compute configuration it profiled (services/planner/
// step_cost.h) and the per-request costs outside the steps (router, gRPC,
// streaming, the KV hand-off between prefill and decode), each fitted from
// measurements (tools/planner_profile.h) and saved as JSON so a router can
// load it (`router --planner-profile`).
#pragma once

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "planner/step_cost.h"

namespace pdserve::planner {

// One decode worker's (or prefill stage's, with tp = 1) compute resources.
struct ComputeConfig {
  int tp = 1;
  int threads_per_rank = 1;
  int threads() const { return tp * threads_per_rank; }
  auto operator<=>(const ComputeConfig&) const = default;
};

// Seconds a request spends outside the steps the simulator runs, as
// a + b · prompt_tokens (b: the KV hand-off grows with the prompt), plus,
// where the simulation asks for it, a per-request draw from `scatter`.
struct LinearCost {
  double base = 0;
  double per_prompt_token = 0;
  // How the calibration's requests scattered around the line, in seconds:
  // evenly spaced quantiles, ascending (median near 0), with the part the
  // prompt steps' own spread explains taken out (the simulator draws that
  // per step). The same request's every token carries its draw, so it moves
  // TTFT, not TPOT; drawn only where asked (SimOptions::ttft_scatter says
  // why). Empty: none (older profiles).
  std::vector<double> scatter;
  double At(int prompt_tokens) const {
    return base + per_prompt_token * prompt_tokens;
  }
  // The scatter's quantile at u ∈ [0, 1); 0 with none.
  double ScatterAt(double u) const;
};

struct PerfModel {
  std::string model;  // what it was profiled on (file or folder)
  int num_layers = 0;
  int block_size = 16;
  // Cores the profile ran on: the simulator shares them among the busy
  // compute threads of a layout that has more (processor sharing).
  int cores = 1;
  std::map<ComputeConfig, StepCost> steps;
  // Added to the delivery of every token of a request (the client sees the
  // stream this much later than the simulated steps emit it: router, gRPC,
  // the request's set-up), per kind of layout: an idle cluster's measured
  // TTFT minus the simulated one. It moves TTFT, not TPOT.
  LinearCost colocated_ttft;
  LinearCost disaggregated_ttft;
  // Added to every decode worker step: a worker process streams each step's
  // tokens and runs its scheduler between steps, which the in-process
  // profile of the engine steps does not (idle TPOT measured − simulated).
  double decode_step_overhead_seconds = 0;
  // Disaggregated: from the first token (sampled by the last prefill stage)
  // to the decode worker having the request (KV complete, admitted).
  double handoff_seconds = 0;
  // CPU seconds outside the workers per streamed token: the router's gRPC
  // and HTTP streaming and (measured on one machine) the client's. On the
  // cores the workers compute on, it competes with them
  // (SimOptions::router_shares_cores).
  double delivery_cpu_seconds = 0;
  // Per decode configuration, where it was calibrated on a colocated
  // cluster of its own (the profile's in-process steps and a worker
  // process's differ by configuration: thread hand-offs, streaming); the
  // scalars above stand in for configurations not calibrated.
  struct Calibration {
    double step_overhead_seconds = 0;
    LinearCost colocated_ttft;
  };
  std::map<ComputeConfig, Calibration> calibrated;
  // Cores a step of each configuration keeps busy on average (process CPU
  // time over wall time while profiling): below threads() where ranks wait
  // on each other (a TP all-reduce blocks rather than spins). Processor
  // sharing charges a layout this demand; unprofiled: threads().
  std::map<ComputeConfig, double> busy_cores;
  // How much longer a step takes while another compute process runs on a
  // neighbouring core (0.25: 25% longer), by its kind and the neighbour's:
  // measured side by side in one process, two one-thread workers on two
  // cores, steps beside the other's work over steps alone
  // (tools/planner_profile.h). The processes share the memory bus and the
  // last-level cache, which a step profiled alone does not show; a decode
  // step streams the weights from memory, so beside another decode it loses
  // most. With the cores oversubscribed it adds to processor sharing.
  struct CoRunning {
    double prefill_stage = 0;  // a prefill step beside a decode step
    double decode_step = 0;    // a decode step beside a prefill step
    // Beside a step of its own kind; not measured (a profile from before
    // they were): the values above.
    std::optional<double> decode_beside_decode;
    std::optional<double> prefill_beside_prefill;
    double DecodeBesideDecode() const {
      return decode_beside_decode.value_or(decode_step);
    }
    double PrefillBesidePrefill() const {
      return prefill_beside_prefill.value_or(prefill_stage);
    }
  };
  CoRunning co_running;
  // A step of g threads that wait for each other at every layer (TP ranks,
  // a rank's thread pool) on an oversubscribed node runs at
  // share^(1 + (g − 1) · e) of full speed, where processor sharing gives
  // it `share`: a rank descheduled for a time slice stalls the others. The
  // profile measures e on a real TP worker beside one and beside two busy
  // one-thread workers (tools/planner_profile.h): `gang_sharing_points`,
  // e at each measured share, between which GangExponentAt interpolates;
  // without them (older profiles) `gang_sharing_exponent` at every share.
  // 0.5, its default, is what a TP 2 decode worker measured beside 1 and 2
  // busy one-thread prefill processes on the dev VM (0.60 and 0.38 of full
  // speed, against processor sharing's 0.71 and 0.52: 0.71^1.5 = 0.60,
  // 0.52^1.5 = 0.38; docs/PERFORMANCE.md run 12).
  double gang_sharing_exponent = 0.5;
  struct GangPoint {
    double share = 1;  // processor sharing's share where it was measured
    double exponent = 0;
  };
  std::vector<GangPoint> gang_sharing_points;  // by share, descending
  // e of a gang whose only compute neighbours are other gangs: measured on
  // the TP worker beside a second TP worker decoding (the share is processor
  // sharing's there). Gangs beside gangs lose less than beside busy
  // one-thread workers: a rank that blocks at its all-reduce hands its core
  // to the other gang's rank, which is just as ready to run. On the dev VM a
  // TP 2 worker beside another ran at 1.56-1.81x its alone step time, under
  // processor sharing's 1.79-1.90x, and beside two prefilling workers at
  // 2.14-2.65x against 1.89-1.95x; with the points alone two TP 2 workers'
  // TPOT p99 came out 62% high (run 25). So the exponent may be negative,
  // down to −1 / (g − 1) (full speed), and it is the gang's whole
  // slow-down there: co-running is not applied beside it. Not measured
  // (older profiles, or no gang that oversubscribes the machine beside
  // another): the points.
  std::optional<GangPoint> gang_beside_gang;
  // e at `share`: linear in the share between the measured points, the
  // nearest point's beyond them; `beside_gangs_only` (every other compute
  // job on the node is a gang) takes `gang_beside_gang` where measured.
  double GangExponentAt(double share, bool beside_gangs_only = false) const;
  // Bytes a prefill stage writes to a decode worker per prompt token, all
  // layers (K and V in the profiled engine's KV element type), and bytes of
  // hidden state a stage sends the next per token. Between processes on one
  // node the hand-off's measured costs above hold them; across nodes the
  // simulator sends them over the nodes' links (SimOptions::
  // network_bytes_per_second). 0: not known (a profile from before them).
  double kv_bytes_per_token = 0;
  double activation_bytes_per_token = 0;
  double BusyCores(ComputeConfig config) const;
  double StepOverhead(ComputeConfig config) const;
  LinearCost ColocatedTtft(ComputeConfig config) const;
  // The per-request disaggregation threshold (router
  // --local-prefill-max-tokens): the longest prompt, in whole blocks up to
  // `max_prompt_tokens`, whose idle TTFT is no longer prefilled by a decode
  // worker of `decode` (its calibrated colocated TTFT + the prompt step)
  // than by a stage of `stage` (the disaggregated TTFT + the stage's prompt
  // step + the hand-off). 0 when the group wins from the shortest prompt
  // on, or when either configuration was not profiled. Idle TTFT only: a
  // prompt prefilled on the decode worker also delays its running streams
  // for one step, which the threshold leaves to the TPOT SLO's margin.
  int LocalPrefillCrossover(ComputeConfig decode, ComputeConfig stage,
                            int max_prompt_tokens) const;

  // The step cost of `config`, or NOT_FOUND naming what was profiled.
  absl::StatusOr<const StepCost*> Step(ComputeConfig config) const;

  nlohmann::json ToJson() const;
  static absl::StatusOr<PerfModel> FromJson(const nlohmann::json& json);
  // Reads/writes the JSON file.
  static absl::StatusOr<PerfModel> Load(const std::string& path);
  absl::Status Save(const std::string& path) const;
};

}  // namespace pdserve::planner
