#include "random_generation.h"

#include <chrono>
#include <cmath>
#include <ctime>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pdserve::grammar::testing {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

double ThreadCpuMicros() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

}  // namespace

absl::StatusOr<GenerationResult> GenerateRandom(
    std::shared_ptr<const CompiledGrammar> grammar,
    const GenerationOptions& options, std::mt19937_64& rng) {
  const TokenVocabulary& vocab = grammar->vocabulary();
  // Single-byte tokens, by byte (-1 when the vocabulary has none).
  std::vector<int32_t> byte_token(256, -1);
  for (int32_t id = 0; id < vocab.size(); ++id) {
    if (vocab.token_bytes(id).size() == 1) {
      byte_token[static_cast<uint8_t>(vocab.token_bytes(id)[0])] = id;
    }
  }
  GrammarMatcher matcher(grammar);
  GenerationResult result;
  std::vector<uint32_t> mask(matcher.BitmaskWords());
  std::vector<int32_t> allowed;
  std::vector<double> cumulative;
  for (int step = 0; step < options.max_tokens; ++step) {
    const double cpu0 = ThreadCpuMicros();
    const auto t0 = std::chrono::steady_clock::now();
    PDS_RETURN_IF_ERROR(matcher.FillNextTokenBitmask(mask));
    const auto t1 = std::chrono::steady_clock::now();
    result.mask_cpu_micros.push_back(ThreadCpuMicros() - cpu0);
    result.mask_micros.push_back(
        std::chrono::duration<double, std::micro>(t1 - t0).count());
    allowed.clear();
    for (size_t w = 0; w < mask.size(); ++w) {
      for (uint32_t bits = mask[w]; bits != 0; bits &= bits - 1) {
        allowed.push_back(static_cast<int32_t>(w * 32 + __builtin_ctz(bits)));
      }
    }
    if (allowed.empty()) {
      return absl::InternalError(absl::StrCat(
          "no token allowed after \"", matcher.text(), "\" (a dead end)"));
    }
    auto is_allowed = [&](int32_t id) {
      return id >= 0 && ((mask[id >> 5] >> (id & 31)) & 1u);
    };
    int32_t chosen = -1;
    if (step < options.free_tokens) {
      const uint64_t salt = rng();
      cumulative.resize(allowed.size());
      double total = 0;
      for (size_t k = 0; k < allowed.size(); ++k) {
        const int32_t id = allowed[k];
        const double u = (SplitMix64(salt ^ static_cast<uint64_t>(id)) >> 11) *
                         (1.0 / 9007199254740992.0);
        double logit = options.logit_scale * u;
        if (vocab.token_bytes(id).size() == 1)
          logit += options.single_byte_bonus;
        total += std::exp(logit);
        cumulative[k] = total;
      }
      const double r = std::uniform_real_distribution<double>(0, total)(rng);
      const size_t k =
          std::upper_bound(cumulative.begin(), cumulative.end(), r) -
          cumulative.begin();
      chosen = allowed[std::min(k, allowed.size() - 1)];
    } else {
      for (int32_t eos : vocab.eos_ids()) {
        if (is_allowed(eos)) {
          chosen = eos;
          break;
        }
      }
      // Inside a JSON string (by the quotes so far) closing it comes first.
      bool in_string = false;
      for (size_t i = 0; i < matcher.text().size(); ++i) {
        const char c = matcher.text()[i];
        if (in_string && c == '\\') {
          ++i;
        } else if (c == '"') {
          in_string = !in_string;
        }
      }
      for (char c : std::string(in_string ? "\"" : "}],:\"")) {
        if (chosen < 0 && is_allowed(byte_token[static_cast<uint8_t>(c)])) {
          chosen = byte_token[static_cast<uint8_t>(c)];
        }
      }
      if (chosen < 0) {
        std::vector<int32_t> single;
        for (int32_t id : allowed) {
          if (vocab.token_bytes(id).size() == 1) single.push_back(id);
        }
        const std::vector<int32_t>& pool = single.empty() ? allowed : single;
        chosen = pool[std::uniform_int_distribution<size_t>(
            0, pool.size() - 1)(rng)];
      }
    }
    PDS_RETURN_IF_ERROR(matcher.Accept(chosen));
    result.ids.push_back(chosen);
    if (matcher.IsTerminated()) {
      result.finished = true;
      break;
    }
  }
  result.text = matcher.text();
  return result;
}

}  // namespace pdserve::grammar::testing
