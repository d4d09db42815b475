// The OpenAI wire format without sockets: parsing, validation, chat template,
// response and error shapes.
#include "router/openai_api.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

namespace pdserve::router {
namespace {

using json = nlohmann::json;

absl::StatusOr<OpenAiRequest> Completion(const std::string& body) {
  return ParseOpenAiRequest(OpenAiEndpoint::kCompletions, body);
}
absl::StatusOr<OpenAiRequest> Chat(const std::string& body) {
  return ParseOpenAiRequest(OpenAiEndpoint::kChatCompletions, body);
}

TEST(OpenAiApiTest, ParsesCompletionWithEveryField) {
  absl::StatusOr<OpenAiRequest> r = Completion(R"({
    "model": "stories260K", "prompt": "Once upon", "max_tokens": 7,
    "temperature": 0.5, "top_p": 0.9, "top_k": 40, "seed": 42,
    "stop": ["\n", "The end"], "stream": true,
    "stream_options": {"include_usage": true}, "n": 1})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->generation.model, "stories260K");
  EXPECT_EQ(r->generation.prompt_text, "Once upon");
  EXPECT_EQ(r->generation.max_tokens, 7);
  EXPECT_FLOAT_EQ(r->generation.sampling.temperature, 0.5f);
  EXPECT_FLOAT_EQ(r->generation.sampling.top_p, 0.9f);
  EXPECT_EQ(r->generation.sampling.top_k, 40);
  EXPECT_EQ(r->generation.sampling.seed, 42u);
  EXPECT_EQ(r->generation.stop, (std::vector<std::string>{"\n", "The end"}));
  EXPECT_TRUE(r->stream);
  EXPECT_TRUE(r->include_usage);
}

TEST(OpenAiApiTest, DefaultsFollowOpenAi) {
  absl::StatusOr<OpenAiRequest> r = Completion(R"({"prompt": "x"})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->generation.model, "");
  EXPECT_EQ(r->generation.max_tokens, 16);
  EXPECT_FLOAT_EQ(r->generation.sampling.temperature, 1.0f);
  EXPECT_FALSE(r->stream);
}

TEST(OpenAiApiTest, PromptForms) {
  auto one = Completion(R"({"prompt": ["only one"]})");
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->generation.prompt_text, "only one");
  auto ids = Completion(R"({"prompt": [1, 2, 3]})");
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(ids->generation.prompt_ids, (std::vector<int32_t>{1, 2, 3}));
  auto nested = Completion(R"({"prompt": [[1, 5]]})");
  ASSERT_TRUE(nested.ok());
  EXPECT_EQ(nested->generation.prompt_ids, (std::vector<int32_t>{1, 5}));
  auto stop = Completion(R"({"prompt": "a", "stop": "x"})");
  ASSERT_TRUE(stop.ok());
  EXPECT_EQ(stop->generation.stop, std::vector<std::string>{"x"});
  EXPECT_FALSE(stop->generation.ignore_eos);
  auto no_eos = Completion(R"({"prompt": "a", "ignore_eos": true})");
  ASSERT_TRUE(no_eos.ok());
  EXPECT_TRUE(no_eos->generation.ignore_eos);
  // Batches: several text prompts or several token-id prompts.
  auto texts = Completion(R"({"prompt": ["a", "bc"], "n": 2})");
  ASSERT_TRUE(texts.ok()) << texts.status();
  ASSERT_EQ(texts->prompts.size(), 2u);
  EXPECT_EQ(texts->prompts[1].text, "bc");
  EXPECT_EQ(texts->generation.prompt_text, "a");
  auto id_batch = Completion(R"({"prompt": [[1, 2], [3]]})");
  ASSERT_TRUE(id_batch.ok()) << id_batch.status();
  ASSERT_EQ(id_batch->prompts.size(), 2u);
  EXPECT_EQ(id_batch->prompts[1].ids, (std::vector<int32_t>{3}));
  std::string many = R"({"prompt": [)";
  for (int i = 0; i <= kMaxBatchChoices; ++i) {
    absl::StrAppend(&many, i ? "," : "", "\"p\"");
  }
  many += "]}";
  auto too_many = Completion(many);
  ASSERT_FALSE(too_many.ok());
  EXPECT_NE(too_many.status().message().find("more than"),
            absl::string_view::npos);
}

TEST(OpenAiApiTest, BatchUsageCountsEachPromptOnce) {
  // Two prompts x two choices: prompts of 5 and 7 tokens.
  const GenerationUsage usage = CombinedUsage(
      {{5, 1, 0}, {5, 2, 0}, {7, 3, 4}, {7, 4, 4}}, /*choices_per_prompt=*/2);
  EXPECT_EQ(usage.prompt_tokens, 12);
  EXPECT_EQ(usage.completion_tokens, 10);
  EXPECT_EQ(usage.cached_prompt_tokens, 4);
}

