#include "tokenizer/tokenizer.h"

#include <atomic>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/mapped_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_util.h"
#include "tokenizer/detokenizer.h"
#include "tokenizer/proto_builder.h"

namespace pdserve::tokenizer {
namespace {

using ::testing::ElementsAreArray;
using testing::GoldenCase;

std::string TokenizerModelPath() {
  return testing::Stories260KDir() + "/tokenizer.model";
}

std::unique_ptr<Tokenizer> LoadHf() {
  model::TokenizerSpec spec;
  spec.sentencepiece_model_path = TokenizerModelPath();
  auto tok = Tokenizer::Create(spec);
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? std::move(*tok) : nullptr;
}

std::unique_ptr<Tokenizer> LoadGguf() {
  bool from_gguf = false;
  auto spec = testing::GgufSpec(&from_gguf);
  EXPECT_TRUE(spec.ok()) << spec.status();
#ifdef PDSERVE_HAVE_MODEL_LIB
  EXPECT_TRUE(from_gguf);
#endif
  if (!spec.ok()) return nullptr;
  EXPECT_TRUE(spec->sentencepiece_model_path.empty());
  auto tok = Tokenizer::Create(*spec);
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? std::move(*tok) : nullptr;
}

// Streams `ids` one at a time; checks every delta is valid UTF-8.
std::string Stream(const Tokenizer& tok, std::span<const int32_t> ids,
                   bool at_text_start = true) {
  IncrementalDetokenizer detok(tok, at_text_start);
  std::string text;
  for (int32_t id : ids) {
    auto delta = detok.Push(id);
    EXPECT_TRUE(delta.ok()) << delta.status();
    if (!delta.ok()) return text;
    EXPECT_TRUE(IsValidUtf8(*delta)) << "id " << id;
    text += *delta;
  }
  std::string tail = detok.Finish();
  EXPECT_TRUE(IsValidUtf8(tail));
  return text + tail;
}

TEST(TokenizerTest, Stories260KBasics) {
  auto tok = LoadHf();
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->vocab_size(), 512);
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_id(), 2);
  EXPECT_EQ(tok->unk_id(), 0);
  EXPECT_TRUE(tok->IsEos(2));
  EXPECT_EQ(*tok->IdToPiece(1), "<s>");
  EXPECT_EQ(*tok->IdToPiece(3), "<0x00>");
  EXPECT_TRUE(tok->CheckCompatibleWith(512).ok());
  auto no_bos = tok->Encode("Once upon a time", /*add_bos=*/false);
  ASSERT_TRUE(no_bos.ok());
  EXPECT_THAT(*no_bos, ElementsAreArray({403, 407, 261, 378}));
}

TEST(TokenizerTest, TokenBytesAreWhatATokenAddsToRunningText) {
  auto tok = LoadHf();
  ASSERT_NE(tok, nullptr);
  // "Once upon a time" without BOS: each word piece carries its space.
  std::string joined;
  for (int32_t id : {403, 407, 261, 378}) {
    auto bytes = tok->TokenBytes(id);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    joined += *bytes;
  }
  EXPECT_EQ(joined, " Once upon a time");
  EXPECT_EQ(*tok->TokenBytes(3), std::string(1, '\0'));  // <0x00>
  EXPECT_EQ(*tok->TokenBytes(3 + 0x0A), "\n");           // <0x0A>
  EXPECT_EQ(*tok->TokenBytes(2), "</s>");                // control: visible
  EXPECT_EQ(tok->TokenBytes(512).status().code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(tok->TokenBytes(-1).status().code(), absl::StatusCode::kOutOfRange);
  // Control tokens are shown by their piece but add nothing to decoded text.
  EXPECT_TRUE(tok->IsControl(1));   // <s>
  EXPECT_TRUE(tok->IsControl(2));   // </s>
  EXPECT_FALSE(tok->IsControl(3));  // <0x00>
  EXPECT_FALSE(tok->IsControl(403));
  EXPECT_FALSE(tok->IsControl(512));
  EXPECT_FALSE(tok->IsControl(-1));
}

TEST(TokenizerTest, GoldenPromptsEncodeWithHfTokenizer) {
  auto tok = LoadHf();
  ASSERT_NE(tok, nullptr);
  const auto goldens = testing::LoadGoldens();
  ASSERT_EQ(goldens.size(), 6u);
  for (const GoldenCase& c : goldens) {
    auto ids = tok->Encode(c.prompt);
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_THAT(*ids, ElementsAreArray(c.prompt_ids)) << c.prompt;
  }
}

TEST(TokenizerTest, GoldenPromptsEncodeWithGgufTokenizer) {
  auto tok = LoadGguf();
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->vocab_size(), 512);
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_id(), 2);
  for (const GoldenCase& c : testing::LoadGoldens()) {
    auto ids = tok->Encode(c.prompt);
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_THAT(*ids, ElementsAreArray(c.prompt_ids)) << c.prompt;
  }
}

