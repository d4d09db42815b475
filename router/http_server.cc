#include "router/http_server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <atomic>
#include <deque>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "router/openai_api.h"

namespace pdserve::router {
namespace {

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

// One request's events, filled by the backend's callbacks and drained by the
// connection thread. Keeps itself alive until the backend's OnDone, so the
// connection may go away first (client disconnect) without a dangling
// observer.
class StreamBuffer : public GenerationObserver,
                     public std::enable_shared_from_this<StreamBuffer> {
 public:
  struct Event {
    std::optional<GenerationDelta> delta;  // else: the final status
    absl::Status status;
  };

  // Starts the call with this buffer as observer.
  absl::Status Start(GenerationBackend* backend, GenerationRequest request) {
    {
      absl::MutexLock lock(&mu_);
      keep_alive_ = shared_from_this();
    }
    absl::StatusOr<std::unique_ptr<GenerationCall>> call =
        backend->Start(std::move(request), this);
    absl::MutexLock lock(&mu_);
    if (!call.ok()) {
      // No callback will come: drop the self-reference (the caller holds
      // another, so this does not destroy us here).
      keep_alive_.reset();
      return call.status();
    }
    call_ = std::move(call).value();
    if (cancel_requested_) call_->Cancel();
    return absl::OkStatus();
  }

  void Cancel() {
    absl::MutexLock lock(&mu_);
    cancel_requested_ = true;
    if (call_ != nullptr && !done_) call_->Cancel();
  }

  // Next event, or nullopt when `until` passes first.
  std::optional<Event> Next(absl::Time until) {
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return !deltas_.empty() || done_;
    };
    mu_.AwaitWithDeadline(absl::Condition(&ready), until);
    if (!deltas_.empty()) {
      Event event{std::move(deltas_.front()), absl::OkStatus()};
      deltas_.pop_front();
      return event;
    }
    if (done_) return Event{std::nullopt, status_};
    return std::nullopt;
  }

  void OnDelta(GenerationDelta delta) override {
    absl::MutexLock lock(&mu_);
    deltas_.push_back(std::move(delta));
  }

  void OnDone(absl::Status status) override {
    std::shared_ptr<StreamBuffer> self;
    {
      absl::MutexLock lock(&mu_);
      done_ = true;
      status_ = std::move(status);
      self = std::move(keep_alive_);
    }
    // `self` may be the last reference: nothing touches members past here.
  }

