#include <algorithm>

#include "speculative/proposer.h"

namespace pdserve::speculative {
namespace {

class NgramProposer final : public Proposer {
 public:
  explicit NgramProposer(const NgramOptions& options) : options_(options) {}
  std::string_view name() const override { return "ngram"; }

  absl::Status Propose(std::span<const ProposalRequest> requests,
                       std::vector<Proposal>* proposals) override {
    proposals->assign(requests.size(), Proposal{});
    for (size_t i = 0; i < requests.size(); ++i) {
      const auto& r = requests[i];
      if (r.max_tokens > 0) Lookup(r.history, r.max_tokens, &(*proposals)[i]);
    }
    return absl::OkStatus();
  }

 private:
  // Longest n first: a longer matching context predicts better. The most
  // recent earlier occurrence wins (local repetition is the common case).
  void Lookup(std::span<const int32_t> h, int max_tokens, Proposal* out) const {
    const int len = static_cast<int>(h.size());
    for (int n = std::min(options_.max_ngram, len - 1); n >= options_.min_ngram;
         --n) {
      std::span<const int32_t> suffix = h.subspan(len - n);
      for (int start = len - n - 1; start >= 0; --start) {
        if (!std::equal(suffix.begin(), suffix.end(), h.begin() + start))
          continue;
        const int from = start + n;
        const int count = std::min(max_tokens, len - from);
        out->tokens.assign(h.begin() + from, h.begin() + from + count);
        return;
      }
    }
  }

  NgramOptions options_;
};

class ScriptedProposer final : public Proposer {
 public:
  explicit ScriptedProposer(std::vector<std::vector<int32_t>> sequences)
      : sequences_(std::move(sequences)) {}
  std::string_view name() const override { return "scripted"; }

  absl::Status Propose(std::span<const ProposalRequest> requests,
                       std::vector<Proposal>* proposals) override {
    proposals->assign(requests.size(), Proposal{});
    for (size_t i = 0; i < requests.size(); ++i) {
      const auto& r = requests[i];
      for (const auto& s : sequences_) {
        if (s.size() <= r.history.size() ||
            !std::equal(r.history.begin(), r.history.end(), s.begin()))
          continue;
        const size_t count = std::min<size_t>(std::max(r.max_tokens, 0),
                                              s.size() - r.history.size());
        (*proposals)[i].tokens.assign(s.begin() + r.history.size(),
                                      s.begin() + r.history.size() + count);
        break;
      }
    }
    return absl::OkStatus();
  }

 private:
  std::vector<std::vector<int32_t>> sequences_;
};

}  // namespace

std::unique_ptr<Proposer> MakeNgramProposer(const NgramOptions& options) {
  return std::make_unique<NgramProposer>(options);
}

std::unique_ptr<Proposer> MakeScriptedProposer(
    std::vector<std::vector<int32_t>> sequences) {
  return std::make_unique<ScriptedProposer>(std::move(sequences));
}

}  // namespace pdserve::speculative
