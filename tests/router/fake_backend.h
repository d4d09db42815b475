// A scripted GenerationBackend for the router's front-end tests. Each call
// runs on a thread of its own and obeys the callback contract of
// generation_backend.h. What it does depends on the prompt text:
//   anything else     max_tokens deltas " w0", " w1", ... (ids 100, 101, ...)
//                     every `token_delay`, then finish "length"; with
//                     logprobs, token i has logprob -0.25 (i + 1) and
//                     alternative k is id 100 + i + k, logprob -0.25 (i + 1) -
//                     k
//   "fail:<code>"     OnDone(<code>) before any token; <code> is one of
//                     unavailable, exhausted, invalid, deadline, internal
//   "midfail"         two tokens, then OnDone(INTERNAL)
//   "hang"            nothing until cancelled or past the deadline
//   "stop"            one token, then finish "stop"
// With echo the first delta (one of its own when max_tokens is 0) carries the
// prompt text; with logprobs too, one prompt token per character of the
// prompt (id 1000 + k, text the character), token k >= 1 scored -0.5 k, its
// alternative j id 2000 + j scored -0.5 k - 1 - j.
// Past the request's deadline a call ends with DEADLINE_EXCEEDED; a
// cancelled one with CANCELLED.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "router/generation_backend.h"

namespace pdserve::router::testing {

class FakeBackend : public GenerationBackend {
 public:
  explicit FakeBackend(absl::Duration token_delay = absl::Milliseconds(1))
      : token_delay_(token_delay) {}
  ~FakeBackend() override { JoinAll(); }

  std::vector<ModelDescription> ListModels() const override {
    return {{"stories260K", 512, 512}};
  }
  absl::Status Health() const override {
    absl::MutexLock lock(&mu_);
    return health_;
  }
  void set_health(absl::Status status) {
    absl::MutexLock lock(&mu_);
    health_ = std::move(status);
  }
  void set_start_error(absl::Status status) {
    absl::MutexLock lock(&mu_);
    start_error_ = std::move(status);
  }

  absl::StatusOr<std::unique_ptr<GenerationCall>> Start(
      GenerationRequest request, GenerationObserver* observer) override {
    auto state = std::make_shared<CallState>();
    {
      absl::MutexLock lock(&mu_);
      if (!start_error_.ok()) return start_error_;
      last_request_ = request;
      requests_.push_back(request);
      ++started_;
      ++active_;
      threads_.emplace_back([this, state, request = std::move(request),
                             observer] { Run(*state, request, observer); });
    }
    return std::unique_ptr<GenerationCall>(new Call(state));
  }

  GenerationRequest last_request() const {
    absl::MutexLock lock(&mu_);
    return last_request_;
  }
  std::vector<GenerationRequest> requests() const {
    absl::MutexLock lock(&mu_);
    return requests_;
  }
  int started() const {
    absl::MutexLock lock(&mu_);
    return started_;
  }
  int cancelled() const { return cancelled_.load(); }
  int active() const {
    absl::MutexLock lock(&mu_);
    return active_;
  }
  // Waits until no call is running (every OnDone returned).
  bool WaitIdle(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto idle = [this]()
                    ABSL_SHARED_LOCKS_REQUIRED(mu_) { return active_ == 0; };
    return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
  }
  void JoinAll() {
    std::vector<std::thread> threads;
    {
      absl::MutexLock lock(&mu_);
      threads.swap(threads_);
    }
    for (std::thread& t : threads) t.join();
  }

 private:
  struct CallState {
    std::atomic<bool> cancel_requested{false};
    absl::Notification cancel;
  };
  class Call : public GenerationCall {
   public:
    explicit Call(std::shared_ptr<CallState> state)
        : state_(std::move(state)) {}
    void Cancel() override {
      // Cancel() may race with itself (OnCancel and a failed write): only
      // the first caller notifies.
      if (!state_->cancel_requested.exchange(true)) state_->cancel.Notify();
    }

   private:
    std::shared_ptr<CallState> state_;
  };

  // Sleeps `d` unless cancelled or past the deadline; the status to end with.
  absl::Status Wait(CallState& state, const GenerationRequest& request,
                    absl::Duration d) {
    absl::Time until = std::min(absl::Now() + d, request.deadline);
    if (state.cancel.WaitForNotificationWithDeadline(until)) {
      cancelled_.fetch_add(1);
      return absl::CancelledError("cancelled by the client");
    }
    if (absl::Now() >= request.deadline) {
      return absl::DeadlineExceededError("deadline exceeded");
    }
    return absl::OkStatus();
  }

