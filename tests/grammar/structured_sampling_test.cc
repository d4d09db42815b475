// Sampling under a grammar. The verifier masks every row by the grammar in
// the state after the drafts before it, so (1) the emitted distribution is
// the masked target's (chi-square against a mask computed here by hand),
// (2) a draft the grammar forbids is never accepted, (3) an accepted draft
// advances the state for the next row, and (4) the constraint is left where
// it was. Then the decode worker with the real stories260K tokenizer: every
// output of a choice, regex and JSON schema request is in its language,
// greedy output is the same with speculation off, n-gram and draft.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>

#include "../decode/decode_test_util.h"
#include "engine/sampler.h"
#include "grammar/grammar.h"
#include "grammar/structured_output.h"
#include "speculative/verifier.h"
#include "testing/chi_square.h"

namespace pdserve::grammar {
namespace {

using json = nlohmann::json;

// Token 0 is EOS; the rest spell pieces of "yes" / "no" and letters the
// grammar never allows.
const std::vector<std::string>& Pieces() {
  static const auto* pieces = new std::vector<std::string>{
      "",  "y", "e", "s", "n", "o", "ye", "yes", "no", "es", "x", "z",
      "a", "b", "c", "d", "f", "g", "h",  "i",   "j",  "k",  "l", "m"};
  return *pieces;
}

std::shared_ptr<const CompiledGrammar> YesNo() {
  auto vocabulary = TokenVocabulary::Create(Pieces(), {0});
  EXPECT_TRUE(vocabulary.ok()) << vocabulary.status();
  auto grammar = CompiledGrammar::Compile(GrammarSpec::Choice({"yes", "no"}),
                                          *std::move(vocabulary));
  EXPECT_TRUE(grammar.ok()) << grammar.status();
  return *std::move(grammar);
}

std::vector<float> RowLogits(uint64_t seed) {
  std::vector<float> l(Pieces().size());
  for (size_t v = 0; v < l.size(); ++v) {
    l[v] = 3.0f * static_cast<float>(engine::UniformForRequest(seed, v, 9));
  }
  return l;
}

// softmax over `allowed` only.
std::vector<double> MaskedSoftmax(const std::vector<float>& logits,
                                  const std::set<int>& allowed) {
  std::vector<double> p(logits.size(), 0.0);
  double z = 0;
  for (int v : allowed) z += std::exp(double{logits[v]});
  for (int v : allowed) p[v] = std::exp(double{logits[v]}) / z;
  return p;
}

using pdserve::testing::ChiSquareRatio;

TEST(StructuredVerifyTest,
     EmitsTheMaskedDistributionAndRejectsForbiddenDrafts) {
  const int vocab = static_cast<int>(Pieces().size());
  const std::vector<float> row0 = RowLogits(1);
  const std::vector<float> row1 = RowLogits(2);
  std::vector<float> both(row0);
  both.insert(both.end(), row1.begin(), row1.end());
  // At the start: the pieces that begin "yes" or "no".
  const std::vector<double> start = MaskedSoftmax(row0, {1, 4, 6, 7, 8});
  engine::SamplingParams params;
  params.temperature = 1.0f;
  constexpr int kDraws = 20000;
  for (int32_t draft : {10 /* "x": forbidden */, 6 /* "ye" */}) {
    SCOPED_TRACE(Pieces()[draft]);
    auto constraint = NewMatcherConstraint(YesNo());
    std::map<int, int> first, after_ye;
    int accepted = 0;
    for (int seed = 0; seed < kDraws; ++seed) {
      params.seed = seed;
      auto out =
          speculative::VerifyDraft(both, vocab, std::vector<int32_t>{draft}, {},
                                   params, 0, {}, {}, constraint.get());
      ASSERT_TRUE(out.ok()) << out.status();
      ++first[out->tokens[0]];
      if (out->accepted_drafts == 1) {
        ++accepted;
        ++after_ye[out->tokens[1]];
      }
    }
    EXPECT_LT(ChiSquareRatio(first, start, kDraws), 1.0);
    if (draft == 10) {
      EXPECT_EQ(accepted, 0);
    } else {
      ASSERT_GT(accepted, 0);
      // After "ye" only "s" continues a choice.
      EXPECT_EQ(after_ye, (std::map<int, int>{{3, accepted}}));
    }
    // Left at the start: "no" is accepted, then only EOS.
    ASSERT_TRUE(constraint->Accept(8).ok());
    std::vector<float> eos_row = RowLogits(3);
    ASSERT_TRUE(constraint->MaskLogits(eos_row).ok());
    for (int v = 1; v < vocab; ++v) {
      EXPECT_EQ(eos_row[v], -std::numeric_limits<float>::infinity()) << v;
    }
    EXPECT_GT(eos_row[0], -1e30f);
  }
}

TEST(StructuredVerifyTest, NoAllowedTokenIsAPreciseError) {
  auto constraint = NewMatcherConstraint(YesNo());
  // The only allowed tokens carry -inf logits.
  std::vector<float> row = RowLogits(4);
  for (int v : {1, 4, 6, 7, 8}) {
    row[v] = -std::numeric_limits<float>::infinity();
  }
  engine::SamplingParams params;
  auto out = speculative::VerifyDraft(row, static_cast<int>(row.size()), {}, {},
                                      params, 0, {}, {}, constraint.get());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(out.status().message().find("no token is allowed"),
            std::string::npos);
}

}  // namespace
}  // namespace pdserve::grammar

