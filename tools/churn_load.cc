#include "tools/churn_load.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "pdserve/v1/generate.grpc.pb.h"

namespace pdserve::tools {
namespace {

struct Answer {
  grpc::Status status;
  std::vector<int32_t> ids;
  std::string text;
  absl::Time first = absl::InfinitePast();
  absl::Time last;
  double longest_gap = 0;
};

Answer Generate(v1::Generation::Stub& stub, const std::string& model,
                const ChurnRequest& request) {
  v1::GenerateRequest wire;
  wire.set_model(model);
  wire.mutable_token_ids()->mutable_ids()->Add(request.prompt_ids.begin(),
                                               request.prompt_ids.end());
  wire.set_max_tokens(request.max_tokens);
  wire.set_ignore_eos(true);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
  auto reader = stub.Generate(&context, wire);
  Answer answer;
  v1::GenerateResponse item;
  while (reader->Read(&item)) {
    const absl::Time now = absl::Now();
    if (item.token_ids_size() > 0) {
      if (answer.first == absl::InfinitePast()) {
        answer.first = now;
      } else {
        answer.longest_gap = std::max(answer.longest_gap,
                                      absl::ToDoubleSeconds(now - answer.last));
      }
      answer.last = now;
    }
    answer.ids.insert(answer.ids.end(), item.token_ids().begin(),
                      item.token_ids().end());
    answer.text += item.text();
  }
  answer.status = reader->Finish();
  return answer;
}

double Percentile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t k = std::min(values.size() - 1,
                            static_cast<size_t>(q * (values.size() - 1) + 0.5));
  return values[k];
}

std::unique_ptr<v1::Generation::Stub> Connect(const std::string& address) {
  return v1::Generation::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
}

}  // namespace

ChurnSummary Summarize(const std::vector<ChurnOutcome>& outcomes,
                       absl::Time from, absl::Time to) {
  ChurnSummary s;
  std::vector<double> ttft;
  std::vector<double> tpot;
  for (const ChurnOutcome& o : outcomes) {
    if (o.start < from || o.start >= to) continue;
    ++s.requests;
    if (o.code != 0) {
      ++s.failed;
      if (s.first_failure.empty()) {
        s.first_failure = absl::StrCat("request ", o.request, ": code ", o.code,
                                       " ", o.error);
      }
      continue;
    }
    if (!o.matched) {
      ++s.mismatched;
      if (s.first_failure.empty()) {
        s.first_failure = absl::StrCat("request ", o.request, ": ", o.mismatch);
      }
    }
    ttft.push_back(o.ttft);
    if (o.tokens > 1) tpot.push_back(o.tpot);
    s.longest_gap = std::max(s.longest_gap, o.longest_gap);
  }
  s.ttft_p50 = Percentile(ttft, 0.5);
  s.ttft_p99 = Percentile(ttft, 0.99);
  s.tpot_p50 = Percentile(tpot, 0.5);
  s.tpot_p99 = Percentile(tpot, 0.99);
  return s;
}

std::string Describe(const ChurnSummary& s) {
  return absl::StrFormat(
      "%d requests, %d failed, %d mismatched; TTFT p50 %.1f ms p99 %.1f ms, "
      "TPOT p50 %.2f ms p99 %.2f ms, longest stall %.0f ms%s%s",
      s.requests, s.failed, s.mismatched, s.ttft_p50 * 1e3, s.ttft_p99 * 1e3,
      s.tpot_p50 * 1e3, s.tpot_p99 * 1e3, s.longest_gap * 1e3,
      s.first_failure.empty() ? "" : "; first: ", s.first_failure);
}

absl::Status Reference(const std::string& router_address,
                       const std::string& model,
                       std::vector<ChurnRequest>* requests) {
  auto stub = Connect(router_address);
  for (size_t i = 0; i < requests->size(); ++i) {
    ChurnRequest& r = (*requests)[i];
    const Answer answer = Generate(*stub, model, r);
    if (!answer.status.ok() ||
        static_cast<int>(answer.ids.size()) != r.max_tokens) {
      return absl::InternalError(absl::StrCat(
          "reference run of request ", i, ": ", answer.status.error_message(),
          " (", answer.ids.size(), " of ", r.max_tokens, " tokens)"));
    }
    r.expected_ids = answer.ids;
    r.expected_text = answer.text;
  }
  return absl::OkStatus();
}

ChurnLoad::ChurnLoad(std::string router_address, std::string model,
                     std::vector<ChurnRequest> requests, int clients)
    : router_address_(std::move(router_address)),
      model_(std::move(model)),
      requests_(std::move(requests)),
      clients_(clients) {}

ChurnLoad::~ChurnLoad() { Stop(); }

void ChurnLoad::Start() {
  for (int c = 0; c < clients_; ++c) {
    threads_.emplace_back([this, c] { Client(c); });
  }
}

void ChurnLoad::Stop() {
  stop_.store(true);
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
  threads_.clear();
}

std::vector<ChurnOutcome> ChurnLoad::outcomes() const {
  absl::MutexLock lock(&mu_);
  return outcomes_;
}

bool ChurnLoad::WaitForMore(int n, absl::Duration timeout) const {
  const int target = completed_.load() + n;
  const absl::Time deadline = absl::Now() + timeout;
  while (completed_.load() < target) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

void ChurnLoad::Client(int index) {
  // A channel per client, as separate users have.
  auto stub = Connect(router_address_);
  int next = index % static_cast<int>(requests_.size());
  while (!stop_.load()) {
    const ChurnRequest& request = requests_[next];
    ChurnOutcome o;
    o.client = index;
    o.request = next;
    o.start = absl::Now();
    const Answer answer = Generate(*stub, model_, request);
    o.end = absl::Now();
    o.code = static_cast<int>(answer.status.error_code());
    o.error = answer.status.error_message();
    o.tokens = static_cast<int>(answer.ids.size());
    o.longest_gap = answer.longest_gap;
    if (answer.first != absl::InfinitePast()) {
      o.ttft = absl::ToDoubleSeconds(answer.first - o.start);
      if (o.tokens > 1) {
        o.tpot =
            absl::ToDoubleSeconds(answer.last - answer.first) / (o.tokens - 1);
      }
    }
    o.matched = answer.ids == request.expected_ids &&
                answer.text == request.expected_text;
    if (!o.matched && answer.status.ok()) {
      size_t k = 0;
      while (k < answer.ids.size() && k < request.expected_ids.size() &&
             answer.ids[k] == request.expected_ids[k]) {
        ++k;
      }
      o.mismatch = absl::StrCat(
          answer.ids.size(), " tokens where ", request.expected_ids.size(),
          " were expected, first difference at ", k,
          answer.ids == request.expected_ids ? " (ids equal, text differs)"
                                             : "");
    }
    {
      absl::MutexLock lock(&mu_);
      outcomes_.push_back(std::move(o));
    }
    const bool failed = answer.status.error_code() != grpc::StatusCode::OK;
    completed_.fetch_add(1);
    next = (next + 1) % static_cast<int>(requests_.size());
    // A refused request comes back at once: a user retrying in a loop
    // waits a little.
    if (failed) absl::SleepFor(absl::Milliseconds(100));
  }
}

}  // namespace pdserve::tools
