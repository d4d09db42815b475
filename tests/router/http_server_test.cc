// The OpenAI HTTP front-end through a real server on 127.0.0.1:0 and
// cpp-httplib's client, over the fake backend: SSE framing, non-streaming
// bodies, chat, models, health, and every error shape and status code.
#include "router/http_server.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "router/admission_limiter.h"
#include "router/openai_api.h"
#include "testing/golden.h"
#include "tests/router/fake_backend.h"
#include "tokenizer/tokenizer.h"

namespace pdserve::router {
namespace {

using json = nlohmann::json;
using testing::FakeBackend;

class HttpServerTest : public ::testing::Test {
 protected:
  void StartServer(GenerationBackend* backend, HttpServerOptions options = {}) {
    absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> server =
        OpenAiHttpServer::Start(options, backend);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    client_ = std::make_unique<httplib::Client>("127.0.0.1", server_->port());
    client_->set_read_timeout(30, 0);
  }
  void SetUp() override { StartServer(&backend_); }
  void TearDown() override {
    if (server_ != nullptr) server_->Stop();
    EXPECT_TRUE(backend_.WaitIdle(absl::Seconds(10)));
  }

  httplib::Result Post(const std::string& path, const std::string& body) {
    return client_->Post(path.c_str(), body, "application/json");
  }

  // Checks OpenAI's error shape and returns the message.
  static std::string ExpectError(const httplib::Result& res, int status) {
    EXPECT_TRUE(res) << "no response";
    if (!res) return "";
    EXPECT_EQ(res->status, status) << res->body;
    json body = json::parse(res->body, nullptr, false);
    EXPECT_TRUE(body.is_object() && body.contains("error")) << res->body;
    if (!body.is_object() || !body.contains("error")) return "";
    const json& error = body["error"];
    EXPECT_TRUE(error["message"].is_string());
    EXPECT_TRUE(error["type"].is_string());
    EXPECT_TRUE(error.contains("param"));
    EXPECT_TRUE(error.contains("code"));
    EXPECT_EQ(res->get_header_value("Content-Type"), "application/json");
    return error["message"].is_string() ? error["message"].get<std::string>()
                                        : "";
  }

  // Splits an SSE body into its `data:` payloads, checking the framing:
  // every event is one "data: ..." line followed by a blank line.
  static std::vector<std::string> Events(const std::string& body) {
    std::vector<std::string> events;
    EXPECT_TRUE(body.size() >= 2 && body.substr(body.size() - 2) == "\n\n")
        << body;
    for (absl::string_view event : absl::StrSplit(body, "\n\n")) {
      if (event.empty()) continue;
      EXPECT_TRUE(absl::StartsWith(event, "data: ")) << event;
      EXPECT_EQ(event.find('\n'), absl::string_view::npos) << event;
      events.emplace_back(event.substr(6));
    }
    return events;
  }

  FakeBackend backend_;
  std::unique_ptr<OpenAiHttpServer> server_;
  std::unique_ptr<httplib::Client> client_;
};

TEST_F(HttpServerTest, NonStreamingCompletion) {
  auto res = Post("/v1/completions",
                  R"({"model": "stories260K", "prompt": "Once upon a time",
                      "max_tokens": 3, "temperature": 0, "seed": 5})");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  json body = json::parse(res->body);
  EXPECT_EQ(body["object"], "text_completion");
  EXPECT_EQ(body["model"], "stories260K");
  EXPECT_TRUE(absl::StartsWith(body["id"].get<std::string>(), "cmpl-"));
  EXPECT_EQ(body["choices"].size(), 1u);
  EXPECT_EQ(body["choices"][0]["text"], " w0 w1 w2");
  EXPECT_EQ(body["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(body["usage"]["completion_tokens"], 3);
  EXPECT_EQ(body["usage"]["prompt_tokens"], 16);
  EXPECT_EQ(body["usage"]["total_tokens"], 19);
  GenerationRequest seen = backend_.last_request();
  EXPECT_EQ(seen.max_tokens, 3);
  EXPECT_EQ(seen.sampling.seed, 5u);
  EXPECT_EQ(seen.sampling.temperature, 0.0f);
  EXPECT_LT(seen.deadline, absl::InfiniteFuture());
}

TEST_F(HttpServerTest, StreamingCompletionSseFraming) {
  auto res = Post("/v1/completions",
                  R"({"prompt": "Once", "max_tokens": 4, "stream": true,
                      "stream_options": {"include_usage": true}})");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  EXPECT_TRUE(absl::StartsWith(res->get_header_value("Content-Type"),
                               "text/event-stream"));
  std::vector<std::string> events = Events(res->body);
  // 4 token chunks, the usage chunk, [DONE].
  ASSERT_EQ(events.size(), 6u) << res->body;
  std::string text;
  for (int i = 0; i < 4; ++i) {
    json chunk = json::parse(events[i]);
    EXPECT_EQ(chunk["object"], "text_completion");
    text += chunk["choices"][0]["text"].get<std::string>();
    if (i < 3) {
      EXPECT_TRUE(chunk["choices"][0]["finish_reason"].is_null());
    } else {
      EXPECT_EQ(chunk["choices"][0]["finish_reason"], "length");
    }
  }
  EXPECT_EQ(text, " w0 w1 w2 w3");
  json usage = json::parse(events[4]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 4);
  EXPECT_EQ(events[5], "[DONE]");
}

