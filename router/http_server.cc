#include "router/http_server.h"

#include <dirent.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>
#include <cstdlib>
#include <deque>
#include <optional>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/version.h"
#include "router/openai_api.h"

namespace pdserve::router {
namespace {

// Shuts down (both ways) every connection this process accepted on TCP port
// `port` other than `listener`: the server's own connections, found
// through /proc/self/fd. Called once the listener is closed, so no new one
// appears meanwhile; the descriptors stay open (their threads close them),
// only their reads end. cpp-httplib gives no handle on accepted sockets.
void ShutdownConnections(int port, int listener) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return;
  while (dirent* entry = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || fd == listener ||
        fd == dirfd(dir)) {
      continue;
    }
    const int sock = static_cast<int>(fd);
    int type = 0;
    int listening = 0;
    socklen_t length = sizeof(type);
    if (getsockopt(sock, SOL_SOCKET, SO_TYPE, &type, &length) != 0 ||
        type != SOCK_STREAM) {
      continue;
    }
    length = sizeof(listening);
    if (getsockopt(sock, SOL_SOCKET, SO_ACCEPTCONN, &listening, &length) != 0 ||
        listening != 0) {
      continue;
    }
    sockaddr_storage local{};
    sockaddr_storage peer{};
    socklen_t local_length = sizeof(local);
    socklen_t peer_length = sizeof(peer);
    if (getsockname(sock, reinterpret_cast<sockaddr*>(&local), &local_length) !=
            0 ||
        getpeername(sock, reinterpret_cast<sockaddr*>(&peer), &peer_length) !=
            0) {
      continue;
    }
    int local_port = -1;
    if (local.ss_family == AF_INET) {
      local_port = ntohs(reinterpret_cast<sockaddr_in*>(&local)->sin_port);
    } else if (local.ss_family == AF_INET6) {
      local_port = ntohs(reinterpret_cast<sockaddr_in6*>(&local)->sin6_port);
    }
    if (local_port == port) shutdown(sock, SHUT_RDWR);
  }
  closedir(dir);
}

// How long a blocked handler sleeps between checks of the server's stop flag.
constexpr absl::Duration kPollSlice = absl::Milliseconds(100);
// Past the deadline the backend gets this long to report DEADLINE_EXCEEDED
// itself before the front-end gives up on it.
constexpr absl::Duration kDeadlineGrace = absl::Seconds(1);
constexpr int kListenBacklog = 1024;

// The metrics `api` label of a request cpp-httplib refused before any of
// our handlers ran: the endpoint's own label where the path is one.
std::string ApiOfPath(const std::string& path) {
  if (path == "/v1/completions") return "openai_completions";
  if (path == "/v1/chat/completions") return "openai_chat";
  return "http_other";
}

// The methods a known path takes (the Allow header of a 405), or null for a
// path that is not a route.
const char* AllowedMethods(const std::string& path) {
  if (path == "/v1/completions" || path == "/v1/chat/completions" ||
      path == "/tokenize" || path == "/detokenize") {
    return "POST";
  }
  if (path == "/v1/models" || absl::StartsWith(path, "/v1/models/") ||
      path == "/health" || path == "/version") {
    return "GET";
  }
  return nullptr;
}

// The status code such a refusal is counted under. An oversized body is
// RESOURCE_EXHAUSTED, as gRPC reports a message over its size limit.
absl::StatusCode StatusCodeOfHttpError(int http_status) {
  switch (http_status) {
    case 400:
      return absl::StatusCode::kInvalidArgument;
    case 404:
    case 405:
      return absl::StatusCode::kNotFound;
    case 413:
    case 414:
    case 431:
      return absl::StatusCode::kResourceExhausted;
    default:
      return absl::StatusCode::kUnknown;
  }
}

// One HTTP request's events, for each of its choices (OpenAI's `n`: one
// backend call per choice), filled by the backend's callbacks and drained by
// the connection thread. Keeps itself alive until every call's OnDone, so the
// connection may go away first (client disconnect) without a dangling
// observer.
class StreamBuffer : public std::enable_shared_from_this<StreamBuffer> {
 public:
  struct Event {
    int choice = 0;
    std::optional<GenerationDelta> delta;  // else: that choice's final status
    absl::Status status;
  };