TEST(TokenizerTest, GgufProtoIsByteIdenticalToTokenizerModel) {
  bool from_gguf = false;
  auto spec = testing::GgufSpec(&from_gguf);
  ASSERT_TRUE(spec.ok()) << spec.status();
  auto proto = BuildSentencePieceModelProto(*spec);
  ASSERT_TRUE(proto.ok()) << proto.status();
  auto file = ReadFileToString(TokenizerModelPath());
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(*proto == *file)
      << "built " << proto->size() << " bytes, file has " << file->size()
      << " (from_gguf=" << from_gguf << ")";
}

TEST(TokenizerTest, HfAndGgufAgreeOnArbitraryText) {
  auto hf = LoadHf();
  auto gguf = LoadGguf();
  ASSERT_NE(hf, nullptr);
  ASSERT_NE(gguf, nullptr);
  for (std::string_view text :
       {"", " ", "  two  spaces ", "Hello, world!\nNew line\ttab", "café 😀",
        "日本語のテキスト", "\x01\x7f control bytes",
        "Ünïcödé ÅÄÖ ñ — “quotes”"}) {
    auto a = hf->Encode(text);
    auto b = gguf->Encode(text);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(*a, *b) << text;
    auto back = gguf->Decode(*b);
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, text);
  }
}

TEST(TokenizerTest, GoldenContinuationsDecodeToText) {
  auto hf = LoadHf();
  auto gguf = LoadGguf();
  ASSERT_NE(hf, nullptr);
  ASSERT_NE(gguf, nullptr);
  for (const GoldenCase& c : testing::LoadGoldens()) {
    // The golden `text` is the continuation decoded as a text of its own:
    // its first word loses the dummy-prefix space and EOS is invisible.
    for (const Tokenizer* tok : {hf.get(), gguf.get()}) {
      auto text = tok->Decode(c.greedy_ids);
      ASSERT_TRUE(text.ok()) << text.status();
      EXPECT_EQ(*text, c.text);
      EXPECT_EQ(Stream(*tok, c.greedy_ids), c.text);
    }
  }
}

TEST(TokenizerTest, StreamingAfterPromptKeepsTheSpace) {
  auto tok = LoadHf();
  ASSERT_NE(tok, nullptr);
  for (const GoldenCase& c : testing::LoadGoldens()) {
    std::vector<int32_t> all = c.prompt_ids;
    all.insert(all.end(), c.greedy_ids.begin(), c.greedy_ids.end());
    auto full = tok->Decode(all);
    auto prompt = tok->Decode(c.prompt_ids);
    ASSERT_TRUE(full.ok() && prompt.ok());
    EXPECT_EQ(*prompt, c.prompt);
    EXPECT_EQ(*prompt + Stream(*tok, c.greedy_ids, /*at_text_start=*/false),
              *full);
    EXPECT_EQ(Stream(*tok, all), *full);
  }
}

