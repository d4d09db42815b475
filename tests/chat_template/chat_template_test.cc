// The template language, one feature at a time, and the API's contract:
// precise errors, raise_exception, limits, tokenizer_config.json reading,
// key order, concurrency. Expected outputs are what @huggingface/jinja
// renders (chat_template_parity_test checks the same templates against it).
#include "chat_template/chat_template.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace pdserve::chat_template {
namespace {

using Json = nlohmann::ordered_json;

// Renders `source` with `context`; the output or "ERROR: <status>".
std::string Render(const std::string& source,
                   const Json& context = Json::object(),
                   const RenderOptions& options = {}) {
  absl::StatusOr<ChatTemplate> t = ChatTemplate::Parse(source, "test.jinja");
  if (!t.ok()) return "ERROR: " + t.status().ToString();
  absl::StatusOr<std::string> out = t->Render(context, options);
  if (!out.ok()) return "ERROR: " + out.status().ToString();
  return *out;
}

TEST(ChatTemplateTest, TextAndExpressions) {
  EXPECT_EQ(Render("Hello {{ name }}!", {{"name", "Ann"}}), "Hello Ann!");
  EXPECT_EQ(
      Render("{{ 1 + 2 }} {{ 7 / 2 }} {{ 7 // 2 }} {{ -7 % 3 }} {{ 2 ** 10 }}"),
      "3 3.5 3 -1 1024");
  EXPECT_EQ(Render("{{ 3.0 }} {{ 0.1 + 0.2 }} {{ 1e21 }}", Json::object()),
            "ERROR: INVALID_ARGUMENT: test.jinja:1:31: syntax error: expected "
            "'}}', got Identifier 'e21'");
  EXPECT_EQ(Render("{{ 3.0 }} {{ 0.1 + 0.2 }} {{ big }} {{ small }}",
                   {{"big", 1e21}, {"small", 1e-7}}),
            "3.0 0.30000000000000004 1e+21 1e-7");
  EXPECT_EQ(Render("{{ true }} {{ none }}|{{ undefined_thing }}|"), "true ||");
  EXPECT_EQ(Render("{{ [1, 'a', none, 2.0] }} {{ {'k': [1, {'x': 1.5}]} }}"),
            "[1, \"a\", null, 2] {\"k\": [1, {\"x\": 1.5}]}");
  EXPECT_EQ(Render("{{ 'esc\\n\\t\\'\\\"\\\\' }}|{{ '\\u00e9\\x41' }}"),
            "esc\n\t'\"\\|\xC3\xA9"
            "A");
  EXPECT_EQ(Render("{{ 'a' ~ 1 ~ 2.0 ~ true }} {{ 'x' + 1 }}"), "a12true x1");
  EXPECT_EQ(
      Render("{{ 'y' if x else 'n' }}[{{ 'only' if x }}]", {{"x", false}}),
      "n[]");
}

TEST(ChatTemplateTest, WhitespaceControlAsTransformers) {
  // trim_blocks + lstrip_blocks, as transformers configures Jinja.
  EXPECT_EQ(Render("A\n{% if true %}\n  yes\n{% endif %}\nB\n"), "A\n  yes\nB");
  EXPECT_EQ(Render("  {%- if true %} x {% endif -%}  \n y"), " x y");
  EXPECT_EQ(Render("a {{- ' b ' -}} c"), "a b c");
  EXPECT_EQ(Render("a\n  {# comment #}\nb"), "a\nb");
  EXPECT_EQ(Render("x{% generation %} kept {% endgeneration %}y"), "x kept y");
}

TEST(ChatTemplateTest, ForLoops) {
  EXPECT_EQ(Render("{% for x in xs %}{{ loop.index }}{{ loop.index0 }}"
                   "{{ loop.revindex }}{{ loop.first }}{{ loop.last }}"
                   "{{ loop.length }}{{ loop.previtem }}{{ loop.nextitem }};"
                   "{% endfor %}",
                   {{"xs", {"a", "b"}}}),
            "102truefalse2b;211falsetrue2a;");
  EXPECT_EQ(
      Render("{% for x in xs if x > 1 %}{{ x }}{% else %}none{% endfor %}",
             {{"xs", {1, 2, 3}}}),
      "23");
  EXPECT_EQ(Render("{% for x in [] %}x{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(Render("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}",
                   {{"d", {{"b", 1}, {"a", 2}}}}),
            "b=1;a=2;");
  EXPECT_EQ(Render("{% for k in d %}{{ k }}{% endfor %}",
                   {{"d", {{"b", 1}, {"a", 2}}}}),
            "ba");
  EXPECT_EQ(
      Render("{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}"
             "{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}"),
      "013");
  EXPECT_EQ(Render("{% for a, b in [[1, 2]] %}{{ a + b }}{% endfor %}"), "3");
  EXPECT_TRUE(absl::StrContains(Render("{% for a, b in [[1]] %}{% endfor %}"),
                                "Too few items to unpack"));
}

