// The public gRPC Generation service through a real channel to a
// RunningServer on 127.0.0.1:0, over the fake backend: streaming, unary,
// ListModels, health, status codes, cancellation reaching the backend, and
// deadlines.
#include "router/generation_service.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/synchronization/notification.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "router/admission_limiter.h"
#include "rpc/auth.h"
#include "rpc/server.h"
#include "tests/router/fake_backend.h"

namespace pdserve::router {
namespace {

using testing::FakeBackend;

class GenerationServiceTest : public ::testing::Test {
 protected:
  void Start(GenerationBackend* backend) {
    service_ = std::make_unique<GenerationService>(backend);
    absl::StatusOr<std::unique_ptr<rpc::RunningServer>> server =
        rpc::RunningServer::Start("127.0.0.1:0", {service_.get()});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    channel_ = grpc::CreateChannel(server_->address(),
                                   grpc::InsecureChannelCredentials());
    stub_ = v1::Generation::NewStub(channel_);
  }
  void SetUp() override { Start(&backend_); }
  void TearDown() override {
    EXPECT_TRUE(backend_.WaitIdle(absl::Seconds(10)));
    server_.reset();
  }

  static v1::GenerateRequest Request(const std::string& text, int max_tokens) {
    v1::GenerateRequest request;
    request.set_text(text);
    request.set_max_tokens(max_tokens);
    return request;
  }

  // Reads a whole stream; the items and the final status.
  std::pair<std::vector<v1::GenerateResponse>, grpc::Status> ReadAll(
      const v1::GenerateRequest& request,
      absl::Duration timeout = absl::Seconds(30)) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    auto reader = stub_->Generate(&context, request);
    std::vector<v1::GenerateResponse> items;
    v1::GenerateResponse item;
    while (reader->Read(&item)) items.push_back(item);
    return {items, reader->Finish()};
  }