  void Run(CallState& state, const GenerationRequest& request,
           GenerationObserver* observer) {
    const std::string prompt = request.prompt_text.value_or("");
    absl::Status status = Script(state, request, prompt, observer);
    observer->OnDone(std::move(status));
    absl::MutexLock lock(&mu_);
    --active_;
  }

  absl::Status Script(CallState& state, const GenerationRequest& request,
                      const std::string& prompt, GenerationObserver* observer) {
    const absl::Time start = absl::Now();
    if (absl::StartsWith(prompt, "fail:")) {
      std::string code = prompt.substr(5);
      if (code == "unavailable") return absl::UnavailableError("no worker");
      if (code == "exhausted") return absl::ResourceExhaustedError("full");
      if (code == "invalid") return absl::InvalidArgumentError("too long");
      if (code == "deadline") return absl::DeadlineExceededError("late");
      return absl::InternalError("boom");
    }
    if (prompt == "hang") {
      return Wait(state, request, absl::InfiniteDuration());
    }
    const int prompt_tokens = request.prompt_ids.has_value()
                                  ? static_cast<int>(request.prompt_ids->size())
                                  : static_cast<int>(prompt.size());
    int n = request.max_tokens;
    FinishReason finish = FinishReason::kLength;
    if (prompt == "stop") {
      n = 1;
      finish = FinishReason::kStop;
    }
    std::optional<PromptEcho> echo;
    if (request.echo) {
      echo.emplace();
      echo->text = prompt;
      if (request.logprobs && !prompt.empty()) {
        echo->first_token = {1000, 0.0f, prompt.substr(0, 1)};
        for (size_t k = 1; k < prompt.size(); ++k) {
          const float logprob = -0.5f * static_cast<float>(k);
          TokenLogprob& l = echo->scored_tokens.emplace_back();
          l.chosen = {1000 + static_cast<int32_t>(k), logprob,
                      prompt.substr(k, 1)};
          for (int j = 0; j < request.top_logprobs; ++j) {
            l.top.push_back({2000 + j, logprob - 1.0f - static_cast<float>(j),
                             absl::StrCat("alt", j)});
          }
        }
      }
    }
    if (n == 0) {
      GenerationDelta delta;
      delta.echo = std::move(echo);
      delta.finished = true;
      delta.finish_reason = FinishReason::kLength;
      delta.usage = {prompt_tokens, 0, 0};
      observer->OnDelta(std::move(delta));
      return absl::OkStatus();
    }
    for (int i = 0; i < n; ++i) {
      if (absl::Status s = Wait(state, request, token_delay_); !s.ok()) {
        return s;
      }
      if (prompt == "midfail" && i == 2) {
        return absl::InternalError("worker died mid-stream");
      }
      GenerationDelta delta;
      if (i == 0) delta.echo = std::move(echo);
      delta.token_ids = {100 + i};
      delta.text = absl::StrCat(" w", i);
      if (request.logprobs) {
        const float logprob = -0.25f * static_cast<float>(i + 1);
        TokenLogprob& l = delta.logprobs.emplace_back();
        l.chosen = {100 + i, logprob, delta.text};
        for (int k = 0; k < request.top_logprobs; ++k) {
          l.top.push_back({100 + i + k, logprob - static_cast<float>(k),
                           absl::StrCat(" w", i + k)});
        }
      }
      if (i + 1 == n) {
        delta.finished = true;
        delta.finish_reason = finish;
        delta.usage = {prompt_tokens, n, 0};
        delta.timing.total_seconds = absl::ToDoubleSeconds(absl::Now() - start);
        delta.timing.time_to_first_token_seconds = 0.001;
      }
      observer->OnDelta(std::move(delta));
    }
    return absl::OkStatus();
  }

  const absl::Duration token_delay_;
  mutable absl::Mutex mu_;
  absl::Status health_ ABSL_GUARDED_BY(mu_);
  absl::Status start_error_ ABSL_GUARDED_BY(mu_);
  GenerationRequest last_request_ ABSL_GUARDED_BY(mu_);
  std::vector<GenerationRequest> requests_ ABSL_GUARDED_BY(mu_);
  int started_ ABSL_GUARDED_BY(mu_) = 0;
  int active_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<int> cancelled_{0};
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::router::testing