  // Starts one call per request (choice i is requests[i]); with `stagger`,
  // choice 0 now and the rest once choice 0 delivered its first delta (see
  // HttpServerOptions::stagger_choices). When the backend refuses a choice
  // started here, the calls already started are cancelled and the refusal is
  // returned (their events still arrive and are ignored); a refusal of a
  // staggered choice arrives as that choice's final event.
  absl::Status Start(GenerationBackend* backend,
                     std::vector<GenerationRequest> requests, bool stagger) {
    const int n = static_cast<int>(requests.size());
    const int now = stagger ? 1 : n;
    {
      absl::MutexLock lock(&mu_);
      keep_alive_ = shared_from_this();
      backend_ = backend;
      running_ = n;
      for (int i = 0; i < n; ++i) {
        observers_.push_back(std::make_unique<ChoiceObserver>(this, i));
      }
      for (int i = now; i < n; ++i) deferred_.push_back(std::move(requests[i]));
    }
    for (int i = 0; i < now; ++i) {
      absl::StatusOr<std::unique_ptr<GenerationCall>> call =
          backend->Start(std::move(requests[i]), observers_[i].get());
      absl::MutexLock lock(&mu_);
      if (!call.ok()) {
        // Choices i.. never get a callback; the started ones are told to
        // stop. The caller holds a reference, so dropping ours here does
        // not destroy us.
        running_ -= n - i;
        deferred_.clear();
        cancel_requested_ = true;
        for (auto& started : calls_) started->Cancel();
        if (running_ == 0) keep_alive_.reset();
        return call.status();
      }
      calls_.push_back(std::move(call).value());
      if (cancel_requested_) calls_.back()->Cancel();
    }
    return absl::OkStatus();
  }

  void Cancel() {
    absl::MutexLock lock(&mu_);
    cancel_requested_ = true;
    if (running_ > 0) {
      for (auto& call : calls_) call->Cancel();
    }
  }

  // Next event of any choice, or nullopt when `until` passes first.
  std::optional<Event> Next(absl::Time until) {
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return !events_.empty();
    };
    mu_.AwaitWithDeadline(absl::Condition(&ready), until);
    if (events_.empty()) return std::nullopt;
    Event event = std::move(events_.front());
    events_.pop_front();
    return event;
  }

 private:
  class ChoiceObserver : public GenerationObserver {
   public:
    ChoiceObserver(StreamBuffer* owner, int index)
        : owner_(owner), index_(index) {}
    void OnDelta(GenerationDelta delta) override {
      owner_->OnDelta(index_, std::move(delta));
    }
    // May destroy the buffer (and this observer): nothing after the call.
    void OnDone(absl::Status status) override {
      owner_->OnDone(index_, std::move(status));
    }

   private:
    StreamBuffer* const owner_;
    const int index_;
  };

  void OnDelta(int choice, GenerationDelta delta) {
    std::vector<GenerationRequest> deferred;
    {
      absl::MutexLock lock(&mu_);
      events_.push_back({choice, std::move(delta), absl::OkStatus()});
      if (choice == 0 && !cancel_requested_) deferred.swap(deferred_);
    }
    if (!deferred.empty()) StartDeferred(std::move(deferred));
  }

  // The staggered choices 1.., on choice 0's callback thread (the backend
  // contract allows Start from there: no lock of ours is held).
  void StartDeferred(std::vector<GenerationRequest> deferred) {
    const int first = static_cast<int>(observers_.size() - deferred.size());
    for (size_t k = 0; k < deferred.size(); ++k) {
      const int choice = first + static_cast<int>(k);
      absl::StatusOr<std::unique_ptr<GenerationCall>> call =
          backend_->Start(std::move(deferred[k]), observers_[choice].get());
      if (!call.ok()) {
        // As if the call had failed at once: the front-end fails the
        // request (and cancels the others) on this event.
        OnDone(choice, call.status());
        continue;
      }
      absl::MutexLock lock(&mu_);
      calls_.push_back(std::move(call).value());
      if (cancel_requested_) calls_.back()->Cancel();
    }
  }

  void OnDone(int choice, absl::Status status) {
    std::shared_ptr<StreamBuffer> self;
    {
      absl::MutexLock lock(&mu_);
      events_.push_back({choice, std::nullopt, std::move(status)});
      // Choice 0 ended before its first delta (an error) or the request was
      // cancelled: the staggered choices never start.
      if (choice == 0 && !deferred_.empty()) {
        running_ -= static_cast<int>(deferred_.size());
        deferred_.clear();
      }
      if (--running_ == 0) self = std::move(keep_alive_);
    }
    // `self` may be the last reference: nothing touches members past here.
  }

  absl::Mutex mu_;
  std::vector<std::unique_ptr<ChoiceObserver>> observers_;  // set in Start
  GenerationBackend* backend_ = nullptr;                    // set in Start
  // Staggered choices not started yet (the last ones, in order).
  std::vector<GenerationRequest> deferred_ ABSL_GUARDED_BY(mu_);
  std::deque<Event> events_ ABSL_GUARDED_BY(mu_);
  int running_ ABSL_GUARDED_BY(mu_) = 0;  // calls without their OnDone yet
  bool cancel_requested_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::unique_ptr<GenerationCall>> calls_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<StreamBuffer> keep_alive_ ABSL_GUARDED_BY(mu_);
};