TEST_F(HttpServerTest, CompletionLogprobsWholeAndStreamed) {
  auto res = Post("/v1/completions",
                  R"({"prompt": "Once", "max_tokens": 3, "logprobs": 1})");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  const json whole = json::parse(res->body)["choices"][0]["logprobs"];
  EXPECT_EQ(whole["tokens"], json({" w0", " w1", " w2"}));
  EXPECT_EQ(whole["token_logprobs"], json({-0.25, -0.5, -0.75}));
  EXPECT_EQ(whole["text_offset"], json({0, 3, 6}));
  EXPECT_EQ(whole["top_logprobs"][2], json({{" w2", -0.75}}));
  EXPECT_TRUE(backend_.last_request().logprobs);
  EXPECT_EQ(backend_.last_request().top_logprobs, 1);

  // Streamed: each chunk carries its token's logprobs, offsets continuing.
  res = Post("/v1/completions",
             R"({"prompt": "Once", "max_tokens": 3, "logprobs": 0,
                 "stream": true})");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  std::vector<std::string> events = Events(res->body);
  ASSERT_EQ(events.size(), 4u) << res->body;
  for (int i = 0; i < 3; ++i) {
    const json lp = json::parse(events[i])["choices"][0]["logprobs"];
    EXPECT_EQ(lp["tokens"], json({absl::StrCat(" w", i)}));
    EXPECT_EQ(lp["text_offset"], json({3 * i}));
  }

  // Chat, and a request without logprobs keeps "logprobs": null.
  res = Post("/v1/chat/completions",
             R"({"messages": [{"role": "user", "content": "Hi"}],
                 "max_tokens": 2, "logprobs": true, "top_logprobs": 3})");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  const json content =
      json::parse(res->body)["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 2u);
  EXPECT_EQ(content[1]["token"], " w1");
  EXPECT_EQ(content[1]["top_logprobs"].size(), 3u);
  res = Post("/v1/completions", R"({"prompt": "Once", "max_tokens": 1})");
  ASSERT_TRUE(res);
  EXPECT_TRUE(json::parse(res->body)["choices"][0]["logprobs"].is_null());
}

TEST_F(HttpServerTest, EchoWholeStreamedAndScoringOnly) {
  // Scoring only (lm-eval-harness): the prompt with its tokens' numbers, no
  // completion.
  auto res = Post("/v1/completions",
                  R"({"prompt": "abc", "echo": true, "max_tokens": 0,
                      "logprobs": 1})");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  json body = json::parse(res->body);
  json choice = body["choices"][0];
  EXPECT_EQ(choice["text"], "abc");
  EXPECT_EQ(choice["finish_reason"], "length");
  EXPECT_EQ(choice["logprobs"]["tokens"], json({"a", "b", "c"}));
  EXPECT_EQ(choice["logprobs"]["token_logprobs"], json({nullptr, -0.5, -1.0}));
  EXPECT_EQ(choice["logprobs"]["text_offset"], json({0, 1, 2}));
  EXPECT_TRUE(choice["logprobs"]["top_logprobs"][0].is_null());
  EXPECT_EQ(choice["logprobs"]["top_logprobs"][2],
            json({{"alt0", -2.0}, {"c", -1.0}}));
  EXPECT_EQ(body["usage"]["completion_tokens"], 0);
  EXPECT_TRUE(backend_.last_request().echo);
  EXPECT_EQ(backend_.last_request().max_tokens, 0);

  // Echo with a completion: prompt first, the tokens' offsets after it.
  res = Post("/v1/completions",
             R"({"prompt": "ab", "echo": true, "max_tokens": 2,
                 "logprobs": 0})");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  choice = json::parse(res->body)["choices"][0];
  EXPECT_EQ(choice["text"], "ab w0 w1");
  EXPECT_EQ(choice["logprobs"]["tokens"], json({"a", "b", " w0", " w1"}));
  EXPECT_EQ(choice["logprobs"]["token_logprobs"],
            json({nullptr, -0.5, -0.25, -0.5}));
  EXPECT_EQ(choice["logprobs"]["text_offset"], json({0, 1, 2, 5}));

  // Echo without logprobs: only the text; streamed, the prompt leads the
  // first chunk.
  res = Post("/v1/completions",
             R"({"prompt": "ab", "echo": true, "max_tokens": 2})");
  ASSERT_TRUE(res);
  choice = json::parse(res->body)["choices"][0];
  EXPECT_EQ(choice["text"], "ab w0 w1");
  EXPECT_TRUE(choice["logprobs"].is_null());
  res = Post("/v1/completions",
             R"({"prompt": "ab", "echo": true, "max_tokens": 2,
                 "logprobs": 0, "stream": true})");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  std::vector<std::string> events = Events(res->body);
  ASSERT_EQ(events.size(), 3u) << res->body;
  const json first = json::parse(events[0])["choices"][0];
  EXPECT_EQ(first["text"], "ab w0");
  EXPECT_EQ(first["logprobs"]["tokens"], json({"a", "b", " w0"}));
  EXPECT_EQ(first["logprobs"]["text_offset"], json({0, 1, 2}));
  const json second = json::parse(events[1])["choices"][0];
  EXPECT_EQ(second["text"], " w1");
  EXPECT_EQ(second["logprobs"]["text_offset"], json({5}));

  // Chat has no echo; max_tokens 0 needs it.
  res = Post("/v1/chat/completions",
             R"({"messages": [{"role": "user", "content": "Hi"}],
                 "echo": true})");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400) << res->body;
  res = Post("/v1/completions", R"({"prompt": "ab", "max_tokens": 0})");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400) << res->body;
}

