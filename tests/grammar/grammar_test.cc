// The matcher against brute force on toy vocabularies: the tokens it allows
// are exactly those keeping the output a prefix of an accepted string, EOS
// only at completion, rollback and copies restore earlier states, and the
// cache shares compiled grammars.
#include "grammar/grammar.h"

#include <atomic>
#include <random>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace pdserve::grammar {
namespace {

using ::testing::HasSubstr;

// Every single byte is a token (id = byte), then the extra multi-byte tokens,
// then EOS.
struct ToyVocab {
  std::shared_ptr<const TokenVocabulary> vocab;
  int32_t eos = 0;
};
ToyVocab MakeVocab(const std::vector<std::string>& extra = {},
                   bool strip_first_space = false) {
  std::vector<std::string> bytes;
  for (int b = 0; b < 256; ++b) bytes.push_back(std::string(1, char(b)));
  for (const std::string& e : extra) bytes.push_back(e);
  bytes.push_back("</s>");
  ToyVocab v;
  v.eos = static_cast<int32_t>(bytes.size() - 1);
  auto created = TokenVocabulary::Create(bytes, {v.eos}, strip_first_space);
  EXPECT_TRUE(created.ok()) << created.status();
  v.vocab = *created;
  return v;
}

std::shared_ptr<const CompiledGrammar> CompileOrDie(
    const GrammarSpec& spec, std::shared_ptr<const TokenVocabulary> vocab) {
  auto compiled = CompiledGrammar::Compile(spec, std::move(vocab));
  EXPECT_TRUE(compiled.ok()) << compiled.status();
  return compiled.ok() ? *compiled : nullptr;
}

std::vector<uint32_t> Mask(GrammarMatcher& m) {
  std::vector<uint32_t> mask(m.BitmaskWords());
  EXPECT_TRUE(m.FillNextTokenBitmask(mask).ok());
  return mask;
}
bool Allowed(const std::vector<uint32_t>& mask, int32_t id) {
  return (mask[id >> 5] >> (id & 31)) & 1u;
}

// Feeds `text` byte by byte; false at the first refused byte.
bool FeedBytes(GrammarMatcher& m, std::string_view text) {
  for (char c : text) {
    if (!m.Accept(static_cast<uint8_t>(c)).ok()) return false;
  }
  return true;
}

// All strings over `alphabet` of length <= n.
std::vector<std::string> AllStrings(const std::string& alphabet, int n) {
  std::vector<std::string> out = {""};
  size_t begin = 0;
  for (int len = 1; len <= n; ++len) {
    const size_t end = out.size();
    for (size_t i = begin; i < end; ++i) {
      for (char c : alphabet) out.push_back(out[i] + c);
    }
    begin = end;
  }
  return out;
}

// For each regex: the set of viable prefixes (prefixes of full matches up to
// length kLong) must equal what the matcher accepts, and completion must equal
// std::regex_match, for every string up to length kShort.
TEST(GrammarMatcherTest, RegexPrefixesMatchBruteForce) {
  constexpr int kShort = 6, kLong = 9;
  const std::string alphabet = "abcd";
  ToyVocab v = MakeVocab();
  const std::vector<std::string> all_long = AllStrings(alphabet, kLong);
  for (const std::string pattern :
       {"a(b|c)*d{1,3}", "(ab|a)c?d", "[a-c]{2,4}d?", "a*b+c?", "(a|b)(c|d)|ca",
        "d(ab)*", "[^a]b*", "(?:ab){2}|c{0,2}"}) {
    SCOPED_TRACE(pattern);
    const std::regex reference(pattern, std::regex::ECMAScript);
    std::set<std::string> viable;
    for (const std::string& s : all_long) {
      if (!std::regex_match(s, reference)) continue;
      for (size_t k = 0; k <= s.size(); ++k) viable.insert(s.substr(0, k));
    }
    auto grammar = CompileOrDie(GrammarSpec::Regex(pattern), v.vocab);
    ASSERT_NE(grammar, nullptr);
    for (const std::string& s : AllStrings(alphabet, kShort)) {
      GrammarMatcher m(grammar);
      const bool accepted = FeedBytes(m, s);
      ASSERT_EQ(accepted, viable.contains(s)) << "'" << s << "'";
      if (!accepted) continue;
      EXPECT_EQ(m.IsComplete(), std::regex_match(s, reference)) << s;
      // The mask agrees with Accept for every alphabet byte and EOS.
      const std::vector<uint32_t> mask = Mask(m);
      for (char c : alphabet) {
        EXPECT_EQ(Allowed(mask, static_cast<uint8_t>(c)),
                  viable.contains(s + c) || (s.size() + 1 > size_t(kLong)))
            << "'" << s << "' + " << c;
      }
      EXPECT_EQ(Allowed(mask, v.eos), m.IsComplete());
      // 'z' is outside the alphabet: only a negated class admits it.
      if (std::string(pattern).find('^') == std::string::npos) {
        EXPECT_FALSE(Allowed(mask, 'z'));
      }
    }
  }
}

TEST(GrammarMatcherTest, MultiByteTokensAndEosOnlyAtCompletion) {
  ToyVocab v = MakeVocab({"yes", "ye", "no", "nope", "yesno", "s"});
  auto grammar =
      CompileOrDie(GrammarSpec::Choice({"yes", "no", "nope"}), v.vocab);
  GrammarMatcher m(grammar);
  const int32_t yes = 256, ye = 257, no = 258, nope = 259, yesno = 260, s = 261;
  std::vector<uint32_t> mask = Mask(m);
  EXPECT_TRUE(Allowed(mask, yes));
  EXPECT_TRUE(Allowed(mask, ye));
  EXPECT_TRUE(Allowed(mask, no));
  EXPECT_TRUE(Allowed(mask, nope));
  EXPECT_FALSE(Allowed(mask, yesno));
  EXPECT_FALSE(Allowed(mask, s));
  EXPECT_FALSE(Allowed(mask, v.eos));
  EXPECT_FALSE(m.Accept(v.eos).ok());
  EXPECT_FALSE(m.Accept(yesno).ok());
  ASSERT_TRUE(m.Accept(ye).ok());
  mask = Mask(m);
  EXPECT_TRUE(Allowed(mask, s));
  EXPECT_TRUE(Allowed(mask, 's'));
  EXPECT_FALSE(Allowed(mask, v.eos));
  EXPECT_FALSE(m.IsComplete());
  ASSERT_TRUE(m.Accept(s).ok());
  EXPECT_TRUE(m.IsComplete());
  mask = Mask(m);
  int allowed = 0;
  for (int32_t id = 0; id < v.vocab->size(); ++id) allowed += Allowed(mask, id);
  EXPECT_EQ(allowed, 1);  // only EOS
  EXPECT_TRUE(Allowed(mask, v.eos));
  ASSERT_TRUE(m.Accept(v.eos).ok());
  EXPECT_TRUE(m.IsTerminated());
  EXPECT_EQ(m.text(), "yes");
  mask = Mask(m);
  for (uint32_t w : mask) EXPECT_EQ(w, 0u);
  EXPECT_FALSE(m.Accept('a').ok());
  // "no" is complete, "nope" continues it: both EOS and 'p' allowed.
  GrammarMatcher n(grammar);
  ASSERT_TRUE(n.Accept(no).ok());
  mask = Mask(n);
  EXPECT_TRUE(Allowed(mask, v.eos));
  EXPECT_TRUE(Allowed(mask, 'p'));
  EXPECT_FALSE(Allowed(mask, nope));
}

TEST(GrammarMatcherTest, RollbackAndCopyRestoreEarlierStates) {
  ToyVocab v = MakeVocab({"{\"", "\":", "true", "\"a"});
  const std::string schema =
      R"({"type":"object","properties":{"a":{"type":"boolean"},
          "b":{"type":"array","items":{"type":"integer"},"maxItems":2}},
          "required":["a"],"additionalProperties":false})";
  auto grammar = CompileOrDie(GrammarSpec::JsonSchema(schema), v.vocab);
  GrammarMatcher m(grammar);
  ASSERT_TRUE(m.Accept(256).ok());  // {"
  ASSERT_TRUE(m.Accept('a').ok());
  ASSERT_TRUE(m.Accept(257).ok());  // ":
  const std::vector<uint32_t> before = Mask(m);
  EXPECT_TRUE(Allowed(before, 258));  // true
  GrammarMatcher copy = m;
  ASSERT_TRUE(FeedBytes(m, "false"));
  ASSERT_TRUE(m.IsComplete() == false);
  ASSERT_TRUE(m.Accept('}').ok());
  EXPECT_TRUE(m.IsComplete());
  ASSERT_TRUE(m.Accept(v.eos).ok());
  ASSERT_TRUE(m.Rollback(7).ok());
  EXPECT_FALSE(m.IsTerminated());
  EXPECT_EQ(m.num_accepted(), 3);
  EXPECT_EQ(m.text(), "{\"a\":");
  EXPECT_EQ(Mask(m), before);
  EXPECT_EQ(Mask(copy), before);
  EXPECT_FALSE(m.Rollback(4).ok());
  // The copy went its own way.
  ASSERT_TRUE(FeedBytes(copy, "true,\"b\":[1,2"));
  EXPECT_FALSE(copy.Accept(',').ok());  // maxItems 2
  ASSERT_TRUE(FeedBytes(copy, "]}"));
  EXPECT_TRUE(copy.IsComplete());
  EXPECT_EQ(m.text(), "{\"a\":");
}

