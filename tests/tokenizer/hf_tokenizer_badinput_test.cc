// Malformed tokenizer.json files fail at load with INVALID_ARGUMENT naming
// the file, the JSON key path and what is wrong; hostile text never crashes
// Encode. Runs under ASan + UBSan in CI (label badinput).
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tokenizer/detokenizer.h"
#include "tokenizer/tokenizer.h"

namespace pdserve::tokenizer {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using ::testing::AllOf;
using ::testing::HasSubstr;

// A tiny valid byte-level BPE tokenizer.json: every byte char, a few merges.
Json TinyDoc() {
  Json vocab = Json::object();
  int id = 0;
  for (const char* t : {"a", "b", "c", "ab", "abc", "Ġ", "Ġa", "<0x41>"}) {
    vocab[t] = id++;
  }
  return {
      {"version", "1.0"},
      {"added_tokens",
       {{{"id", 8},
         {"content", "<|eot|>"},
         {"special", true},
         {"lstrip", false},
         {"rstrip", false},
         {"normalized", false},
         {"single_word", false}}}},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"},
           {"pattern", {{"Regex", "\\s?\\p{L}+|\\s+"}}},
           {"behavior", "Isolated"},
           {"invert", false}},
          {{"type", "ByteLevel"},
           {"add_prefix_space", false},
           {"use_regex", false}}}}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model",
       {{"type", "BPE"},
        {"vocab", vocab},
        {"merges", {"a b", "ab c", "Ġ a"}},
        {"byte_fallback", false},
        {"unk_token", nullptr}}},
  };
}

class HfBadInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ =
        (fs::temp_directory_path() /
         absl::StrCat(
             "hf_badinput.", getpid(), ".",
             ::testing::UnitTest::GetInstance()->current_test_info()->name()))
            .string();
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Write(const std::string& text,
                    const std::string& name = "tokenizer.json") {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }
  absl::StatusOr<std::unique_ptr<Tokenizer>> Load(const Json& doc) {
    model::TokenizerSpec spec;
    spec.hf_tokenizer_json_path = Write(doc.dump());
    return Tokenizer::Create(spec);
  }
  // Fails INVALID_ARGUMENT with the file, `key` and `what` in the message.
  void ExpectFails(const Json& doc, const std::string& key,
                   const std::string& what) {
    auto tok = Load(doc);
    ASSERT_FALSE(tok.ok()) << key;
    EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument)
        << tok.status();
    EXPECT_THAT(std::string(tok.status().message()),
                AllOf(HasSubstr(dir_ + "/tokenizer.json"), HasSubstr(key),
                      HasSubstr(what)));
  }

  std::string dir_;
};

TEST_F(HfBadInputTest, TinyDocumentLoadsAndEncodes) {
  auto tok = Load(TinyDoc());
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->vocab_size(), 9);
  auto ids = (*tok)->Encode("abc a<|eot|>", false);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*ids, (std::vector<int32_t>{4, 6, 8}));
  EXPECT_EQ(*(*tok)->Decode(*ids), "abc a");  // the special is skipped
}