TEST_F(HttpServerTest, PromptBatchesLikeLmEvalHarness) {
  // lm-eval-harness's batched loglikelihood request: several prompts, echo,
  // one token, logprobs 1. One choice per prompt, in prompt order.
  auto res = Post("/v1/completions",
                  R"({"prompt": ["ab", "xyz"], "echo": true, "max_tokens": 1,
                      "logprobs": 1, "temperature": 0})");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  json body = json::parse(res->body);
  ASSERT_EQ(body["choices"].size(), 2u);
  EXPECT_EQ(body["choices"][0]["index"], 0);
  EXPECT_EQ(body["choices"][0]["text"], "ab w0");
  EXPECT_EQ(body["choices"][1]["text"], "xyz w0");
  EXPECT_EQ(body["choices"][1]["logprobs"]["tokens"],
            json({"x", "y", "z", " w0"}));
  // Each prompt counted once: 2 + 3 characters (the fake's tokens).
  EXPECT_EQ(body["usage"]["prompt_tokens"], 5);
  EXPECT_EQ(body["usage"]["completion_tokens"], 2);

  // Two prompts x n = 2, streamed: four choices, indices p * n + i.
  res = Post("/v1/completions",
             R"({"prompt": [[1, 2], [3]], "n": 2, "max_tokens": 2,
                 "stream": true, "stream_options": {"include_usage": true}})");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  std::set<int> indices;
  int usage_events = 0;
  for (const std::string& event : Events(res->body)) {
    if (event == "[DONE]") continue;
    const json chunk = json::parse(event);
    for (const json& choice : chunk["choices"]) {
      indices.insert(choice["index"].get<int>());
    }
    if (chunk.contains("usage") && !chunk["usage"].is_null()) {
      ++usage_events;
      EXPECT_EQ(chunk["usage"]["prompt_tokens"], 3);
      EXPECT_EQ(chunk["usage"]["completion_tokens"], 8);
    }
  }
  EXPECT_EQ(indices, (std::set<int>{0, 1, 2, 3}));
  EXPECT_EQ(usage_events, 1);
  std::vector<std::vector<int32_t>> prompts;
  for (const GenerationRequest& r : backend_.requests()) {
    if (r.prompt_ids.has_value()) prompts.push_back(*r.prompt_ids);
  }
  // In choice order: prompt 0's two choices, then prompt 1's.
  EXPECT_EQ(prompts,
            (std::vector<std::vector<int32_t>>{{1, 2}, {1, 2}, {3}, {3}}));
}