struct JsonCase {
  std::string schema;
  std::vector<std::string> valid;
  std::vector<std::string> invalid;
};

TEST(GrammarMatcherTest, JsonSchemaAcceptsValidAndRefusesInvalid) {
  ToyVocab v = MakeVocab();
  const std::vector<JsonCase> cases = {
      {R"({"type":"object","properties":{"name":{"type":"string"},
          "age":{"type":"integer"}},"required":["name"]})",
       {R"({"name":"x"})", R"({"name":"é\"\n","age":-12})",
        "{ \"name\" : \"\" , \"age\" : 0 }"},
       {R"({})", R"({"age":1})", R"({"name":1})", R"({"name":"x","age":1.5})",
        R"({"age":1,"name":"x"})", R"({"name":"x",})", "{\"name\":\"\x01\"}",
        R"({"name":"x","age":01})"}},
      {R"({"type":"array","items":{"enum":["a",1,null,true]},"minItems":1,"maxItems":3})",
       {R"(["a"])", R"([1,null,true])", "[ \"a\" ]"},
       {R"([])", R"(["b"])", R"([1,1,1,1])", R"([false])"}},
      {R"({"anyOf":[{"type":"string","pattern":"^[a-z]+@[a-z]+\\.com$"},
          {"type":"null"}]})",
       {R"("ab@cd.com")", "null"},
       {R"("ab@cd.org")", R"("@cd.com")", R"("Ab@cd.com")"}},
      {R"({"type":"string","minLength":2,"maxLength":3})",
       {R"("ab")", R"("abc")", R"("\"\\")", R"("日本")"},
       {R"("a")", R"("abcd")", R"("\u0041")"}},
      {R"({"$defs":{"node":{"type":"object","properties":{
            "v":{"type":"number"},"next":{"anyOf":[{"$ref":"#/$defs/node"},{"type":"null"}]}},
            "required":["v","next"],"additionalProperties":false}},
          "$ref":"#/$defs/node"})",
       {R"({"v":1,"next":null})",
        R"({"v":-1.5e3,"next":{"v":0.25,"next":null}})"},
       {R"({"v":1})", R"({"v":1,"next":{"v":2}})", R"({"v":.5,"next":null})"}},
      {R"({"type":["integer","boolean"]})",
       {"7", "true", "-0"},
       {"\"7\"", "1.0", "null"}},
      {R"({"const":{"k":[1,"x"]}})",
       {R"({"k":[1,"x"]})"},
       {R"({"k":[1]})", "{ \"k\":[1,\"x\"]}"}},
  };
  for (const JsonCase& c : cases) {
    SCOPED_TRACE(c.schema);
    auto grammar = CompileOrDie(GrammarSpec::JsonSchema(c.schema), v.vocab);
    ASSERT_NE(grammar, nullptr);
    for (const std::string& doc : c.valid) {
      GrammarMatcher m(grammar);
      EXPECT_TRUE(FeedBytes(m, doc) && m.IsComplete()) << "refused: " << doc;
    }
    for (const std::string& doc : c.invalid) {
      GrammarMatcher m(grammar);
      EXPECT_FALSE(FeedBytes(m, doc) && m.IsComplete()) << "accepted: " << doc;
    }
  }
}

