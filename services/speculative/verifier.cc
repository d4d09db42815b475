#include "speculative/verifier.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "speculative/proposer.h"

namespace pdserve::speculative {

absl::StatusOr<VerifyOutcome> VerifyDraft(
    std::span<const float> logits, int vocab, std::span<const int32_t> draft,
    std::span<const std::vector<float>> draft_probs,
    const engine::SamplingParams& params, uint64_t first_output_index,
    const VerifyOptions& options, const engine::SamplingHistory& history,
    engine::TokenConstraint* constraint) {
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
  auto row = [&](size_t i) {
    return logits.subspan(i * static_cast<size_t>(vocab), vocab);
  };
  // Row i's history: the output so far plus the drafts before it.
  const bool processes = params.processes_logits() || constraint != nullptr;
  std::vector<int32_t> output;
  if (processes) {
    output.reserve(history.output.size() + gamma);
    output.assign(history.output.begin(), history.output.end());
    output.insert(output.end(), draft.begin(), draft.end());
  }
  auto history_at = [&](size_t i) {
    engine::SamplingHistory h = history;
    if (processes) {
      h.output =
          std::span<const int32_t>(output).first(history.output.size() + i);
    }
    return h;
  };
  // The constraint walks the accepted drafts; it is rewound on every return.
  int advanced = 0;
  auto rewind = [&]() -> absl::Status {
    if (constraint == nullptr || advanced == 0) return absl::OkStatus();
    const int n = advanced;
    advanced = 0;
    return constraint->Rollback(n);
  };
  std::vector<float> processed_row;
  // Row i as the sampler sees it: raw, or through the logit processors and
  // the constraint in its state after drafts 1..i.
  auto target_row = [&](size_t i) -> absl::StatusOr<std::span<const float>> {
    if (!processes) return row(i);
    processed_row.assign(row(i).begin(), row(i).end());
    engine::ApplyLogitProcessors(processed_row, params, history_at(i),
                                 first_output_index + i);
    if (constraint != nullptr) {
      PDS_RETURN_IF_ERROR(constraint->MaskLogits(processed_row));
      bool any = false;
      for (float l : processed_row) {
        if (l != -std::numeric_limits<float>::infinity()) {
          any = true;
          break;
        }
      }
      if (!any) {
        return absl::FailedPreconditionError(absl::StrCat(
            "structured output: no token is allowed at output position ",
            first_output_index + i,
            " (the grammar and the logit processors exclude every token)"));
      }
    }
    return std::span<const float>(processed_row);
  };
  auto finish = [&](absl::StatusOr<VerifyOutcome> result)
      -> absl::StatusOr<VerifyOutcome> {
    absl::Status rewound = rewind();
    if (!rewound.ok()) return rewound;
    return result;
  };
  VerifyOutcome out;
  std::vector<float> p;
  for (size_t i = 0; i < gamma; ++i) {
    const uint64_t index = first_output_index + i;
    const int32_t d = draft[i];
    absl::StatusOr<std::span<const float>> target = target_row(i);
    if (!target.ok()) return finish(target.status());
    bool accept;
    if (options.accept_all_for_test) {
      accept = true;
    } else if (params.greedy()) {
      accept = engine::ArgMax(*target) == d;
    } else {
      engine::SamplingDistribution(*target, params, &p);
      const double q = draft_probs.empty() ? 1.0 : draft_probs[i][d];
      const double u =
          engine::UniformForRequest(params.seed, index, kAcceptStream);
      // q(d) > 0 since d was drawn from q; guard anyway against a proposer
      // reporting zero mass for its own token (then p/q is +inf: accept iff
      // p(d) > 0).
      accept = q > 0 ? u * q < p[d] : p[d] > 0;
      if (!accept) {
        // Residual normalize(max(0, p - q)); DrawFromDistribution normalizes.
        if (draft_probs.empty()) {
          p[d] = 0.0f;
        } else {
          for (int v = 0; v < vocab; ++v)
            p[v] = std::max(0.0f, p[v] - draft_probs[i][v]);
        }
        double mass = 0;
        for (float x : p) mass += x;
        if (mass <= 0) {
          // p <= q everywhere yet d was rejected: only possible through
          // rounding; fall back to the target distribution itself.
          engine::SamplingDistribution(*target, params, &p);
        }
        out.tokens.push_back(engine::DrawFromDistribution(
            p, engine::UniformForRequest(params.seed, index, kResidualStream)));
        return finish(std::move(out));
      }
    }
    if (!accept) {
      // Greedy correction: the target's own choice at this position.
      out.tokens.push_back(engine::ArgMax(*target));
      return finish(std::move(out));
    }
    out.tokens.push_back(d);
    ++out.accepted_drafts;
    if (constraint != nullptr) {
      // The next row is masked in the state after this draft. (A draft the
      // grammar forbids has p = 0 and is never accepted, except by the
      // test-only accept-all verifier.)
      if (absl::Status s = constraint->Accept(d); !s.ok()) {
        return finish(s);
      }
      ++advanced;
    }
  }
  absl::StatusOr<std::span<const float>> bonus = target_row(gamma);
  if (!bonus.ok()) return finish(bonus.status());
  if (params.greedy()) {
    out.tokens.push_back(engine::ArgMax(*bonus));
  } else {
    std::vector<float> probs;
    engine::SamplingDistribution(*bonus, params, &probs);
    out.tokens.push_back(engine::DrawFromDistribution(
        probs,
        engine::UniformForRequest(params.seed, first_output_index + gamma)));
  }
  return finish(std::move(out));
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