TEST_F(HttpServerTest, SeveralChoicesWholeAndStreamed) {
  auto res = Post("/v1/completions",
                  R"({"prompt": "Once", "max_tokens": 2, "n": 3,
                      "temperature": 1, "seed": 40})");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  json body = json::parse(res->body);
  ASSERT_EQ(body["choices"].size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(body["choices"][i]["index"], i);
    EXPECT_EQ(body["choices"][i]["text"], " w0 w1");
  }
  EXPECT_EQ(body["usage"]["completion_tokens"], 6);
  EXPECT_EQ(body["usage"]["prompt_tokens"], 4);
  // One backend call per choice, seeds 40, 41, 42, distinct ids.
  std::vector<GenerationRequest> seen = backend_.requests();
  ASSERT_EQ(seen.size(), 3u);
  std::set<uint64_t> seeds;
  std::set<std::string> ids;
  for (const GenerationRequest& r : seen) {
    seeds.insert(r.sampling.seed);
    ids.insert(r.request_id);
  }
  EXPECT_EQ(seeds, (std::set<uint64_t>{40, 41, 42}));
  EXPECT_EQ(ids.size(), 3u);

  // Streamed chat: chunks of both choices, each starting with the role,
  // then one usage chunk for all, then [DONE].
  res = Post("/v1/chat/completions",
             R"({"messages": [{"role": "user", "content": "Hi"}],
                 "max_tokens": 3, "n": 2, "stream": true,
                 "stream_options": {"include_usage": true}})");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  std::vector<std::string> events = Events(res->body);
  ASSERT_EQ(events.size(), 2u * 3u + 2u) << res->body;
  std::map<int, std::string> text;
  std::map<int, int> roles, finishes;
  for (size_t e = 0; e + 2 < events.size(); ++e) {
    json chunk = json::parse(events[e]);
    const int index = chunk["choices"][0]["index"].get<int>();
    const json& delta = chunk["choices"][0]["delta"];
    if (delta.contains("role")) ++roles[index];
    if (delta.contains("content")) {
      text[index] += delta["content"].get<std::string>();
    }
    if (!chunk["choices"][0]["finish_reason"].is_null()) ++finishes[index];
  }
  EXPECT_EQ(text,
            (std::map<int, std::string>{{0, " w0 w1 w2"}, {1, " w0 w1 w2"}}));
  EXPECT_EQ(roles, (std::map<int, int>{{0, 1}, {1, 1}}));
  EXPECT_EQ(finishes, (std::map<int, int>{{0, 1}, {1, 1}}));
  EXPECT_EQ(
      json::parse(events[events.size() - 2])["usage"]["completion_tokens"], 6);
  EXPECT_EQ(events.back(), "[DONE]");

  // Staggered (the default): choices 1.. start once choice 0 streamed its
  // first token; a choice 0 that never does leaves them unstarted.
  const int before = backend_.started();
  std::thread hung([&] {
    httplib::Client client("127.0.0.1", server_->port());
    client.set_read_timeout(30, 0);
    (void)client.Post("/v1/completions", R"({"prompt": "hang", "n": 3})",
                      "application/json");
  });
  absl::Time until = absl::Now() + absl::Seconds(5);
  while (backend_.started() == before && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(backend_.started(), before + 1);
  server_->Stop();  // cancels the hung choice 0
  hung.join();
  EXPECT_TRUE(backend_.WaitIdle(absl::Seconds(5)));
  EXPECT_EQ(backend_.started(), before + 1);

  // Not staggered: all at once.
  HttpServerOptions all_at_once;
  all_at_once.stagger_choices = false;
  StartServer(&backend_, all_at_once);
  std::thread hung_all([&] {
    httplib::Client client("127.0.0.1", server_->port());
    client.set_read_timeout(30, 0);
    (void)client.Post("/v1/completions", R"({"prompt": "hang", "n": 3})",
                      "application/json");
  });
  until = absl::Now() + absl::Seconds(5);
  while (backend_.started() < before + 4 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(backend_.started(), before + 4);
  server_->Stop();
  hung_all.join();
  StartServer(&backend_);

  // A failing choice fails the request (the others are cancelled).
  ExpectError(Post("/v1/completions", R"({"prompt": "fail:invalid", "n": 2})"),
              400);
}

TEST_F(HttpServerTest, ChatStreamingAndNot) {
  auto res = Post("/v1/chat/completions",
                  R"({"messages": [{"role": "user", "content": "Hi"}],
                      "max_tokens": 2})");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  json body = json::parse(res->body);
  EXPECT_EQ(body["object"], "chat.completion");
  EXPECT_EQ(body["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(body["choices"][0]["message"]["content"], " w0 w1");
  EXPECT_EQ(backend_.last_request().prompt_text, "User: Hi\nAssistant:");

  auto streamed = Post("/v1/chat/completions",
                       R"({"messages": [{"role": "user", "content": "Hi"}],
                           "max_tokens": 2, "stream": true})");
  ASSERT_TRUE(streamed);
  ASSERT_EQ(streamed->status, 200);
  std::vector<std::string> events = Events(streamed->body);
  ASSERT_EQ(events.size(), 3u) << streamed->body;
  json first = json::parse(events[0]);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(first["choices"][0]["delta"]["content"], " w0");
  json last = json::parse(events[1]);
  EXPECT_FALSE(last["choices"][0]["delta"].contains("role"));
  EXPECT_EQ(last["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(events[2], "[DONE]");
}

TEST_F(HttpServerTest, ModelsAndHealth) {
  auto models = client_->Get("/v1/models");
  ASSERT_TRUE(models);
  ASSERT_EQ(models->status, 200);
  json body = json::parse(models->body);
  EXPECT_EQ(body["object"], "list");
  EXPECT_EQ(body["data"][0]["id"], "stories260K");
  EXPECT_EQ(body["data"][0]["object"], "model");

  auto health = client_->Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  backend_.set_health(absl::UnavailableError("no decode worker"));
  ExpectError(client_->Get("/health"), 503);
}

TEST_F(HttpServerTest, OneModelAndTheVersion) {
  auto model = client_->Get("/v1/models/stories260K");
  ASSERT_TRUE(model);
  ASSERT_EQ(model->status, 200) << model->body;
  json body = json::parse(model->body);
  EXPECT_EQ(body["id"], "stories260K");
  EXPECT_EQ(body["object"], "model");
  EXPECT_TRUE(body["created"].is_number_integer());
  EXPECT_EQ(body["owned_by"], "pdserve");
  EXPECT_NE(ExpectError(client_->Get("/v1/models/gpt-9"), 404).find("'gpt-9'"),
            std::string::npos);
  auto version = client_->Get("/version");
  ASSERT_TRUE(version);
  EXPECT_EQ(version->status, 200);
  EXPECT_TRUE(json::parse(version->body)["version"].is_string())
      << version->body;
}

TEST_F(HttpServerTest, WrongMethodOnAKnownPathIs405WithAllow) {
  for (const char* path :
       {"/v1/completions", "/v1/chat/completions", "/tokenize"}) {
    auto res = client_->Get(path);
    std::string message = ExpectError(res, 405);
    EXPECT_EQ(res->get_header_value("Allow"), "POST") << path;
    EXPECT_NE(message.find("POST"), std::string::npos) << message;
  }
  auto res = client_->Post("/v1/models", "{}", "application/json");
  ExpectError(res, 405);
  EXPECT_EQ(res->get_header_value("Allow"), "GET");
  res = client_->Delete("/v1/models/stories260K");
  ExpectError(res, 405);
  EXPECT_EQ(res->get_header_value("Allow"), "GET");
  // An unknown path stays 404.
  ExpectError(client_->Get("/v1/nothing"), 404);
}

TEST_F(HttpServerTest, TokenizeAndDetokenizeWithTheModelsTokenizer) {
#if defined(__SANITIZE_ADDRESS__)
  // The SentencePiece shim is opened without RTLD_DEEPBIND under ASan
  // (services/tokenizer/sentencepiece_backend.h), so its protobuf meets
  // gRPC's in this process and refuses to run; the release run covers this.
  GTEST_SKIP() << "SentencePiece cannot share an ASan process with gRPC";
#endif
  model::TokenizerSpec spec;
  spec.sentencepiece_model_path =
      ::pdserve::testing::Stories260KDir() + "/tokenizer.model";
  absl::StatusOr<std::unique_ptr<tokenizer::Tokenizer>> tok =
      tokenizer::Tokenizer::Create(spec);
  ASSERT_TRUE(tok.ok()) << tok.status();
  // Without a tokenizer (a dummy model): a clear 400.
  EXPECT_NE(ExpectError(Post("/tokenize", R"({"prompt": "Once"})"), 400)
                .find("no tokenizer"),
            std::string::npos);
  server_->Stop();
  HttpServerOptions options;
  options.tokenizer = tok->get();
  StartServer(&backend_, options);

  const std::string text = "Once upon a time";
  const std::vector<int32_t> expected = *(*tok)->Encode(text, true);
  auto res = Post("/tokenize", R"({"prompt": "Once upon a time"})");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  json body = json::parse(res->body);
  EXPECT_EQ(body["tokens"].get<std::vector<int32_t>>(), expected);
  EXPECT_EQ(body["count"], expected.size());
  EXPECT_TRUE(body["max_model_len"].is_number_integer());
  res = Post("/tokenize",
             R"({"prompt": "Once upon a time", "add_special_tokens": false})");
  ASSERT_TRUE(res);
  EXPECT_EQ(json::parse(res->body)["tokens"].get<std::vector<int32_t>>(),
            *(*tok)->Encode(text, false));
  // Chat messages: the prompt /v1/chat/completions would feed the model.
  res =
      Post("/tokenize", R"({"messages": [{"role": "user", "content": "Hi"}]})");
  ASSERT_TRUE(res);
  EXPECT_EQ(json::parse(res->body)["tokens"].get<std::vector<int32_t>>(),
            *(*tok)->Encode(RenderChatPrompt({{"user", "Hi"}}), true));

  res = Post("/detokenize", json{{"tokens", expected}}.dump());
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  EXPECT_EQ(json::parse(res->body)["prompt"], text);

  // Bad requests: precise 400s, never a 500.
  for (const char* bad :
       {R"({})", R"({"prompt": "a", "messages": []})", R"({"prompt": 5})",
        R"({"prompt": "a", "truncate_prompt_tokens": 3})", "{oops"}) {
    EXPECT_FALSE(ExpectError(Post("/tokenize", bad), 400).empty()) << bad;
  }
  for (const char* bad :
       {R"({})", R"({"tokens": [-1]})", R"({"tokens": "abc"})",
        R"({"tokens": [99999999]})"}) {
    EXPECT_FALSE(ExpectError(Post("/detokenize", bad), 400).empty()) << bad;
  }
  ExpectError(Post("/tokenize", R"({"model": "gpt-9", "prompt": "a"})"), 404);
}

TEST_F(HttpServerTest, BadRequestsGet400AndTheServerKeepsServing) {
  for (const char* body :
       {"{", "[]", "not json", "{\"prompt\": \"\"}",
        "{\"prompt\": \"a\", "
        "\"max_tokens\": 0}",
        "{\"prompt\": \"a\", \"temperature\": -1}",
        "{\"prompt\": \"a\", \"n\": 0}", "{\"prompt\": \"\xc3\x28\"}",
        "{\"model\": \"stories260K\"}"}) {
    std::string message = ExpectError(Post("/v1/completions", body), 400);
    EXPECT_FALSE(message.empty()) << body;
  }
  ExpectError(Post("/v1/chat/completions", "{\"messages\": []}"), 400);
  EXPECT_EQ(backend_.started(), 0);
  auto ok = Post("/v1/completions", R"({"prompt": "a", "max_tokens": 1})");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200);
}

TEST_F(HttpServerTest, UnknownModelIs404) {
  std::string message = ExpectError(
      Post("/v1/completions", R"({"model": "gpt-9", "prompt": "a"})"), 404);
  EXPECT_NE(message.find("gpt-9"), std::string::npos);
  auto res = Post("/v1/completions", R"({"model": "gpt-9", "prompt": "a"})");
  EXPECT_EQ(json::parse(res->body)["error"]["code"], "model_not_found");
}

TEST_F(HttpServerTest, BackendErrorsMapToStatusCodes) {
  const std::pair<const char*, int> cases[] = {{"fail:unavailable", 503},
                                               {"fail:exhausted", 429},
                                               {"fail:invalid", 400},
                                               {"fail:deadline", 504},
                                               {"fail:internal", 500}};
  for (const auto& [prompt, status] : cases) {
    for (bool stream : {false, true}) {
      json body = {{"prompt", prompt}, {"stream", stream}};
      ExpectError(Post("/v1/completions", body.dump()), status);
    }
  }
  backend_.set_start_error(absl::UnavailableError("nothing healthy"));
  ExpectError(Post("/v1/completions", R"({"prompt": "a"})"), 503);
}

TEST_F(HttpServerTest, MidStreamErrorIsAnSseErrorEvent) {
  auto res = Post("/v1/completions",
                  R"({"prompt": "midfail", "max_tokens": 8, "stream": true})");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200);
  std::vector<std::string> events = Events(res->body);
  ASSERT_EQ(events.size(), 4u) << res->body;
  json error = json::parse(events[2]);
  EXPECT_EQ(error["error"]["type"], "server_error");
  EXPECT_EQ(events[3], "[DONE]");
  // Not streaming: the whole request fails.
  ExpectError(Post("/v1/completions", R"({"prompt": "midfail",
                                          "max_tokens": 8})"),
              500);
}

