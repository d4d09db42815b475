// What the sampling controls cost per output token: engine::DrawToken on one
// logits row with the logit processors off and on (presence, frequency and
// repetition penalties, a logit bias, min_tokens), greedy and sampled
// (temperature + top-p, and min-p), at the vocabularies of stories260K-size
// (32k) and Llama 3 (128k) models, with a 1,024-token prompt and 512 output
// tokens of history. Same binary, same rows, side by side.
//
//   build/bench/sampler_bench [--iterations N]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "engine/sampler.h"

namespace {

using pdserve::engine::DrawToken;
using pdserve::engine::SamplingHistory;
using pdserve::engine::SamplingParams;

double MicrosPerToken(const std::vector<float>& logits,
                      const SamplingParams& params,
                      const SamplingHistory& history, int iterations) {
  int64_t sink = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) {
    sink += DrawToken(logits, params, history.output.size(), history);
  }
  const auto end = std::chrono::steady_clock::now();
  if (sink == -1) std::printf("impossible\n");
  return std::chrono::duration<double, std::micro>(end - start).count() /
         iterations;
}

}  // namespace

int main(int argc, char** argv) {
  int iterations = 200;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--iterations") == 0 && i + 1 < argc) {
      iterations = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: %s [--iterations N]\n", argv[0]);
      return std::strcmp(argv[i], "--help") == 0 ? 0 : 2;
    }
  }
  std::printf(
      "| vocab | logits | mode | processors off µs/token | on µs/token | "
      "on − off |\n|---|---|---|---|---|---|\n");
  for (int vocab : {32000, 128256}) {
    for (const bool zipf : {false, true}) {
      // Flat: uniform logits in [-4, 4] (the nucleus is most of the
      // vocabulary). Zipf: p ∝ 1/rank^1.2 over a shuffled vocabulary, closer
      // to a language model's peaked rows.
      std::vector<float> logits(vocab);
      for (int v = 0; v < vocab; ++v) {
        const double u = pdserve::engine::UniformForRequest(7, v, 9);
        logits[v] = static_cast<float>(zipf ? -1.2 * std::log(1.0 + u * vocab)
                                            : 8.0 * u - 4.0);
      }
      std::vector<int32_t> prompt(1024), output(512);
      for (size_t i = 0; i < prompt.size(); ++i) {
        prompt[i] = static_cast<int32_t>((i * 7919) % vocab);
      }
      for (size_t i = 0; i < output.size(); ++i) {
        output[i] = static_cast<int32_t>((i * 104729) % vocab);
      }
      const std::vector<int32_t> eos = {2};
      const SamplingHistory history{prompt, output, eos};
      for (const bool sampled : {false, true}) {
        SamplingParams off;
        if (sampled) {
          off.temperature = 0.8f;
          off.top_p = 0.95f;
        }
        SamplingParams on = off;
        on.presence_penalty = 0.5f;
        on.frequency_penalty = 0.5f;
        on.repetition_penalty = 1.1f;
        on.logit_bias = {{5, 2.0f}, {17, -100.0f}};
        on.min_tokens = 600;  // still holding EOS back at output 512
        if (sampled) on.min_p = 0.05f;
        const double a = MicrosPerToken(logits, off, history, iterations);
        const double b = MicrosPerToken(logits, on, history, iterations);
        std::printf("| %d | %s | %s | %.1f | %.1f | %.1f |\n", vocab,
                    zipf ? "Zipf 1.2" : "flat",
                    sampled ? "temperature 0.8, top-p 0.95 (+ min-p 0.05 on)"
                            : "greedy",
                    a, b, b - a);
      }
    }
  }
  return 0;
}