TEST(OpenAiApiTest, ChatTemplateForBaseModels) {
  auto r = Chat(R"({"messages": [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
      {"role": "user", "content": "Tell a story"}],
      "max_completion_tokens": 5})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r->generation.prompt_text,
            "System: Be brief.\nUser: Hi\nAssistant: Hello\nUser: Tell a "
            "story\nAssistant:");
  EXPECT_EQ(r->generation.max_tokens, 5);
  EXPECT_EQ(r->messages.size(), 4u);
}

struct BadCase {
  const char* name;
  OpenAiEndpoint endpoint;
  std::string body;
  const char* mentions;
};

class OpenAiBadInputTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(OpenAiBadInputTest, IsInvalidArgumentNamingTheProblem) {
  const BadCase& c = GetParam();
  absl::StatusOr<OpenAiRequest> r = ParseOpenAiRequest(c.endpoint, c.body);
  ASSERT_FALSE(r.ok()) << c.body;
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find(c.mentions), absl::string_view::npos)
      << r.status();
  EXPECT_EQ(HttpStatusFor(r.status()), 400);
}

constexpr auto kC = OpenAiEndpoint::kCompletions;
constexpr auto kChat = OpenAiEndpoint::kChatCompletions;

INSTANTIATE_TEST_SUITE_P(
    Cases, OpenAiBadInputTest,
    ::testing::Values(
        BadCase{"malformed_json", kC, R"({"prompt": "x",)", "not valid JSON"},
        BadCase{"invalid_utf8", kC, "{\"prompt\": \"\xff\xfe\"}",
                "not valid JSON"},
        BadCase{"not_object", kC, R"(["prompt"])", "JSON object"},
        BadCase{"empty_body", kC, "", "not valid JSON"},
        BadCase{"no_prompt", kC, R"({"model": "m"})", "'prompt'"},
        BadCase{"empty_prompt", kC, R"({"prompt": ""})", "'prompt'"},
        BadCase{"empty_ids", kC, R"({"prompt": []})", "'prompt'"},
        BadCase{"negative_id", kC, R"({"prompt": [1, -2]})", "'prompt'"},
        BadCase{"batch_mixed", kC, R"({"prompt": ["a", [1, 2]]})",
                "mixes text and token-id"},
        BadCase{"batch_empty_member", kC, R"({"prompt": [[1], []]})",
                "'prompt'"},
        BadCase{"batch_too_many_choices", kC,
                R"({"prompt": ["a", "b", "c", "d", "e"], "n": 13})", "'n'"},
        BadCase{"prompt_number", kC, R"({"prompt": 5})", "'prompt'"},
        BadCase{"model_number", kC, R"({"prompt": "a", "model": 3})",
                "'model'"},
        BadCase{"max_tokens_zero", kC, R"({"prompt": "a", "max_tokens": 0})",
                "max_tokens"},
        BadCase{"max_tokens_float", kC, R"({"prompt": "a", "max_tokens": 1.5})",
                "max_tokens"},
        BadCase{"max_tokens_huge", kC,
                R"({"prompt": "a", "max_tokens": 99999999999})", "max_tokens"},
        BadCase{"negative_temperature", kC,
                R"({"prompt": "a", "temperature": -0.1})", "temperature"},
        BadCase{"temperature_string", kC,
                R"({"prompt": "a", "temperature": "hot"})", "temperature"},
        BadCase{"top_p_zero", kC, R"({"prompt": "a", "top_p": 0})", "top_p"},
        BadCase{"top_k_negative", kC, R"({"prompt": "a", "top_k": -5})",
                "top_k"},
        BadCase{"n_zero", kC, R"({"prompt": "a", "n": 0})", "'n'"},
        BadCase{"n_too_many", kC, R"({"prompt": "a", "n": 17})", "'n'"},
        BadCase{"best_of_below_n", kC,
                R"({"prompt": "a", "n": 3, "best_of": 2})", "best_of"},
        BadCase{"best_of_too_many", kC, R"({"prompt": "a", "best_of": 17})",
                "best_of"},
        BadCase{"best_of_streamed", kC,
                R"({"prompt": "a", "best_of": 2, "stream": true})", "best_of"},
        BadCase{"echo_string", kC, R"({"prompt": "a", "echo": "yes"})", "echo"},
        BadCase{"max_tokens_negative_echo", kC,
                R"({"prompt": "a", "echo": true, "max_tokens": -1})",
                "max_tokens"},
        BadCase{"chat_echo", kChat,
                R"({"messages": [{"role": "user", "content": "x"}],
                    "echo": true})",
                "completions option"},
        BadCase{"logprobs_over_20", kC, R"({"prompt": "a", "logprobs": 21})",
                "'logprobs'"},
        BadCase{"logprobs_negative", kC, R"({"prompt": "a", "logprobs": -1})",
                "'logprobs'"},
        BadCase{"logprobs_true_completions", kC,
                R"({"prompt": "a", "logprobs": true})", "'logprobs'"},
        BadCase{"top_logprobs_completions", kC,
                R"({"prompt": "a", "top_logprobs": 2})", "chat option"},
        BadCase{"presence_penalty_range", kC,
                R"({"prompt": "a", "presence_penalty": 2.5})",
                "presence_penalty"},
        BadCase{"frequency_penalty_string", kC,
                R"({"prompt": "a", "frequency_penalty": "high"})",
                "frequency_penalty"},
        BadCase{"repetition_penalty_zero", kC,
                R"({"prompt": "a", "repetition_penalty": 0})",
                "repetition_penalty"},
        BadCase{"min_p_range", kC, R"({"prompt": "a", "min_p": 1.5})", "min_p"},
        BadCase{"min_tokens_over_max", kC,
                R"({"prompt": "a", "max_tokens": 4, "min_tokens": 5})",
                "min_tokens"},
        BadCase{"logit_bias_key", kC,
                R"({"prompt": "a", "logit_bias": {"dog": 5}})", "logit_bias"},
        BadCase{"logit_bias_value", kC,
                R"({"prompt": "a", "logit_bias": {"5": 101}})", "logit_bias"},
        BadCase{"two_formats", kC,
                R"({"prompt": "a", "guided_regex": "a+",
                    "response_format": {"type": "json_object"}})",
                "guided_regex"},
        BadCase{"format_type", kC,
                R"({"prompt": "a", "response_format": {"type": "yaml"}})",
                "response_format"},
        BadCase{"format_schema_missing", kC,
                R"({"prompt": "a", "response_format": {"type": "json_schema",
                    "json_schema": {"name": "x"}}})",
                "response_format"},
        BadCase{"guided_choice_empty", kC,
                R"({"prompt": "a", "guided_choice": []})", "guided_choice"},
        BadCase{"guided_regex_number", kC,
                R"({"prompt": "a", "guided_regex": 5})", "guided_regex"},
        BadCase{"format_ignore_eos", kC,
                R"({"prompt": "a", "guided_regex": "a+", "ignore_eos": true})",
                "ignore_eos"},
        BadCase{"format_min_tokens", kC,
                R"({"prompt": "a", "guided_regex": "a+", "min_tokens": 2})",
                "min_tokens"},
        BadCase{"logit_bias_array", kC, R"({"prompt": "a", "logit_bias": [5]})",
                "logit_bias"},
        BadCase{"stream_string", kC, R"({"prompt": "a", "stream": "yes"})",
                "stream"},
        BadCase{"stop_number", kC, R"({"prompt": "a", "stop": 1})", "stop"},
        BadCase{"ignore_eos_string", kC,
                R"({"prompt": "a", "ignore_eos": "1"})", "ignore_eos"},
        BadCase{"stop_empty", kC, R"({"prompt": "a", "stop": [""]})", "stop"},
        BadCase{"too_many_stops", kC,
                R"({"prompt": "a", "stop": ["1","2","3","4","5","6","7","8",
                    "9","10","11","12","13","14","15","16","17"]})",
                "stop"},
        BadCase{"no_messages", kChat, R"({"model": "m"})", "messages"},
        BadCase{"empty_messages", kChat, R"({"messages": []})", "messages"},
        BadCase{"bad_role", kChat,
                R"({"messages": [{"role": "robot", "content": "x"}]})", "role"},
        BadCase{"no_content", kChat, R"({"messages": [{"role": "user"}]})",
                "content"},
        BadCase{"chat_logprobs_number", kChat,
                R"({"messages": [{"role": "user", "content": "x"}],
                    "logprobs": 3})",
                "'logprobs'"},
        BadCase{"chat_top_without_logprobs", kChat,
                R"({"messages": [{"role": "user", "content": "x"}],
                    "top_logprobs": 3})",
                "needs \"logprobs\": true"},
        BadCase{"chat_top_over_20", kChat,
                R"({"messages": [{"role": "user", "content": "x"}],
                    "logprobs": true, "top_logprobs": 21})",
                "'top_logprobs'"},
        BadCase{"image_part", kChat,
                R"({"messages": [{"role": "user", "content":
                    [{"type": "image_url", "image_url": {}}]}]})",
                "content"}),
    [](const ::testing::TestParamInfo<BadCase>& info) {
      return std::string(info.param.name);
    });

