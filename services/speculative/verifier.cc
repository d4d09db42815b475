#include "speculative/verifier.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "speculative/proposer.h"

namespace pdserve::speculative {

namespace {

absl::Status CheckVerifyInputs(
    std::span<const float> logits, int vocab, std::span<const int32_t> draft,
    std::span<const std::vector<float>> draft_probs) {
  const size_t gamma = draft.size();
  if (vocab <= 0 || logits.size() != (gamma + 1) * static_cast<size_t>(vocab))
    return absl::InvalidArgumentError(
        absl::StrCat("verify needs ", gamma + 1, " rows of ", vocab,
                     " logits, got ", logits.size(), " floats"));
  if (!draft_probs.empty() && draft_probs.size() != gamma)
    return absl::InvalidArgumentError(
        absl::StrCat("draft_probs has ", draft_probs.size(), " rows for ",
                     gamma, " draft tokens"));
  for (size_t i = 0; i < gamma; ++i) {
    if (draft[i] < 0 || draft[i] >= vocab)
      return absl::InvalidArgumentError(absl::StrCat(
          "draft token ", draft[i], " outside vocabulary of ", vocab));
    if (!draft_probs.empty() &&
        draft_probs[i].size() != static_cast<size_t>(vocab))
      return absl::InvalidArgumentError(absl::StrCat(
          "draft_probs row ", i, " has ", draft_probs[i].size(), " entries"));
  }
  return absl::OkStatus();
}

// The target's rows as the sampler sees them during one verification: raw,
// or through the logit processors (with the drafts before each row as
// output history) and the constraint, which walks the accepted drafts and
// is rewound at the end.
class TargetRows {
 public:
  TargetRows(std::span<const float> logits, int vocab,
             std::span<const int32_t> draft,
             const engine::SamplingParams& params, uint64_t first_output_index,
             const engine::SamplingHistory& history,
             engine::TokenConstraint* constraint)
      : logits_(logits),
        vocab_(vocab),
        params_(params),
        first_output_index_(first_output_index),
        history_(history),
        constraint_(constraint),
        processes_(params.processes_logits() || constraint != nullptr) {
    if (processes_) {
      output_.reserve(history.output.size() + draft.size());
      output_.assign(history.output.begin(), history.output.end());
      output_.insert(output_.end(), draft.begin(), draft.end());
    }
  }

  // Row i, in the constraint's state after drafts 1..i.
  absl::StatusOr<std::span<const float>> Row(size_t i) {
    const std::span<const float> raw =
        logits_.subspan(i * static_cast<size_t>(vocab_), vocab_);
    if (!processes_) return raw;
    processed_.assign(raw.begin(), raw.end());
    engine::SamplingHistory h = history_;
    h.output =
        std::span<const int32_t>(output_).first(history_.output.size() + i);
    engine::ApplyLogitProcessors(processed_, params_, h,
                                 first_output_index_ + i);
    if (constraint_ == nullptr) return std::span<const float>(processed_);
    PDS_RETURN_IF_ERROR(constraint_->MaskLogits(processed_));
    for (float l : processed_) {
      if (l != -std::numeric_limits<float>::infinity()) {
        return std::span<const float>(processed_);
      }
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "structured output: no token is allowed at output position ",
        first_output_index_ + i,
        " (the grammar and the logit processors exclude every token)"));
  }

  // Draft `d` accepted: the next row is masked in the state after it. (A
  // draft the grammar forbids has p = 0 and is never accepted, except by the
  // test-only accept-all verifier.)
  absl::Status Accept(int32_t d) {
    if (constraint_ == nullptr) return absl::OkStatus();
    PDS_RETURN_IF_ERROR(constraint_->Accept(d));
    ++advanced_;
    return absl::OkStatus();
  }

  // `result`, once the constraint is back where the verification began.
  absl::StatusOr<VerifyOutcome> Finish(absl::StatusOr<VerifyOutcome> result) {
    if (constraint_ != nullptr && advanced_ > 0) {
      const int n = advanced_;
      advanced_ = 0;
      PDS_RETURN_IF_ERROR(constraint_->Rollback(n));
    }
    return result;
  }