// What a RejectionHook was told: "api code" per refusal.
class RejectionLog {
 public:
  RejectionHook Hook() {
    return [this](const std::string& api, absl::StatusCode code) {
      absl::MutexLock lock(&mu_);
      entries_.push_back(
          absl::StrCat(api, " ", absl::StatusCodeToString(code)));
    };
  }
  std::vector<std::string> entries() {
    absl::MutexLock lock(&mu_);
    return entries_;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> entries_;
};

// cpp-httplib refuses an oversized body itself, before our handler: the
// refusal still reaches the metrics hook, under the endpoint's api.
TEST_F(HttpServerTest, OversizedBodyIs413AndCounted) {
  server_->Stop();
  RejectionLog rejections;
  HttpServerOptions options;
  options.max_body_bytes = 1024;
  options.on_rejected = rejections.Hook();
  StartServer(&backend_, options);
  std::string prompt(4096, 'a');
  json body = {{"prompt", prompt}};
  ExpectError(Post("/v1/completions", body.dump()), 413);
  ExpectError(Post("/v1/chat/completions", body.dump()), 413);
  auto ok = Post("/v1/completions", R"({"prompt": "a", "max_tokens": 1})");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200);
  EXPECT_THAT(rejections.entries(),
              ::testing::ElementsAre("openai_completions RESOURCE_EXHAUSTED",
                                     "openai_chat RESOURCE_EXHAUSTED"));
}