TEST(ChatTemplateTest, SetNamespaceAndScopes) {
  EXPECT_EQ(Render("{% set ns = namespace(n=0) %}{% for i in range(4) %}"
                   "{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }} {{ ns }}"),
            "6 {\"n\": 6}");
  EXPECT_EQ(Render("{% set x = 'out' %}{% for i in [1] %}{% set x = 'in' %}"
                   "{{ x }}{% endfor %} {{ x }}"),
            "in out");
  EXPECT_EQ(Render("{% set a, b = 1, 2 %}{{ a }}{{ b }}"), "12");
  EXPECT_EQ(Render("{% set block %}in {{ 1 }}{% endset %}[{{ block }}]"),
            "[in 1]");
  EXPECT_TRUE(absl::StrContains(Render("{% set d = {} %}{% set d.x = 1 %}"),
                                "cannot assign attribute on non-namespace"));
}

TEST(ChatTemplateTest, Macros) {
  EXPECT_EQ(
      Render("{% macro g(n, greeting='Hi', p='!') %}{{ greeting }} {{ n }}"
             "{{ p }}{% endmacro %}{{ g('A') }} {{ g('B', 'Yo') }} "
             "{{ g('C', p='?') }}"),
      "Hi A! Yo B! Hi C?");
  EXPECT_EQ(Render("{% macro v() %}{{ varargs }}{{ kwargs }}{% endmacro %}"
                   "{{ v(1, k=2) }}"),
            "[1]{\"k\": 2}");
  EXPECT_EQ(Render("{% macro w(t) %}<{{ t }}>{{ caller() }}</{{ t }}>"
                   "{% endmacro %}{% call w('b') %}x{% endcall %}"),
            "<b>x</b>");
  EXPECT_TRUE(
      absl::StrContains(Render("{% macro m() %}{% endmacro %}{{ m(1) }}"),
                        "takes not more than 0 argument(s)"));
}

TEST(ChatTemplateTest, MemberAccessAndSlicing) {
  const Json ctx = {
      {"m", {{"role", "user"}}}, {"xs", {0, 1, 2, 3, 4}}, {"u", "日本語😀x"}};
  EXPECT_EQ(Render("{{ m['role'] }} {{ m.role }} {{ xs[-1] }} {{ xs[9] }}|"
                   "{{ xs.length }} {{ 'abc'[1] }} {{ u.length }}",
                   ctx),
            "user user 4 |5 b 6");
  EXPECT_EQ(Render("{{ xs[1:] }} {{ xs[::-1] }} {{ xs[1:4:2] }} {{ xs[-2:] }} "
                   "{{ u[1:] }} {{ u[::-1] }}",
                   ctx),
            "[1, 2, 3, 4] [4, 3, 2, 1, 0] [1, 3] [3, 4] 本語😀x x😀語本日");
  EXPECT_EQ(Render("[{{ missing.a.b }}][{{ none.x }}]"), "[][]");
  EXPECT_TRUE(absl::StrContains(Render("{{ missing[0] }}"),
                                "Cannot access property with non-string"));
}