 private:
  const std::span<const float> logits_;
  const int vocab_;
  const engine::SamplingParams& params_;
  const uint64_t first_output_index_;
  const engine::SamplingHistory& history_;
  engine::TokenConstraint* const constraint_;
  const bool processes_;
  std::vector<int32_t> output_;  // history + drafts (when processing)
  std::vector<float> processed_;
  int advanced_ = 0;  // drafts the constraint accepted
};

// The token after rejected draft `d` at output `index`: a draw from the
// residual normalize(max(0, p - q)), where `p` holds the target's
// distribution (overwritten) and q the draft's (one-hot at d when the
// proposer gives no distribution).
int32_t DrawResidual(std::span<const float> target,
                     const engine::SamplingParams& params,
                     std::span<const float> draft_dist, int32_t d,
                     uint64_t index, std::vector<float>& p) {
  if (draft_dist.empty()) {
    p[d] = 0.0f;
  } else {
    for (size_t v = 0; v < p.size(); ++v) {
      p[v] = std::max(0.0f, p[v] - draft_dist[v]);
    }
  }
  double mass = 0;
  for (float x : p) mass += x;
  if (mass <= 0) {
    // p <= q everywhere yet d was rejected: only possible through rounding;
    // fall back to the target distribution itself.
    engine::SamplingDistribution(target, params, &p);
  }
  // DrawFromDistribution normalizes.
  return engine::DrawFromDistribution(
      p, engine::UniformForRequest(params.seed, index, kResidualStream));
}

}  // namespace

absl::StatusOr<VerifyOutcome> VerifyDraft(
    std::span<const float> logits, int vocab, std::span<const int32_t> draft,
    std::span<const std::vector<float>> draft_probs,
    const engine::SamplingParams& params, uint64_t first_output_index,
    const VerifyOptions& options, const engine::SamplingHistory& history,
    engine::TokenConstraint* constraint) {
  PDS_RETURN_IF_ERROR(CheckVerifyInputs(logits, vocab, draft, draft_probs));
  const size_t gamma = draft.size();
  TargetRows rows(logits, vocab, draft, params, first_output_index, history,
                  constraint);
  VerifyOutcome out;
  std::vector<float> p;
  for (size_t i = 0; i < gamma; ++i) {
    const uint64_t index = first_output_index + i;
    const int32_t d = draft[i];
    absl::StatusOr<std::span<const float>> target = rows.Row(i);
    if (!target.ok()) return rows.Finish(target.status());
    if (options.accept_all_for_test) {
      // accepted below
    } else if (params.greedy()) {
      if (engine::ArgMax(*target) != d) {
        // Greedy correction: the target's own choice at this position.
        out.tokens.push_back(engine::ArgMax(*target));
        return rows.Finish(std::move(out));
      }
    } else {
      engine::SamplingDistribution(*target, params, &p);
      const double q = draft_probs.empty() ? 1.0 : draft_probs[i][d];
      const double u =
          engine::UniformForRequest(params.seed, index, kAcceptStream);
      // q(d) > 0 since d was drawn from q; guard anyway against a proposer
      // reporting zero mass for its own token (then p/q is +inf: accept iff
      // p(d) > 0).
      const bool accept = q > 0 ? u * q < p[d] : p[d] > 0;
      if (!accept) {
        out.tokens.push_back(DrawResidual(
            *target, params,
            draft_probs.empty() ? std::span<const float>()
                                : std::span<const float>(draft_probs[i]),
            d, index, p));
        return rows.Finish(std::move(out));
      }
    }
    out.tokens.push_back(d);
    ++out.accepted_drafts;
    if (absl::Status s = rows.Accept(d); !s.ok()) return rows.Finish(s);
  }
  absl::StatusOr<std::span<const float>> bonus = rows.Row(gamma);
  if (!bonus.ok()) return rows.Finish(bonus.status());
  if (params.greedy()) {
    out.tokens.push_back(engine::ArgMax(*bonus));
  } else {
    std::vector<float> probs;
    engine::SamplingDistribution(*bonus, params, &probs);
    out.tokens.push_back(engine::DrawFromDistribution(
        probs,
        engine::UniformForRequest(params.seed, first_output_index + gamma)));
  }
  return rows.Finish(std::move(out));
}

absl::StatusOr<VerifyOutcome> VerifyGreedyFromArgmax(
    std::span<const int32_t> argmax, std::span<const int32_t> draft) {
  if (argmax.size() != draft.size() + 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("greedy verify got ", argmax.size(), " argmax rows for ",
                     draft.size(), " draft tokens (needs one more)"));
  }
  VerifyOutcome out;
  for (size_t i = 0; i < draft.size(); ++i) {
    out.tokens.push_back(argmax[i]);
    if (argmax[i] != draft[i]) return out;
    ++out.accepted_drafts;
  }
  out.tokens.push_back(argmax[draft.size()]);
  return out;
}

}  // namespace pdserve::speculative