TEST_F(HfBadInputTest, BadJson) {
  model::TokenizerSpec spec;
  spec.hf_tokenizer_json_path = Write("{\"model\": {");
  auto tok = Tokenizer::Create(spec);
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(tok.status().message()),
              AllOf(HasSubstr("tokenizer.json"), HasSubstr("invalid JSON")));
  spec.hf_tokenizer_json_path = Write("[1, 2]");
  EXPECT_EQ(Tokenizer::Create(spec).status().code(),
            absl::StatusCode::kInvalidArgument);
  spec.hf_tokenizer_json_path = Write("");
  EXPECT_EQ(Tokenizer::Create(spec).status().code(),
            absl::StatusCode::kInvalidArgument);
  spec.hf_tokenizer_json_path = dir_ + "/missing.json";
  EXPECT_EQ(Tokenizer::Create(spec).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(HfBadInputTest, UnknownComponentTypes) {
  Json doc = TinyDoc();
  doc["model"]["type"] = "WordPiece";
  ExpectFails(doc, "model.type", "WordPiece");

  doc = TinyDoc();
  doc["pre_tokenizer"]["pretokenizers"][1]["type"] = "Fancy";
  ExpectFails(doc, "pre_tokenizer.pretokenizers[1].type", "Fancy");

  doc = TinyDoc();
  doc["normalizer"] = {{"type", "Precompiled"}};
  ExpectFails(doc, "normalizer.type", "Precompiled");

  doc = TinyDoc();
  doc["decoder"] = {{"type", "Sequence"}, {"decoders", {{{"type", "CTC"}}}}};
  ExpectFails(doc, "decoder.decoders[0].type", "CTC");

  doc = TinyDoc();
  doc["post_processor"] = {{"type", "Weird"}};
  ExpectFails(doc, "post_processor.type", "Weird");

  doc = TinyDoc();
  doc["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Sideways";
  ExpectFails(doc, "pre_tokenizer.pretokenizers[0].behavior", "Sideways");

  doc = TinyDoc();
  doc["pre_tokenizer"]["pretokenizers"][0].erase("type");
  ExpectFails(doc, "pre_tokenizer.pretokenizers[0].type", "missing");
}

TEST_F(HfBadInputTest, InvalidRegex) {
  Json doc = TinyDoc();
  doc["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(\\p{L}+";
  ExpectFails(doc, "pre_tokenizer.pretokenizers[0].pattern.Regex",
              "invalid regex");
  doc["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\p{Nope}";
  ExpectFails(doc, "pre_tokenizer.pretokenizers[0].pattern.Regex",
              "invalid regex");
  doc["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "[a[b]]";
  ExpectFails(doc, "pre_tokenizer.pretokenizers[0].pattern.Regex",
              "nested character class");
  doc["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"Glob", "*"}};
  ExpectFails(doc, "pre_tokenizer.pretokenizers[0].pattern", "Regex");
  doc = TinyDoc();
  doc["normalizer"] = {{"type", "Replace"},
                       {"pattern", {{"Regex", "a{2,1}"}}},
                       {"content", "x"}};
  ExpectFails(doc, "normalizer.pattern.Regex", "invalid regex");
}

TEST_F(HfBadInputTest, MergesReferencingUnknownTokens) {
  Json doc = TinyDoc();
  doc["model"]["merges"][1] = "ab z";
  ExpectFails(doc, "model.merges[1]", "\"z\" is not in the vocabulary");
  doc = TinyDoc();
  // Pair format; "bc" is missing.
  doc["model"]["merges"] = Json::array({Json::array({"b", "c"})});
  ExpectFails(doc, "model.merges[0]", "the merged token \"bc\"");
  doc = TinyDoc();
  doc["model"]["merges"][0] = "abc";
  ExpectFails(doc, "model.merges[0]", "expected \"left right\"");
  doc = TinyDoc();
  doc["model"]["merges"][0] = 7;
  ExpectFails(doc, "model.merges[0]", "expected");
  doc = TinyDoc();
  doc["model"].erase("merges");
  ExpectFails(doc, "model.merges", "expected a list");
}

TEST_F(HfBadInputTest, IdsOutOfRange) {
  Json doc = TinyDoc();
  doc["model"]["vocab"]["c"] = -1;
  ExpectFails(doc, "model.vocab.c", "id must be an integer");
  doc["model"]["vocab"]["c"] = 1LL << 40;
  ExpectFails(doc, "model.vocab.c", "id must be an integer");
  doc["model"]["vocab"]["c"] = "two";
  ExpectFails(doc, "model.vocab.c", "id must be an integer");
  doc = TinyDoc();
  doc["model"]["vocab"]["c"] = 2000000000;
  ExpectFails(doc, "model.vocab", "sparse");
  doc = TinyDoc();
  doc["added_tokens"][0]["id"] = -5;
  ExpectFails(doc, "added_tokens[0].id", "id must be an integer");
  doc = TinyDoc();
  doc["added_tokens"][0]["content"] = "";
  ExpectFails(doc, "added_tokens[0].content", "empty");
  doc = TinyDoc();
  doc["model"]["unk_token"] = "<unk>";
  ExpectFails(doc, "model.unk_token", "not in the vocabulary");
  doc = TinyDoc();
  doc["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single",
       {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
        {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}}};
  ExpectFails(doc, "post_processor.single[0].SpecialToken.id", "<s>");
}

TEST_F(HfBadInputTest, WrongTypes) {
  Json doc = TinyDoc();
  doc["model"]["byte_fallback"] = "yes";
  ExpectFails(doc, "model.byte_fallback", "true or false");
  doc = TinyDoc();
  doc["pre_tokenizer"]["pretokenizers"] = 3;
  ExpectFails(doc, "pre_tokenizer.pretokenizers", "list");
  doc = TinyDoc();
  doc["model"] = 3;
  ExpectFails(doc, "model", "object");
}

TEST_F(HfBadInputTest, BadConfig) {
  model::TokenizerSpec spec;
  spec.hf_tokenizer_json_path = Write(TinyDoc().dump());
  spec.hf_tokenizer_config_path =
      Write(R"({"bos_token": "<nope>"})", "tokenizer_config.json");
  auto tok = Tokenizer::Create(spec);
  ASSERT_FALSE(tok.ok());
  EXPECT_THAT(std::string(tok.status().message()),
              AllOf(HasSubstr("bos_token"), HasSubstr("<nope>")));
  spec.hf_tokenizer_config_path = Write("{", "tokenizer_config.json");
  EXPECT_EQ(Tokenizer::Create(spec).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(HfBadInputTest, HostileTextNeverCrashes) {
  auto tok = Load(TinyDoc());
  ASSERT_TRUE(tok.ok()) << tok.status();
  std::mt19937 rng(7);
  for (int i = 0; i < 2000; ++i) {
    std::string text(rng() % 64, '\0');
    for (char& c : text) c = static_cast<char>(rng());
    if (i % 3 == 0) text += "<|eot|>";
    auto ids = (*tok)->Encode(text, i % 2 == 0);
    ASSERT_TRUE(ids.ok()) << ids.status();
    auto back = (*tok)->Decode(*ids);
    ASSERT_TRUE(back.ok());
    IncrementalDetokenizer detok(**tok);
    std::string streamed;
    for (int32_t id : *ids) streamed += *detok.Push(id);
    streamed += detok.Finish();
    EXPECT_EQ(streamed, *back);
  }
  // A long whitespace run and a long word stay linear enough to finish.
  EXPECT_TRUE((*tok)->Encode(std::string(200000, ' '), false).ok());
  EXPECT_TRUE((*tok)->Encode(std::string(200000, 'a'), false).ok());
  EXPECT_FALSE((*tok)->Decode(std::vector<int32_t>{9}).ok());
  EXPECT_FALSE((*tok)->Decode(std::vector<int32_t>{-1}).ok());
}

TEST_F(HfBadInputTest, GgufGpt2Vocabularies) {
  model::TokenizerSpec spec;
  spec.ggml_model = "gpt2";
  spec.tokens = {"a", "b", "ab"};
  spec.merges = {"a b"};
  spec.ggml_pre = "martian";
  auto tok = Tokenizer::Create(spec);
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(tok.status().message()), HasSubstr("martian"));
  spec.ggml_pre = "qwen2";
  spec.merges = {"a c"};
  tok = Tokenizer::Create(spec);
  ASSERT_FALSE(tok.ok());
  EXPECT_THAT(std::string(tok.status().message()),
              AllOf(HasSubstr("model.merges[0]"), HasSubstr("\"c\"")));
  spec.merges = {"a b"};
  spec.token_types = {1, 1};
  EXPECT_EQ(Tokenizer::Create(spec).status().code(),
            absl::StatusCode::kInvalidArgument);
  spec.token_types = {1, 1, 1};
  spec.bos_token_id = 7;
  spec.add_bos = true;
  EXPECT_EQ(Tokenizer::Create(spec).status().code(),
            absl::StatusCode::kInvalidArgument);
  spec.bos_token_id = -1;
  tok = Tokenizer::Create(spec);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ(*(*tok)->Encode("ab", false), (std::vector<int32_t>{2}));
}

}  // namespace
}  // namespace pdserve::tokenizer
