// The router's OpenAI-compatible HTTP front-end over a GenerationBackend:
//   POST /v1/completions, POST /v1/chat/completions (SSE when "stream": true,
//   ending in `data: [DONE]`), GET /v1/models, GET /health.
// Errors use OpenAI's JSON shape with the status codes of openai_api.h.
//
// Threads: one accept thread plus a fixed pool of connection threads
// (cpp-httplib is thread-per-connection; a streaming response holds its
// thread until the stream ends). Handlers block on a per-request buffer that
// the backend's callbacks fill, bounded by the request deadline, so a stuck
// backend cannot hold a thread forever.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "router/chat_prompt.h"
#include "router/generation_backend.h"
#include "rpc/auth.h"
#include "rpc/tls.h"
#include "tokenizer/tokenizer.h"

namespace pdserve::router {

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0 = pick a free port (tests)
  // Connection threads: the most concurrent requests served (streams
  // included); more connections wait for a thread. Keep it above the
  // admission limit so refusals are 429s, not waits.
  int threads = 128;
  size_t max_body_bytes = 4 << 20;  // larger bodies get 413
  // Each request's deadline (the backend gets it; 504 when it passes).
  absl::Duration request_timeout = absl::Minutes(10);
  // Told about requests refused before the backend (optional).
  RejectionHook on_rejected;
  // API keys (not owned; null or empty: none needed): every /v1/ route then
  // needs "Authorization: Bearer <key>" (else 401); /health stays open.
  const rpc::BearerTokens* api_keys = nullptr;
  // HTTPS with these files (none: plain HTTP); with a client CA, clients
  // must present a certificate it signed (mutual TLS).
  rpc::TlsFiles tls;
  // OpenAI `n` > 1: start choices 1.. when choice 0 streams its first token,
  // not all at once. By then choice 0's prompt blocks are published at its
  // decode worker and cached in its prefill group, so with prefix-aware
  // routing the other choices prefill only the prompt's last partial block
  // instead of the whole prompt again; they pay about one TTFT of latency.
  bool stagger_choices = true;
  // The served model's tokenizer (not owned; null for a dummy model without
  // one): POST /tokenize and /detokenize use it, else answer 400 saying so.
  const tokenizer::Tokenizer* tokenizer = nullptr;
  // How chat messages become the prompt (not owned; null: the base-model
  // fallback): the model's own template, with tools and template kwargs.
  const ChatPrompt* chat_prompt = nullptr;
  // How long an idle keep-alive connection stays open (the server says so in
  // every response's Keep-Alive header). Clients reuse pooled connections
  // after pauses of their own; a server that closes sooner races their next
  // request, which then fails with a broken pipe or a reset (measured with a
  // 1 s timeout: 333 of 1,498 requests of 60 clients pausing up to 1.5 s,
  // bench/http_keepalive_load.py). Stop() closes idle connections itself,
  // so a long timeout does not delay it.
  absl::Duration keep_alive = absl::Seconds(60);
  // Requests one connection serves before the server asks it to close
  // (Connection: close on the last: the client reconnects, no race).
  int keep_alive_requests = 1000;
  // While it answers true (the router drains), every response carries
  // "Connection: close", so clients reconnect elsewhere. Optional.
  std::function<bool()> draining;
};

class OpenAiHttpServer {
 public:
  // Binds and starts serving. `backend` is not owned and must outlive the
  // server. UNAVAILABLE when the address cannot be bound.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> Start(
      const HttpServerOptions& options, GenerationBackend* backend);

  ~OpenAiHttpServer();  // Stop()
  OpenAiHttpServer(const OpenAiHttpServer&) = delete;
  OpenAiHttpServer& operator=(const OpenAiHttpServer&) = delete;

  int port() const;
  // Stops accepting, cancels open streams and joins every thread. Idempotent.
  void Stop();

  class Impl;

 private:
  explicit OpenAiHttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pdserve::router
