// Chat prompts through a model's own template (services/chat_template) and
// tool calls read back from answers, without a cluster: what the router sends
// the tokenizer and what the client gets back.
#include "router/chat_prompt.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "router/openai_api.h"
#include "router/tool_calls.h"

namespace pdserve::router {
namespace {

using ojson = nlohmann::ordered_json;
using json = nlohmann::json;

// A small Hermes-style template (the shape Qwen's use): tools as JSON lines in
// the system turn, <tool_call> tags, a kwarg, raise_exception.
constexpr char kHermesTemplate[] =
    R"({%- if messages[0].role != 'system' and messages[0].role != 'user' -%}
{{- raise_exception('Conversations must start with a system or user turn.') -}}
{%- endif -%}
{%- if tools -%}
<|im_start|>system
# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}Call a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif -%}
{%- for m in messages -%}
<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{%- endif -%})";

std::unique_ptr<ChatPrompt> Hermes() {
  auto prompt = ChatPrompt::FromSource(kHermesTemplate, "test template", "",
                                       "<|im_end|>");
  EXPECT_TRUE(prompt.ok()) << prompt.status();
  return prompt.ok() ? *std::move(prompt) : nullptr;
}

TEST(ChatPromptTest, ModelTemplateRendersMessagesToolsAndKwargs) {
  auto prompt = Hermes();
  ASSERT_NE(prompt, nullptr);
  absl::StatusOr<OpenAiRequest> r =
      ParseOpenAiRequest(OpenAiEndpoint::kChatCompletions, R"({
        "messages": [{"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "content": null, "tool_calls": [
                       {"id": "call_1", "type": "function", "function":
                        {"name": "get_weather",
                         "arguments": "{\"city\": \"Paris\"}"}}]},
                     {"role": "tool", "tool_call_id": "call_1",
                      "content": "18 C"}],
        "tools": [{"type": "function", "function": {"name": "get_weather",
                   "parameters": {"type": "object", "properties":
                     {"city": {"type": "string"}}}}}],
        "chat_template_kwargs": {"enable_thinking": false}})",
                         prompt.get());
  ASSERT_TRUE(r.ok()) << r.status();
  const std::string& text = *r->generation.prompt_text;
  EXPECT_FALSE(r->generation.add_special_tokens);
  EXPECT_EQ(r->tool_format, ToolCallFormat::kHermes);
  // Key order of the tool schema survives (tojson of an ordered object).
  EXPECT_NE(
      text.find(
          R"({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object")"),
      std::string::npos)
      << text;
  // The assistant's call arguments reach the template as an object.
  EXPECT_NE(
      text.find(R"({"name": "get_weather", "arguments": {"city": "Paris"}})"),
      std::string::npos)
      << text;
  EXPECT_NE(text.find("<|im_start|>tool\n18 C<|im_end|>"), std::string::npos)
      << text;
  EXPECT_TRUE(text.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"))
      << text;
}

TEST(ChatPromptTest, TemplateRefusalIsA400WithItsMessage) {
  auto prompt = Hermes();
  ASSERT_NE(prompt, nullptr);
  absl::StatusOr<OpenAiRequest> r = ParseOpenAiRequest(
      OpenAiEndpoint::kChatCompletions,
      R"({"messages": [{"role": "assistant", "content": "hi"}]})",
      prompt.get());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(HttpStatusFor(r.status()), 400);
  EXPECT_NE(r.status().message().find(
                "Conversations must start with a system or user turn."),
            std::string::npos)
      << r.status();
}

// A conversation that would cost the template too much work is the
// request's fault: a 400, never a 429 that invites a retry.
TEST(ChatPromptTest, RenderLimitsAreA400) {
  absl::StatusOr<std::unique_ptr<ChatPrompt>> prompt = ChatPrompt::FromSource(
      "{% for m in messages %}{% for a in range(1000) %}{% for b in "
      "range(1000) %}x{% endfor %}{% endfor %}{% endfor %}",
      "heavy template", "", "");
  ASSERT_TRUE(prompt.ok()) << prompt.status();
  absl::StatusOr<OpenAiRequest> r = ParseOpenAiRequest(
      OpenAiEndpoint::kChatCompletions,
      R"({"messages": [{"role": "user", "content": "x"}]})", prompt->get());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(HttpStatusFor(r.status()), 400) << r.status();
  EXPECT_NE(r.status().message().find("chat template"), std::string::npos)
      << r.status();
}

