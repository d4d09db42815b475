// Open-loop load against a router's gRPC API, measured as a client sees it:
// TTFT, TPOT (per request: (last − first) / (tokens − 1)), ITL (gaps between
// streamed items), tokens/s and goodput (requests/s meeting both SLOs). The
// arrivals come from planner::MakeArrivals, so load_bench, planner_bench and
// the planner's predictions all see the same requests.
#pragma once

#include <string>
#include <vector>

#include "absl/time/time.h"
#include "pdserve/v1/generate.grpc.pb.h"
#include "planner/workload.h"

namespace pdserve::tools {

struct RequestResult {
  bool ok = false;
  std::string error;
  double ttft = 0;  // seconds
  double tpot = 0;
  double e2e = 0;
  double first_gap = 0;  // first item to second, seconds (0 if one item)
  int tokens = 0;
  std::vector<double> itl;
  absl::Time end;
};

struct LoadReport {
  std::string name;
  int ok = 0;
  int failed = 0;
  double ttft_p50 = 0, ttft_p99 = 0, tpot_p50 = 0, tpot_p99 = 0, itl_p50 = 0,
         itl_p99 = 0, tokens_per_s = 0, goodput = 0, duration = 0;
  std::vector<RequestResult> requests;  // in arrival order
  // Goodput of these requests under another SLO (same duration).
  double GoodputFor(double slo_ttft, double slo_tpot) const;
};

// One request with token-id prompt, greedy, streamed to the end.
RequestResult RunRequest(v1::Generation::Stub& stub,
                         const std::vector<int32_t>& prompt, int max_tokens);
// The same on a fresh channel (its connection set-up is timed too).
RequestResult RunRequest(const std::string& router_address,
                         const std::vector<int32_t>& prompt, int max_tokens);

// The arrivals open loop (each at its offset from the start, whatever the
// latencies), every request on its own thread.
LoadReport RunLoad(const std::string& name, const std::string& router_address,
                   const std::vector<planner::Arrival>& arrivals,
                   double slo_ttft, double slo_tpot);

void PrintLoadHeader();
void PrintLoad(const LoadReport& report);

}  // namespace pdserve::tools
