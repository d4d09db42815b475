// Bad specs get precise INVALID_ARGUMENT errors (the keyword and its JSON
// path, the regex construct and its offset, the limit crossed) and never a
// crash or a blow-up: malformed and unsupported schemas, pathological
// regexes, deep nesting, huge bounds; bad matcher calls too.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grammar/grammar.h"
#include "gtest/gtest.h"

namespace pdserve::grammar {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::shared_ptr<const TokenVocabulary> Vocab() {
  std::vector<std::string> bytes;
  for (int b = 0; b < 256; ++b) bytes.push_back(std::string(1, char(b)));
  bytes.push_back("{\"");
  bytes.push_back("");  // EOS
  auto v = TokenVocabulary::Create(bytes, {257});
  EXPECT_TRUE(v.ok()) << v.status();
  return *v;
}

absl::Status CompileStatus(const GrammarSpec& spec) {
  return CompiledGrammar::Compile(spec, Vocab()).status();
}

void ExpectInvalid(const GrammarSpec& spec,
                   const std::vector<std::string>& fragments) {
  const absl::Status status = CompileStatus(spec);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument)
      << spec.text << ": " << status;
  for (const std::string& f : fragments) {
    EXPECT_THAT(std::string(status.message()), HasSubstr(f)) << spec.text;
  }
}

TEST(GrammarBadInputTest, UnsupportedKeywordsNameKeywordAndPath) {
  ExpectInvalid(
      GrammarSpec::JsonSchema(
          R"({"type":"object","properties":{"a":{"type":"number","minimum":3}}})"),
      {"'minimum'", "$.properties.a", "only on type integer"});
  ExpectInvalid(
      GrammarSpec::JsonSchema(R"({"type":"integer","minimum":1e300})"),
      {"$.minimum", "16 integer digits"});
  ExpectInvalid(GrammarSpec::JsonSchema(
                    R"({"type":"integer","minimum":3,"maximum":2.5})"),
                {"no integer satisfies"});
  ExpectInvalid(
      GrammarSpec::JsonSchema(
          R"({"type":"array","items":{"type":"string","format":"hostname"}})"),
      {"'format'", "$.items", "\"hostname\"", "supported: date-time"});
  ExpectInvalid(GrammarSpec::JsonSchema(R"({"oneOf":[{"type":"string"}]})"),
                {"'oneOf'", "at $"});
  ExpectInvalid(
      GrammarSpec::JsonSchema(R"({"type":"object","patternProperties":{}})"),
      {"'patternProperties'"});
  ExpectInvalid(GrammarSpec::JsonSchema(R"({"type":"string","frobnicate":1})"),
                {"'frobnicate'", "at $"});
  ExpectInvalid(GrammarSpec::JsonSchema(
                    R"({"anyOf":[{"type":"string"}],"type":"string"})"),
                {"'anyOf'", "'type'"});
  ExpectInvalid(GrammarSpec::JsonSchema(
                    R"({"type":"string","pattern":"a+","maxLength":3})"),
                {"'pattern'", "minLength/maxLength"});
  ExpectInvalid(
      GrammarSpec::JsonSchema(R"({"type":"array","uniqueItems":true})"),
      {"'uniqueItems'"});
  ExpectInvalid(GrammarSpec::JsonSchema(R"({"type":"integer","minLength":2})"),
                {"'minLength'", "needs type 'string'"});
}