  FakeBackend backend_;
  std::unique_ptr<GenerationService> service_;
  std::unique_ptr<rpc::RunningServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Generation::Stub> stub_;
};

TEST_F(GenerationServiceTest, StreamsDeltasWithTheSummaryOnTheLastItem) {
  v1::GenerateRequest request = Request("Once upon", 5);
  request.set_request_id("my-id");
  request.mutable_sampling()->set_temperature(0.7f);
  request.mutable_sampling()->set_seed(9);
  request.add_stop("\n");
  auto [items, status] = ReadAll(request);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(items.size(), 5u);
  std::string text;
  for (size_t i = 0; i < items.size(); ++i) {
    EXPECT_EQ(items[i].request_id(), "my-id");
    ASSERT_EQ(items[i].token_ids_size(), 1);
    EXPECT_EQ(items[i].token_ids(0), 100 + static_cast<int>(i));
    text += items[i].text();
    if (i + 1 < items.size()) {
      EXPECT_EQ(items[i].finish_reason(), v1::FINISH_REASON_UNSPECIFIED);
      EXPECT_FALSE(items[i].has_usage());
    }
  }
  EXPECT_EQ(text, " w0 w1 w2 w3 w4");
  EXPECT_EQ(items.back().finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(items.back().usage().completion_tokens(), 5);
  EXPECT_EQ(items.back().usage().prompt_tokens(), 9);
  EXPECT_GT(items.back().timing().time_to_first_token_seconds(), 0);
  GenerationRequest seen = backend_.last_request();
  EXPECT_EQ(seen.model, "stories260K");
  EXPECT_FLOAT_EQ(seen.sampling.temperature, 0.7f);
  EXPECT_FLOAT_EQ(seen.sampling.top_p, 1.0f);  // 0 on the wire = off
  EXPECT_EQ(seen.sampling.seed, 9u);
  EXPECT_EQ(seen.stop, std::vector<std::string>{"\n"});
  EXPECT_LT(seen.deadline, absl::InfiniteFuture());
}

TEST_F(GenerationServiceTest, LogprobsAndAlternativesPerToken) {
  v1::GenerateRequest request = Request("x", 3);
  request.set_include_logprobs(true);
  request.set_top_logprobs(2);
  auto [items, status] = ReadAll(request);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(items.size(), 3u);
  for (size_t i = 0; i < items.size(); ++i) {
    ASSERT_EQ(items[i].logprobs_size(), 1);
    EXPECT_FLOAT_EQ(items[i].logprobs(0), -0.25f * (i + 1));
    ASSERT_EQ(items[i].top_logprobs_size(), 1);
    const v1::TopLogprobs& top = items[i].top_logprobs(0);
    ASSERT_EQ(top.alternatives_size(), 2);
    EXPECT_EQ(top.alternatives(1).token_id(), 100 + static_cast<int>(i) + 1);
    EXPECT_FLOAT_EQ(top.alternatives(1).logprob(), -0.25f * (i + 1) - 1);
  }
  EXPECT_TRUE(backend_.last_request().logprobs);
  EXPECT_EQ(backend_.last_request().top_logprobs, 2);

  // Unary: the same, accumulated; logprobs alone: no alternatives.
  request.set_top_logprobs(0);
  grpc::ClientContext context;
  v1::GenerateResponse unary;
  ASSERT_TRUE(stub_->GenerateUnary(&context, request, &unary).ok());
  EXPECT_EQ(unary.logprobs_size(), 3);
  EXPECT_EQ(unary.top_logprobs_size(), 0);
  // Not asked: nothing.
  auto [plain, plain_status] = ReadAll(Request("x", 2));
  ASSERT_TRUE(plain_status.ok());
  for (const auto& item : plain) EXPECT_EQ(item.logprobs_size(), 0);
}

TEST_F(GenerationServiceTest, EchoCarriesThePromptAndItsScores) {
  // Scoring only: one item, the prompt's numbers, nothing generated.
  v1::GenerateRequest request = Request("abc", 0);
  request.set_echo(true);
  request.set_include_logprobs(true);
  request.set_top_logprobs(1);
  auto [items, status] = ReadAll(request);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(items.size(), 1u);
  const v1::PromptEcho& echo = items[0].echo();
  EXPECT_EQ(echo.text(), "abc");
  EXPECT_EQ(
      std::vector<int32_t>(echo.token_ids().begin(), echo.token_ids().end()),
      (std::vector<int32_t>{1000, 1001, 1002}));
  ASSERT_EQ(echo.logprobs_size(), 2);
  EXPECT_FLOAT_EQ(echo.logprobs(1), -1.0f);
  ASSERT_EQ(echo.top_logprobs_size(), 2);
  EXPECT_EQ(echo.top_logprobs(0).alternatives(0).token_id(), 2000);
  EXPECT_EQ(items[0].token_ids_size(), 0);
  EXPECT_EQ(items[0].finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_TRUE(backend_.last_request().echo);
  EXPECT_EQ(backend_.last_request().max_tokens, 0);

  // With a continuation: the echo rides on the first item only; without
  // logprobs it is the text alone.
  request = Request("ab", 2);
  request.set_echo(true);
  auto [streamed, streamed_status] = ReadAll(request);
  ASSERT_TRUE(streamed_status.ok()) << streamed_status.error_message();
  ASSERT_EQ(streamed.size(), 2u);
  EXPECT_EQ(streamed[0].echo().text(), "ab");
  EXPECT_EQ(streamed[0].echo().token_ids_size(), 0);
  EXPECT_EQ(streamed[0].token_ids_size(), 1);
  EXPECT_FALSE(streamed[1].has_echo());
  grpc::ClientContext context;
  v1::GenerateResponse unary;
  ASSERT_TRUE(stub_->GenerateUnary(&context, request, &unary).ok());
  EXPECT_EQ(unary.echo().text(), "ab");
  EXPECT_EQ(unary.token_ids_size(), 2);
}

TEST_F(GenerationServiceTest, UnsetSeedIsFreshPerRequestAndZeroIsKept) {
  v1::GenerateRequest request = Request("x", 1);
  request.mutable_sampling()->set_temperature(1.0f);
  ASSERT_TRUE(ReadAll(request).second.ok());
  const uint64_t first = backend_.last_request().sampling.seed;
  ASSERT_TRUE(ReadAll(request).second.ok());
  // Two draws of a 64-bit generator: equal only by a 2^-64 accident.
  EXPECT_NE(backend_.last_request().sampling.seed, first);
  request.mutable_sampling()->set_seed(0);  // explicitly 0: reproducible
  ASSERT_TRUE(ReadAll(request).second.ok());
  EXPECT_EQ(backend_.last_request().sampling.seed, 0u);
}

TEST_F(GenerationServiceTest, TokenIdPromptsAndDefaults) {
  v1::GenerateRequest request;
  request.mutable_token_ids()->add_ids(1);
  request.mutable_token_ids()->add_ids(42);
  auto [items, status] = ReadAll(request);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(items.size(), 16u);  // max_tokens unset = 16
  EXPECT_FALSE(items[0].request_id().empty());
  EXPECT_EQ(backend_.last_request().prompt_ids, (std::vector<int32_t>{1, 42}));
  EXPECT_FALSE(backend_.last_request().ignore_eos);
  request.set_ignore_eos(true);
  ASSERT_TRUE(ReadAll(request).second.ok());
  EXPECT_TRUE(backend_.last_request().ignore_eos);
}

TEST_F(GenerationServiceTest, UnaryAndListModels) {
  grpc::ClientContext context;
  v1::GenerateResponse response;
  grpc::Status status =
      stub_->GenerateUnary(&context, Request("stop", 10), &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.text(), " w0");
  EXPECT_EQ(response.finish_reason(), v1::FINISH_REASON_STOP);
  EXPECT_EQ(response.usage().completion_tokens(), 1);

  grpc::ClientContext context2;
  v1::GenerateResponse many;
  ASSERT_TRUE(stub_->GenerateUnary(&context2, Request("x", 4), &many).ok());
  EXPECT_EQ(many.text(), " w0 w1 w2 w3");
  EXPECT_EQ(many.token_ids_size(), 4);

  grpc::ClientContext context3;
  v1::ListModelsResponse models;
  ASSERT_TRUE(
      stub_->ListModels(&context3, v1::ListModelsRequest(), &models).ok());
  ASSERT_EQ(models.models_size(), 1);
  EXPECT_EQ(models.models(0).name(), "stories260K");
  EXPECT_EQ(models.models(0).context_length(), 512);
}

TEST_F(GenerationServiceTest, HealthAndReflectionServed) {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext context;
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  ASSERT_TRUE(health->Check(&context, request, &response).ok());
  EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);
}

TEST_F(GenerationServiceTest, BadRequestsAreInvalidArgument) {
  std::vector<v1::GenerateRequest> bad;
  bad.push_back(v1::GenerateRequest());  // no prompt
  bad.push_back(Request("", 4));
  // (Invalid UTF-8 in `text` never reaches us: protobuf refuses to parse a
  // string field holding it.)
  bad.push_back(Request("a", -1));
  v1::GenerateRequest temp = Request("a", 4);
  temp.mutable_sampling()->set_temperature(-1);
  bad.push_back(temp);
  v1::GenerateRequest top_p = Request("a", 4);
  top_p.mutable_sampling()->set_top_p(1.5f);
  bad.push_back(top_p);
  v1::GenerateRequest top_k = Request("a", 4);
  top_k.mutable_sampling()->set_top_k(-2);
  bad.push_back(top_k);
  v1::GenerateRequest empty_ids;
  empty_ids.mutable_token_ids();
  bad.push_back(empty_ids);
  v1::GenerateRequest stop = Request("a", 4);
  stop.add_stop("");
  bad.push_back(stop);
  v1::GenerateRequest top_alone = Request("a", 4);
  top_alone.set_top_logprobs(2);  // without include_logprobs
  bad.push_back(top_alone);
  v1::GenerateRequest top_many = Request("a", 4);
  top_many.set_include_logprobs(true);
  top_many.set_top_logprobs(21);
  bad.push_back(top_many);
  bad.push_back(Request("a", 0));  // generate nothing: only with echo
  for (const v1::GenerateRequest& request : bad) {
    auto [items, status] = ReadAll(request);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << request.DebugString();
    EXPECT_TRUE(items.empty());
    grpc::ClientContext context;
    v1::GenerateResponse response;
    EXPECT_EQ(stub_->GenerateUnary(&context, request, &response).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  v1::GenerateRequest model = Request("a", 4);
  model.set_model("gpt-9");
  EXPECT_EQ(ReadAll(model).second.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(backend_.started(), 0);
  // Still serving.
  EXPECT_TRUE(ReadAll(Request("a", 2)).second.ok());
}

TEST_F(GenerationServiceTest, BackendStatusesPassThrough) {
  EXPECT_EQ(ReadAll(Request("fail:unavailable", 4)).second.error_code(),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(ReadAll(Request("fail:exhausted", 4)).second.error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  auto [items, status] = ReadAll(Request("midfail", 8));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_EQ(items.size(), 2u);
  backend_.set_start_error(absl::UnavailableError("nothing healthy"));
  EXPECT_EQ(ReadAll(Request("a", 2)).second.error_code(),
            grpc::StatusCode::UNAVAILABLE);
  grpc::ClientContext context;
  v1::GenerateResponse response;
  EXPECT_EQ(
      stub_->GenerateUnary(&context, Request("a", 2), &response).error_code(),
      grpc::StatusCode::UNAVAILABLE);
}

TEST_F(GenerationServiceTest, ClientCancelReachesTheBackend) {
  grpc::ClientContext context;
  auto reader = stub_->Generate(&context, Request("hang", 4));
  absl::Time until = absl::Now() + absl::Seconds(5);
  while (backend_.active() == 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(backend_.active(), 1);
  context.TryCancel();
  v1::GenerateResponse item;
  EXPECT_FALSE(reader->Read(&item));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(backend_.WaitIdle(absl::Seconds(5)));
  EXPECT_EQ(backend_.cancelled(), 1);
}

TEST_F(GenerationServiceTest, CancelMidStreamWhileWritesAreInFlight) {
  FakeBackend fast(absl::Microseconds(50));
  service_.reset();
  server_.reset();
  Start(&fast);
  for (int round = 0; round < 20; ++round) {
    grpc::ClientContext context;
    auto reader = stub_->Generate(&context, Request("x", 100000));
    v1::GenerateResponse item;
    for (int i = 0; i < round && reader->Read(&item); ++i) {
    }
    context.TryCancel();
    while (reader->Read(&item)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  EXPECT_TRUE(fast.WaitIdle(absl::Seconds(10)));
  // A call cancelled before the server saw it never reaches the backend;
  // every one that did was cancelled there.
  EXPECT_GE(fast.started(), 19);
  EXPECT_EQ(fast.cancelled(), fast.started());
  server_.reset();
}

TEST_F(GenerationServiceTest, DeadlineEndsTheCallAndTheBackendWork) {
  auto [items, status] = ReadAll(Request("hang", 4), absl::Milliseconds(200));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_TRUE(backend_.WaitIdle(absl::Seconds(5)));

  grpc::ClientContext context;
  context.set_deadline(
      absl::ToChronoTime(absl::Now() + absl::Milliseconds(200)));
  v1::GenerateResponse response;
  EXPECT_EQ(stub_->GenerateUnary(&context, Request("hang", 4), &response)
                .error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_TRUE(backend_.WaitIdle(absl::Seconds(5)));
}

TEST_F(GenerationServiceTest, AdmissionLimitIsResourceExhausted) {
  AdmissionLimiter limiter(&backend_, 2);
  service_.reset();
  server_.reset();
  Start(&limiter);
  grpc::ClientContext c1, c2;
  auto r1 = stub_->Generate(&c1, Request("hang", 4));
  auto r2 = stub_->Generate(&c2, Request("hang", 4));
  absl::Time until = absl::Now() + absl::Seconds(5);
  while (limiter.in_flight() < 2 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(limiter.in_flight(), 2);
  EXPECT_EQ(ReadAll(Request("a", 2)).second.error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  c1.TryCancel();
  c2.TryCancel();
  r1->Finish();
  r2->Finish();
  EXPECT_TRUE(backend_.WaitIdle(absl::Seconds(5)));
  EXPECT_EQ(limiter.in_flight(), 0);
  EXPECT_TRUE(ReadAll(Request("a", 2)).second.ok());
  server_.reset();
}

TEST_F(GenerationServiceTest, ManyConcurrentStreams) {
  constexpr int kStreams = 32;
  std::vector<std::thread> threads;
  std::atomic<int> good{0};
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] {
      auto [items, status] = ReadAll(Request("x", 1 + i % 7));
      if (status.ok() && static_cast<int>(items.size()) == 1 + i % 7) good++;
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(good.load(), kStreams);
}

// With API keys, every Generation call carries "authorization: Bearer
// <key>" or gets UNAUTHENTICATED before the backend sees it.
// Raw bytes through gRPC's generic stub (a client that does not speak
// protobuf, or a corrupted message): the status for `bytes` sent to
// /pdserve.v1.Generation/`method`, unary or streaming.
grpc::Status SendBytes(const std::shared_ptr<grpc::Channel>& channel,
                       const std::string& method, const std::string& bytes,
                       bool streaming) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  grpc::Slice slice(bytes);
  grpc::ByteBuffer request(&slice, 1);
  const std::string path = "/pdserve.v1.Generation/" + method;
  if (!streaming) {
    grpc::ByteBuffer response;
    absl::Notification done;
    grpc::Status status;
    stub.UnaryCall(&context, path, grpc::StubOptions(), &request, &response,
                   [&](grpc::Status s) {
                     status = std::move(s);
                     done.Notify();
                   });
    done.WaitForNotification();
    return status;
  }
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(&context, path, &cq);
  void* tag = nullptr;
  bool ok = false;
  call->StartCall(reinterpret_cast<void*>(1));
  cq.Next(&tag, &ok);
  call->Write(request, reinterpret_cast<void*>(2));
  cq.Next(&tag, &ok);
  call->WritesDone(reinterpret_cast<void*>(3));
  cq.Next(&tag, &ok);
  grpc::ByteBuffer item;
  do {
    call->Read(&item, reinterpret_cast<void*>(4));
    cq.Next(&tag, &ok);
  } while (ok);
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return status;
}

// gRPC's own parsing answers undecodable requests with UNIMPLEMENTED and no
// message (issue 21); the service parses them itself and says what is wrong.
TEST_F(GenerationServiceTest,
       UndecodableRequestsAreInvalidArgumentWithAMessage) {
  const std::string garbage("\xff\xff\xff\xff\x0f not protobuf");
  for (const bool streaming : {false, true}) {
    SCOPED_TRACE(streaming ? "Generate" : "GenerateUnary");
    const grpc::Status status = SendBytes(
        channel_, streaming ? "Generate" : "GenerateUnary", garbage, streaming);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(status.error_message().find("pdserve.v1.GenerateRequest"),
              std::string::npos)
        << status.error_message();
  }
  // And the service still serves.
  auto [items, status] = ReadAll(Request("Once", 2));
  EXPECT_TRUE(status.ok()) << status.error_message();
}

// A client built from a newer .proto sets a field this server does not know:
// refused naming the field, never answered as if it had not been sent (top
// level and inside a nested message).
TEST_F(GenerationServiceTest, FieldsThisServerDoesNotKnowAreRefused) {
  const std::string valid = Request("Once", 2).SerializeAsString();
  // Field 999, varint 1: tag (999 << 3 | 0) as a varint, then the value.
  const std::string unknown_field = std::string("\xb8\x3e\x01", 3);
  v1::GenerateRequest with_sampling = Request("Once", 2);
  with_sampling.mutable_sampling()->set_temperature(0.5);
  std::string nested = with_sampling.sampling().SerializeAsString();
  nested += unknown_field;
  v1::GenerateRequest outer = Request("Once", 2);
  const std::string nested_bytes =
      outer.SerializeAsString() + std::string("\x32", 1) +
      std::string(1, static_cast<char>(nested.size())) + nested;
  for (const bool streaming : {false, true}) {
    SCOPED_TRACE(streaming ? "Generate" : "GenerateUnary");
    const char* method = streaming ? "Generate" : "GenerateUnary";
    grpc::Status status =
        SendBytes(channel_, method, valid + unknown_field, streaming);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(status.error_message().find(
                  "field number 999 of pdserve.v1.GenerateRequest"),
              std::string::npos)
        << status.error_message();
    status = SendBytes(channel_, method, nested_bytes, streaming);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(status.error_message().find("field number 999 of "
                                          "pdserve.v1.SamplingParams"),
              std::string::npos)
        << status.error_message();
    // The same bytes without the stranger field are served.
    EXPECT_TRUE(SendBytes(channel_, method, valid, streaming).ok());
  }
}

TEST_F(GenerationServiceTest, ApiKeysKeepOutCallersWithoutOne) {
  server_.reset();
  auto keys = rpc::BearerTokens::Of({"key-0123456789abcdef"});
  ASSERT_TRUE(keys.ok()) << keys.status();
  service_ = std::make_unique<GenerationService>(&backend_, nullptr, &*keys);
  auto server = rpc::RunningServer::Start("127.0.0.1:0", {service_.get()});
  ASSERT_TRUE(server.ok()) << server.status();
  server_ = *std::move(server);
  stub_ = v1::Generation::NewStub(grpc::CreateChannel(
      server_->address(), grpc::InsecureChannelCredentials()));
  auto [items, status] = ReadAll(Request("Once", 2));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(items.empty());
  {
    grpc::ClientContext context;
    v1::GenerateResponse response;
    EXPECT_EQ(stub_->GenerateUnary(&context, Request("Once", 2), &response)
                  .error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    grpc::ClientContext list_context;
    v1::ListModelsResponse models;
    EXPECT_EQ(stub_->ListModels(&list_context, v1::ListModelsRequest(), &models)
                  .error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  // A stranger's undecodable bytes: UNAUTHENTICATED, not a parse error.
  EXPECT_EQ(SendBytes(grpc::CreateChannel(server_->address(),
                                          grpc::InsecureChannelCredentials()),
                      "GenerateUnary", "\xff\xff", false)
                .error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  // A channel that sends the key on every call.
  stub_ = v1::Generation::NewStub(
      rpc::CreateChannel(server_->address(), "key-0123456789abcdef"));
  auto [good_items, good_status] = ReadAll(Request("Once", 2));
  EXPECT_TRUE(good_status.ok()) << good_status.error_message();
  EXPECT_FALSE(good_items.empty());
}

}  // namespace
}  // namespace pdserve::router