TEST(ChatPromptTest, ForcedToolChoiceOpensTheCallInThePrompt) {
  auto prompt = Hermes();
  ASSERT_NE(prompt, nullptr);
  const std::string tools =
      R"("tools": [{"type": "function", "function": {"name": "f"}},
                   {"type": "function", "function": {"name": "g"}}])";
  absl::StatusOr<OpenAiRequest> named = ParseOpenAiRequest(
      OpenAiEndpoint::kChatCompletions,
      R"({"messages": [{"role": "user", "content": "x"}], )" + tools +
          R"(, "tool_choice": {"type": "function", "function": {"name": "g"}}})",
      prompt.get());
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_EQ(named->answer_prefix,
            "<tool_call>\n{\"name\": \"g\", \"arguments\": ");
  EXPECT_TRUE(named->generation.prompt_text->ends_with(named->answer_prefix));
  // The answer is read back with its opening.
  ParsedAnswer answer = ParseToolCalls(
      named->tool_format, named->answer_prefix + "{\"x\": 1}}\n</tool_call>");
  ASSERT_EQ(answer.tool_calls.size(), 1u);
  EXPECT_EQ(answer.tool_calls[0].name, "g");
  EXPECT_EQ(answer.tool_calls[0].arguments, R"({"x":1})");

  absl::StatusOr<OpenAiRequest> none = ParseOpenAiRequest(
      OpenAiEndpoint::kChatCompletions,
      R"({"messages": [{"role": "user", "content": "x"}], )" + tools +
          R"(, "tool_choice": "none"})",
      prompt.get());
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->tool_format, ToolCallFormat::kNone);
  EXPECT_EQ(none->generation.prompt_text->find("# Tools"), std::string::npos);

  // A function not in tools, "required" without tools: precise 400s.
  EXPECT_FALSE(
      ParseOpenAiRequest(
          OpenAiEndpoint::kChatCompletions,
          R"({"messages": [{"role": "user", "content": "x"}], )" + tools +
              R"(, "tool_choice": {"type": "function", "function": {"name": "h"}}})",
          prompt.get())
          .ok());
  EXPECT_FALSE(
      ParseOpenAiRequest(OpenAiEndpoint::kChatCompletions,
                         R"({"messages": [{"role": "user", "content": "x"}],
                       "tool_choice": "required"})",
                         prompt.get())
          .ok());
}

TEST(ChatPromptTest, BaseModelsWithoutATemplateRefuseToolsAndKwargs) {
  for (const char* body : {R"({"messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f"}}]})",
                           R"({"messages": [{"role": "user", "content": "x"}],
            "chat_template_kwargs": {"enable_thinking": false}})"}) {
    absl::StatusOr<OpenAiRequest> r =
        ParseOpenAiRequest(OpenAiEndpoint::kChatCompletions, body);
    ASSERT_FALSE(r.ok()) << body;
    EXPECT_NE(r.status().message().find("no chat template"), std::string::npos)
        << r.status();
  }
  absl::StatusOr<OpenAiRequest> r =
      ParseOpenAiRequest(OpenAiEndpoint::kChatCompletions,
                         R"({"messages": [{"role": "user", "content": "x"}],
          "add_generation_prompt": false})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r->generation.prompt_text, "User: x\n");
  EXPECT_TRUE(r->generation.add_special_tokens);
}