// Every request field of the OpenAI completions/chat APIs and of vLLM's
// extensions, each with a value that would change the answer: a field is
// honoured (its effect is checked in the tests above and in the e2e suites)
// or refused with a 400 that names it. Never accepted and ignored.
TEST(OpenAiApiTest, EveryKnownFieldIsHonouredOrRefusedByName) {
  struct Field {
    const char* name;
    const char* value;  // JSON
    bool honoured;
  };
  const std::vector<Field> completions = {
      {"model", R"("stories260K")", true},
      {"max_tokens", "3", true},
      {"temperature", "0.5", true},
      {"top_p", "0.5", true},
      {"top_k", "5", true},
      {"seed", "7", true},
      {"n", "2", true},
      {"stop", R"(["x"])", true},
      {"stream", "true", true},
      {"stream_options", R"({"include_usage": true})", true},
      {"logprobs", "2", true},
      {"echo", "true", true},
      {"ignore_eos", "true", true},
      {"best_of", "2", true},
      {"frequency_penalty", "0.5", true},
      {"presence_penalty", "0.5", true},
      {"logit_bias", R"({"5": 10})", true},
      {"suffix", R"("end")", false},
      {"user", R"("alice")", false},
      {"repetition_penalty", "1.2", true},
      {"min_p", "0.1", true},
      {"min_tokens", "4", true},
      {"length_penalty", "1.5", false},
      {"use_beam_search", "true", false},
      {"stop_token_ids", "[5]", false},
      {"include_stop_str_in_output", "true", false},
      {"skip_special_tokens", "false", false},
      {"spaces_between_special_tokens", "false", false},
      {"truncate_prompt_tokens", "4", false},
      {"prompt_logprobs", "1", false},
      {"allowed_token_ids", "[1, 2]", false},
      {"bad_words", R"(["x"])", false},
      {"guided_json", R"({"type": "object"})", true},
      {"guided_regex", R"("a+")", true},
      {"guided_choice", R"(["a", "b"])", true},
      {"guided_grammar", R"("root ::= [a-z]+")", false},
      {"response_format", R"({"type": "json_object"})", true},
      {"priority", "1", false},
      {"metadata", R"({"k": "v"})", false},
      {"store", "true", false},
      {"service_tier", R"("default")", false},
  };
  // Each field alone on a minimal request of its endpoint.
  auto check = [](OpenAiEndpoint endpoint, const std::string& base,
                  const std::vector<Field>& fields) {
    for (const Field& f : fields) {
      SCOPED_TRACE(f.name);
      absl::StatusOr<OpenAiRequest> r = ParseOpenAiRequest(
          endpoint,
          absl::StrCat(base, R"(, ")", f.name, R"(": )", f.value, "}"));
      if (f.honoured) {
        EXPECT_TRUE(r.ok()) << r.status();
        continue;
      }
      ASSERT_FALSE(r.ok());
      EXPECT_EQ(HttpStatusFor(r.status()), 400);
      EXPECT_NE(r.status().message().find(f.name), std::string::npos)
          << r.status();
    }
  };
  check(OpenAiEndpoint::kCompletions, R"({"prompt": "a")", completions);
  const std::vector<Field> chat = {
      {"max_completion_tokens", "3", true},
      {"logprobs", "true", true},
      {"top_logprobs", "0", true},
      {"tool_choice", R"("auto")", true},
      {"tools", R"([{"type": "function", "function": {"name": "f"}}])", false},
      {"parallel_tool_calls", "true", false},
      {"response_format", R"({"type": "json_schema"})", false},
      {"reasoning_effort", R"("low")", false},
      {"modalities", R"(["text"])", false},
      {"audio", R"({})", false},
      {"prediction", R"({})", false},
      {"web_search_options", R"({})", false},
      {"chat_template", R"("x")", false},
      {"chat_template_kwargs", R"({"enable_thinking": false})", false},
      {"add_generation_prompt", "false", true},
      {"continue_final_message", "true", false},
      {"documents", "[]", false},
  };
  check(OpenAiEndpoint::kChatCompletions,
        R"({"messages": [{"role": "user", "content": "x"}])", chat);
  // A null value is the same as leaving the field out.
  EXPECT_TRUE(Completion(R"({"prompt": "a", "response_format": null})").ok());
}