TEST(TokenizerTest, MultiByteCharactersUseByteFallbackAndStreamWhole) {
  auto tok = LoadGguf();
  ASSERT_NE(tok, nullptr);
  const std::string text = "café 😀 naïve 日本";
  auto ids = tok->Encode(text, /*add_bos=*/false);
  ASSERT_TRUE(ids.ok());
  int byte_pieces = 0;
  for (int32_t id : *ids) {
    byte_pieces += tok->IdToPiece(id)->starts_with("<0x") ? 1 : 0;
  }
  EXPECT_GE(byte_pieces, 4)
      << "the 512-piece vocabulary should spell 😀 in bytes";

  IncrementalDetokenizer detok(*tok);
  std::string streamed;
  size_t max_pending = 0;
  for (int32_t id : *ids) {
    auto delta = detok.Push(id);
    ASSERT_TRUE(delta.ok());
    EXPECT_TRUE(IsValidUtf8(*delta)) << "half a character leaked: " << *delta;
    max_pending = std::max(max_pending, detok.pending_bytes());
    streamed += *delta;
  }
  EXPECT_GE(max_pending, 3u);  // the first three bytes of 😀 were held back
  EXPECT_EQ(detok.Finish(), "");
  EXPECT_EQ(streamed, text);
  EXPECT_EQ(*tok->Decode(*ids), text);
}

TEST(TokenizerTest, FinishFlushesAnIncompleteCharacterAsReplacement) {
  auto tok = LoadHf();
  ASSERT_NE(tok, nullptr);
  // "a" then the first two bytes of 😀 (F0 9F 98 80); byte <0xXX> is id 3+XX.
  auto a = tok->Encode("a", /*add_bos=*/false);
  ASSERT_TRUE(a.ok());
  std::vector<int32_t> ids = *a;
  ids.push_back(3 + 0xF0);
  ids.push_back(3 + 0x9F);
  IncrementalDetokenizer detok(*tok);
  auto text = detok.PushAll(ids);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, "a");
  EXPECT_EQ(detok.pending_bytes(), 2u);
  EXPECT_EQ(detok.Finish(), "\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(*tok->Decode(ids), "a\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST(TokenizerTest, InvalidBytesAreReplacedWithoutWaiting) {
  auto tok = LoadHf();
  ASSERT_NE(tok, nullptr);
  IncrementalDetokenizer detok(*tok);
  // E2 followed by 'A' can never be a character: emit U+FFFD then 'A' at once.
  EXPECT_EQ(*detok.Push(3 + 0xE2), "");
  EXPECT_EQ(*detok.Push(3 + 'A'),
            "\xEF\xBF\xBD"
            "A");
  EXPECT_EQ(detok.pending_bytes(), 0u);
  EXPECT_EQ(*tok->Decode(std::vector<int32_t>{3 + 0xE2, 3 + 'A'}),
            "\xEF\xBF\xBD"
            "A");
}

TEST(TokenizerTest, StreamingMatchesDecodeOnRandomIds) {
  auto tok = LoadHf();
  ASSERT_NE(tok, nullptr);
  std::mt19937 rng(1234);
  // Bias towards byte pieces (ids 3..258) so runs of bytes form valid and
  // invalid UTF-8 alike, with control tokens sprinkled in.
  std::uniform_int_distribution<int> any(0, tok->vocab_size() - 1);
  std::uniform_int_distribution<int> byte(0xC0, 0xF4);
  std::uniform_int_distribution<int> trail(0x80, 0xBF);
  std::uniform_int_distribution<int> pick(0, 9);
  for (int round = 0; round < 3000; ++round) {
    std::vector<int32_t> ids;
    const int len = 1 + round % 24;
    for (int i = 0; i < len; ++i) {
      switch (pick(rng)) {
        case 0:
          ids.push_back(3 + byte(rng));
          break;
        case 1:
        case 2:
          ids.push_back(3 + trail(rng));
          break;
        case 3:
          ids.push_back(pick(rng) % 3);
          break;  // unk, bos, eos
        default:
          ids.push_back(any(rng));
          break;
      }
    }
    auto full = tok->Decode(ids);
    ASSERT_TRUE(full.ok());
    ASSERT_EQ(Stream(*tok, ids), *full) << "round " << round;
  }
}

// A tiny vocabulary where "▁" is a piece of its own, to pin down how the
// dummy-prefix space is dropped when the first piece is just a space.
TEST(TokenizerTest, StreamingMatchesDecodeWithBareSpacePiece) {
  model::TokenizerSpec spec;
  spec.ggml_model = "llama";
  auto add = [&](std::string piece, float score, int type) {
    spec.tokens.push_back(std::move(piece));
    spec.scores.push_back(score);
    spec.token_types.push_back(type);
  };
  add("<unk>", 0, 2);
  add("<s>", 0, 3);
  add("</s>", 0, 3);
  for (int b = 0; b < 256; ++b) {
    add(absl::StrCat("<0x", absl::Hex(b, absl::kZeroPad2), ">"), 0, 6);
  }
  // absl::Hex is lowercase; SentencePiece wants "<0xAB>".
  for (auto& t : spec.tokens) {
    if (t.starts_with("<0x")) {
      for (char& ch : t) ch = (ch >= 'a' && ch <= 'f') ? ch - 'a' + 'A' : ch;
    }
  }
  add("\xE2\x96\x81", -1, 1);
  add("\xE2\x96\x81\xE2\x96\x81", -2, 1);
  add("\xE2\x96\x81"
      "a",
      -3, 1);
  add("a", -4, 1);
  add("b", -5, 1);
  add("\xE2\x96\x81"
      "b",
      -6, 1);
  spec.bos_token_id = 1;
  spec.eos_token_id = 2;
  spec.unk_token_id = 0;
  auto tok = Tokenizer::Create(spec);
  ASSERT_TRUE(tok.ok()) << tok.status();
  const int first = 259;
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> pick(0, 7);
  for (int round = 0; round < 2000; ++round) {
    std::vector<int32_t> ids;
    for (int i = 0; i < 1 + round % 6; ++i) {
      const int p = pick(rng);
      ids.push_back(p < 6 ? first + p : (p == 6 ? 1 : 3 + 0x20));
    }
    auto full = (*tok)->Decode(ids);
    ASSERT_TRUE(full.ok());
    std::string pieces;
    for (int32_t id : ids)
      absl::StrAppend(&pieces, std::string(*(*tok)->IdToPiece(id)), "|");
    ASSERT_EQ(Stream(**tok, ids), *full) << pieces;
  }
}

TEST(TokenizerTest, SpecialPiecesWithNonDefaultNamesAreFound) {
  // SentencePiece looks BOS/EOS up by piece name; the builder must name them
  // when they are not "<s>"/"</s>".
  model::TokenizerSpec spec;
  spec.ggml_model = "llama";
  spec.tokens = {"<UNK>",         "<|begin|>",    "<|end|>", "\xE2\x96\x81hi",
                 "\xE2\x96\x81h", "\xE2\x96\x81", "h",       "i"};
  spec.scores = {0, 0, 0, -1, -2, -3, -4, -5};
  spec.token_types = {2, 3, 3, 1, 1, 1, 1, 1};
  spec.unk_token_id = 0;
  spec.bos_token_id = 1;
  spec.eos_token_id = 2;
  auto tok = Tokenizer::Create(spec);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->unk_id(), 0);
  EXPECT_EQ((*tok)->bos_id(), 1);
  EXPECT_EQ((*tok)->eos_id(), 2);
  EXPECT_THAT(*(*tok)->Encode("hi"), ElementsAreArray({1, 3}));
  EXPECT_EQ(*(*tok)->Decode(std::vector<int32_t>{1, 3, 2}), "hi");
}

