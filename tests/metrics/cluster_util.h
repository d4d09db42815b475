// Helpers for tests that run real pdserve processes and a real Prometheus:
// child processes with their output in a log, free loopback ports, the
// Prometheus HTTP API, and one request driven the way the router drives it
// (DecodeWorker.Admit -> PrefillGroup.Prefill -> DecodeWorker.StreamTokens).
#pragma once

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <functional>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "pdserve/v1/decode.grpc.pb.h"
#include "pdserve/v1/prefill.grpc.pb.h"

namespace pdserve::metrics::testing {

inline std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The first "metrics on HOST:PORT" in a log, or "".
inline std::string MetricsAddress(const std::string& log) {
  std::smatch m;
  static const std::regex re("metrics on ([0-9.]+:[0-9]+)");
  return std::regex_search(log, m, re) ? m[1].str() : "";
}

inline int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

// A child process with stdout+stderr in `log`; killed with the test.
class Child {
 public:
  // `env` (NAME=value) replaces the environment when not empty.
  Child(const std::vector<std::string>& argv, const std::string& log,
        const std::vector<std::string>& env = {})
      : log_(log) {
    pid_ = fork();
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, 1);
      dup2(fd, 2);
      std::vector<char*> args;
      std::vector<std::string> copy = argv;
      for (auto& a : copy) args.push_back(a.data());
      args.push_back(nullptr);
      if (env.empty()) {
        execv(args[0], args.data());
      } else {
        std::vector<std::string> env_copy = env;
        std::vector<char*> envp;
        for (auto& e : env_copy) envp.push_back(e.data());
        envp.push_back(nullptr);
        execve(args[0], args.data(), envp.data());
      }
      _exit(127);
    }
  }
  ~Child() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  std::string Log() const { return Slurp(log_); }
  bool Alive() const {
    int status = 0;
    return waitpid(pid_, &status, WNOHANG) == 0;
  }
  // Waits (bounded) until `re`'s first group appears in the log.
  std::string WaitFor(const std::string& pattern, absl::Duration timeout) {
    const std::regex re(pattern);
    const absl::Time end = absl::Now() + timeout;
    while (absl::Now() < end && Alive()) {
      std::smatch m;
      const std::string log = Log();
      if (std::regex_search(log, m, re)) return m[1].str();
      absl::SleepFor(absl::Milliseconds(20));
    }
    ADD_FAILURE() << "no /" << pattern << "/ in " << log_ << ":\n" << Log();
    return "";
  }

 private:
  std::string log_;
  pid_t pid_ = -1;
};

inline nlohmann::json Query(httplib::Client& prom, const std::string& expr) {
  const httplib::Params params = {{"query", expr}};
  auto res = prom.Get("/api/v1/query", params, httplib::Headers{});
  if (!res) return {};
  auto json = nlohmann::json::parse(res->body, nullptr, false);
  return json.is_discarded() ? nlohmann::json{} : json;
}

// Timings of one request as a router sees them.
struct RequestTimes {
  double ttft = -1;
  std::vector<double> gaps;  // between streamed tokens
  double e2e = 0;
};

// One request through a decode worker and a prefill group; the tokens it
// produced (empty on failure, with a test failure).
inline std::vector<int32_t> RunRequest(
    pdserve::v1::DecodeWorker::Stub& decode, const std::string& decode_address,
    const std::function<grpc::Status(const pdserve::v1::PrefillSubmitRequest&,
                                     pdserve::v1::PrefillSubmitResponse*)>&
        prefill,
    uint64_t id, const std::vector<int32_t>& prompt, int max_tokens,
    RequestTimes* times = nullptr) {
  namespace v1 = ::pdserve::v1;
  const absl::Time start = absl::Now();
  v1::AdmitRequest admit;
  admit.set_request_id(id);
  for (int32_t t : prompt) admit.add_prompt_ids(t);
  admit.set_max_tokens(max_tokens);
  v1::AdmitResponse admitted;
  grpc::ClientContext actx;
  actx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  grpc::Status s = decode.Admit(&actx, admit, &admitted);
  if (!s.ok()) {
    ADD_FAILURE() << "Admit: " << s.error_message();
    return {};
  }
  v1::PrefillSubmitRequest submit;
  submit.set_request_id(id);
  for (int32_t t : prompt) submit.add_prompt_ids(t);
  auto* dst = submit.mutable_destination();
  dst->set_decode_address(decode_address);
  dst->set_cached_tokens(admitted.cached_tokens());
  for (const auto& rank : admitted.ranks()) {
    auto* r = dst->add_ranks();
    r->set_sink_descriptor(rank.sink_descriptor());
    r->set_grant(rank.grant());
  }
  v1::PrefillSubmitResponse prefilled;
  s = prefill(submit, &prefilled);
  if (!s.ok()) {
    ADD_FAILURE() << "Prefill: " << s.error_message();
    return {};
  }
  grpc::ClientContext sctx;
  sctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  v1::StreamTokensRequest stream_request;
  stream_request.set_request_id(id);
  auto reader = decode.StreamTokens(&sctx, stream_request);
  v1::DecodeDelta delta;
  std::vector<int32_t> tokens;
  absl::Time last = start;
  RequestTimes local;
  while (reader->Read(&delta)) {
    const absl::Time now = absl::Now();
    if (delta.token_ids_size() > 0) {
      if (local.ttft < 0) {
        local.ttft = absl::ToDoubleSeconds(now - start);
      } else {
        local.gaps.push_back(absl::ToDoubleSeconds(now - last));
      }
      last = now;
    }
    for (int32_t t : delta.token_ids()) tokens.push_back(t);
  }
  s = reader->Finish();
  if (!s.ok()) {
    ADD_FAILURE() << "StreamTokens: " << s.error_message();
    return {};
  }
  local.e2e = absl::ToDoubleSeconds(absl::Now() - start);
  if (times != nullptr) *times = local;
  return tokens;
}

}  // namespace pdserve::metrics::testing