TEST(GrammarBadInputTest, MalformedSchemas) {
  ExpectInvalid(GrammarSpec::JsonSchema("{\"type\":"), {"not valid JSON"});
  ExpectInvalid(GrammarSpec::JsonSchema(""), {"not valid JSON"});
  ExpectInvalid(GrammarSpec::JsonSchema("[1,2]"), {"must be a JSON object"});
  ExpectInvalid(GrammarSpec::JsonSchema("false"), {"accepts no value"});
  ExpectInvalid(GrammarSpec::JsonSchema(R"({"type":"strnig"})"),
                {"unknown type 'strnig'", "$.type"});
  ExpectInvalid(GrammarSpec::JsonSchema(R"({"type":7})"), {"$.type"});
  ExpectInvalid(
      GrammarSpec::JsonSchema(
          R"({"type":"object","properties":{"a":{}},"required":["b"]})"),
      {"'b'", "$.required"});
  ExpectInvalid(GrammarSpec::JsonSchema(R"({"type":"array","minItems":-1})"),
                {"$.minItems", "non-negative"});
  ExpectInvalid(
      GrammarSpec::JsonSchema(R"({"type":"array","minItems":3,"maxItems":2})"),
      {"maxItems is smaller"});
  ExpectInvalid(GrammarSpec::JsonSchema(R"({"enum":[]})"), {"$.enum"});
  ExpectInvalid(GrammarSpec::JsonSchema(R"({"type":"string","enum":[1,2]})"),
                {"no enum/const value has the schema's type"});
  ExpectInvalid(GrammarSpec::JsonSchema(R"({"$ref":"#/$defs/missing"})"),
                {"points nowhere", "$.$ref"});
  ExpectInvalid(GrammarSpec::JsonSchema(R"({"$ref":"http://x/y.json"})"),
                {"'$ref'", "inside the schema"});
  ExpectInvalid(
      GrammarSpec::JsonSchema(
          R"({"$defs":{"a":{"$ref":"#/$defs/b"},"b":{"$ref":"#/$defs/a"}},"$ref":"#/$defs/a"})"),
      {"refers to itself"});
  ExpectInvalid(GrammarSpec::JsonSchema(R"({"type":"string","pattern":"(a"})"),
                {"$.pattern", "missing ')'"});
}

TEST(GrammarBadInputTest, DeepAndHugeSchemasAreBounded) {
  std::string deep;
  for (int i = 0; i < 100000; ++i) deep += "{\"items\":";
  deep += "{}";
  for (int i = 0; i < 100000; ++i) deep += "}";
  ExpectInvalid(GrammarSpec::JsonSchema(deep), {"nests", "levels"});
  std::string nested = "{\"type\":\"integer\"}";
  for (int i = 0; i < 40; ++i) {
    nested = absl::StrCat("{\"type\":\"array\",\"items\":", nested, "}");
  }
  ExpectInvalid(GrammarSpec::JsonSchema(nested), {"deeper than 32"});
  // Nested bounds add up rather than multiply (a repeated item is one shared
  // rule): 5000 x 5000 x 5000 stays a small grammar.
  auto nested_bounds = CompiledGrammar::Compile(
      GrammarSpec::JsonSchema(
          R"({"type":"array","maxItems":5000,"items":{"type":"array","maxItems":5000,"items":{"type":"string","maxLength":5000}}})"),
      Vocab());
  ASSERT_TRUE(nested_bounds.ok()) << nested_bounds.status();
  EXPECT_LT((*nested_bounds)->grammar_size(), 200000);
  // A single bound past the grammar size limit.
  ExpectInvalid(
      GrammarSpec::JsonSchema(R"({"type":"string","maxLength":100000000})"),
      {"grammar too large"});
  std::string many = R"({"type":"object","properties":{)";
  for (int i = 0; i < 20000; ++i) {
    many += absl::StrCat(i ? "," : "", "\"p", i, "\":{\"type\":\"string\"}");
  }
  many += "}}";
  ExpectInvalid(GrammarSpec::JsonSchema(many), {"more than 10000 subschemas"});
  ExpectInvalid(GrammarSpec::JsonSchema(std::string(2 << 20, ' ')),
                {"bytes; the limit is"});
}

TEST(GrammarBadInputTest, PathologicalAndUnsupportedRegexes) {
  ExpectInvalid(GrammarSpec::Regex("(a)\\1"), {"backreferences", "offset 3"});
  ExpectInvalid(GrammarSpec::Regex("a(?=b)"), {"lookaround"});
  ExpectInvalid(GrammarSpec::Regex("(?<!a)b"), {"lookaround"});
  ExpectInvalid(GrammarSpec::Regex("\\bword"), {"word boundaries"});
  ExpectInvalid(GrammarSpec::Regex("\\p{L}"), {"Unicode property"});
  ExpectInvalid(GrammarSpec::Regex("(?i)abc"), {"inline flags"});
  ExpectInvalid(GrammarSpec::Regex("a**"), {"nothing to repeat"});
  ExpectInvalid(GrammarSpec::Regex("*a"), {"nothing to repeat"});
  ExpectInvalid(GrammarSpec::Regex("a{3,1}"), {"m < n"});
  ExpectInvalid(GrammarSpec::Regex("a{2000}"), {"above 1000"});
  ExpectInvalid(GrammarSpec::Regex("a^b"), {"'^'"});
  ExpectInvalid(GrammarSpec::Regex("a$b"), {"'$'"});
  ExpectInvalid(GrammarSpec::Regex("[b-a]"), {"out of order"});
  ExpectInvalid(GrammarSpec::Regex("[abc"), {"missing ']'"});
  ExpectInvalid(GrammarSpec::Regex("abc)"), {"unmatched ')'"});
  ExpectInvalid(GrammarSpec::Regex("\\"), {"trailing backslash"});
  ExpectInvalid(GrammarSpec::Regex("\\uD800"), {"surrogate"});
  ExpectInvalid(GrammarSpec::Regex("[]"), {"matches no string"});
  ExpectInvalid(GrammarSpec::Regex(std::string("\xff", 1)),
                {"not valid UTF-8"});
  ExpectInvalid(GrammarSpec::Regex(std::string(5000, 'a')),
                {"the limit is 4096"});
  ExpectInvalid(
      GrammarSpec::Regex(std::string(1000, '(') + std::string(1000, ')')),
      {"nested deeper than 64"});
  auto nested_repeat = CompiledGrammar::Compile(
      GrammarSpec::Regex("((a{1000}){1000}){1000}"), Vocab());
  ASSERT_TRUE(nested_repeat.ok()) << nested_repeat.status();
  EXPECT_LT((*nested_repeat)->grammar_size(), 20000);
  // Nested stars over empty-matching groups compile and match in bounded
  // time: the automaton is a DFA, there is no backtracking.
  auto grammar =
      CompiledGrammar::Compile(GrammarSpec::Regex("((a*)*|b?)*c"), Vocab());
  ASSERT_TRUE(grammar.ok()) << grammar.status();
  GrammarMatcher m(*grammar);
  for (int i = 0; i < 5000; ++i) ASSERT_TRUE(m.Accept('a').ok());
  EXPECT_FALSE(m.Accept('d').ok());
  EXPECT_TRUE(m.Accept('c').ok());
  EXPECT_TRUE(m.IsComplete());
  EXPECT_LT((*grammar)->automaton_states(), 10);
}

TEST(GrammarBadInputTest, BadChoicesAndOptions) {
  ExpectInvalid(GrammarSpec::Choice({}), {"at least one choice"});
  ExpectInvalid(GrammarSpec::Choice({"a", ""}), {"choice 1 is empty"});
  ExpectInvalid(GrammarSpec::Choice(std::vector<std::string>(20000, "x")),
                {"the limit is 10000"});
  GrammarSpec spec = GrammarSpec::JsonObject();
  spec.max_json_whitespace = -1;
  ExpectInvalid(spec, {"max_json_whitespace"});
  EXPECT_EQ(CompiledGrammar::Compile(GrammarSpec::JsonObject(), nullptr)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(GrammarBadInputTest, BadVocabularies) {
  EXPECT_EQ(TokenVocabulary::Create({}, {0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      std::string(TokenVocabulary::Create({"a", "b"}, {}).status().message()),
      HasSubstr("EOS"));
  EXPECT_THAT(
      std::string(TokenVocabulary::Create({"a", "b"}, {2}).status().message()),
      HasSubstr("outside the vocabulary"));
}

TEST(GrammarBadInputTest, BadMatcherCalls) {
  auto grammar = CompiledGrammar::Compile(GrammarSpec::Regex("ab"), Vocab());
  ASSERT_TRUE(grammar.ok());
  GrammarMatcher m(*grammar);
  EXPECT_THAT(std::string(m.Accept(-1).message()), HasSubstr("outside"));
  EXPECT_THAT(std::string(m.Accept(100000).message()), HasSubstr("outside"));
  EXPECT_THAT(std::string(m.Accept('b').message()),
              AllOf(HasSubstr("not allowed"), HasSubstr("\"b\"")));
  EXPECT_THAT(std::string(m.Accept(257).message()),
              HasSubstr("before the output is complete"));
  EXPECT_THAT(std::string(m.Rollback(1).message()),
              HasSubstr("cannot roll back"));
  EXPECT_FALSE(m.Rollback(-1).ok());
  std::vector<uint32_t> short_mask(2);
  EXPECT_EQ(m.FillNextTokenBitmask(short_mask).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.num_accepted(), 0);  // nothing above changed the state
  ASSERT_TRUE(m.Accept('a').ok());
  ASSERT_TRUE(m.Accept('b').ok());
  ASSERT_TRUE(m.Accept(257).ok());
  EXPECT_THAT(std::string(m.Accept('a').message()),
              HasSubstr("after the output ended"));
}

}  // namespace
}  // namespace pdserve::grammar
