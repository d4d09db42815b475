// Generates outputs under a grammar by sampling tokens from random logits
// under the mask, as a model would be constrained, for the validation test
// and grammar_bench. After `free_tokens` steps it steers towards completion
// (EOS when allowed, else a closing byte " } ] , : when allowed, else a random
// allowed single-byte token) so every output ends within a bounded length.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grammar/grammar.h"

namespace pdserve::grammar::testing {

struct GenerationOptions {
  int max_tokens = 600;
  int free_tokens = 32;          // steps sampled from random logits
  double logit_scale = 8.0;      // logits are uniform in [0, scale)
  double single_byte_bonus = 0;  // added to single-byte tokens' logits
};

struct GenerationResult {
  std::string text;
  bool finished = false;  // ended by EOS within max_tokens
  std::vector<int32_t> ids;
  std::vector<double> mask_micros;  // FillNextTokenBitmask wall time per step
  // The same calls in this thread's CPU time: on a loaded machine it leaves
  // out the time the thread was not scheduled.
  std::vector<double> mask_cpu_micros;
};

[[nodiscard]] absl::StatusOr<GenerationResult> GenerateRandom(
    std::shared_ptr<const CompiledGrammar> grammar,
    const GenerationOptions& options, std::mt19937_64& rng);

}  // namespace pdserve::grammar::testing