// One admitted generate request, as its responders need it.
struct GenerateReply {
  OpenAiEndpoint endpoint = OpenAiEndpoint::kCompletions;
  std::string id;  // cmpl-... / chatcmpl-...
  int64_t created = 0;
  std::string model;
  bool logprobs = false;  // as the client asked (best_of may force them on)
  int32_t top_logprobs = 0;
  int n = 1;            // choices returned
  int candidates = 1;   // per prompt, generated (best_of)
  int num_choices = 1;  // generated: prompts x candidates
  absl::Time deadline;
  ToolCallFormat tool_format = ToolCallFormat::kNone;
  std::string answer_prefix;  // forced opening of the answer (tool calls)
  bool include_usage = false;
};

// Choice p * candidates + i: prompt p's i-th, its own request (id suffix)
// with seed + i, so sampled choices differ and a fixed seed reproduces all
// of them.
std::vector<GenerationRequest> ChoiceRequests(
    const GenerationRequest& generation,
    const std::vector<PromptInput>& prompts, const GenerateReply& reply) {
  const int num_prompts = reply.num_choices / reply.candidates;
  std::vector<GenerationRequest> choices;
  for (int p = 0; p < num_prompts; ++p) {
    for (int i = 0; i < reply.candidates; ++i) {
      GenerationRequest& choice = choices.emplace_back(generation);
      if (p > 0) {
        choice.prompt_text = prompts[p].text;
        choice.prompt_ids = prompts[p].ids;
      }
      if (reply.num_choices > 1) {
        absl::StrAppend(&choice.request_id, "-", p * reply.candidates + i);
      }
      choice.sampling.seed += static_cast<uint64_t>(i);
    }
  }
  return choices;
}

// Adds one delta of a unary (non-streaming) choice to its outcome.
void AccumulateDelta(GenerationDelta& delta, bool logprobs,
                     CompletionOutcome& outcome) {
  if (delta.echo.has_value()) {
    // The first delta: the prompt comes before anything generated.
    PromptEcho& echo = *delta.echo;
    outcome.text = echo.text + outcome.text;
    outcome.logprobs.text_offset = TextCharacters(echo.text);
    if (logprobs) outcome.logprobs.prompt = std::move(echo);
  }
  outcome.text += delta.text;
  for (TokenLogprob& l : delta.logprobs) {
    outcome.logprobs.tokens.push_back(std::move(l));
  }
  if (delta.finished) {
    outcome.finish_reason = delta.finish_reason;
    outcome.usage = delta.usage;
  }
}

void SendError(httplib::Response& res, const absl::Status& status) {
  res.status = HttpStatusFor(status);
  res.set_content(ErrorBody(status), "application/json");
}

int64_t NowUnixSeconds() { return absl::ToUnixSeconds(absl::Now()); }

}  // namespace

class OpenAiHttpServer::Impl {
 public:
  Impl(const HttpServerOptions& options, GenerationBackend* backend)
      : options_(options), backend_(backend) {}

  ~Impl() { Stop(); }

  absl::Status Start() {
    if (absl::Status s = CreateServer(); !s.ok()) return s;
    InstallAuthentication();
    server_->set_keep_alive_timeout(
        std::max<int64_t>(1, absl::ToInt64Seconds(options_.keep_alive)));
    server_->set_keep_alive_max_count(
        static_cast<size_t>(std::max(1, options_.keep_alive_requests)));
    if (options_.draining) {
      // A draining router hands its clients to the other replicas.
      server_->set_post_routing_handler(
          [this](const httplib::Request&, httplib::Response& res) {
            if (options_.draining()) res.set_header("Connection", "close");
          });
    }
    InstallRoutes();
    InstallErrorHandler();
    return BindAndListen();
  }

  void Stop() {
    if (stopped_.exchange(true)) return;
    if (server_ == nullptr) return;  // Start() failed before creating it
    server_->stop();
    // httplib waits out each idle keep-alive connection's timeout before its
    // thread ends; end them now (streams in flight end too: NextEvent sees
    // stopped_ and cancels them).
    ShutdownConnections(port_, listen_fd_);
    if (listener_.joinable()) listener_.join();
  }

  int port() const { return port_; }

