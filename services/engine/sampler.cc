#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "engine/matmul.h"

namespace pdserve::engine {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Orders candidates best first: higher logit, then lower id.
bool Better(const TopLogprob& a, const TopLogprob& b) {
  return a.logprob != b.logprob ? a.logprob > b.logprob : a.token < b.token;
}

}  // namespace

void ApplyLogitProcessors(std::span<float> logits, const SamplingParams& params,
                          const SamplingHistory& history, uint64_t index) {
  if (!params.processes_logits()) return;
  const int64_t vocab = static_cast<int64_t>(logits.size());
  auto in_vocab = [vocab](int32_t t) { return t >= 0 && t < vocab; };
  if (index < static_cast<uint64_t>(std::max(params.min_tokens, 0))) {
    for (int32_t t : history.end_tokens) {
      if (in_vocab(t)) logits[t] = -std::numeric_limits<float>::infinity();
    }
  }
  for (const LogitBias& b : params.logit_bias) {
    if (in_vocab(b.token)) logits[b.token] += b.bias;
  }
  const float r = params.repetition_penalty;
  const bool count_output =
      params.frequency_penalty != 0.0f || params.presence_penalty != 0.0f;
  if (r == 1.0f && !count_output) return;
  // Output counts; the prompt only adds membership for repetition_penalty.
  absl::flat_hash_map<int32_t, int32_t> output_count;
  output_count.reserve(history.output.size());
  for (int32_t t : history.output) {
    if (in_vocab(t)) ++output_count[t];
  }
  if (r != 1.0f) {
    auto penalize = [&](int32_t t) {
      float& l = logits[t];
      l = l > 0.0f ? l / r : l * r;
    };
    absl::flat_hash_set<int32_t> seen;  // each token penalized once
    seen.reserve(history.prompt.size() + output_count.size());
    for (int32_t t : history.prompt) {
      if (in_vocab(t) && seen.insert(t).second) penalize(t);
    }
    for (const auto& [t, count] : output_count) {
      if (seen.insert(t).second) penalize(t);
    }
  }
  if (count_output) {
    for (const auto& [t, count] : output_count) {
      logits[t] -= params.frequency_penalty * static_cast<float>(count) +
                   params.presence_penalty;
    }
  }
}

double UniformForRequest(uint64_t seed, uint64_t index, uint64_t stream) {
  uint64_t bits = SplitMix64(SplitMix64(SplitMix64(seed) ^ index) ^
                             (stream * 0x632be59bd9b4e019ull));
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

int32_t ArgMax(std::span<const float> logits) {
  if (logits.empty()) return 0;  // as max_element: the (empty) begin
  const int64_t n = static_cast<int64_t>(logits.size());
  // The first element equal to the maximum: the lowest id on ties.
  const int64_t at =
      FirstAbove(logits.data(), n, MaxOf(logits.data(), n), /*or_equal=*/true);
  // Only NaNs compare false with everything; fall back to the scalar rule.
  if (at == n) {
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) -
                                logits.begin());
  }
  return static_cast<int32_t>(at);
}

