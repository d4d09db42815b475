// Fixtures for the decode worker service tests: stories260K, a DecodeWorker
// with its DecodeService served in process on 127.0.0.1:0, and a test-side
// prefill that computes the prompt's KV with the full-model engine and writes
// it into the worker's sinks through a transport::KvSource (as a prefill
// group does), then reports completion with the first token.
#pragma once

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "common/logging.h"
#include "decode/decode_worker.h"
#include "decode_worker/decode_service.h"
#include "engine/llama_engine.h"
#include "kv/kv_pool.h"
#include "model/weight_source.h"
#include "pdserve/v1/decode.grpc.pb.h"
#include "rpc/server.h"
#include "testing/golden.h"
#include "transport/kv_transfer.h"
#include "transport/ucx_worker.h"

namespace pdserve::decode_worker::testing_util {

namespace v1 = ::pdserve::v1;

// No tokenizer: Debian's libsentencepiece carries its own protobuf 3.14
// and cannot run in a process that uses libprotobuf 3.21 (gRPC); see
// decode_worker/README.md. The service streams tokens only.
struct Model {
  std::unique_ptr<model::WeightSource> weights;
};

inline const Model& Stories() {
  static Model* m = [] {
    auto* model = new Model;
    auto w = model::OpenModel(pdserve::testing::Stories260KGguf());
    PDS_CHECK(w.ok());
    model->weights = std::move(*w);
    return model;
  }();
  return *m;
}

inline std::vector<pdserve::testing::GoldenCase> AllGoldenCases() {
  auto cases = pdserve::testing::LoadGoldenCases("golden.jsonl");
  for (auto& c : pdserve::testing::LoadGoldenCases("golden_long.jsonl"))
    cases.push_back(c);
  return cases;
}

inline std::chrono::system_clock::time_point Deadline(int seconds) {
  return std::chrono::system_clock::now() + std::chrono::seconds(seconds);
}

// A decode worker served in process.
class Server {
 public:
  explicit Server(int tp = 2, absl::Duration kv_lease = absl::Seconds(30),
                  int64_t num_blocks = 128,
                  absl::Duration kv_complete_timeout = absl::Seconds(10)) {
    decode::DecodeWorkerOptions wo;
    wo.tp_size = tp;
    wo.threads_per_rank = 1;
    wo.block_size = 16;
    wo.num_blocks = num_blocks;
    wo.kv_lease = kv_lease * 2 + absl::Seconds(10);
    auto w = decode::DecodeWorker::Create(*Stories().weights, nullptr, wo);
    PDS_CHECK(w.ok()) << w.status();
    worker_ = std::move(*w);
    DecodeServiceOptions so;
    so.model_name = "stories260K";
    so.kv_lease = kv_lease;
    so.kv_complete_timeout = kv_complete_timeout;
    auto s =
        DecodeService::Create(worker_.get(), Stories().weights->config(), so);
    PDS_CHECK(s.ok()) << s.status();
    service_ = std::move(*s);
    auto r = rpc::RunningServer::Start("127.0.0.1:0", {service_.get()});
    PDS_CHECK(r.ok()) << r.status();
    server_ = std::move(*r);
    server_->SetServing(true);
    channel_ = grpc::CreateChannel(server_->address(),
                                   grpc::InsecureChannelCredentials());
    stub_ = v1::DecodeWorker::NewStub(channel_);
  }
  ~Server() {
    server_->Shutdown(1.0);
    server_.reset();
    service_.reset();
    worker_.reset();
  }
  v1::DecodeWorker::Stub& stub() { return *stub_; }
  std::shared_ptr<grpc::Channel> channel() { return channel_; }
  decode::DecodeWorker& worker() { return *worker_; }
  DecodeService& service() { return *service_; }