TEST_F(HttpServerTest, UnknownPathIs404InOpenAiShapeAndCounted) {
  server_->Stop();
  RejectionLog rejections;
  HttpServerOptions options;
  options.on_rejected = rejections.Hook();
  StartServer(&backend_, options);
  ExpectError(client_->Get("/v1/nothing"), 404);
  // A handler's own refusal is counted once, by the handler.
  ExpectError(Post("/v1/completions", "{oops"), 400);
  // Answered requests are not refusals.
  ASSERT_TRUE(client_->Get("/v1/models"));
  EXPECT_THAT(rejections.entries(),
              ::testing::ElementsAre("http_other NOT_FOUND",
                                     "openai_completions INVALID_ARGUMENT"));
}

TEST_F(HttpServerTest, DeadlineIs504AndCancelsTheBackend) {
  server_->Stop();
  HttpServerOptions options;
  options.request_timeout = absl::Milliseconds(200);
  StartServer(&backend_, options);
  ExpectError(Post("/v1/completions", R"({"prompt": "hang"})"), 504);
  ExpectError(Post("/v1/completions", R"({"prompt": "hang", "stream": true})"),
              504);
}

TEST_F(HttpServerTest, AdmissionLimitIs429) {
  server_->Stop();
  AdmissionLimiter limiter(&backend_, 1);
  StartServer(&limiter);
  // One stream holds the only slot.
  std::atomic<bool> got_first{false};
  std::thread holder([&] {
    httplib::Client client("127.0.0.1", server_->port());
    client.set_read_timeout(30, 0);
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/completions";
    req.body = R"({"prompt": "hang", "stream": true})";
    req.set_header("Content-Type", "application/json");
    req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) {
      got_first = true;
      return true;
    };
    client.send(req);
  });
  absl::Time until = absl::Now() + absl::Seconds(5);
  while (limiter.in_flight() == 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(limiter.in_flight(), 1);
  std::string message =
      ExpectError(Post("/v1/completions", R"({"prompt": "a"})"), 429);
  EXPECT_NE(message.find("admission"), std::string::npos);
  ExpectError(Post("/v1/completions", R"({"prompt": "a", "n": 2})"), 429);
  // Stopping the server cancels the held stream.
  server_->Stop();
  holder.join();
  EXPECT_TRUE(backend_.WaitIdle(absl::Seconds(5)));
  EXPECT_EQ(limiter.in_flight(), 0);
}

