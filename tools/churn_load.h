// Closed-loop streaming load for membership changes (the elastic-cluster
// tests and bench/elastic_bench): C clients, each sending the next of a fixed
// set of greedy requests as soon as its last one ended, through the router's
// gRPC API, while the caller scales, drains, restarts or kills workers. Every
// answer is checked against the request's undisturbed answer (token ids and
// text): a stream that lost, repeated or changed a token counts as
// mismatched, one that ended with an error as failed, so "0 failed, 0
// mismatched" is the whole claim of a scenario. TTFT and TPOT are kept per
// request for before/during comparisons.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pdserve::tools {

struct ChurnRequest {
  std::vector<int32_t> prompt_ids;
  int max_tokens = 64;  // always all of them (ignore_eos)
  // The undisturbed answer (Reference() fills them).
  std::vector<int32_t> expected_ids;
  std::string expected_text;
};

struct ChurnOutcome {
  absl::Time start;
  absl::Time end;
  int client = 0;
  int request = 0;       // index into the request set
  int code = 0;          // grpc::StatusCode
  std::string error;     // for a failure
  bool matched = false;  // ids and text equal the expected ones
  std::string mismatch;  // how they differ
  int tokens = 0;
  double ttft = 0;  // seconds
  double tpot = 0;  // seconds per token after the first
  // Longest gap between two streamed items: a migration's stall.
  double longest_gap = 0;
};

// Outcomes of requests that started in [from, to).
struct ChurnSummary {
  int requests = 0;
  int failed = 0;
  int mismatched = 0;
  double ttft_p50 = 0, ttft_p99 = 0, tpot_p50 = 0, tpot_p99 = 0;
  double longest_gap = 0;
  std::string first_failure;  // message of the first failed or mismatched
};
ChurnSummary Summarize(const std::vector<ChurnOutcome>& outcomes,
                       absl::Time from = absl::InfinitePast(),
                       absl::Time to = absl::InfiniteFuture());
std::string Describe(const ChurnSummary& summary);

// Runs each request once, alone, and records its answer as the expected one
// (greedy: what every later run must reproduce). INTERNAL on a failure.
[[nodiscard]] absl::Status Reference(const std::string& router_address,
                                     const std::string& model,
                                     std::vector<ChurnRequest>* requests);

class ChurnLoad {
 public:
  ChurnLoad(std::string router_address, std::string model,
            std::vector<ChurnRequest> requests, int clients);
  ~ChurnLoad();  // Stop()
  ChurnLoad(const ChurnLoad&) = delete;
  ChurnLoad& operator=(const ChurnLoad&) = delete;

  void Start();
  // Lets every client finish the request it is in, then joins them.
  void Stop();
  std::vector<ChurnOutcome> outcomes() const;
  int completed() const { return completed_.load(); }
  // Blocks until `n` more requests completed after the call, or `timeout`.
  bool WaitForMore(int n, absl::Duration timeout) const;

 private:
  void Client(int index);

  const std::string router_address_;
  const std::string model_;
  const std::vector<ChurnRequest> requests_;
  const int clients_;
  std::atomic<bool> stop_{false};
  std::atomic<int> completed_{0};
  std::vector<std::thread> threads_;
  mutable absl::Mutex mu_;
  std::vector<ChurnOutcome> outcomes_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::tools