// The sampling controls reach the request as given (their effect on the
// tokens is tested at the sampler, the decode worker and end to end).
TEST(OpenAiApiTest, SamplingControlsReachTheRequest) {
  absl::StatusOr<OpenAiRequest> r = ParseOpenAiRequest(
      OpenAiEndpoint::kCompletions,
      R"({"prompt": "a", "presence_penalty": -0.5, "frequency_penalty": 1.25,
          "repetition_penalty": 1.1, "min_p": 0.05, "min_tokens": 3,
          "logit_bias": {"12": -100, "3": 2.5}, "n": 2, "best_of": 5})");
  ASSERT_TRUE(r.ok()) << r.status();
  const engine::SamplingParams& s = r->generation.sampling;
  EXPECT_FLOAT_EQ(s.presence_penalty, -0.5f);
  EXPECT_FLOAT_EQ(s.frequency_penalty, 1.25f);
  EXPECT_FLOAT_EQ(s.repetition_penalty, 1.1f);
  EXPECT_FLOAT_EQ(s.min_p, 0.05f);
  EXPECT_EQ(s.min_tokens, 3);
  // Sorted by token for the engine.
  EXPECT_EQ(s.logit_bias,
            (std::vector<engine::LogitBias>{{3, 2.5f}, {12, -100.0f}}));
  EXPECT_EQ(r->n, 2);
  EXPECT_EQ(r->best_of, 5);
  EXPECT_FALSE(s.structured_output.enabled());
  // Structured output as OpenAI and vLLM spell it.
  using Kind = engine::StructuredOutput::Kind;
  auto format = [](const std::string& field) {
    absl::StatusOr<OpenAiRequest> f = ParseOpenAiRequest(
        OpenAiEndpoint::kChatCompletions,
        absl::StrCat(R"({"messages": [{"role": "user", "content": "x"}], )",
                     field, "}"));
    EXPECT_TRUE(f.ok()) << f.status();
    return f.ok() ? f->generation.sampling.structured_output
                  : engine::StructuredOutput{};
  };
  EXPECT_EQ(format(R"("response_format": {"type": "json_object"})").kind,
            Kind::kJsonObject);
  EXPECT_FALSE(format(R"("response_format": {"type": "text"})").enabled());
  engine::StructuredOutput schema = format(
      R"("response_format": {"type": "json_schema", "json_schema":
          {"name": "p", "strict": true, "schema": {"type": "object"}}})");
  EXPECT_EQ(schema.kind, Kind::kJsonSchema);
  EXPECT_EQ(json::parse(schema.text), json::parse(R"({"type": "object"})"));
  // Properties keep the order the client wrote (they are produced in it).
  EXPECT_EQ(
      format(R"("guided_json": {"properties": {"zeta": {}, "alpha": {}}})")
          .text,
      R"({"properties":{"zeta":{},"alpha":{}}})");
  EXPECT_EQ(format(R"("guided_json": "{\"type\": \"integer\"}")").text,
            R"({"type": "integer"})");
  EXPECT_EQ(format(R"("guided_regex": "[ab]+")").kind, Kind::kRegex);
  EXPECT_EQ(format(R"("guided_choice": ["x", "y"])").choices,
            (std::vector<std::string>{"x", "y"}));
  absl::StatusOr<OpenAiRequest> plain = Completion(R"({"prompt": "a"})");
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->best_of, 1);
  EXPECT_FALSE(plain->generation.sampling.processes_logits());
}