// Integer bounds: every spelling from lo - 150 to hi + 150 (and the extremes)
// is accepted exactly when it lies in range.
TEST(GrammarMatcherTest, IntegerBoundsMatchBruteForce) {
  ToyVocab v = MakeVocab();
  struct Bounds {
    std::string keywords;
    int64_t lo, hi;
  };
  const std::vector<Bounds> cases = {
      {R"("minimum":0,"maximum":100)", 0, 100},
      {R"("minimum":7,"maximum":1234)", 7, 1234},
      {R"("minimum":-250,"maximum":-3)", -250, -3},
      {R"("exclusiveMinimum":-10.5,"exclusiveMaximum":99)", -10, 98},
      {R"("minimum":1.5,"maximum":1000)", 2, 1000},
      {R"("minimum":-1,"maximum":0)", -1, 0},
      {R"("minimum":190,"maximum":210)", 190, 210},
      {R"("minimum":42)", 42, 9999999999999999},
      {R"("maximum":-42)", -9999999999999999, -42}};
  for (const Bounds& c : cases) {
    SCOPED_TRACE(c.keywords);
    auto grammar = CompileOrDie(GrammarSpec::JsonSchema(absl::StrCat(
                                    R"({"type":"integer",)", c.keywords, "}")),
                                v.vocab);
    ASSERT_NE(grammar, nullptr);
    std::vector<int64_t> probes;
    for (int64_t x = std::max<int64_t>(c.lo, -2000) - 150;
         x <= std::min<int64_t>(c.hi, 2000) + 150; ++x) {
      probes.push_back(x);
    }
    for (int64_t x : {c.lo, c.hi, c.lo - 1, c.hi + 1, int64_t{0},
                      int64_t{9999999999999999}, int64_t{-9999999999999999}}) {
      probes.push_back(x);
    }
    for (int64_t x : probes) {
      GrammarMatcher m(grammar);
      const bool accepted = FeedBytes(m, std::to_string(x)) && m.IsComplete();
      ASSERT_EQ(accepted, x >= c.lo && x <= c.hi) << x;
    }
    GrammarMatcher leading_zero(grammar);
    EXPECT_FALSE(FeedBytes(leading_zero, "007") && leading_zero.IsComplete());
    GrammarMatcher minus_zero(grammar);
    EXPECT_FALSE(FeedBytes(minus_zero, "-0") && minus_zero.IsComplete());
  }
}