TEST(ChatTemplateTest, Tests) {
  EXPECT_EQ(
      Render("{{ x is defined }}{{ y is undefined }}{{ none is none }}"
             "{{ 's' is string }}{{ 1.5 is number }}{{ 1 is integer }}"
             "{{ {} is mapping }}{{ [] is iterable }}{{ 's' is sequence }}"
             "{{ true is boolean }}{{ true is true }}{{ false is false }}"
             "{{ 3 is odd }}{{ 4 is even }}{{ 1 is not none }}",
             {{"x", 1}}),
      "truetruetruetruetruetruetruetruetruetruetruetruetruetruetrue");
  EXPECT_EQ(Render("{{ 6 is divisibleby(3) }}{{ 1 is equalto(1) }}"),
            "truetrue");
  EXPECT_TRUE(
      absl::StrContains(Render("{{ 1 is nosuch }}"), "Unknown test: nosuch"));
}

TEST(ChatTemplateTest, Filters) {
  EXPECT_EQ(
      Render("{{ ' a ' | trim }}|{{ 'ab' | upper }}|{{ 'hi there' | title }}|"
             "{{ 'hi' | capitalize }}|{{ 'aa' | replace('a', 'b') }}|"
             "{{ 'a\nb' | indent(2, true) }}|{{ '42x' | int }}|"
             "{{ '2.5' | float }}|{{ 'abc' | length }}|{{ 'x' | safe }}"),
      "a|AB|Hi There|Hi|bb|  a\n  b|42|2.5|3|x");
  const Json ctx = {
      {"xs", {3, 1, 2}},
      {"objs", {{{"n", "a"}, {"ok", true}}, {{"n", "b"}, {"ok", false}}}}};
  EXPECT_EQ(Render("{{ xs | length }} {{ xs | first }} {{ xs | last }} "
                   "{{ xs | join(',') }} {{ xs | sort }} {{ xs | reverse }} "
                   "{{ [1, 1, 2] | unique }} {{ xs | list }} {{ xs | string }}",
                   ctx),
            "3 3 2 3,1,2 [1, 2, 3] [2, 1, 3] [1, 2] [3, 1, 2] [3, 1, 2]");
  EXPECT_EQ(Render("{{ objs | map(attribute='n') | join }} "
                   "{{ objs | selectattr('ok') | map(attribute='n') | list }} "
                   "{{ objs | rejectattr('ok') | map(attribute='n') | list }} "
                   "{{ objs | selectattr('n', 'equalto', 'b') | length }}",
                   ctx),
            "ab [\"a\"] [\"b\"] 1");
  EXPECT_EQ(Render("{{ x | default('d') }} {{ '' | default('e', true) }} "
                   "{{ -2 | abs }} {{ 2.7 | int }} {{ 2 | float }}"),
            "d e 2 2 2.0");
  EXPECT_EQ(Render("{{ d | items }} {{ d | dictsort }} {{ d | length }}",
                   {{"d", {{"b", 1}, {"a", 2}}}}),
            "[[\"b\", 1], [\"a\", 2]] [[\"a\", 2], [\"b\", 1]] 2");
}

TEST(ChatTemplateTest, ToJsonMatchesTheReference) {
  const Json ctx = {
      {"v", {{"b", {1, 2.5, "日", nullptr, true}}, {"a", "x\ty"}}}};
  EXPECT_EQ(Render("{{ v | tojson }}", ctx),
            "{\"b\": [1, 2.5, \"日\", null, true], \"a\": \"x\\ty\"}");
  EXPECT_EQ(
      Render("{{ v | tojson(indent=2) }}", ctx),
      "{\n  \"b\": [\n    1,\n    2.5,\n    \"日\",\n    null,\n    true\n"
      "  ],\n  \"a\": \"x\\ty\"\n}");
  EXPECT_EQ(
      Render("{{ v | tojson(separators=(',', ':'), sort_keys=true) }}", ctx),
      "{\"a\":\"x\\ty\",\"b\":[1,2.5,\"日\",null,true]}");
  EXPECT_EQ(Render("{{ 'é😀' | tojson(ensure_ascii=true) }}"),
            "\"\\u00e9\\ud83d\\ude00\"");
  // JSON floats with integral values are integers, as in JavaScript.
  EXPECT_EQ(Render("{{ x | tojson }} {{ x }}", {{"x", 1.0}}), "1 1");
}