 private:
  // The server (TLS or plain), its threads and its body limit.
  absl::Status CreateServer() {
    if (absl::Status s = rpc::CheckTlsFiles(options_.tls); !s.ok()) return s;
    if (options_.tls.enabled()) {
      auto tls = std::make_unique<httplib::SSLServer>(
          options_.tls.cert_file.c_str(), options_.tls.key_file.c_str(),
          options_.tls.client_ca_file.empty()
              ? nullptr
              : options_.tls.client_ca_file.c_str());
      if (!tls->is_valid()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "cannot use TLS certificate ", options_.tls.cert_file, " / key ",
            options_.tls.key_file,
            " (not a matching PEM pair, or an unreadable client CA)"));
      }
      server_ = std::move(tls);
    } else {
      server_ = std::make_unique<httplib::Server>();
    }
    const int threads = std::max(2, options_.threads);
    server_->new_task_queue = [threads] {
      return new httplib::ThreadPool(static_cast<size_t>(threads));
    };
    server_->set_payload_max_length(options_.max_body_bytes);
    return absl::OkStatus();
  }

  void InstallAuthentication() {
    // API keys: every /v1/ route and /tokenize, /detokenize check the caller
    // before any work (/health, /version and /metrics stay open).
    server_->set_pre_routing_handler([this](const httplib::Request& req,
                                            httplib::Response& res) {
      if (options_.api_keys == nullptr || !options_.api_keys->enabled() ||
          !(absl::StartsWith(req.path, "/v1/") || req.path == "/tokenize" ||
            req.path == "/detokenize")) {
        return httplib::Server::HandlerResponse::Unhandled;
      }
      const std::string header = req.get_header_value(rpc::kAuthorizationKey);
      if (options_.api_keys->Accepts(header)) {
        return httplib::Server::HandlerResponse::Unhandled;
      }
      if (options_.on_rejected) {
        options_.on_rejected(ApiOfPath(req.path),
                             absl::StatusCode::kUnauthenticated);
      }
      res.status = 401;
      res.set_header("WWW-Authenticate", "Bearer");
      res.set_content(
          ErrorBody(401, header.empty() ? "missing API key: send the header "
                                          "\"Authorization: Bearer <key>\""
                                        : "incorrect API key"),
          "application/json");
      return httplib::Server::HandlerResponse::Handled;
    });
  }

  void InstallRoutes() {
    server_->Post("/v1/completions",
                  [this](const httplib::Request& req, httplib::Response& res) {
                    HandleGenerate(OpenAiEndpoint::kCompletions, req, res);
                  });
    server_->Post("/v1/chat/completions",
                  [this](const httplib::Request& req, httplib::Response& res) {
                    HandleGenerate(OpenAiEndpoint::kChatCompletions, req, res);
                  });
    server_->Get(
        "/v1/models", [this](const httplib::Request&, httplib::Response& res) {
          res.set_content(ModelsBody(backend_->ListModels(), NowUnixSeconds()),
                          "application/json");
        });
    server_->Get(R"(/v1/models/(.+))", [this](const httplib::Request& req,
                                              httplib::Response& res) {
      // Model ids may hold '/' (Hugging Face names): the rest of the path.
      absl::StatusOr<ModelDescription> model =
          ResolveModel(*backend_, req.matches[1].str());
      if (!model.ok()) {
        SendError(res, absl::NotFoundError(absl::StrCat(
                           "no model '", req.matches[1].str(), "' here")));
        return;
      }
      res.set_content(ModelBody(*model, NowUnixSeconds()), "application/json");
    });
    server_->Get("/version", [](const httplib::Request&,
                                httplib::Response& res) {
      res.set_content(absl::StrCat("{\"version\":\"", kPdserveVersion, "\"}"),
                      "application/json");
    });
    server_->Post("/tokenize",
                  [this](const httplib::Request& req, httplib::Response& res) {
                    HandleTokenize(req, res);
                  });
    server_->Post("/detokenize",
                  [this](const httplib::Request& req, httplib::Response& res) {
                    HandleDetokenize(req, res);
                  });
    server_->Get("/health", [this](const httplib::Request&,
                                   httplib::Response& res) {
      absl::Status health = backend_->Health();
      if (!health.ok()) {
        res.status = 503;
        res.set_content(ErrorBody(503, health.ToString()), "application/json");
        return;
      }
      res.set_content("{\"status\":\"ok\"}", "application/json");
    });
  }

  void InstallErrorHandler() {
    // cpp-httplib's own errors (unknown path, 413 oversized body, ...) get
    // the OpenAI shape too, unless a handler already wrote a body (then the
    // handler has counted the request already). They are counted like every
    // other refusal, so a client posting to a wrong path or sending
    // oversized prompts shows in pdserve_router_requests_total.
    server_->set_error_handler(httplib::Server::HandlerWithResponse(
        [this](const httplib::Request& req, httplib::Response& res) {
          if (!res.body.empty())
            return httplib::Server::HandlerResponse::Unhandled;
          if (options_.on_rejected) {
            options_.on_rejected(ApiOfPath(req.path),
                                 StatusCodeOfHttpError(res.status));
          }
          // A known path asked with the wrong method: 405 and what it takes.
          if (res.status == 404) {
            if (const char* allow = AllowedMethods(req.path)) {
              res.status = 405;
              res.set_header("Allow", allow);
            }
          }
          std::string message =
              res.status == 404
                  ? absl::StrCat("no route for ", req.method, " ", req.path)
              : res.status == 405
                  ? absl::StrCat(req.path, " takes ", AllowedMethods(req.path),
                                 ", not ", req.method)
              : res.status == 413 ? std::string("request body too large")
                                  : absl::StrCat("HTTP error ", res.status);
          res.set_content(
              ErrorBody(res.status == 404 ? 400 : res.status, message),
              "application/json");
          return httplib::Server::HandlerResponse::Handled;
        }));
  }

  absl::Status BindAndListen() {
    // Debian's build compiles httplib's listen backlog to 5: a burst of new
    // connections (many clients opening streams at once) overflows it and
    // some fail. Remember the listening socket and listen() again with a
    // real backlog (Linux updates the backlog of a listening socket).
    server_->set_socket_options([this](socket_t sock) {
      httplib::default_socket_options(sock);
      listen_fd_ = sock;
    });
    if (options_.port == 0) {
      port_ = server_->bind_to_any_port(options_.host);
    } else {
      port_ = server_->bind_to_port(options_.host, options_.port)
                  ? options_.port
                  : -1;
    }
    if (port_ <= 0) {
      return absl::UnavailableError(absl::StrCat(
          "cannot bind HTTP on ", options_.host, ":", options_.port));
    }
    if (listen_fd_ >= 0) ::listen(listen_fd_, kListenBacklog);
    listener_ = std::thread([this] { server_->listen_after_bind(); });
    // httplib's stop() is a no-op until the accept loop runs: wait for it, so
    // a Stop() right after Start() cannot leave the loop running forever.
    const absl::Time until = absl::Now() + absl::Seconds(10);
    while (!server_->is_running() && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    if (!server_->is_running()) {
      return absl::InternalError("HTTP accept loop did not start");
    }
    return absl::OkStatus();
  }

  class SseStream;

  void HandleGenerate(OpenAiEndpoint endpoint, const httplib::Request& req,
                      httplib::Response& res);
  void RespondUnary(const GenerateReply& reply, StreamBuffer& buffer,
                    StreamBuffer::Event first, httplib::Response& res);
  // Why a request ended with no event: the server stopping or its deadline.
  absl::Status EndedWithoutAnswer() const;
  void HandleTokenize(const httplib::Request& req, httplib::Response& res);
  void HandleDetokenize(const httplib::Request& req, httplib::Response& res);
  // Waits for the next event up to `until`, waking every kPollSlice to see
  // whether the server is stopping (then: cancel, nullopt).
  std::optional<StreamBuffer::Event> NextEvent(StreamBuffer& buffer,
                                               absl::Time until) {
    while (true) {
      absl::Time slice = std::min(until, absl::Now() + kPollSlice);
      std::optional<StreamBuffer::Event> event = buffer.Next(slice);
      if (event.has_value()) return event;
      if (stopped_.load() || absl::Now() >= until) {
        buffer.Cancel();
        return std::nullopt;
      }
    }
  }

  const HttpServerOptions options_;
  GenerationBackend* const backend_;
  std::unique_ptr<httplib::Server> server_;  // an SSLServer with TLS
  std::thread listener_;
  int port_ = 0;
  int listen_fd_ = -1;  // owned by server_
  std::atomic<bool> stopped_{false};
};