  v1::DecodeLoad Load() {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(30));
    v1::DecodeLoad load;
    auto s = stub_->GetLoad(&ctx, v1::GetLoadRequest(), &load);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return load;
  }
  // Polls (bounded) until the worker's KV usage is `blocks`.
  bool WaitForBlocksUsed(int64_t blocks, absl::Duration timeout) {
    const absl::Time end = absl::Now() + timeout;
    while (absl::Now() < end) {
      if (Load().kv_blocks_used() == blocks) return true;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return false;
  }

 private:
  std::unique_ptr<decode::DecodeWorker> worker_;
  std::unique_ptr<DecodeService> service_;
  std::unique_ptr<rpc::RunningServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::DecodeWorker::Stub> stub_;
};

// The prefill side: the full-model engine computes the prompt's KV into a
// local pool, a KvSource writes it into every rank's sink.
class TestPrefill {
 public:
  TestPrefill() {
    engine::EngineOptions eo;
    eo.num_threads = 1;
    auto e = engine::LlamaEngine::Create(*Stories().weights, eo);
    PDS_CHECK(e.ok()) << e.status();
    engine_ = std::move(*e);
    auto p = kv::KvPool::Create(engine_->KvLayout(16), kMaxBlocks);
    PDS_CHECK(p.ok());
    pool_ = std::move(*p);
    auto u = transport::UcxWorker::Create();
    PDS_CHECK(u.ok()) << u.status();
    ucx_ = std::move(*u);
  }

  // Computes the prompt's KV and first token (greedy), writes the KV into the
  // destination `admit` names, then calls KvComplete (or with
  // `first_token_override` unless it is -1; with `first_logprob` as token 0's
  // report when given). Returns KvComplete's status. Without
  // `call_complete` it stops after the writes (a stage that died before its
  // notice) and returns OK.
  grpc::Status Run(v1::DecodeWorker::Stub& stub, uint64_t id,
                   const std::vector<int32_t>& prompt,
                   const v1::AdmitResponse& admit,
                   int64_t first_token_override = -1,
                   const v1::TokenLogprob* first_logprob = nullptr,
                   bool call_complete = true) {
    const int n = static_cast<int>(prompt.size());
    const int bs = admit.model().block_size();
    EXPECT_EQ(bs, 16);
    std::vector<int32_t> table((n + bs - 1) / bs);
    for (size_t b = 0; b < table.size(); ++b) table[b] = static_cast<int>(b);
    PDS_CHECK(static_cast<int64_t>(table.size()) <= kMaxBlocks);
    engine::ForwardBatch batch;
    engine::SequenceStep step;
    step.tokens = prompt;
    step.num_tokens = n;
    step.block_table = table;
    step.logit_indices = {n - 1};
    batch.sequences.push_back(step);
    engine::ForwardResult result;
    auto fs = engine_->Forward(batch, *pool_, &result);
    EXPECT_TRUE(fs.ok()) << fs;
    const int32_t first = static_cast<int32_t>(
        std::max_element(result.logits.begin(), result.logits.end()) -
        result.logits.begin());

    const int64_t cached = admit.cached_tokens();
    if (cached < n) {
      if (source_ == nullptr) {
        transport::KvModelSpec spec;
        spec.model_id = admit.model().config_identity();
        spec.dtype = kv::KvDType::kF32;
        spec.block_size = bs;
        spec.head_dim = admit.model().head_dim();
        spec.num_layers = admit.model().num_layers();
        spec.num_kv_heads = admit.model().num_kv_heads();
        auto s = transport::KvSource::Create(ucx_.get(), pool_.get(), spec);
        PDS_CHECK(s.ok()) << s.status();
        source_ = std::move(*s);
      }
      for (const auto& rank : admit.ranks()) {
        if (connected_.insert(rank.sink_descriptor()).second) {
          auto c = source_->Connect(rank.sink_descriptor());
          EXPECT_TRUE(c.ok()) << c.status();
        }
        auto g = source_->AddGrant(rank.grant());
        EXPECT_TRUE(g.ok()) << g;
      }
      // Grant token 0 is prompt position `cached` (block aligned).
      std::vector<int64_t> src(table.begin() + cached / bs, table.end());
      auto h =
          source_->Write(id, src, 0, admit.model().num_layers(), 0, n - cached);
      EXPECT_TRUE(h.ok()) << h.status();
      if (h.ok()) {
        auto ws = (*h)->Wait(absl::Seconds(60));
        EXPECT_TRUE(ws.ok()) << ws;
      }
      source_->Forget(id);
    }
    if (!call_complete) return grpc::Status::OK;
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(60));
    v1::KvCompleteRequest req;
    req.set_request_id(id);
    req.set_first_token(first_token_override == -1
                            ? first
                            : static_cast<int32_t>(first_token_override));
    if (first_logprob != nullptr) {
      *req.mutable_first_token_logprob() = *first_logprob;
    }
    v1::KvCompleteResponse resp;
    return stub.KvComplete(&ctx, req, &resp);
  }