TEST(ChatTemplateTest, StringAndDictMethods) {
  EXPECT_EQ(
      Render("{{ ' a '.strip() }}|{{ 'a,b,,c'.split(',') }}|"
             "{{ ' a  b '.split() }}|{{ 'a b c'.split(' ', 1) }}|"
             "{{ 'hey'.startswith('he') }}{{ 'hey'.endswith(('x', 'y')) }}|"
             "{{ 'x</think>y'.split('</think>')[-1] }}|"
             "{{ 'aXa'.replace('a', 'b', 1) }}"),
      "a|[\"a\", \"b\", \"\", \"c\"]|[\"a\", \"b\"]|[\"a\", \"b c\"]|"
      "truetrue|y|bXa");
  EXPECT_EQ(Render("{{ d.get('a') }} {{ d.get('z', 'dz') }} {{ d.keys() }} "
                   "{{ d.values() }}",
                   {{"d", {{"a", 1}}}}),
            "1 dz [\"a\"] [1]");
}

TEST(ChatTemplateTest, StrftimeNowUsesTheInjectedTime) {
  RenderOptions options;
  std::tm tm{};
  tm.tm_year = 124;
  tm.tm_mon = 6;
  tm.tm_mday = 26;
  tm.tm_hour = 9;
  tm.tm_min = 5;
  options.local_time = tm;
  EXPECT_EQ(Render("{{ strftime_now('%d %b %Y %B %H:%M %%') }}", Json::object(),
                   options),
            "26 Jul 2024 July 09:05 %");
}

TEST(ChatTemplateTest, ParseErrorsNameOriginLineAndWhat) {
  auto status = [](const std::string& s) {
    return ChatTemplate::Parse(s, "tokenizer_config.json").status();
  };
  absl::Status s = status("line1\n{% if x %}\nno end");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "missing {% endif %}")) << s;
  EXPECT_TRUE(absl::StartsWith(s.message(), "tokenizer_config.json:")) << s;
  s = status("ok\nok\n{{ x + }}");
  EXPECT_TRUE(absl::StartsWith(s.message(), "tokenizer_config.json:3:")) << s;
  s = status("{% frobnicate %}");
  EXPECT_TRUE(absl::StrContains(s.message(), "unknown statement 'frobnicate'"))
      << s;
  s = status("{{ 'unterminated }}");
  EXPECT_TRUE(absl::StrContains(s.message(), "Unexpected end of input")) << s;
  s = status("{# never closed");
  EXPECT_TRUE(absl::StrContains(s.message(), "Missing end of comment tag"))
      << s;
  s = status("{{ " + std::string(500, '(') + "1" + std::string(500, ')') +
             " }}");
  EXPECT_TRUE(absl::StrContains(s.message(), "nesting deeper than")) << s;
  EXPECT_EQ(status(std::string(2 << 20, 'x')).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ChatTemplateTest, RaiseExceptionIsTheTemplatesText) {
  absl::StatusOr<ChatTemplate> t = ChatTemplate::Parse(
      "{% if messages[0].role != 'user' %}"
      "{{ raise_exception('Conversation roles must alternate user/assistant') "
      "}}"
      "{% endif %}ok",
      "t");
  ASSERT_TRUE(t.ok());
  const absl::StatusOr<std::string> out =
      t->Render(Json{{"messages", {{{"role", "assistant"}}}}});
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(out.status().message(),
            "Conversation roles must alternate user/assistant");
  EXPECT_TRUE(IsRaisedByTemplate(out.status()));
  // Other runtime errors carry the position and are not "raised".
  const absl::StatusOr<std::string> other = t->Render(Json::object());
  EXPECT_FALSE(other.ok());
  EXPECT_FALSE(IsRaisedByTemplate(other.status()));
  EXPECT_TRUE(absl::StartsWith(other.status().message(), "t:1:"))
      << other.status();
}

TEST(ChatTemplateTest, LimitsAreResourceExhausted) {
  RenderOptions small;
  small.limits.max_steps = 10'000;
  small.limits.max_output_bytes = 1000;
  EXPECT_TRUE(absl::StrContains(
      Render("{% for i in range(100000) %}{% endfor %}", Json::object(), small),
      "RESOURCE_EXHAUSTED: template rendering exceeds 10000 steps"));
  EXPECT_TRUE(absl::StrContains(
      Render("{% for i in range(500) %}xxxx{% endfor %}", Json::object(),
             small),
      "RESOURCE_EXHAUSTED: template output exceeds 1000 bytes"));
  EXPECT_TRUE(absl::StrContains(
      Render("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"),
      "RESOURCE_EXHAUSTED: template nesting exceeds"));
}