void OpenAiHttpServer::Impl::HandleTokenize(const httplib::Request& req,
                                            httplib::Response& res) {
  absl::StatusOr<TokenizeRequest> parsed =
      ParseTokenizeRequest(req.body, options_.chat_prompt);
  if (!parsed.ok()) return SendError(res, parsed.status());
  absl::StatusOr<ModelDescription> model =
      ResolveModel(*backend_, parsed->model);
  if (!model.ok()) return SendError(res, model.status());
  if (options_.tokenizer == nullptr) {
    return SendError(res, absl::FailedPreconditionError(
                              "this router has no tokenizer (the model has "
                              "none): it takes and returns token ids"));
  }
  absl::StatusOr<std::vector<int32_t>> ids =
      options_.tokenizer->Encode(parsed->text, parsed->add_special_tokens);
  if (!ids.ok()) return SendError(res, ids.status());
  res.set_content(TokenizeBody(*ids, model->context_length),
                  "application/json");
}

void OpenAiHttpServer::Impl::HandleDetokenize(const httplib::Request& req,
                                              httplib::Response& res) {
  absl::StatusOr<DetokenizeRequest> parsed = ParseDetokenizeRequest(req.body);
  if (!parsed.ok()) return SendError(res, parsed.status());
  absl::StatusOr<ModelDescription> model =
      ResolveModel(*backend_, parsed->model);
  if (!model.ok()) return SendError(res, model.status());
  if (options_.tokenizer == nullptr) {
    return SendError(res, absl::FailedPreconditionError(
                              "this router has no tokenizer (the model has "
                              "none): it takes and returns token ids"));
  }
  absl::StatusOr<std::string> text = options_.tokenizer->Decode(parsed->tokens);
  if (!text.ok()) {
    // An id outside the vocabulary is the caller's mistake.
    return SendError(res, absl::InvalidArgumentError(text.status().message()));
  }
  res.set_content(DetokenizeBody(*text), "application/json");
}