// best_of keeps each prompt's n candidates of highest cumulative logprob,
// bills every candidate's tokens, and drops logprobs nobody asked for.
TEST(OpenAiApiTest, BestCandidatesRankByCumulativeLogprob) {
  auto candidate = [](std::string text, std::vector<float> logprobs) {
    CompletionOutcome c;
    c.text = std::move(text);
    c.usage.prompt_tokens = 4;
    c.usage.completion_tokens = static_cast<int32_t>(logprobs.size());
    for (float l : logprobs) {
      TokenLogprob t;
      t.chosen.logprob = l;
      c.logprobs.tokens.push_back(t);
    }
    return c;
  };
  // Two prompts, three candidates each.
  std::vector<CompletionOutcome> all = {
      candidate("a0", {-1, -1}),         candidate("a1", {-0.5}),
      candidate("a2", {-3, -0.1, -0.1}), candidate("b0", {-0.1}),
      candidate("b1", {-0.2}),           candidate("b2", {-0.05, -0.01})};
  std::vector<CompletionOutcome> best =
      BestCandidates(all, /*per_prompt=*/3, /*n=*/1, /*keep_logprobs=*/false);
  ASSERT_EQ(best.size(), 2u);
  EXPECT_EQ(best[0].text, "a1");
  EXPECT_EQ(best[1].text, "b2");
  EXPECT_EQ(best[0].usage.completion_tokens, 6);  // 1 + the dropped 2 + 3
  EXPECT_TRUE(best[0].logprobs.tokens.empty());
  best = BestCandidates(all, 3, 2, /*keep_logprobs=*/true);
  ASSERT_EQ(best.size(), 4u);
  EXPECT_EQ(best[0].text, "a1");
  EXPECT_EQ(best[1].text, "a0");
  EXPECT_EQ(best[2].text, "b2");
  EXPECT_EQ(best[3].text, "b0");
  EXPECT_EQ(best[1].logprobs.tokens.size(), 2u);
}

