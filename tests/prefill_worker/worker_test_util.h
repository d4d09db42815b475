// Test harness for real prefill_worker processes: starts a group (stages
// S-1..1, then stage 0 with their addresses, every port chosen by the
// process and read back from a file), two decode-rank KvSinks standing in
// for a decode worker's TP ranks, and a fake DecodeWorker gRPC endpoint that
// records KvComplete notices. Every wait is bounded; the destructor kills
// every child (children also die with the test via PR_SET_PDEATHSIG).
#pragma once

#include <fcntl.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "engine/engine_test_util.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "kv/kv_pool.h"
#include "pdserve/v1/prefill.grpc.pb.h"
#include "testing/golden.h"
#include "transport/kv_transfer.h"
#include "transport/ucx_worker.h"

namespace pdserve::prefill::testing {

inline constexpr int kBlockSize = 16;
inline constexpr int kRanks = 2;
inline constexpr int64_t kSinkBlocks = 256;

// A DecodeWorker stand-in: answers /pdserve.v1.DecodeWorker/KvComplete with
// an empty message and records each notice.
class FakeDecode : public grpc::CallbackGenericService {
 public:
  struct Notice {
    uint64_t request_id;
    int32_t first_token;
    pdserve::v1::TokenLogprob first_token_logprob;
  };
  FakeDecode() {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port_);
    builder.RegisterCallbackGenericService(this);
    server_ = builder.BuildAndStart();
  }
  ~FakeDecode() override {
    server_->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::seconds(1));
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  std::vector<Notice> notices() const {
    absl::MutexLock lock(&mu_);
    return notices_;
  }

  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* context) override {
    class Reactor : public grpc::ServerGenericBidiReactor {
     public:
      Reactor(FakeDecode* owner, std::string method)
          : owner_(owner), method_(std::move(method)) {
        StartRead(&request_);
      }
      void OnReadDone(bool ok) override {
        if (!ok) {
          Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no body"));
          return;
        }
        if (method_ != "/pdserve.v1.DecodeWorker/KvComplete") {
          Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, method_));
          return;
        }
        std::vector<grpc::Slice> slices;
        (void)request_.Dump(&slices);
        std::string bytes;
        for (const auto& s : slices) {
          bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
        }
        pdserve::v1::KvCompleteRequest notice;
        if (!notice.ParseFromString(bytes)) {
          Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "parse"));
          return;
        }
        {
          absl::MutexLock lock(&owner_->mu_);
          owner_->notices_.push_back({notice.request_id(), notice.first_token(),
                                      notice.first_token_logprob()});
        }
        // An empty message still needs a (zero-length) slice.
        grpc::Slice empty(std::string{});
        response_ = grpc::ByteBuffer(&empty, 1);
        StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
      }
      void OnDone() override { delete this; }

     private:
      FakeDecode* owner_;
      std::string method_;
      grpc::ByteBuffer request_;
      grpc::ByteBuffer response_;  // empty = KvCompleteResponse{}
    };
    return new Reactor(this, context->method());
  }

 private:
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  mutable absl::Mutex mu_;
  std::vector<Notice> notices_ ABSL_GUARDED_BY(mu_);
};

// Two TP ranks, each all layers and half of the KV heads.
struct DecodeRanks {
  std::vector<std::unique_ptr<transport::UcxWorker>> workers;
  std::vector<std::unique_ptr<kv::KvPool>> pools;
  std::vector<std::unique_ptr<transport::KvSink>> sinks;
  int heads_per_rank = 0;

  explicit DecodeRanks(const model::ModelConfig& config) {
    const transport::KvModelSpec spec{config.Identity(), kv::KvDType::kF32,
                                      kBlockSize,        config.head_dim,
                                      config.num_layers, config.num_kv_heads};
    heads_per_rank = config.num_kv_heads / kRanks;
    for (int r = 0; r < kRanks; ++r) {
      auto worker = transport::UcxWorker::Create();
      EXPECT_TRUE(worker.ok()) << worker.status();
      kv::KvCacheLayout layout{config.num_layers,  0,          heads_per_rank,
                               r * heads_per_rank, kBlockSize, config.head_dim,
                               kv::KvDType::kF32};
      auto pool = kv::KvPool::Create(layout, kSinkBlocks);
      EXPECT_TRUE(pool.ok());
      transport::KvSinkOptions options;
      options.revoke_quarantine = absl::Seconds(2);
      auto sink =
          transport::KvSink::Create(worker->get(), pool->get(), spec, options);
      EXPECT_TRUE(sink.ok()) << sink.status();
      workers.push_back(std::move(*worker));
      pools.push_back(std::move(*pool));
      sinks.push_back(std::move(*sink));
    }
  }
  ~DecodeRanks() {
    sinks.clear();
    pools.clear();
    workers.clear();
  }
  int64_t active() const {
    int64_t n = 0;
    for (const auto& s : sinks) n += s->active_requests();
    return n;
  }
};