TEST(TokenizerTest, ConcurrentEncodeDecode) {
  auto tok = LoadHf();
  ASSERT_NE(tok, nullptr);
  const auto goldens = testing::LoadGoldens();
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 50; ++i) {
        for (const GoldenCase& c : goldens) {
          auto ids = tok->Encode(c.prompt);
          auto text = tok->Decode(c.greedy_ids);
          if (!ids.ok() || *ids != c.prompt_ids || !text.ok() ||
              *text != c.text)
            ++failures;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
}

#ifdef PDSERVE_HAVE_MODEL_LIB
TEST(TokenizerTest, LoadTokenizerForModelBothLayouts) {
  for (const std::string& path :
       {testing::Stories260KDir() + "/stories260K.gguf",
        testing::Stories260KDir()}) {
    auto source = model::OpenModel(path);
    ASSERT_TRUE(source.ok()) << source.status();
    auto tok = LoadTokenizerForModel(**source);
    ASSERT_TRUE(tok.ok()) << tok.status();
    for (const GoldenCase& c : testing::LoadGoldens()) {
      EXPECT_THAT(*(*tok)->Encode(c.prompt), ElementsAreArray(c.prompt_ids))
          << path;
    }
  }
}
#endif

}  // namespace
}  // namespace pdserve::tokenizer
