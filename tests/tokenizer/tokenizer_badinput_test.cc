// Malformed tokenizers must come back as errors, never crashes.
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "common/mapped_file.h"
#include "gtest/gtest.h"
#include "test_util.h"
#include "tokenizer/detokenizer.h"
#include "tokenizer/proto_builder.h"
#include "tokenizer/tokenizer.h"

namespace pdserve::tokenizer {
namespace {

class TempFile {
 public:
  explicit TempFile(const std::string& bytes) {
    path_ = (std::filesystem::temp_directory_path() /
             ("pdserve_tok_" + std::to_string(::getpid()) + "_" +
              std::to_string(counter_++)))
                .string();
    std::ofstream(path_, std::ios::binary) << bytes;
  }
  ~TempFile() { std::filesystem::remove(path_); }
  const std::string& path() const { return path_; }

 private:
  static inline int counter_ = 0;
  std::string path_;
};

absl::StatusOr<std::unique_ptr<Tokenizer>> CreateFromFile(
    const std::string& path) {
  model::TokenizerSpec spec;
  spec.sentencepiece_model_path = path;
  return Tokenizer::Create(spec);
}

std::string RealModelBytes() {
  auto bytes = ReadFileToString(testing::Stories260KDir() + "/tokenizer.model");
  EXPECT_TRUE(bytes.ok());
  return bytes.ok() ? *bytes : std::string();
}

model::TokenizerSpec RealSpec() {
  auto spec = testing::SpecFromSentencePieceFile(testing::Stories260KDir() +
                                                 "/tokenizer.model");
  EXPECT_TRUE(spec.ok());
  return spec.ok() ? *spec : model::TokenizerSpec();
}

TEST(TokenizerBadInputTest, MissingFile) {
  auto tok = CreateFromFile("/nonexistent/tokenizer.model");
  ASSERT_FALSE(tok.ok());
  EXPECT_TRUE(absl::StrContains(tok.status().message(),
                                "/nonexistent/tokenizer.model"));
}

TEST(TokenizerBadInputTest, EmptyFile) {
  TempFile f("");
  auto tok = CreateFromFile(f.path());
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(tok.status().message(), "empty"))
      << tok.status();
}

TEST(TokenizerBadInputTest, GarbageFile) {
  TempFile f(
      "this is not a protobuf \xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff");
  EXPECT_FALSE(CreateFromFile(f.path()).ok());
}

TEST(TokenizerBadInputTest, TruncatedFiles) {
  const std::string bytes = RealModelBytes();
  ASSERT_FALSE(bytes.empty());
  // Every cut either fails cleanly or (when it lands on a field boundary that
  // leaves a loadable model) yields a smaller but working tokenizer.
  for (size_t cut = 1; cut < bytes.size(); cut += 37) {
    TempFile f(bytes.substr(0, cut));
    auto tok = CreateFromFile(f.path());
    if (tok.ok()) {
      EXPECT_TRUE((*tok)->Encode("Once upon a time").ok());
    }
  }
  TempFile half(bytes.substr(0, bytes.size() / 2));
  EXPECT_FALSE(CreateFromFile(half.path()).ok());
}

TEST(TokenizerBadInputTest, CorruptedBytes) {
  const std::string bytes = RealModelBytes();
  ASSERT_FALSE(bytes.empty());
  for (size_t pos = 0; pos < bytes.size(); pos += 53) {
    std::string corrupt = bytes;
    corrupt[pos] = static_cast<char>(corrupt[pos] ^ 0xA5);
    TempFile f(corrupt);
    auto tok = CreateFromFile(f.path());
    if (tok.ok()) {
      // A flipped score or piece byte can still load; it must still work.
      auto ids = (*tok)->Encode("Once upon a time, café 😀");
      if (ids.ok()) {
        EXPECT_TRUE((*tok)->Decode(*ids).ok());
      }
    }
  }
}

TEST(TokenizerBadInputTest, SpecWithNothingOrBoth) {
  EXPECT_EQ(Tokenizer::Create(model::TokenizerSpec()).status().code(),
            absl::StatusCode::kInvalidArgument);
  model::TokenizerSpec both = RealSpec();
  both.sentencepiece_model_path =
      testing::Stories260KDir() + "/tokenizer.model";
  EXPECT_EQ(Tokenizer::Create(both).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TokenizerBadInputTest, EmptyVocab) {
  model::TokenizerSpec spec;
  spec.ggml_model = "llama";
  auto tok = Tokenizer::Create(spec);
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(tok.status().message(), "empty"))
      << tok.status();
}

TEST(TokenizerBadInputTest, MismatchedScoresAndTypes) {
  model::TokenizerSpec spec = RealSpec();
  spec.scores.pop_back();
  auto tok = Tokenizer::Create(spec);
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(tok.status().message(), "scores"))
      << tok.status();