class WorkerGroup {
 public:
  // Starts S processes; `extra` flags go to every stage; with
  // `trace_steps` each stage writes its --step-trace at StepTrace(stage).
  // Fails the test (and leaves stub() null) when the group does not come up
  // within 60 s.
  WorkerGroup(int stages, const std::string& split,
              std::vector<std::string> extra = {}, bool trace_steps = false)
      : stages_(stages) {
    char tmpl[] = "/tmp/prefill_worker_test.XXXXXX";
    dir_ = mkdtemp(tmpl);
    std::vector<std::string> peers(stages);
    for (int i = stages - 1; i >= 0; --i) {
      std::vector<std::string> args = {
          "--model",       pdserve::testing::Stories260KGguf(),
          "--stage",       std::to_string(i),
          "--stages",      std::to_string(stages),
          "--layer-split", split,
          "--host",        "127.0.0.1",
          "--port",        "0",
          "--port-file",   PortFile(i),
          "--block-size",  std::to_string(kBlockSize),
          "--num-blocks",  "256"};
      if (i == 0 && stages > 1) {
        args.push_back("--peers");
        args.push_back(absl::StrJoin(peers.begin() + 1, peers.end(), ","));
      }
      for (const auto& e : extra) args.push_back(e);
      if (trace_steps) {
        args.push_back("--step-trace");
        args.push_back(StepTrace(i));
      }
      pids_.insert(pids_.begin(), Spawn(args, absl::StrCat(dir_, "/log", i)));
      // Stage 0 needs every later stage's address; they come up in parallel
      // otherwise (stage 0 waits for them itself).
      if (i > 0) {
        peers[i] = WaitForFile(PortFile(i), absl::Seconds(60));
        if (peers[i].empty()) return;
      }
    }
    address_ = WaitForFile(PortFile(0), absl::Seconds(60));
    if (address_.empty()) return;
    auto channel =
        grpc::CreateChannel(address_, grpc::InsecureChannelCredentials());
    stub_ = pdserve::v1::PrefillGroup::NewStub(channel);
    health_ = grpc::health::v1::Health::NewStub(channel);
  }
  ~WorkerGroup() {
    for (pid_t pid : pids_) {
      if (pid > 0) {
        kill(pid, SIGCONT);
        kill(pid, SIGKILL);
      }
    }
    for (pid_t pid : pids_) {
      if (pid > 0) waitpid(pid, nullptr, 0);
    }
    std::system(absl::StrCat("rm -rf ", dir_).c_str());
  }

  pdserve::v1::PrefillGroup::Stub* stub() { return stub_.get(); }
  std::string StepTrace(int stage) const {
    return absl::StrCat(dir_, "/steps", stage, ".csv");
  }
  pid_t pid(int stage) const { return pids_[stage]; }
  void Signal(int stage, int sig) { kill(pids_[stage], sig); }
  void Kill(int stage) {
    kill(pids_[stage], SIGKILL);
    waitpid(pids_[stage], nullptr, 0);
    pids_[stage] = -1;
  }
  std::string Log(int stage) const {
    std::ifstream in(absl::StrCat(dir_, "/log", stage));
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  std::string Logs() const {
    std::string all;
    for (int i = 0; i < stages_; ++i) {
      absl::StrAppend(&all, "--- stage ", i, "\n", Log(i));
    }
    return all;
  }

  // grpc.health.v1 status of the whole server ("" service).
  grpc::health::v1::HealthCheckResponse::ServingStatus Health() {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(5));
    grpc::health::v1::HealthCheckRequest request;
    grpc::health::v1::HealthCheckResponse response;
    grpc::Status s = health_->Check(&context, request, &response);
    if (!s.ok()) return grpc::health::v1::HealthCheckResponse::UNKNOWN;
    return response.status();
  }

  grpc::Status Prefill(const pdserve::v1::PrefillSubmitRequest& request,
                       pdserve::v1::PrefillSubmitResponse* response,
                       absl::Duration timeout = absl::Seconds(30)) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    return stub_->Prefill(&context, request, response);
  }

 private:
  std::string PortFile(int stage) const {
    return absl::StrCat(dir_, "/port", stage);
  }
  static pid_t Spawn(const std::vector<std::string>& args,
                     const std::string& log) {
    pid_t pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
      }
      std::vector<char*> argv;
      std::string bin = PREFILL_WORKER;
      argv.push_back(bin.data());
      std::vector<std::string> copy = args;
      for (auto& a : copy) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(bin.c_str(), argv.data());
      _exit(127);
    }
    return pid;
  }
  // The file's first line once it exists; "" (and a test failure) on timeout
  // or when a child died.
  std::string WaitForFile(const std::string& path, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      std::ifstream in(path);
      std::string line;
      if (in && std::getline(in, line) && !line.empty()) return line;
      for (pid_t pid : pids_) {
        int status = 0;
        if (pid > 0 && waitpid(pid, &status, WNOHANG) == pid) {
          ADD_FAILURE() << "a prefill_worker exited early\n" << Logs();
          return "";
        }
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    ADD_FAILURE() << "timed out waiting for " << path << "\n" << Logs();
    return "";
  }

  const int stages_;
  std::string dir_;
  std::vector<pid_t> pids_;
  std::string address_;
  std::unique_ptr<pdserve::v1::PrefillGroup::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
};

// A request for `prompt` whose KV goes to `ranks` blocks `dst` (prompt
// positions [cached, n) as grant tokens [0, n - cached)).
inline pdserve::v1::PrefillSubmitRequest MakeRequest(
    uint64_t id, const std::vector<int32_t>& prompt, DecodeRanks& ranks,
    const std::vector<int64_t>& dst, int64_t cached,
    const std::string& decode_address) {
  pdserve::v1::PrefillSubmitRequest request;
  request.set_request_id(id);
  for (int32_t t : prompt) request.add_prompt_ids(t);
  auto* destination = request.mutable_destination();
  destination->set_decode_address(decode_address);
  destination->set_cached_tokens(cached);
  for (auto& sink : ranks.sinks) {
    auto grant = sink->Expect(id, static_cast<int64_t>(prompt.size()) - cached,
                              dst, absl::Seconds(20));
    EXPECT_TRUE(grant.ok()) << grant.status();
    auto* rank = destination->add_ranks();
    rank->set_sink_descriptor(sink->descriptor());
    rank->set_grant(grant.ok() ? *grant : "");
  }
  return request;
}

}  // namespace pdserve::prefill::testing