TEST_F(HttpServerTest, ClientDisconnectCancelsTheGeneration) {
  server_->Stop();
  FakeBackend slow(absl::Milliseconds(20));
  StartServer(&slow);
  int chunks = 0;
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = R"({"prompt": "slow", "max_tokens": 1000, "stream": true})";
  req.set_header("Content-Type", "application/json");
  req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) {
    return ++chunks < 3;  // hang up after a few chunks
  };
  client_->send(req);
  EXPECT_TRUE(slow.WaitIdle(absl::Seconds(10)));
  EXPECT_EQ(slow.cancelled(), 1);
  server_->Stop();
}

TEST_F(HttpServerTest, ConcurrentStreams) {
  constexpr int kStreams = 64;
  std::vector<std::thread> threads;
  std::atomic<int> good{0};
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] {
      httplib::Client client("127.0.0.1", server_->port());
      client.set_read_timeout(30, 0);
      json body = {
          {"prompt", "x"}, {"max_tokens", 1 + i % 5}, {"stream", true}};
      auto res =
          client.Post("/v1/completions", body.dump(), "application/json");
      if (res && res->status == 200 &&
          res->body.find("data: [DONE]\n\n") != std::string::npos) {
        good++;
      } else {
        ADD_FAILURE() << "stream " << i << ": "
                      << (res ? absl::StrCat(res->status, " ", res->body)
                              : httplib::to_string(res.error()));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(good.load(), kStreams);
}

// With API keys every /v1/ route needs "Authorization: Bearer <key>" (401 in
// OpenAI's error shape otherwise, counted as UNAUTHENTICATED); /health stays
// open for probes.
TEST_F(HttpServerTest, ApiKeysKeepOutCallersWithoutOne) {
  server_->Stop();
  auto keys =
      rpc::BearerTokens::Of({"key-0123456789abcdef", "another-key-0123456"});
  ASSERT_TRUE(keys.ok()) << keys.status();
  std::vector<absl::StatusCode> rejected;
  absl::Mutex mu;
  HttpServerOptions options;
  options.api_keys = &*keys;
  options.on_rejected = [&](const std::string&, absl::StatusCode code) {
    absl::MutexLock lock(&mu);
    rejected.push_back(code);
  };
  StartServer(&backend_, options);
  const std::string body = R"({"prompt": "Once", "max_tokens": 2})";
  std::string message = ExpectError(
      client_->Post("/v1/completions", body, "application/json"), 401);
  EXPECT_NE(message.find("Authorization: Bearer"), std::string::npos)
      << message;
  httplib::Headers wrong = {{"Authorization", "Bearer not-the-key-at-all"}};
  ExpectError(client_->Post("/v1/completions", wrong, body, "application/json"),
              401);
  EXPECT_EQ(client_->Get("/v1/models")->status, 401);
  for (const char* key : {"key-0123456789abcdef", "another-key-0123456"}) {
    httplib::Headers good = {{"Authorization", absl::StrCat("Bearer ", key)}};
    auto res = client_->Post("/v1/completions", good, body, "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 200) << res->body;
  }
  EXPECT_EQ(client_->Get("/health")->status, 200);
  absl::MutexLock lock(&mu);
  EXPECT_EQ(rejected, std::vector<absl::StatusCode>(
                          3, absl::StatusCode::kUnauthenticated));
}

}  // namespace
}  // namespace pdserve::router