// The server-sent events of one streaming request: cpp-httplib calls
// Provide on the connection's thread after the handler returned, once per
// event, until it calls done() or returns false. Choices' chunks interleave
// as they come, each with its index.
class OpenAiHttpServer::Impl::SseStream {
 public:
  SseStream(Impl* server, std::shared_ptr<StreamBuffer> buffer,
            StreamBuffer::Event first, GenerateReply reply)
      : server_(server),
        buffer_(std::move(buffer)),
        pending_(std::move(first)),
        reply_(std::move(reply)),
        open_(reply_.num_choices),
        first_(reply_.num_choices, true),
        text_offset_(reply_.num_choices, 0),
        usage_(reply_.num_choices) {
    if (reply_.tool_format != ToolCallFormat::kNone) {
      for (int c = 0; c < reply_.num_choices; ++c) {
        tool_calls_.emplace_back(reply_.tool_format);
        // The forced opening is part of the answer (held: it starts a call).
        (void)tool_calls_.back().Push(reply_.answer_prefix);
      }
    }
  }

  bool Provide(httplib::DataSink& sink) {
    std::optional<StreamBuffer::Event> event = std::move(pending_);
    pending_.reset();
    if (!event.has_value()) {
      event = server_->NextEvent(*buffer_, reply_.deadline + kDeadlineGrace);
    }
    if (!event.has_value()) {
      // Deadline or shutdown mid-stream: say so, then end the stream.
      Write(sink, StreamErrorEvent(server_->EndedWithoutAnswer()));
      return EndStream(sink);
    }
    if (!event->delta.has_value()) return ChoiceDone(sink, event->status);
    return WriteDelta(sink, event->choice, *event->delta);
  }

  // The connection is gone or the stream ended: stop what still runs.
  void Release() {
    if (!finished_) buffer_->Cancel();
  }

 private:
  static bool Write(httplib::DataSink& sink, const std::string& data) {
    return sink.write(data.data(), data.size());
  }
  bool EndStream(httplib::DataSink& sink) {
    Write(sink, std::string(kStreamDoneEvent));
    finished_ = true;
    sink.done();
    return true;
  }

  // A choice's OnDone: OK after its finished delta, or a mid-stream error,
  // which ends the whole stream (the other choices stop).
  bool ChoiceDone(httplib::DataSink& sink, const absl::Status& status) {
    if (!status.ok()) {
      buffer_->Cancel();
      Write(sink, StreamErrorEvent(status));
      return EndStream(sink);
    }
    if (--open_ > 0) return true;
    if (reply_.include_usage &&
        !Write(sink, StreamUsageEvent(reply_.endpoint, reply_.id,
                                      reply_.created, reply_.model,
                                      CombinedUsage(usage_, reply_.n)))) {
      return false;
    }
    return EndStream(sink);
  }