 private:
  absl::Mutex mu_;
  std::deque<GenerationDelta> deltas_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  bool cancel_requested_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<GenerationCall> call_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<StreamBuffer> keep_alive_ ABSL_GUARDED_BY(mu_);
};

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
    const int threads = std::max(2, options_.threads);
    server_.new_task_queue = [threads] {
      return new httplib::ThreadPool(static_cast<size_t>(threads));
    };
    server_.set_payload_max_length(options_.max_body_bytes);
    // Short keep-alive so Stop() does not wait long on idle connections.
    server_.set_keep_alive_timeout(1);
    server_.Post("/v1/completions",
                 [this](const httplib::Request& req, httplib::Response& res) {
                   HandleGenerate(OpenAiEndpoint::kCompletions, req, res);
                 });
    server_.Post("/v1/chat/completions",
                 [this](const httplib::Request& req, httplib::Response& res) {
                   HandleGenerate(OpenAiEndpoint::kChatCompletions, req, res);
                 });
    server_.Get(
        "/v1/models", [this](const httplib::Request&, httplib::Response& res) {
          res.set_content(ModelsBody(backend_->ListModels(), NowUnixSeconds()),
                          "application/json");
        });
    server_.Get("/health", [this](const httplib::Request&,
                                  httplib::Response& res) {
      absl::Status health = backend_->Health();
      if (!health.ok()) {
        res.status = 503;
        res.set_content(ErrorBody(503, health.ToString()), "application/json");
        return;
      }
      res.set_content("{\"status\":\"ok\"}", "application/json");
    });
    // cpp-httplib's own errors (unknown path, 413 oversized body, ...) get
    // the OpenAI shape too, unless a handler already wrote a body (then the
    // handler has counted the request already). They are counted like every
    // other refusal, so a client posting to a wrong path or sending
    // oversized prompts shows in pdserve_router_requests_total.
    server_.set_error_handler(httplib::Server::HandlerWithResponse(
        [this](const httplib::Request& req, httplib::Response& res) {
          if (!res.body.empty())
            return httplib::Server::HandlerResponse::Unhandled;
          if (options_.on_rejected) {
            options_.on_rejected(ApiOfPath(req.path),
                                 StatusCodeOfHttpError(res.status));
          }
          std::string message =
              res.status == 404
                  ? absl::StrCat("no route for ", req.method, " ", req.path)
              : res.status == 413 ? std::string("request body too large")
                                  : absl::StrCat("HTTP error ", res.status);
          res.set_content(
              ErrorBody(res.status == 404 ? 400 : res.status, message),
              "application/json");
          return httplib::Server::HandlerResponse::Handled;
        }));
    // Debian's build compiles httplib's listen backlog to 5: a burst of new
    // connections (many clients opening streams at once) overflows it and
    // some fail. Remember the listening socket and listen() again with a
    // real backlog (Linux updates the backlog of a listening socket).
    server_.set_socket_options([this](socket_t sock) {
      httplib::default_socket_options(sock);
      listen_fd_ = sock;
    });
    if (options_.port == 0) {
      port_ = server_.bind_to_any_port(options_.host);
    } else {
      port_ = server_.bind_to_port(options_.host, options_.port) ? options_.port
                                                                 : -1;
    }
    if (port_ <= 0) {
      return absl::UnavailableError(absl::StrCat(
          "cannot bind HTTP on ", options_.host, ":", options_.port));
    }
    if (listen_fd_ >= 0) ::listen(listen_fd_, kListenBacklog);
    listener_ = std::thread([this] { server_.listen_after_bind(); });
    // httplib's stop() is a no-op until the accept loop runs: wait for it, so
    // a Stop() right after Start() cannot leave the loop running forever.
    const absl::Time until = absl::Now() + absl::Seconds(10);
    while (!server_.is_running() && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    if (!server_.is_running()) {
      return absl::InternalError("HTTP accept loop did not start");
    }
    return absl::OkStatus();
  }

  void Stop() {
    if (stopped_.exchange(true)) return;
    server_.stop();
    if (listener_.joinable()) listener_.join();
  }

  int port() const { return port_; }