  spec = RealSpec();
  spec.token_types.resize(10);
  tok = Tokenizer::Create(spec);
  ASSERT_FALSE(tok.ok());
  EXPECT_TRUE(absl::StrContains(tok.status().message(), "token_type"))
      << tok.status();
}

TEST(TokenizerBadInputTest, BadTokenTypesAndIds) {
  model::TokenizerSpec spec = RealSpec();
  spec.token_types[100] = 42;
  EXPECT_EQ(Tokenizer::Create(spec).status().code(),
            absl::StatusCode::kInvalidArgument);

  spec = RealSpec();
  spec.token_types[0] = 1;  // no unknown piece left
  EXPECT_EQ(Tokenizer::Create(spec).status().code(),
            absl::StatusCode::kInvalidArgument);

  spec = RealSpec();
  spec.token_types[300] = 6;  // a word marked as a byte
  EXPECT_EQ(Tokenizer::Create(spec).status().code(),
            absl::StatusCode::kInvalidArgument);

  spec = RealSpec();
  spec.bos_token_id = 512;
  EXPECT_EQ(Tokenizer::Create(spec).status().code(),
            absl::StatusCode::kInvalidArgument);

  spec = RealSpec();
  spec.tokens[300] = "";
  EXPECT_EQ(Tokenizer::Create(spec).status().code(),
            absl::StatusCode::kInvalidArgument);

  spec = RealSpec();
  spec.tokens[300] =
      spec.tokens[301];  // duplicate piece: SentencePiece rejects it
  EXPECT_FALSE(Tokenizer::Create(spec).ok());

  // gpt2 vocabularies go to the tokenizer.json backend, which needs merges.
  spec = RealSpec();
  spec.ggml_model = "gpt2";
  EXPECT_EQ(Tokenizer::Create(spec).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(Tokenizer::Create(spec).status().message(),
                                "tokenizer.ggml.merges"));
}

TEST(TokenizerBadInputTest, VocabMismatchWithModel) {
  auto tok = Tokenizer::Create(RealSpec());
  ASSERT_TRUE(tok.ok()) << tok.status();
  absl::Status s = (*tok)->CheckCompatibleWith(32000);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(s.message(), "512")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "32000")) << s;
  EXPECT_EQ((*tok)->CheckCompatibleWith(511).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE((*tok)->CheckCompatibleWith(512).ok());
  // A model that pads its embedding to a round size (Qwen3: +267 rows).
  EXPECT_TRUE((*tok)->CheckCompatibleWith(512 + 267).ok());
  EXPECT_TRUE(
      (*tok)->CheckCompatibleWith(512 + Tokenizer::kMaxVocabPadding).ok());
  EXPECT_EQ(
      (*tok)->CheckCompatibleWith(512 + Tokenizer::kMaxVocabPadding + 1).code(),
      absl::StatusCode::kFailedPrecondition);
  // Until a model adopts it, the padding ids are outside the vocabulary.
  EXPECT_FALSE((*tok)->IsPadding(600));
  EXPECT_EQ((*tok)->Decode(std::vector<int32_t>{600}).status().code(),
            absl::StatusCode::kOutOfRange);
}

TEST(TokenizerBadInputTest, OutOfRangeIds) {
  auto tok = Tokenizer::Create(RealSpec());
  ASSERT_TRUE(tok.ok());
  EXPECT_EQ((*tok)->Decode(std::vector<int32_t>{5, 512}).status().code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*tok)->Decode(std::vector<int32_t>{-1}).status().code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*tok)->IdToPiece(512).status().code(),
            absl::StatusCode::kOutOfRange);
  IncrementalDetokenizer detok(**tok);
  EXPECT_EQ(detok.Push(100000).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_TRUE(detok.Push(300).ok());
}

TEST(TokenizerBadInputTest, InvalidUtf8TextStillEncodes) {
  auto tok = Tokenizer::Create(RealSpec());
  ASSERT_TRUE(tok.ok());
  auto ids = (*tok)->Encode(std::string("ab\xff\xfe\xc3", 5));
  ASSERT_TRUE(ids.ok()) << ids.status();
  auto text = (*tok)->Decode(*ids);
  ASSERT_TRUE(text.ok());
  EXPECT_TRUE(IsValidUtf8(*text));
}

}  // namespace
}  // namespace pdserve::tokenizer
