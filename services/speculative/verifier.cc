#include "speculative/verifier.h"

#include "absl/strings/str_cat.h"
#include "speculative/proposer.h"

namespace pdserve::speculative {

absl::StatusOr<VerifyOutcome> VerifyDraft(
    std::span<const float> logits, int vocab, std::span<const int32_t> draft,
    std::span<const std::vector<float>> draft_probs,
    const engine::SamplingParams& params, uint64_t first_output_index,
    const VerifyOptions& options, const engine::SamplingHistory& history) {
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
  const bool processes = params.processes_logits();
  std::vector<int32_t> output;
  if (processes) {
    output.reserve(history.output.size() + gamma);
    output.assign(history.output.begin(), history.output.end());
  }
  auto history_at = [&](size_t i) {
    engine::SamplingHistory h = history;
    if (processes)
      h.output =
          std::span<const int32_t>(output).first(history.output.size() + i);
    return h;
  };
  if (processes) output.insert(output.end(), draft.begin(), draft.end());
  std::vector<float> processed_row;
  // Row i as the sampler sees it: raw, or through the logit processors.
  auto target_row = [&](size_t i) -> std::span<const float> {
    if (!processes) return row(i);
    processed_row.assign(row(i).begin(), row(i).end());
    engine::ApplyLogitProcessors(processed_row, params, history_at(i),
                                 first_output_index + i);
    return processed_row;
  };
  VerifyOutcome out;
  std::vector<float> p;
  for (size_t i = 0; i < gamma; ++i) {
    const uint64_t index = first_output_index + i;
    const int32_t d = draft[i];
    bool accept;
    if (options.accept_all_for_test) {
      accept = true;
    } else if (params.greedy()) {
      accept = engine::ArgMax(target_row(i)) == d;
    } else {
      engine::SamplingDistribution(target_row(i), params, &p);
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
          engine::SamplingDistribution(target_row(i), params, &p);
        }
        out.tokens.push_back(engine::DrawFromDistribution(
            p, engine::UniformForRequest(params.seed, index, kResidualStream)));
        return out;
      }
    }
    if (!accept) {
      // Greedy correction: the target's own choice at this position.
      out.tokens.push_back(engine::ArgMax(target_row(i)));
      return out;
    }
    out.tokens.push_back(d);
    ++out.accepted_drafts;
  }
  out.tokens.push_back(engine::DrawToken(
      row(gamma), params, first_output_index + gamma, history_at(gamma)));
  return out;
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