// A GGUF file carries its template as tokenizer.chat_template; its special
// tokens are spelled from the vocabulary.
TEST(ChatPromptTest, GgufTemplateWithTokensFromTheVocabulary) {
  model::TokenizerSpec spec;
  spec.tokens = {"<unk>", "<|begin_of_text|>", "<|eot_id|>", "a"};
  spec.bos_token_id = 1;
  spec.eos_token_id = 2;
  spec.chat_template =
      "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}"
      "{{ eos_token }}{% endfor %}";
  absl::StatusOr<std::unique_ptr<ChatPrompt>> prompt =
      ChatPrompt::ForGguf("m.gguf", spec);
  ASSERT_TRUE(prompt.ok()) << prompt.status();
  EXPECT_NE((*prompt)->Describe().find("m.gguf tokenizer.chat_template"),
            std::string::npos)
      << (*prompt)->Describe();
  absl::StatusOr<OpenAiRequest> r = ParseOpenAiRequest(
      OpenAiEndpoint::kChatCompletions,
      R"({"messages": [{"role": "user", "content": "hi"}]})", prompt->get());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r->generation.prompt_text, "<|begin_of_text|>user: hi<|eot_id|>");
  // No template in the file: the fallback.
  spec.chat_template.clear();
  EXPECT_FALSE((*ChatPrompt::ForGguf("m.gguf", spec))->has_template());
  // A broken one: a load error naming the file.
  spec.chat_template = "{% for %}";
  absl::StatusOr<std::unique_ptr<ChatPrompt>> broken =
      ChatPrompt::ForGguf("m.gguf", spec);
  ASSERT_FALSE(broken.ok());
  EXPECT_NE(broken.status().message().find("m.gguf"), std::string::npos)
      << broken.status();
}

TEST(ToolCallsTest, HermesCallsAndTheTextAroundThem) {
  ParsedAnswer a = ParseToolCalls(
      ToolCallFormat::kHermes,
      "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
      "{\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", "
      "\"arguments\": {}}\n</tool_call>");
  EXPECT_EQ(a.content, "Let me check.");
  ASSERT_EQ(a.tool_calls.size(), 2u);
  EXPECT_EQ(a.tool_calls[0].name, "get_weather");
  EXPECT_EQ(a.tool_calls[0].arguments, R"({"city":"Paris"})");
  EXPECT_EQ(a.tool_calls[1].name, "now");
  EXPECT_TRUE(a.tool_calls[0].id.starts_with("call_"));
  EXPECT_NE(a.tool_calls[0].id, a.tool_calls[1].id);
  // Not a call after all: the model's text is kept as it was written.
  ParsedAnswer broken = ParseToolCalls(
      ToolCallFormat::kHermes, "<tool_call>\n{\"name\": oops\n</tool_call>");
  EXPECT_TRUE(broken.tool_calls.empty());
  EXPECT_EQ(broken.content, "<tool_call>\n{\"name\": oops\n</tool_call>");
}

TEST(ToolCallsTest, Llama3JsonCalls) {
  ParsedAnswer a = ParseToolCalls(
      ToolCallFormat::kLlama3Json,
      "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"a\": \"x;y\"}}; "
      "{\"name\": \"g\", \"parameters\": {}}");
  ASSERT_EQ(a.tool_calls.size(), 2u);
  EXPECT_EQ(a.tool_calls[0].arguments, R"({"a":"x;y"})");
  EXPECT_EQ(a.tool_calls[1].name, "g");
  EXPECT_TRUE(ParseToolCalls(ToolCallFormat::kLlama3Json, "Hello {there}")
                  .tool_calls.empty());
}

TEST(ToolCallsTest, StreamingHoldsOnlyWhatMayBeACall) {
  ToolCallStream stream(ToolCallFormat::kHermes);
  std::string content;
  for (const char* delta :
       {"Sure", ", one moment.", "\n<tool", "_call>\n{\"name\": \"f\", ",
        "\"arguments\": {}}\n</tool_call>"}) {
    content += stream.Push(delta);
  }
  EXPECT_EQ(content, "Sure, one moment.\n");
  ParsedAnswer rest = stream.Finish();
  ASSERT_EQ(rest.tool_calls.size(), 1u);
  EXPECT_EQ(rest.tool_calls[0].name, "f");
  // A '<' that turns out not to open a call is released.
  ToolCallStream plain(ToolCallFormat::kHermes);
  std::string out = plain.Push("a <");
  out += plain.Push("b> c");
  out += plain.Finish().content;
  EXPECT_EQ(out, "a <b> c");
}

}  // namespace
}  // namespace pdserve::router