namespace pdserve::router {
namespace {

// A raw keep-alive HTTP/1.1 connection: what a pooled client holds.
class RawConnection {
 public:
  explicit RawConnection(int port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(port));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = connect(fd_, reinterpret_cast<sockaddr*>(&address),
                         sizeof(address)) == 0;
    timeval timeout{5, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  }
  ~RawConnection() { close(fd_); }
  bool connected() const { return connected_; }
  // One GET on this connection; the response's head and body, "" when the
  // server had closed it (what a client sees as a broken pipe or reset).
  std::string Get(const std::string& path) {
    const std::string request =
        absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: x\r\n\r\n");
    if (send(fd_, request.data(), request.size(), MSG_NOSIGNAL) !=
        static_cast<ssize_t>(request.size())) {
      return "";
    }
    std::string response;
    char buffer[4096];
    while (true) {
      const ssize_t n = recv(fd_, buffer, sizeof(buffer), 0);
      if (n <= 0) return response;
      response.append(buffer, static_cast<size_t>(n));
      const size_t head_end = response.find("\r\n\r\n");
      if (head_end == std::string::npos) continue;
      const size_t at = response.find("Content-Length: ");
      if (at == std::string::npos || at > head_end) return response;
      const size_t length = std::stoul(response.substr(at + 16));
      if (response.size() >= head_end + 4 + length) return response;
    }
  }
  // Whether the server ended the connection (EOF) within `timeout`.
  bool ClosedWithin(absl::Duration timeout) {
    timeval t = absl::ToTimeval(timeout);
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &t, sizeof(t));
    char byte;
    return recv(fd_, &byte, 1, 0) == 0;
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

// An idle pooled connection stays usable across a client's pause (the 1 s
// timeout it had failed a third of a paced load: the server closed
// connections as their next request went out), and Stop() still ends at
// once with such connections open.
TEST(HttpKeepAliveTest, IdleConnectionsOutliveClientPausesAndStopIsPrompt) {
  FakeBackend backend;
  HttpServerOptions options;
  options.keep_alive = absl::Seconds(30);
  auto server = OpenAiHttpServer::Start(options, &backend);
  ASSERT_TRUE(server.ok()) << server.status();
  RawConnection connection((*server)->port());
  ASSERT_TRUE(connection.connected());
  std::string first = connection.Get("/health");
  EXPECT_TRUE(absl::StartsWith(first, "HTTP/1.1 200")) << first;
  EXPECT_NE(first.find("Keep-Alive: timeout=30"), std::string::npos) << first;
  absl::SleepFor(absl::Milliseconds(1500));
  std::string second = connection.Get("/health");
  EXPECT_TRUE(absl::StartsWith(second, "HTTP/1.1 200")) << second;
  const absl::Time stop = absl::Now();
  (*server)->Stop();
  EXPECT_LT(absl::Now() - stop, absl::Seconds(2));
  EXPECT_TRUE(connection.ClosedWithin(absl::Seconds(1)));
}

// A draining router asks its clients to reconnect (to another replica).
TEST(HttpKeepAliveTest, DrainingServerClosesConnectionsAfterEachResponse) {
  FakeBackend backend;
  std::atomic<bool> draining{false};
  HttpServerOptions options;
  options.draining = [&draining] { return draining.load(); };
  auto server = OpenAiHttpServer::Start(options, &backend);
  ASSERT_TRUE(server.ok()) << server.status();
  RawConnection connection((*server)->port());
  std::string before = connection.Get("/v1/models");
  EXPECT_EQ(before.find("Connection: close"), std::string::npos) << before;
  draining.store(true);
  std::string during = connection.Get("/v1/models");
  EXPECT_NE(during.find("Connection: close"), std::string::npos) << during;
  // (The client closes on that header; Stop() ends what a client keeps.)
  (*server)->Stop();
  EXPECT_TRUE(connection.ClosedWithin(absl::Seconds(1)));
}

}  // namespace
}  // namespace pdserve::router