  bool WriteDelta(httplib::DataSink& sink, int choice, GenerationDelta& delta) {
    if (delta.finished) usage_[choice] = delta.usage;
    // Tokens whose text is held back (a possible stop string, half a
    // character) still get their chunk when logprobs were asked for.
    if (delta.text.empty() && !delta.finished && !first_[choice] &&
        delta.logprobs.empty() && !delta.echo.has_value()) {
      return true;
    }
    LogprobsOutput chunk_logprobs;
    chunk_logprobs.requested = reply_.logprobs;
    chunk_logprobs.top_logprobs = reply_.top_logprobs;
    std::string text = std::move(delta.text);
    if (delta.echo.has_value()) {
      // The prompt leads the choice's first chunk; offsets of the generated
      // tokens count from its end.
      text = delta.echo->text + text;
      text_offset_[choice] += TextCharacters(delta.echo->text);
      if (reply_.logprobs) chunk_logprobs.prompt = std::move(delta.echo);
    }
    chunk_logprobs.text_offset = text_offset_[choice];
    for (const TokenLogprob& l : delta.logprobs) {
      text_offset_[choice] += TokenCharacters(l.chosen);
    }
    chunk_logprobs.tokens = std::move(delta.logprobs);
    const bool first_chunk = first_[choice];
    first_[choice] = false;
    if (!tool_calls_.empty()) {
      ToolCallStream& calls = tool_calls_[choice];
      text = calls.Push(text);
      if (text.empty() && !delta.finished && !first_chunk &&
          chunk_logprobs.tokens.empty()) {
        return true;  // all held back (a call is being written)
      }
      if (delta.finished) {
        ParsedAnswer rest = calls.Finish();
        text += rest.content;
        if (!rest.tool_calls.empty()) {
          if ((!text.empty() || first_chunk) &&
              !Write(sink, Chunk(text, FinishReason::kNone, first_chunk,
                                 chunk_logprobs, choice))) {
            return false;
          }
          return Write(sink, StreamToolCallsEvent(reply_.id, reply_.created,
                                                  reply_.model, rest.tool_calls,
                                                  choice));
        }
      }
    }
    // A failed write means the client went away: returning false closes the
    // connection and Release cancels the generation.
    return Write(
        sink,
        Chunk(text, delta.finished ? delta.finish_reason : FinishReason::kNone,
              first_chunk, chunk_logprobs, choice));
  }

  std::string Chunk(const std::string& text, FinishReason finish,
                    bool first_chunk, const LogprobsOutput& logprobs,
                    int choice) const {
    return StreamChunkEvent(reply_.endpoint, reply_.id, reply_.created,
                            reply_.model, text, finish, first_chunk, logprobs,
                            choice);
  }

  Impl* const server_;
  const std::shared_ptr<StreamBuffer> buffer_;
  std::optional<StreamBuffer::Event> pending_;  // the first event, unsent
  const GenerateReply reply_;
  int open_;                                // choices not finished yet
  std::vector<bool> first_;                 // per choice: no chunk sent yet
  std::vector<int64_t> text_offset_;        // per choice: characters reported
  std::vector<GenerationUsage> usage_;      // per choice, from its last delta
  std::vector<ToolCallStream> tool_calls_;  // chat with tools: held calls
  bool finished_ = false;
};

absl::Status OpenAiHttpServer::Impl::EndedWithoutAnswer() const {
  return stopped_ ? absl::UnavailableError("router stopping")
                  : absl::DeadlineExceededError("request deadline exceeded");
}