 private:
  void HandleGenerate(OpenAiEndpoint endpoint, const httplib::Request& req,
                      httplib::Response& res);
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
  httplib::Server server_;
  std::thread listener_;
  int port_ = 0;
  int listen_fd_ = -1;  // owned by server_
  std::atomic<bool> stopped_{false};
};

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
  absl::StatusOr<OpenAiRequest> parsed = ParseOpenAiRequest(endpoint, req.body);
  if (!parsed.ok()) return reject(parsed.status());
  absl::StatusOr<ModelDescription> model =
      ResolveModel(*backend_, parsed->generation.model);
  if (!model.ok()) return reject(model.status());

  GenerationRequest generation = std::move(parsed->generation);
  const bool logprobs = generation.logprobs;
  const int32_t top_logprobs = generation.top_logprobs;
  generation.api = api;
  generation.model = model->name;
  generation.request_id = NewRequestId();
  const absl::Time deadline = absl::Now() + options_.request_timeout;
  generation.deadline = deadline;
  const std::string id = absl::StrCat(
      endpoint == OpenAiEndpoint::kCompletions ? "cmpl-" : "chatcmpl-",
      generation.request_id);
  const int64_t created = NowUnixSeconds();

  auto buffer = std::make_shared<StreamBuffer>();
  if (absl::Status started = buffer->Start(backend_, std::move(generation));
      !started.ok()) {
    return SendError(res, started);
  }
  const absl::Status timeout =
      absl::DeadlineExceededError("request deadline exceeded");
  // The first event decides the status line: an error before any token is
  // an HTTP error with the right code, even for a streaming request.
  std::optional<StreamBuffer::Event> first =
      NextEvent(*buffer, deadline + kDeadlineGrace);
  if (!first.has_value()) {
    return SendError(
        res, stopped_ ? absl::UnavailableError("router stopping") : timeout);
  }
  if (!first->delta.has_value() && !first->status.ok()) {
    return SendError(res, first->status);
  }

  if (!parsed->stream) {
    CompletionOutcome outcome;
    outcome.logprobs.requested = logprobs;
    outcome.logprobs.top_logprobs = top_logprobs;
    std::optional<StreamBuffer::Event> event = std::move(first);
    while (true) {
      if (!event.has_value()) {
        return SendError(res, stopped_
                                  ? absl::UnavailableError("router stopping")
                                  : timeout);
      }
      if (!event->delta.has_value()) {
        if (!event->status.ok()) return SendError(res, event->status);
        break;
      }
      outcome.text += event->delta->text;
      for (TokenLogprob& l : event->delta->logprobs) {
        outcome.logprobs.tokens.push_back(std::move(l));
      }
      if (event->delta->finished) {
        outcome.finish_reason = event->delta->finish_reason;
        outcome.usage = event->delta->usage;
      }
      event = NextEvent(*buffer, deadline + kDeadlineGrace);
    }
    res.set_content(CompletionBody(endpoint, id, created, model->name, outcome),
                    "application/json");
    return;
  }

  // Streaming: the provider runs on this connection's thread after the
  // handler returns, once per chunk, until it calls done() or returns false.
  struct StreamState {
    std::shared_ptr<StreamBuffer> buffer;
    std::optional<StreamBuffer::Event> pending;
    bool first = true;
    bool finished = false;
    int64_t text_offset = 0;  // characters of the tokens already reported
  };
  auto state = std::make_shared<StreamState>();
  state->buffer = buffer;
  state->pending = std::move(first);
  const bool include_usage = parsed->include_usage;
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Request-Id", id);
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, state, endpoint, id, created, name = model->name, include_usage,
       logprobs, top_logprobs, deadline,
       timeout](size_t, httplib::DataSink& sink) {
        std::optional<StreamBuffer::Event> event = std::move(state->pending);
        state->pending.reset();
        if (!event.has_value()) {
          event = NextEvent(*state->buffer, deadline + kDeadlineGrace);
        }
        auto write = [&sink](const std::string& data) {
          return sink.write(data.data(), data.size());
        };
        if (!event.has_value()) {
          // Deadline or shutdown mid-stream: say so, then end the stream.
          write(StreamErrorEvent(
              stopped_ ? absl::UnavailableError("router stopping") : timeout));
          write(std::string(kStreamDoneEvent));
          state->finished = true;
          sink.done();
          return true;
        }
        if (!event->delta.has_value()) {
          // OnDone: OK after the finished delta, or a mid-stream error.
          if (!event->status.ok()) write(StreamErrorEvent(event->status));
          write(std::string(kStreamDoneEvent));
          state->finished = true;
          sink.done();
          return true;
        }
        GenerationDelta& delta = *event->delta;
        bool ok = true;
        // Tokens whose text is held back (a possible stop string, half a
        // character) still get their chunk when logprobs were asked for.
        if (!delta.text.empty() || delta.finished || state->first ||
            !delta.logprobs.empty()) {
          LogprobsOutput chunk_logprobs;
          chunk_logprobs.requested = logprobs;
          chunk_logprobs.top_logprobs = top_logprobs;
          chunk_logprobs.text_offset = state->text_offset;
          for (const TokenLogprob& l : delta.logprobs) {
            state->text_offset += TokenCharacters(l.chosen);
          }
          chunk_logprobs.tokens = std::move(delta.logprobs);
          ok = write(StreamChunkEvent(
              endpoint, id, created, name, delta.text,
              delta.finished ? delta.finish_reason : FinishReason::kNone,
              state->first, chunk_logprobs));
          state->first = false;
        }
        if (ok && delta.finished && include_usage) {
          ok =
              write(StreamUsageEvent(endpoint, id, created, name, delta.usage));
        }
        // A failed write means the client went away: returning false closes
        // the connection and the releaser cancels the generation.
        return ok;
      },
      [state](bool /*success*/) {
        if (!state->finished) state->buffer->Cancel();
      });
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