void SamplingDistribution(std::span<const float> logits,
                          const SamplingParams& params,
                          std::vector<float>* probs) {
  const size_t vocab = logits.size();
  probs->assign(vocab, 0.0f);
  if (vocab == 0) return;
  if (params.greedy()) {
    (*probs)[ArgMax(logits)] = 1.0f;
    return;
  }
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (size_t i = 0; i < vocab; ++i) {
    double p = std::exp((double{logits[i]} - max_logit) / params.temperature);
    (*probs)[i] = static_cast<float>(p);
    sum += p;
  }
  for (float& p : *probs) p = static_cast<float>(p / sum);
  if (params.min_p > 0.0f) {
    // Relative to the most likely token; renormalized with the cuts below.
    const float max_p = *std::max_element(probs->begin(), probs->end());
    const float floor = params.min_p * max_p;
    double kept = 0;
    for (float& p : *probs) {
      if (p < floor) p = 0.0f;
      kept += p;
    }
    for (float& p : *probs) p = static_cast<float>(p / kept);
  }
  const bool use_top_k =
      params.top_k > 0 && static_cast<size_t>(params.top_k) < vocab;
  const bool use_top_p = params.top_p < 1.0f;
  if (!use_top_k && !use_top_p) return;
  // Ids by probability, ties by id (a strict order, so the cut is
  // deterministic). Only a prefix is ever needed: top-k's k, and the nucleus,
  // which for real distributions is a few hundred tokens of a 128k
  // vocabulary. So the best `sorted` ids are selected and sorted, growing 4x
  // until the cut falls inside them (a full sort cost 22 ms a token at 128k).
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  const std::vector<float>& pr = *probs;
  auto before = [&pr](int32_t a, int32_t b) {
    return pr[a] != pr[b] ? pr[a] > pr[b] : a < b;
  };
  const size_t top_k_cut =
      use_top_k ? static_cast<size_t>(params.top_k) : vocab;
  size_t sorted = 0;
  auto sort_prefix = [&](size_t n) {
    n = std::min(n, vocab);
    if (n <= sorted) return;
    // order[sorted..) holds the ids not yet placed.
    if (n < vocab) {
      std::nth_element(order.begin() + sorted, order.begin() + n, order.end(),
                       before);
    }
    std::sort(order.begin() + sorted, order.begin() + n, before);
    sorted = n;
  };
  size_t keep = top_k_cut;
  if (use_top_p) {
    // The top-k set's mass (all of it without top-k).
    double kept_mass = 0;
    if (!use_top_k) {
      for (float x : *probs) kept_mass += x;
    } else {
      sort_prefix(top_k_cut);
      for (size_t i = 0; i < top_k_cut; ++i) kept_mass += (*probs)[order[i]];
    }
    double cumulative = 0;
    size_t nucleus = 0;
    size_t want = std::min<size_t>(top_k_cut, 256);
    // Smallest prefix whose mass (within the top-k set) reaches top_p.
    while (true) {
      sort_prefix(want);
      bool reached = false;
      while (nucleus < std::min(sorted, top_k_cut)) {
        cumulative += (*probs)[order[nucleus]];
        ++nucleus;
        if (cumulative >= params.top_p * kept_mass) {
          reached = true;
          break;
        }
      }
      if (reached || nucleus >= top_k_cut || sorted >= vocab) break;
      want = std::min(top_k_cut, want * 4);
    }
    keep = nucleus;
  } else {
    sort_prefix(keep);
  }
  double kept = 0;
  for (size_t i = 0; i < keep; ++i) kept += (*probs)[order[i]];
  for (size_t i = keep; i < vocab; ++i) (*probs)[order[i]] = 0.0f;
  for (size_t i = 0; i < keep; ++i)
    (*probs)[order[i]] = static_cast<float>((*probs)[order[i]] / kept);
}

int32_t DrawFromDistribution(std::span<const float> probs, double u) {
  double total = 0;
  for (float p : probs) total += p;
  double target = u * total;
  double cumulative = 0;
  int32_t last_nonzero = -1;
  for (size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] <= 0.0f) continue;
    last_nonzero = static_cast<int32_t>(i);
    cumulative += probs[i];
    if (target < cumulative) return static_cast<int32_t>(i);
  }
  return last_nonzero;  // rounding at the top end
}