TEST(GrammarMatcherTest, JsonObjectModeAndWhitespaceBound) {
  ToyVocab v = MakeVocab();
  GrammarSpec spec = GrammarSpec::JsonObject();
  spec.max_json_whitespace = 4;
  auto grammar = CompileOrDie(spec, v.vocab);
  for (const std::string doc :
       {"{}", R"({"a":[1,{"b":null},"c"],"d":{"e":{"f":[[]]}}})",
        " {\n  \"x\": true\n}\n"}) {
    GrammarMatcher m(grammar);
    EXPECT_TRUE(FeedBytes(m, doc) && m.IsComplete()) << doc;
  }
  for (const std::string doc : {"[]", "1", "\"a\"", "{\"a\"}", "{'a':1}"}) {
    GrammarMatcher m(grammar);
    EXPECT_FALSE(FeedBytes(m, doc) && m.IsComplete()) << doc;
  }
  GrammarMatcher m(grammar);
  ASSERT_TRUE(FeedBytes(m, "{    "));  // 4 whitespace bytes: the bound
  EXPECT_FALSE(m.Accept(' ').ok());
  EXPECT_TRUE(m.Accept('}').ok());
}

TEST(GrammarMatcherTest, FirstTokenLeadingSpacePolicy) {
  ToyVocab v = MakeVocab({" yes", " no"}, /*strip_first_space=*/true);
  auto grammar = CompileOrDie(GrammarSpec::Choice({"yes", "no yes"}), v.vocab);
  GrammarMatcher m(grammar);
  std::vector<uint32_t> mask = Mask(m);
  EXPECT_TRUE(Allowed(mask, 256));   // " yes" decodes as "yes" first
  EXPECT_FALSE(Allowed(mask, ' '));  // a lone space would vanish
  ASSERT_TRUE(m.Accept(257).ok());   // " no" -> "no"
  EXPECT_EQ(m.text(), "no");
  mask = Mask(m);
  EXPECT_TRUE(Allowed(mask, 256));  // " yes" keeps its space later
  ASSERT_TRUE(m.Accept(256).ok());
  EXPECT_TRUE(m.IsComplete());
}