void OpenAiHttpServer::Impl::HandleGenerate(OpenAiEndpoint endpoint,
                                            const httplib::Request& req,
                                            httplib::Response& res) {
  const std::string api = endpoint == OpenAiEndpoint::kCompletions
                              ? "openai_completions"
                              : "openai_chat";
  auto reject = [&](const absl::Status& status) {
    if (options_.on_rejected) options_.on_rejected(api, status.code());
    SendError(res, status);
  };
  absl::StatusOr<OpenAiRequest> parsed =
      ParseOpenAiRequest(endpoint, req.body, options_.chat_prompt);
  if (!parsed.ok()) return reject(parsed.status());
  absl::StatusOr<ModelDescription> model =
      ResolveModel(*backend_, parsed->generation.model);
  if (!model.ok()) return reject(model.status());

  GenerationRequest generation = std::move(parsed->generation);
  GenerateReply reply;
  reply.endpoint = endpoint;
  reply.model = model->name;
  reply.logprobs = generation.logprobs;
  reply.top_logprobs = generation.top_logprobs;
  reply.n = parsed->n;
  // best_of > n: every prompt gets best_of candidates, generated with
  // logprobs whatever the client asked, and the n best are returned.
  reply.candidates = parsed->best_of;
  if (reply.candidates > reply.n) generation.logprobs = true;
  // A completions batch: every prompt gets its candidates.
  const int num_prompts = std::max<int>(1, parsed->prompts.size());
  reply.num_choices = num_prompts * reply.candidates;
  reply.deadline = absl::Now() + options_.request_timeout;
  reply.tool_format = parsed->tool_format;
  reply.answer_prefix = parsed->answer_prefix;
  reply.include_usage = parsed->include_usage;
  generation.api = api;
  generation.model = model->name;
  generation.request_id = NewRequestId();
  generation.deadline = reply.deadline;
  reply.id = absl::StrCat(
      endpoint == OpenAiEndpoint::kCompletions ? "cmpl-" : "chatcmpl-",
      generation.request_id);
  reply.created = NowUnixSeconds();

  auto buffer = std::make_shared<StreamBuffer>();
  // The stagger shares one prompt's prefill among its choices; a batch of
  // prompts starts at once.
  if (absl::Status started = buffer->Start(
          backend_, ChoiceRequests(generation, parsed->prompts, reply),
          options_.stagger_choices && reply.candidates > 1 && num_prompts == 1);
      !started.ok()) {
    return SendError(res, started);
  }
  // The first event decides the status line: an error before any token is
  // an HTTP error with the right code, even for a streaming request.
  std::optional<StreamBuffer::Event> first =
      NextEvent(*buffer, reply.deadline + kDeadlineGrace);
  absl::Status failed = !first.has_value()          ? EndedWithoutAnswer()
                        : !first->delta.has_value() ? first->status
                                                    : absl::OkStatus();
  if (!failed.ok()) {
    buffer->Cancel();  // the other choices, if any are still running
    return SendError(res, failed);
  }
  if (!parsed->stream) {
    return RespondUnary(reply, *buffer, std::move(*first), res);
  }
  auto stream =
      std::make_shared<SseStream>(this, buffer, std::move(*first), reply);
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Request-Id", reply.id);
  res.set_chunked_content_provider(
      "text/event-stream",
      [stream](size_t, httplib::DataSink& sink) {
        return stream->Provide(sink);
      },
      [stream](bool /*success*/) { stream->Release(); });
}

void OpenAiHttpServer::Impl::RespondUnary(const GenerateReply& reply,
                                          StreamBuffer& buffer,
                                          StreamBuffer::Event first,
                                          httplib::Response& res) {
  std::vector<CompletionOutcome> outcomes(reply.num_choices);
  for (CompletionOutcome& outcome : outcomes) {
    outcome.logprobs.requested = reply.logprobs;
    outcome.logprobs.top_logprobs = reply.top_logprobs;
  }
  std::optional<StreamBuffer::Event> event = std::move(first);
  for (int open = reply.num_choices; open > 0;) {
    absl::Status failed = !event.has_value()          ? EndedWithoutAnswer()
                          : !event->delta.has_value() ? event->status
                                                      : absl::OkStatus();
    if (!failed.ok()) {
      buffer.Cancel();  // the other choices, if any are still running
      return SendError(res, failed);
    }
    if (event->delta.has_value()) {
      AccumulateDelta(*event->delta, reply.logprobs, outcomes[event->choice]);
    } else {
      --open;
    }
    if (open > 0) event = NextEvent(buffer, reply.deadline + kDeadlineGrace);
  }
  if (reply.candidates > reply.n) {
    outcomes = BestCandidates(std::move(outcomes), reply.candidates, reply.n,
                              reply.logprobs);
  }
  if (reply.tool_format != ToolCallFormat::kNone) {
    for (CompletionOutcome& outcome : outcomes) {
      ParsedAnswer answer =
          ParseToolCalls(reply.tool_format, reply.answer_prefix + outcome.text);
      if (answer.tool_calls.empty()) continue;  // plain text stays as is
      outcome.text = std::move(answer.content);
      outcome.tool_calls = std::move(answer.tool_calls);
    }
  }
  res.set_content(CompletionBody(reply.endpoint, reply.id, reply.created,
                                 reply.model, outcomes, reply.n),
                  "application/json");
}

OpenAiHttpServer::OpenAiHttpServer(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}

OpenAiHttpServer::~OpenAiHttpServer() { Stop(); }

absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> OpenAiHttpServer::Start(
    const HttpServerOptions& options, GenerationBackend* backend) {
  auto impl = std::make_unique<Impl>(options, backend);
  if (absl::Status s = impl->Start(); !s.ok()) return s;
  return std::unique_ptr<OpenAiHttpServer>(
      new OpenAiHttpServer(std::move(impl)));
}

int OpenAiHttpServer::port() const { return impl_->port(); }

void OpenAiHttpServer::Stop() {
  if (impl_ != nullptr) impl_->Stop();
}

}  // namespace pdserve::router