namespace pdserve::decode {
namespace {

using json = nlohmann::json;
using testing_util::AllGoldenCases;
using testing_util::ExpectNoLeak;
using testing_util::MakeWorker;
using testing_util::Options;
using testing_util::Stories;
using testing_util::Stream;

struct Format {
  std::string name;
  engine::StructuredOutput spec;
  // The output is in the language.
  std::function<bool(const std::string&)> valid;
};

std::vector<Format> Formats() {
  using Kind = engine::StructuredOutput::Kind;
  std::vector<Format> f;
  f.push_back({"Choice",
               {Kind::kChoice, "", {"happy", "sad", "a big red ball"}},
               [](const std::string& s) {
                 return s == "happy" || s == "sad" || s == "a big red ball";
               }});
  f.push_back({"Regex",
               {Kind::kRegex, "(Tim|Lily) is [0-9]{1,2} years old\\.", {}},
               [](const std::string& s) {
                 return std::regex_match(
                     s, std::regex("(Tim|Lily) is [0-9]{1,2} years old\\."));
               }});
  f.push_back({"JsonSchema",
               {Kind::kJsonSchema,
                R"({"type": "object", "properties": {
              "name": {"type": "string", "maxLength": 12},
              "age": {"type": "integer"},
              "mood": {"enum": ["happy", "sad"]}},
            "required": ["name", "age", "mood"],
            "additionalProperties": false})",
                {}},
               [](const std::string& s) {
                 json j = json::parse(s, nullptr, false);
                 if (j.is_discarded() || !j.is_object() || j.size() != 3)
                   return false;
                 return j["name"].is_string() &&
                        j["name"].get<std::string>().size() <= 12 * 4 &&
                        j["age"].is_number_integer() &&
                        (j["mood"] == "happy" || j["mood"] == "sad");
               }});
  return f;
}

class StructuredDecodeTest : public ::testing::TestWithParam<Format> {};

TEST_P(StructuredDecodeTest, EveryOutputIsInTheLanguageThroughEveryMode) {
  const Format& format = GetParam();
  const auto golden = AllGoldenCases()[0];
  std::vector<int32_t> greedy_off;
  for (auto mode : {SpeculationMode::kOff, SpeculationMode::kNgram,
                    SpeculationMode::kDraft}) {
    auto worker = MakeWorker(Options(1, mode));
    constexpr int kSampled = 6;
    std::vector<Stream> streams(kSampled + 1);
    for (int i = 0; i <= kSampled; ++i) {
      RequestParams p;
      p.max_new_tokens = 450;  // up to 20 whitespace bytes per JSON gap
      p.sampling.structured_output = format.spec;
      if (i > 0) {
        p.sampling.temperature = 1.0f;
        p.sampling.seed = 100 + i;
      }
      ASSERT_TRUE(
          worker->Submit(i, golden.prompt_ids, p, streams[i].Callback()).ok());
    }
    for (int i = 0; i <= kSampled; ++i) {
      ASSERT_TRUE(streams[i].Wait());
      const std::string text = streams[i].text();
      EXPECT_EQ(streams[i].reason(), FinishReason::kEos)
          << format.name << " output " << i << ": " << text;
      EXPECT_TRUE(format.valid(text))
          << format.name << " output " << i << ": " << text;
    }
    if (mode == SpeculationMode::kOff) {
      greedy_off = streams[0].tokens();
    } else {
      EXPECT_EQ(streams[0].tokens(), greedy_off);
    }
    ExpectNoLeak(*worker);
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, StructuredDecodeTest,
                         ::testing::ValuesIn(Formats()),
                         [](const auto& info) { return info.param.name; });

TEST(StructuredDecodeTest, ABadSchemaIsRefusedAtAdmission) {
  auto worker = MakeWorker(Options(1, SpeculationMode::kOff));
  RequestParams p;
  p.sampling.structured_output = {engine::StructuredOutput::Kind::kJsonSchema,
                                  R"({"type": "object", "minProperties": 2})",
                                  {}};
  Stream s;
  absl::Status status =
      worker->Submit(1, AllGoldenCases()[0].prompt_ids, p, s.Callback());
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("minProperties"), std::string::npos)
      << status;
  ExpectNoLeak(*worker);
}

}  // namespace
}  // namespace pdserve::decode