// Matchers of one shared grammar on several threads at once (the lazy
// automaton and mask cache sit behind the grammar's mutex): every thread's
// masks agree with single-byte Accept checks and every output completes.
TEST(GrammarMatcherTest, ConcurrentMatchersShareOneGrammar) {
  ToyVocab v = MakeVocab({"\"a", "\":", "12", "true", "},{"});
  auto grammar = CompileOrDie(GrammarSpec::JsonSchema(R"({"type":"array",
      "items":{"type":"object","properties":{"a":{"type":"integer"},
      "b":{"type":"string","maxLength":5}},"required":["a"]},"maxItems":4})"),
                              v.vocab);
  ASSERT_NE(grammar, nullptr);
  std::atomic<int> completed{0}, mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int run = 0; run < 40; ++run) {
        GrammarMatcher m(grammar);
        for (int step = 0; step < 200 && !m.IsTerminated(); ++step) {
          std::vector<uint32_t> mask(m.BitmaskWords());
          if (!m.FillNextTokenBitmask(mask).ok()) return;
          std::vector<int32_t> allowed;
          for (int32_t id = 0; id < v.vocab->size(); ++id) {
            if (Allowed(mask, id)) allowed.push_back(id);
            if (id < 256) {
              GrammarMatcher probe = m;
              if (probe.Accept(id).ok() != Allowed(mask, id)) ++mismatches;
            }
          }
          if (allowed.empty()) return;
          // Prefer EOS and closing bytes after a while so outputs end.
          int32_t pick = allowed[rng() % allowed.size()];
          if (step > 30) {
            for (int32_t id :
                 {v.eos, int32_t{'"'}, int32_t{'}'}, int32_t{']'}}) {
              if (Allowed(mask, id)) {
                pick = id;
                break;
              }
            }
          }
          if (!m.Accept(pick).ok()) return;
        }
        if (m.IsTerminated()) ++completed;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
  EXPECT_EQ(completed.load(), 160);
}

TEST(GrammarCacheTest, SameSpecAndVocabularyShareOneGrammar) {
  ToyVocab v = MakeVocab();
  ToyVocab other = MakeVocab({"xy"});
  GrammarCache cache(2);
  const GrammarSpec spec = GrammarSpec::JsonSchema(R"({"type":"integer"})");
  auto a = cache.Get(spec, v.vocab);
  auto b = cache.Get(spec, v.vocab);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->get(), b->get());
  EXPECT_EQ(cache.compilations(), 1);
  auto c = cache.Get(spec, other.vocab);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(a->get(), c->get());
  auto d = cache.Get(GrammarSpec::Regex("[0-9]+"), v.vocab);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(cache.compilations(), 3);
  // Capacity 2: the least recently used (a) was dropped; `a` stays valid.
  auto e = cache.Get(spec, v.vocab);
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(cache.compilations(), 4);
  GrammarMatcher m(*a);
  EXPECT_TRUE(FeedBytes(m, "42") && m.IsComplete());
}

TEST(GrammarMatcherTest, ApplyMaskToLogitsForbidsPaddingRows) {
  ToyVocab v = MakeVocab();
  auto grammar = CompileOrDie(GrammarSpec::Regex("ab"), v.vocab);
  GrammarMatcher m(grammar);
  std::vector<float> logits(v.vocab->size() + 5, 1.0f);
  ASSERT_TRUE(m.ApplyMaskToLogits(logits).ok());
  for (size_t id = 0; id < logits.size(); ++id) {
    EXPECT_EQ(std::isinf(logits[id]), id != 'a') << id;
  }
  EXPECT_TRUE(*m.IsTokenAllowed('a'));
  EXPECT_FALSE(*m.IsTokenAllowed('b'));
  std::vector<float> short_logits(10);
  EXPECT_FALSE(m.ApplyMaskToLogits(short_logits).ok());
}

}  // namespace
}  // namespace pdserve::grammar