TEST(ChatTemplateTest, ContextKeyOrderAndTypes) {
  // ordered_json keeps the request's order (as transformers does); plain
  // json sorts keys.
  const std::string source = "{{ d | tojson }}";
  const Json ordered = {{"d", {{"z", 1}, {"a", 2}}}};
  EXPECT_EQ(Render(source, ordered), "{\"z\": 1, \"a\": 2}");
  absl::StatusOr<ChatTemplate> t = ChatTemplate::Parse(source, "t");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(*t->Render(nlohmann::json{{"d", {{"z", 1}, {"a", 2}}}}),
            "{\"a\": 2, \"z\": 1}");
  // JavaScript lists integer-like keys first.
  EXPECT_EQ(Render(source, Json{{"d", {{"b", 1}, {"2", 2}, {"1", 3}}}}),
            "{\"1\": 3, \"2\": 2, \"b\": 1}");
  EXPECT_TRUE(absl::StrContains(Render("x", Json{{"range", 1}}),
                                "Variable already declared: range"));
  const absl::Status not_object =
      ChatTemplate::Parse("x", "t")->Render(Json::array()).status();
  EXPECT_TRUE(absl::StrContains(not_object.message(), "must be a JSON object"))
      << not_object;
}

TEST(ChatTemplateTest, ConcurrentRendersShareOneTemplate) {
  absl::StatusOr<ChatTemplate> t = ChatTemplate::Parse(
      "{% set ns = namespace(n=0) %}{% for m in messages %}"
      "{% set ns.n = ns.n + 1 %}{{ m.content }}{% endfor %}{{ ns.n }}",
      "t");
  ASSERT_TRUE(t.ok());
  std::vector<std::thread> threads;
  std::vector<int> failures(4, 0);
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      const ChatTemplate copy = *t;  // Copies share the parsed tree.
      for (int i = 0; i < 200; ++i) {
        Json ctx = {{"messages", {{{"content", std::to_string(k)}}}}};
        if (*copy.Render(ctx) != std::to_string(k) + "1") ++failures[k];
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures, std::vector<int>(4, 0));
}

TEST(ChatTemplateTest, TokenizerConfig) {
  absl::StatusOr<TokenizerConfigTemplates> c = ReadTokenizerConfig(
      Json::parse(R"({"chat_template": "{{ x }}", "bos_token": "<s>",
                      "eos_token": {"content": "</s>", "lstrip": false}})"),
      "cfg");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(*c->Select(false), "{{ x }}");
  EXPECT_EQ(*c->Select(true), "{{ x }}");
  EXPECT_EQ(c->bos_token, "<s>");
  EXPECT_EQ(c->eos_token, "</s>");

  c = ReadTokenizerConfig(Json::parse(R"({"chat_template": [
        {"name": "default", "template": "D"},
        {"name": "tool_use", "template": "T"}]})"),
                          "cfg");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(*c->Select(false), "D");
  EXPECT_EQ(*c->Select(true), "T");

  c = ReadTokenizerConfig(Json::parse(R"({"bos_token": null})"), "cfg");
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->empty());
  EXPECT_EQ(c->Select(false), nullptr);

  c = ReadTokenizerConfig(Json::parse(R"({"chat_template": [{"name": 1}]})"),
                          "cfg.json");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(
      absl::StrContains(c.status().message(), "cfg.json: \"chat_template\"[0]"))
      << c.status();
  c = ReadTokenizerConfig(Json::parse(R"({"eos_token": 5})"), "cfg.json");
  EXPECT_TRUE(absl::StrContains(c.status().message(), "\"eos_token\""))
      << c.status();
  EXPECT_EQ(ReadTokenizerConfigFile("/nonexistent/tokenizer_config.json")
                .status()
                .code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace pdserve::chat_template