TokenLogprobs ComputeTokenLogprobs(std::span<const float> logits, int32_t token,
                                   int top_n) {
  TokenLogprobs out;
  if (logits.empty()) return out;
  const double log_z =
      LogSumExp(logits.data(), static_cast<int64_t>(logits.size()));
  if (token >= 0 && static_cast<size_t>(token) < logits.size())
    out.logprob = static_cast<float>(double{logits[token]} - log_z);
  const size_t n =
      std::min(static_cast<size_t>(std::max(top_n, 0)), logits.size());
  if (n == 0) return out;
  // A heap of the n best so far, worst on top. Once it is full, FirstAbove
  // skips (8 logits per compare) to the next logit that beats the worst.
  std::vector<TopLogprob>& heap = out.top;
  heap.reserve(n + 1);
  const int64_t size = static_cast<int64_t>(logits.size());
  for (int64_t i = 0; i < size; ++i) {
    if (heap.size() == n) {
      // Skip to the next logit above the worst kept one (ids only grow, so a
      // later logit equal to it loses the tie).
      i += FirstAbove(logits.data() + i, size - i, heap.front().logprob,
                      /*or_equal=*/false);
      if (i == size) break;
    }
    TopLogprob candidate{static_cast<int32_t>(i), logits[i]};
    heap.push_back(candidate);
    std::push_heap(heap.begin(), heap.end(), Better);
    if (heap.size() > n) {
      std::pop_heap(heap.begin(), heap.end(), Better);
      heap.pop_back();
    }
  }
  std::sort_heap(heap.begin(), heap.end(), Better);
  for (TopLogprob& t : heap)
    t.logprob = static_cast<float>(double{t.logprob} - log_z);
  return out;
}

void ProcessedDistribution(std::span<const float> logits,
                           const SamplingParams& params,
                           const SamplingHistory& history, uint64_t index,
                           std::vector<float>* probs) {
  if (!params.processes_logits()) {
    SamplingDistribution(logits, params, probs);
    return;
  }
  std::vector<float> processed(logits.begin(), logits.end());
  ApplyLogitProcessors(processed, params, history, index);
  SamplingDistribution(processed, params, probs);
}

int32_t DrawToken(std::span<const float> logits, const SamplingParams& params,
                  uint64_t index, const SamplingHistory& history) {
  if (params.greedy() && !params.processes_logits()) return ArgMax(logits);
  std::vector<float> processed;
  if (params.processes_logits()) {
    processed.assign(logits.begin(), logits.end());
    ApplyLogitProcessors(processed, params, history, index);
    logits = processed;
  }
  if (params.greedy()) return ArgMax(logits);
  std::vector<float> probs;
  SamplingDistribution(logits, params, &probs);
  return DrawFromDistribution(probs, UniformForRequest(params.seed, index));
}

SampledToken Sample(std::span<const float> logits, const SamplingParams& params,
                    uint64_t index, int top_logprobs,
                    const SamplingHistory& history) {
  SampledToken out;
  out.token = DrawToken(logits, params, index, history);
  TokenLogprobs logprobs =
      ComputeTokenLogprobs(logits, out.token, top_logprobs);
  out.logprob = logprobs.logprob;
  out.top = std::move(logprobs.top);
  return out;
}

absl::StatusOr<SampledToken> SampleWithConstraint(
    std::span<const float> logits, const SamplingParams& params, uint64_t index,
    int top_logprobs, const SamplingHistory& history,
    TokenConstraint* constraint) {
  if (constraint == nullptr) {
    return Sample(logits, params, index, top_logprobs, history);
  }
  std::vector<float> processed(logits.begin(), logits.end());
  ApplyLogitProcessors(processed, params, history, index);
  if (absl::Status s = constraint->MaskLogits(processed); !s.ok()) return s;
  const bool any = std::any_of(processed.begin(), processed.end(), [](float l) {
    return l != -std::numeric_limits<float>::infinity();
  });
  if (!any) {
    return absl::FailedPreconditionError(absl::StrCat(
        "structured output: no token is allowed at output position ", index,
        " (the grammar and the logit processors exclude every token)"));
  }
  SampledToken out;
  if (params.greedy()) {
    out.token = ArgMax(processed);
  } else {
    std::vector<float> probs;
    SamplingDistribution(processed, params, &probs);
    out.token =
        DrawFromDistribution(probs, UniformForRequest(params.seed, index));
  }
  TokenLogprobs logprobs =
      ComputeTokenLogprobs(logits, out.token, top_logprobs);
  out.logprob = logprobs.logprob;
  out.top = std::move(logprobs.top);
  return out;
}

}  // namespace pdserve::engine