 private:
  static constexpr int64_t kMaxBlocks = 64;
  std::unique_ptr<engine::LlamaEngine> engine_;
  std::unique_ptr<kv::KvPool> pool_;
  std::unique_ptr<transport::UcxWorker> ucx_;
  std::unique_ptr<transport::KvSource> source_;
  std::set<std::string> connected_;
};

// A prefill-side source that holds a request's grant on ONE decode rank
// without writing: connected (so the sink waits for its revoke confirmation)
// and, with `stuck`, never answering revokes (the sink then waits out its
// quarantine), as a source of a frozen or restarting stage would.
class GrantHolder {
 public:
  GrantHolder(const v1::AdmitResponse& admit, int rank, bool stuck) {
    engine::EngineOptions eo;
    eo.num_threads = 1;
    auto e = engine::LlamaEngine::Create(*Stories().weights, eo);
    PDS_CHECK(e.ok()) << e.status();
    auto p = kv::KvPool::Create((*e)->KvLayout(16), 4);
    PDS_CHECK(p.ok());
    pool_ = std::move(*p);
    auto u = transport::UcxWorker::Create();
    PDS_CHECK(u.ok()) << u.status();
    ucx_ = std::move(*u);
    transport::KvModelSpec spec;
    spec.model_id = admit.model().config_identity();
    spec.dtype = kv::KvDType::kF32;
    spec.block_size = admit.model().block_size();
    spec.head_dim = admit.model().head_dim();
    spec.num_layers = admit.model().num_layers();
    spec.num_kv_heads = admit.model().num_kv_heads();
    auto s = transport::KvSource::Create(ucx_.get(), pool_.get(), spec);
    PDS_CHECK(s.ok()) << s.status();
    source_ = std::move(*s);
    const auto& destination = admit.ranks(rank);
    const auto connected = source_->Connect(destination.sink_descriptor());
    EXPECT_TRUE(connected.ok()) << connected.status();
    const absl::Status added = source_->AddGrant(destination.grant());
    EXPECT_TRUE(added.ok()) << added;
    if (stuck) source_->IgnoreRevokesForTest();
  }

 private:
  std::unique_ptr<kv::KvPool> pool_;
  std::unique_ptr<transport::UcxWorker> ucx_;
  std::unique_ptr<transport::KvSource> source_;
};

inline grpc::Status Admit(v1::DecodeWorker::Stub& stub,
                          const v1::AdmitRequest& req,
                          v1::AdmitResponse* resp) {
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(30));
  return stub.Admit(&ctx, req, resp);
}

inline v1::AdmitRequest MakeAdmit(uint64_t id, const std::vector<int32_t>& p,
                                  int max_tokens) {
  v1::AdmitRequest req;
  req.set_request_id(id);
  req.mutable_prompt_ids()->Add(p.begin(), p.end());
  req.set_max_tokens(max_tokens);
  return req;
}

struct Streamed {
  std::vector<int32_t> tokens;
  std::vector<v1::TokenLogprob> logprobs;
  std::string text;
  int deltas = 0;
  bool finished = false;
  v1::FinishReason reason = v1::FINISH_REASON_UNSPECIFIED;
  grpc::Status status;
};

// Reads a whole stream (bounded by the deadline). `after_first` runs once
// the first delta arrived.
template <typename F>
Streamed ReadStream(v1::DecodeWorker::Stub& stub, uint64_t id, F after_first,
                    int deadline_s = 120) {
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(deadline_s));
  v1::StreamTokensRequest req;
  req.set_request_id(id);
  auto reader = stub.StreamTokens(&ctx, req);
  Streamed out;
  v1::DecodeDelta d;
  while (reader->Read(&d)) {
    out.tokens.insert(out.tokens.end(), d.token_ids().begin(),
                      d.token_ids().end());
    out.text += d.text();
    out.logprobs.insert(out.logprobs.end(), d.logprobs().begin(),
                        d.logprobs().end());
    if (++out.deltas == 1) after_first(ctx);
    if (d.finished()) {
      out.finished = true;
      out.reason = d.finish_reason();
    }
  }
  out.status = reader->Finish();
  return out;
}

inline Streamed ReadStream(v1::DecodeWorker::Stub& stub, uint64_t id) {
  return ReadStream(stub, id, [](grpc::ClientContext&) {});
}

}  // namespace pdserve::decode_worker::testing_util
