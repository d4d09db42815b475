#include "tools/load_generator.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstdio>
#include <thread>

#include "absl/time/clock.h"
#include "planner/simulator.h"

namespace pdserve::tools {
namespace {

std::unique_ptr<v1::Generation::Stub> Connect(const std::string& address) {
  return v1::Generation::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
}

}  // namespace

RequestResult RunRequest(v1::Generation::Stub& stub,
                         const std::vector<int32_t>& prompt, int max_tokens) {
  v1::GenerateRequest request;
  request.mutable_token_ids()->mutable_ids()->Add(prompt.begin(), prompt.end());
  request.set_max_tokens(max_tokens);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(300)));
  RequestResult r;
  const absl::Time start = absl::Now();
  absl::Time first = absl::InfinitePast();
  absl::Time last = start;
  auto reader = stub.Generate(&context, request);
  v1::GenerateResponse item;
  while (reader->Read(&item)) {
    if (item.token_ids_size() == 0) continue;
    const absl::Time now = absl::Now();
    if (r.tokens == 0) {
      first = now;
    } else {
      r.itl.push_back(absl::ToDoubleSeconds(now - last));
    }
    last = now;
    r.tokens += item.token_ids_size();
  }
  grpc::Status status = reader->Finish();
  r.end = absl::Now();
  r.ok = status.ok() && r.tokens > 0;
  if (!r.ok) r.error = status.error_message();
  r.ttft = absl::ToDoubleSeconds(first - start);
  r.e2e = absl::ToDoubleSeconds(r.end - start);
  if (!r.itl.empty()) r.first_gap = r.itl.front();
  if (r.tokens > 1) {
    r.tpot = absl::ToDoubleSeconds(last - first) / (r.tokens - 1);
  }
  return r;
}

RequestResult RunRequest(const std::string& router_address,
                         const std::vector<int32_t>& prompt, int max_tokens) {
  auto stub = Connect(router_address);
  return RunRequest(*stub, prompt, max_tokens);
}

LoadReport RunLoad(const std::string& name, const std::string& router_address,
                   const std::vector<planner::Arrival>& arrivals,
                   double slo_ttft, double slo_tpot) {
  auto channel =
      grpc::CreateChannel(router_address, grpc::InsecureChannelCredentials());
  // Connected before the clock starts, as a serving client's channel is:
  // else the first request pays the TCP and HTTP/2 set-up (35-100 ms more
  // TTFT on this VM, often a run's p99).
  channel->WaitForConnected(
      absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  auto stub = v1::Generation::NewStub(channel);
  std::vector<RequestResult> results(arrivals.size());
  std::vector<std::thread> threads;
  threads.reserve(arrivals.size());
  const absl::Time start = absl::Now();
  for (size_t i = 0; i < arrivals.size(); ++i) {
    const absl::Time due = start + absl::Seconds(arrivals[i].seconds);
    if (absl::Now() < due) absl::SleepFor(due - absl::Now());
    threads.emplace_back([&, i] {
      results[i] =
          RunRequest(*stub, arrivals[i].prompt, arrivals[i].max_tokens);
    });
  }
  for (auto& t : threads) t.join();
  LoadReport report;
  report.name = name;
  std::vector<double> ttft, tpot, itl;
  int64_t tokens = 0;
  int good = 0;
  absl::Time end = start;
  for (const RequestResult& r : results) {
    if (!r.ok) {
      ++report.failed;
      if (report.failed == 1) {
        std::fprintf(stderr, "%s: request failed: %s\n", name.c_str(),
                     r.error.c_str());
      }
      continue;
    }
    ++report.ok;
    ttft.push_back(r.ttft);
    if (r.tokens > 1) tpot.push_back(r.tpot);
    itl.insert(itl.end(), r.itl.begin(), r.itl.end());
    tokens += r.tokens;
    end = std::max(end, r.end);
    if (r.ttft <= slo_ttft && (r.tokens <= 1 || r.tpot <= slo_tpot)) ++good;
  }
  report.duration = absl::ToDoubleSeconds(end - start);
  report.ttft_p50 = planner::Percentile(ttft, 0.5);
  report.ttft_p99 = planner::Percentile(ttft, 0.99);
  report.tpot_p50 = planner::Percentile(tpot, 0.5);
  report.tpot_p99 = planner::Percentile(tpot, 0.99);
  report.itl_p50 = planner::Percentile(itl, 0.5);
  report.itl_p99 = planner::Percentile(itl, 0.99);
  report.tokens_per_s = report.duration > 0 ? tokens / report.duration : 0;
  report.goodput = report.duration > 0 ? good / report.duration : 0;
  report.requests = std::move(results);
  return report;
}

double LoadReport::GoodputFor(double slo_ttft, double slo_tpot) const {
  int good = 0;
  for (const RequestResult& r : requests) {
    if (r.ok && r.ttft <= slo_ttft && (r.tokens <= 1 || r.tpot <= slo_tpot)) {
      ++good;
    }
  }
  return duration > 0 ? good / duration : 0;
}

void PrintLoadHeader() {
  std::printf("%-34s %5s %5s %9s %9s %9s %9s %8s %8s %9s %9s\n", "run", "ok",
              "fail", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50",
              "ITL p99", "tok/s", "goodput");
}

void PrintLoad(const LoadReport& r) {
  std::printf(
      "%-34s %5d %5d %7.1fms %7.1fms %7.2fms %7.2fms %6.2fms %6.2fms %9.0f "
      "%7.2f/s\n",
      r.name.c_str(), r.ok, r.failed, r.ttft_p50 * 1e3, r.ttft_p99 * 1e3,
      r.tpot_p50 * 1e3, r.tpot_p99 * 1e3, r.itl_p50 * 1e3, r.itl_p99 * 1e3,
      r.tokens_per_s, r.goodput);
  std::fflush(stdout);
}

}  // namespace pdserve::tools