TEST(OpenAiApiTest, StatusCodes) {
  EXPECT_EQ(HttpStatusFor(absl::InvalidArgumentError("")), 400);
  EXPECT_EQ(HttpStatusFor(absl::NotFoundError("")), 404);
  EXPECT_EQ(HttpStatusFor(absl::ResourceExhaustedError("")), 429);
  EXPECT_EQ(HttpStatusFor(absl::UnavailableError("")), 503);
  EXPECT_EQ(HttpStatusFor(absl::DeadlineExceededError("")), 504);
  EXPECT_EQ(HttpStatusFor(absl::InternalError("")), 500);
}

TEST(OpenAiApiTest, ErrorShape) {
  json body = json::parse(ErrorBody(absl::NotFoundError("no such model")));
  ASSERT_TRUE(body.contains("error"));
  EXPECT_EQ(body["error"]["message"], "no such model");
  EXPECT_EQ(body["error"]["type"], "invalid_request_error");
  EXPECT_TRUE(body["error"]["param"].is_null());
  EXPECT_EQ(body["error"]["code"], "model_not_found");
  json limited = json::parse(ErrorBody(absl::ResourceExhaustedError("full")));
  EXPECT_EQ(limited["error"]["code"], "rate_limit_exceeded");
}

TEST(OpenAiApiTest, ResponseShapes) {
  CompletionOutcome outcome{" w0 w1", FinishReason::kLength, {3, 2, 0}, {}};
  json c = json::parse(CompletionBody(kC, "cmpl-1", 7, "m", outcome));
  EXPECT_EQ(c["object"], "text_completion");
  EXPECT_EQ(c["choices"][0]["text"], " w0 w1");
  EXPECT_EQ(c["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(c["usage"]["total_tokens"], 5);
  json chat = json::parse(CompletionBody(kChat, "chatcmpl-1", 7, "m", outcome));
  EXPECT_EQ(chat["object"], "chat.completion");
  EXPECT_EQ(chat["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(chat["choices"][0]["message"]["content"], " w0 w1");

  std::string event =
      StreamChunkEvent(kChat, "id", 7, "m", "hi", FinishReason::kNone, true);
  ASSERT_EQ(event.rfind("data: ", 0), 0u);
  ASSERT_EQ(event.substr(event.size() - 2), "\n\n");
  json chunk = json::parse(event.substr(6));
  EXPECT_EQ(chunk["object"], "chat.completion.chunk");
  EXPECT_EQ(chunk["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(chunk["choices"][0]["delta"]["content"], "hi");
  EXPECT_TRUE(chunk["choices"][0]["finish_reason"].is_null());
}

TEST(OpenAiApiTest, SeveralChoices) {
  auto parsed = ParseOpenAiRequest(kC, R"({"prompt": "a", "n": 3})");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->n, 3);
  EXPECT_EQ(ParseOpenAiRequest(kC, R"({"prompt": "a"})")->n, 1);
  std::vector<CompletionOutcome> outcomes = {
      {" a", FinishReason::kLength, {5, 2, 3}, {}},
      {" b c", FinishReason::kStop, {5, 1, 3}, {}}};
  json body = json::parse(CompletionBody(kC, "cmpl-1", 7, "m", outcomes, 2));
  ASSERT_EQ(body["choices"].size(), 2u);
  EXPECT_EQ(body["choices"][1]["index"], 1);
  EXPECT_EQ(body["choices"][1]["text"], " b c");
  EXPECT_EQ(body["choices"][1]["finish_reason"], "stop");
  // One prompt, counted once; completions summed.
  EXPECT_EQ(body["usage"]["prompt_tokens"], 5);
  EXPECT_EQ(body["usage"]["completion_tokens"], 3);
  EXPECT_EQ(body["usage"]["prompt_tokens_details"]["cached_tokens"], 3);
  json chunk = json::parse(StreamChunkEvent(kChat, "id", 7, "m", "x",
                                            FinishReason::kNone, true, {}, 4)
                               .substr(6));
  EXPECT_EQ(chunk["choices"][0]["index"], 4);
}

TEST(OpenAiApiTest, NoSeedMeansAFreshOne) {
  auto a = ParseOpenAiRequest(kC, R"({"prompt": "a"})");
  auto b = ParseOpenAiRequest(kC, R"({"prompt": "a", "seed": null})");
  auto fixed = ParseOpenAiRequest(kC, R"({"prompt": "a", "seed": 0})");
  ASSERT_TRUE(a.ok() && b.ok() && fixed.ok());
  EXPECT_NE(a->generation.sampling.seed, b->generation.sampling.seed);
  EXPECT_EQ(fixed->generation.sampling.seed, 0u);
}

TEST(OpenAiApiTest, LogprobsRequests) {
  auto completions =
      ParseOpenAiRequest(kC, R"({"prompt": "a", "logprobs": 3})");
  ASSERT_TRUE(completions.ok()) << completions.status();
  EXPECT_TRUE(completions->generation.logprobs);
  EXPECT_EQ(completions->generation.top_logprobs, 3);
  auto zero = ParseOpenAiRequest(kC, R"({"prompt": "a", "logprobs": 0})");
  ASSERT_TRUE(zero.ok());
  EXPECT_TRUE(zero->generation.logprobs);
  EXPECT_EQ(zero->generation.top_logprobs, 0);
  for (const char* off :
       {R"({"prompt": "a"})", R"({"prompt": "a", "logprobs": null})",
        R"({"prompt": "a", "logprobs": false})"}) {
    auto parsed = ParseOpenAiRequest(kC, off);
    ASSERT_TRUE(parsed.ok()) << off;
    EXPECT_FALSE(parsed->generation.logprobs) << off;
  }
  auto chat = ParseOpenAiRequest(
      kChat, R"({"messages": [{"role": "user", "content": "x"}],
                 "logprobs": true, "top_logprobs": 20})");
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_TRUE(chat->generation.logprobs);
  EXPECT_EQ(chat->generation.top_logprobs, 20);
  auto chat_plain = ParseOpenAiRequest(
      kChat, R"({"messages": [{"role": "user", "content": "x"}],
                 "logprobs": true})");
  ASSERT_TRUE(chat_plain.ok());
  EXPECT_EQ(chat_plain->generation.top_logprobs, 0);
}

TEST(OpenAiApiTest, EchoRequests) {
  // lm-eval-harness's loglikelihood request: score the prompt, generate
  // nothing.
  auto scoring = ParseOpenAiRequest(
      kC, R"({"prompt": "a b", "echo": true, "max_tokens": 0, "logprobs": 1})");
  ASSERT_TRUE(scoring.ok()) << scoring.status();
  EXPECT_TRUE(scoring->generation.echo);
  EXPECT_EQ(scoring->generation.max_tokens, 0);
  EXPECT_TRUE(scoring->generation.logprobs);
  EXPECT_EQ(scoring->generation.top_logprobs, 1);
  auto plain = ParseOpenAiRequest(kC, R"({"prompt": "a", "echo": false})");
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(plain->generation.echo);
  auto zero = ParseOpenAiRequest(kC, R"({"prompt": "a", "max_tokens": 0})");
  ASSERT_FALSE(zero.ok());
  EXPECT_NE(zero.status().message().find("0 only with echo"),
            absl::string_view::npos)
      << zero.status();
  GenerationRequest without_echo = scoring->generation;
  without_echo.echo = false;
  EXPECT_FALSE(ValidateGenerationRequest(without_echo).ok());
}

TEST(OpenAiApiTest, EchoedPromptLeadsTheLogprobs) {
  // "Once upon": token 0 " Once" carries SentencePiece's dummy-prefix space,
  // which the prompt text does not start with.
  CompletionOutcome outcome{
      "Once upon a", FinishReason::kLength, {2, 1, 0}, {}};
  outcome.logprobs.requested = true;
  outcome.logprobs.top_logprobs = 1;
  PromptEcho echo;
  echo.text = "Once upon";
  echo.first_token = {20, 0.0f, " Once"};
  TokenLogprob upon;
  upon.chosen = {21, -1.5f, " upon"};
  upon.top = {{22, -0.5f, " on"}};
  echo.scored_tokens = {upon};
  outcome.logprobs.prompt = echo;
  outcome.logprobs.text_offset = TextCharacters(echo.text);
  TokenLogprob a;
  a.chosen = {23, -0.25f, " a"};
  a.top = {a.chosen};
  outcome.logprobs.tokens = {a};
  json c = json::parse(CompletionBody(kC, "cmpl-1", 7, "m", outcome));
  const json& lp = c["choices"][0]["logprobs"];
  EXPECT_EQ(lp["tokens"], json({" Once", " upon", " a"}));
  EXPECT_EQ(lp["token_logprobs"], json({nullptr, -1.5, -0.25}));
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  EXPECT_EQ(lp["top_logprobs"][1], json({{" on", -0.5}, {" upon", -1.5}}));
  // Offsets index the choice's text "Once upon a": "Once" 0, " upon" 4,
  // " a" 9.
  EXPECT_EQ(lp["text_offset"], json({0, 4, 9}));
  EXPECT_EQ(c["choices"][0]["text"], "Once upon a");
}

TEST(OpenAiApiTest, TokenDisplayShowsTextBytesOrIds) {
  EXPECT_EQ(TokenDisplay({5, -1, " time"}), " time");
  // Half of "é" (0xC3 0xA9): not text on its own.
  EXPECT_EQ(TokenDisplay({200, -1, "\xc3"}), "bytes:\\xc3");
  EXPECT_EQ(TokenDisplay({42, -1, ""}), "token_id:42");
  EXPECT_EQ(TokenCharacters({200, -1, "\xc3"}), 1);
  EXPECT_EQ(TokenCharacters({201, -1, "\xa9"}), 0);
  EXPECT_EQ(TokenCharacters({5, -1, " t\xc3\xa9"}), 3);
}

TEST(OpenAiApiTest, LogprobsShapes) {
  CompletionOutcome outcome{" a b", FinishReason::kLength, {3, 2, 0}, {}};
  outcome.logprobs.requested = true;
  outcome.logprobs.top_logprobs = 2;
  outcome.logprobs.tokens = {
      {{10, -0.25f, " a"}, {{10, -0.25f, " a"}, {11, -2.0f, " c"}}},
      // The sampled token is not among the top two: completions add it.
      {{12, -3.0f, " b"}, {{13, -0.5f, " d"}, {14, -1.5f, "\xc3"}}},
  };
  json c = json::parse(CompletionBody(kC, "cmpl-1", 7, "m", outcome));
  const json& lp = c["choices"][0]["logprobs"];
  EXPECT_EQ(lp["tokens"], json({" a", " b"}));
  EXPECT_EQ(lp["token_logprobs"], json({-0.25, -3.0}));
  EXPECT_EQ(lp["text_offset"], json({0, 2}));
  ASSERT_EQ(lp["top_logprobs"].size(), 2u);
  EXPECT_EQ(lp["top_logprobs"][0], json({{" a", -0.25}, {" c", -2.0}}));
  EXPECT_EQ(lp["top_logprobs"][1],
            json({{" d", -0.5}, {"bytes:\\xc3", -1.5}, {" b", -3.0}}));

  json chat = json::parse(CompletionBody(kChat, "chatcmpl-1", 7, "m", outcome));
  const json& content = chat["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 2u);
  EXPECT_EQ(content[0]["token"], " a");
  EXPECT_EQ(content[0]["logprob"], -0.25);
  EXPECT_EQ(content[0]["bytes"], json({32, 97}));
  ASSERT_EQ(content[1]["top_logprobs"].size(), 2u);
  EXPECT_EQ(content[1]["top_logprobs"][1]["token"], "bytes:\\xc3");
  EXPECT_EQ(content[1]["top_logprobs"][1]["bytes"], json({0xc3}));
  EXPECT_TRUE(chat["choices"][0]["logprobs"]["refusal"].is_null());

  // Not requested: null, as before.
  outcome.logprobs.requested = false;
  EXPECT_TRUE(json::parse(CompletionBody(kC, "c", 7, "m",
                                         outcome))["choices"][0]["logprobs"]
                  .is_null());
  // A stream chunk starts its offsets where the earlier chunks ended.
  LogprobsOutput chunk;
  chunk.requested = true;
  chunk.text_offset = 9;
  chunk.tokens = {{{12, -3.0f, " b"}, {}}};
  json event = json::parse(StreamChunkEvent(kC, "id", 7, "m", " b",
                                            FinishReason::kNone, false, chunk)
                               .substr(6));
  EXPECT_EQ(event["choices"][0]["logprobs"]["text_offset"], json({9}));
  EXPECT_EQ(event["choices"][0]["logprobs"]["top_logprobs"][0],
            json({{" b", -3.0}}));
}

}  // namespace
}  // namespace pdserve::router
