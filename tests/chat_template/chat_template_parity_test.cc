// Parity with @huggingface/jinja (the renderer of record): the real chat
// templates of the @lenml tokenizer packages over generated conversations,
// and coverage templates written for the language, rendered by the
// reference (tests/chat_template/render_reference.mjs, installed by
// scripts/setup_tokenizer_refs.sh) and by ChatTemplate, compared byte for
// byte. Setup failures fail the test: the comparison is the point.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "chat_template/chat_template.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "testing/shell.h"

namespace pdserve::chat_template {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

const std::string kSource = PDSERVE_SOURCE_DIR;

using ::pdserve::testing::CommandResult;
CommandResult Shell(const std::string& command) {
  return ::pdserve::testing::RunShell(command, kSource);
}
std::string Slurp(const std::string& path) {
  return ::pdserve::testing::ReadFileOrEmpty(path);
}
const std::string kBinary = PDSERVE_BINARY_DIR;

std::string Escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else {
      out.push_back(c);
    }
  }
  return out;
}

// Where two renders first differ, with context around it.
std::string FirstDiff(const std::string& want, const std::string& got) {
  size_t i = 0;
  while (i < want.size() && i < got.size() && want[i] == got[i]) ++i;
  const size_t from = i > 80 ? i - 80 : 0;
  return absl::StrCat("first difference at byte ", i, " (lengths ", want.size(),
                      " vs ", got.size(), ")\n  reference: ...",
                      Escape(want.substr(from, 160)), "...\n  pdserve:   ...",
                      Escape(got.substr(from, 160)), "...");
}

std::tm FixedLocalTime() {
  // render_reference.mjs pins Date to 2024-07-26 09:05 UTC and runs with
  // TZ=UTC.
  std::tm tm{};
  tm.tm_year = 2024 - 1900;
  tm.tm_mon = 6;
  tm.tm_mday = 26;
  tm.tm_hour = 9;
  tm.tm_min = 5;
  return tm;
}

class ChatTemplateParityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string refs = kBinary + "/tokenizer-refs";
    const CommandResult setup =
        Shell(absl::StrCat("scripts/setup_tokenizer_refs.sh '", refs, "'"));
    if (setup.code != 0) {
      setup_error_ = "scripts/setup_tokenizer_refs.sh failed:\n" + setup.output;
      return;
    }
    const std::string out = kBinary + "/chat_template_reference.json";
    const CommandResult node = Shell(absl::StrCat(
        "TZ=UTC node tests/chat_template/render_reference.mjs --modules '",
        refs, "' --out '", out, "'"));
    if (node.code != 0) {
      setup_error_ = "render_reference.mjs failed:\n" + node.output;
      return;
    }
    std::printf("%s", node.output.c_str());
    cases_ = new Json(Json::parse(Slurp(out), nullptr, false));
    if (cases_->is_discarded()) setup_error_ = "unreadable " + out;
  }

  static void TearDownTestSuite() {
    delete cases_;
    cases_ = nullptr;
  }

  // Renders every case of `family`; returns how many matched.
  static void CompareFamily(const std::string& family, int* compared,
                            int* matched, int* both_failed) {
    ASSERT_TRUE(setup_error_.empty()) << setup_error_;
    RenderOptions options;
    options.local_time = FixedLocalTime();
    std::map<std::string, ChatTemplate> parsed;
    for (const Json& c : (*cases_)["cases"]) {
      if (c["family"] != family) continue;
      ++*compared;
      const std::string name = c["name"];
      const std::string source = c["source"];
      auto it = parsed.find(source);
      if (it == parsed.end()) {
        absl::StatusOr<ChatTemplate> t = ChatTemplate::Parse(source, name);
        if (!t.ok()) {
          EXPECT_TRUE(c.contains("error"))
              << name << ": pdserve refuses a template the reference renders: "
              << t.status();
          if (c.contains("error")) ++*both_failed;
          continue;
        }
        it = parsed.emplace(source, *std::move(t)).first;
      }
      const absl::StatusOr<std::string> got =
          it->second.Render(c["context"], options);
      if (c.contains("error")) {
        EXPECT_FALSE(got.ok())
            << name << ": the reference fails ("
            << c["error"].get<std::string>() << ") but pdserve renders:\n"
            << *got << "\ncontext: " << c["context"].dump();
        if (!got.ok()) ++*both_failed;
        continue;
      }
      if (!got.ok()) {
        ADD_FAILURE() << name << ": " << got.status()
                      << "\ncontext: " << c["context"].dump();
        continue;
      }
      const std::string want = c["expected"];
      if (*got == want) {
        ++*matched;
      } else {
        ADD_FAILURE() << name << ": " << FirstDiff(want, *got)
                      << "\ncontext: " << c["context"].dump();
      }
    }
    std::printf("%s: %d cases, %d byte-identical renders, %d failing in both\n",
                family.c_str(), *compared, *matched, *both_failed);
  }

  static inline Json* cases_ = nullptr;
  static inline std::string setup_error_;
};

TEST_F(ChatTemplateParityTest, Llama3TemplateMatchesReference) {
  int compared = 0, matched = 0, both_failed = 0;
  CompareFamily("llama3", &compared, &matched, &both_failed);
  EXPECT_GE(matched, 50);
  EXPECT_EQ(matched + both_failed, compared);
}

TEST_F(ChatTemplateParityTest, Qwen3TemplateMatchesReference) {
  int compared = 0, matched = 0, both_failed = 0;
  CompareFamily("qwen3", &compared, &matched, &both_failed);
  EXPECT_GE(matched, 50);
  EXPECT_EQ(matched + both_failed, compared);
}

TEST_F(ChatTemplateParityTest, CoverageTemplatesMatchReference) {
  int compared = 0, matched = 0, both_failed = 0;
  CompareFamily("coverage", &compared, &matched, &both_failed);
  EXPECT_GE(compared, 40);
  EXPECT_EQ(matched + both_failed, compared);
}

TEST_F(ChatTemplateParityTest, Llama2ConfigHasNoTemplate) {
  const std::string path = kBinary +
                           "/tokenizer-refs/node_modules/@lenml/"
                           "tokenizer-llama2/models/tokenizer_config.json";
  ASSERT_TRUE(setup_error_.empty()) << setup_error_;
  absl::StatusOr<TokenizerConfigTemplates> config =
      ReadTokenizerConfigFile(path);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->empty());
  EXPECT_EQ(config->bos_token, "<s>");
  EXPECT_EQ(config->eos_token, "</s>");
}

}  // namespace
}  // namespace pdserve::chat_template
