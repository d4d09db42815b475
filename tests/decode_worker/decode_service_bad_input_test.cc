// Bad requests to the decode worker's gRPC service get precise status codes,
// and the server keeps serving (a golden request afterwards still streams
// golden tokens).
#include <thread>
#include <vector>

#include "decode_service_test_util.h"

namespace pdserve::decode_worker {
namespace {

using namespace testing_util;  // NOLINT

grpc::StatusCode AdmitCode(Server& server, const v1::AdmitRequest& req) {
  v1::AdmitResponse resp;
  return Admit(server.stub(), req, &resp).error_code();
}

grpc::StatusCode KvCompleteCode(Server& server, uint64_t id, int32_t token) {
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(30));
  v1::KvCompleteRequest req;
  req.set_request_id(id);
  req.set_first_token(token);
  v1::KvCompleteResponse resp;
  return server.stub().KvComplete(&ctx, req, &resp).error_code();
}

grpc::StatusCode AbortCode(Server& server, uint64_t id) {
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(30));
  v1::AbortRequest req;
  req.set_request_id(id);
  v1::AbortResponse resp;
  return server.stub().Abort(&ctx, req, &resp).error_code();
}

TEST(DecodeServiceBadInputTest, PreciseCodesAndTheServerKeepsServing) {
  Server server(/*tp=*/2, absl::Seconds(30), 128,
                /*kv_complete_timeout=*/absl::Seconds(1));
  const int64_t baseline = server.Load().kv_blocks_used();
  const auto c = AllGoldenCases().front();
  using grpc::StatusCode;

  EXPECT_EQ(AdmitCode(server, MakeAdmit(1, {}, 8)),
            StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(AdmitCode(server, MakeAdmit(1, {1, 100000}, 8)),
            StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(AdmitCode(server, MakeAdmit(1, {1, -3}, 8)),
            StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(AdmitCode(server, MakeAdmit(1, c.prompt_ids, -5)),
            StatusCode::INVALID_ARGUMENT);
  {
    auto req = MakeAdmit(1, c.prompt_ids, 8);
    req.mutable_sampling()->set_temperature(-1);
    EXPECT_EQ(AdmitCode(server, req), StatusCode::INVALID_ARGUMENT);
  }
  {
    auto req = MakeAdmit(1, c.prompt_ids, 8);
    req.mutable_sampling()->set_top_p(1.5f);
    EXPECT_EQ(AdmitCode(server, req), StatusCode::INVALID_ARGUMENT);
  }
  {
    auto req = MakeAdmit(1, c.prompt_ids, 8);
    req.mutable_sampling()->set_top_k(-2);
    EXPECT_EQ(AdmitCode(server, req), StatusCode::INVALID_ARGUMENT);
  }
  {
    auto req = MakeAdmit(1, c.prompt_ids, 8);
    req.add_stop("");
    EXPECT_EQ(AdmitCode(server, req), StatusCode::INVALID_ARGUMENT);
  }
  {
    // Prompt scores of a remote prefill come from the prefill group.
    auto req = MakeAdmit(1, c.prompt_ids, 8);
    req.set_include_prompt_logprobs(true);
    EXPECT_EQ(AdmitCode(server, req), StatusCode::INVALID_ARGUMENT);
  }
  // More tokens than the context.
  EXPECT_EQ(AdmitCode(server, MakeAdmit(1, c.prompt_ids, 1 << 20)),
            StatusCode::INVALID_ARGUMENT);
  // Nothing was admitted by any of those.
  EXPECT_EQ(server.Load().kv_blocks_used(), baseline);
  EXPECT_EQ(server.service().channels(), 0);

  // Unknown ids.
  EXPECT_EQ(KvCompleteCode(server, 424242, 5), StatusCode::NOT_FOUND);
  EXPECT_EQ(AbortCode(server, 424242), StatusCode::NOT_FOUND);
  {
    Streamed s = ReadStream(server.stub(), 424242);
    EXPECT_EQ(s.status.error_code(), StatusCode::NOT_FOUND);
    EXPECT_EQ(s.deltas, 0);
  }

  // A live id twice; a second stream; completion twice; a bad first token.
  v1::AdmitResponse admit;
  ASSERT_TRUE(
      Admit(server.stub(), MakeAdmit(2, c.prompt_ids, c.max_new_tokens), &admit)
          .ok());
  EXPECT_EQ(AdmitCode(server, MakeAdmit(2, c.prompt_ids, 8)),
            StatusCode::ALREADY_EXISTS);
  {
    TestPrefill prefill;
    ASSERT_TRUE(prefill.Run(server.stub(), 2, c.prompt_ids, admit).ok());
    EXPECT_EQ(KvCompleteCode(server, 2, 5), StatusCode::FAILED_PRECONDITION);
    Streamed s = ReadStream(server.stub(), 2);
    EXPECT_TRUE(s.status.ok()) << s.status.error_message();
    EXPECT_EQ(s.tokens, c.greedy_ids);
    // The stream was consumed: the id is gone.
    Streamed again = ReadStream(server.stub(), 2);
    EXPECT_EQ(again.status.error_code(), StatusCode::NOT_FOUND);
    EXPECT_EQ(AbortCode(server, 2), StatusCode::NOT_FOUND);
  }
  {
    // Two streams for one request: the second is refused, the first works.
    v1::AdmitResponse a3;
    ASSERT_TRUE(Admit(server.stub(), MakeAdmit(3, c.prompt_ids, 8), &a3).ok());
    grpc::ClientContext ctx1;
    ctx1.set_deadline(Deadline(60));
    v1::StreamTokensRequest sr;
    sr.set_request_id(3);
    auto first = server.stub().StreamTokens(&ctx1, sr);
    // The first stream attaches asynchronously: retry (bounded) until the
    // second one is refused.
    grpc::StatusCode second = StatusCode::OK;
    for (int i = 0; i < 100 && second != StatusCode::ALREADY_EXISTS; ++i) {
      absl::SleepFor(absl::Milliseconds(20));
      grpc::ClientContext ctx2;
      ctx2.set_deadline(Deadline(5));
      auto r2 = server.stub().StreamTokens(&ctx2, sr);
      v1::DecodeDelta ignored;
      while (r2->Read(&ignored)) {
      }
      second = r2->Finish().error_code();
    }
    EXPECT_EQ(second, StatusCode::ALREADY_EXISTS);
    TestPrefill prefill;
    ASSERT_TRUE(prefill.Run(server.stub(), 3, c.prompt_ids, a3).ok());
    v1::DecodeDelta d;
    std::vector<int32_t> tokens;
    while (first->Read(&d))
      tokens.insert(tokens.end(), d.token_ids().begin(), d.token_ids().end());
    EXPECT_TRUE(first->Finish().ok());
    EXPECT_EQ(tokens.size(), 8u);
  }
  {
    // The KV arrived but the first token is outside the vocabulary: the
    // request is failed and freed.
    v1::AdmitResponse a4;
    ASSERT_TRUE(Admit(server.stub(), MakeAdmit(4, c.prompt_ids, 8), &a4).ok());
    TestPrefill prefill;
    EXPECT_EQ(
        prefill.Run(server.stub(), 4, c.prompt_ids, a4, 100000).error_code(),
        StatusCode::INVALID_ARGUMENT);
    Streamed s = ReadStream(server.stub(), 4);
    EXPECT_FALSE(s.status.ok());
  }
  {
    // Token 0's report names an alternative outside the vocabulary: refused
    // precisely, the request failed and freed.
    auto req = MakeAdmit(7, c.prompt_ids, 8);
    req.set_include_logprobs(true);
    req.set_top_logprobs(1);
    v1::AdmitResponse a7;
    ASSERT_TRUE(Admit(server.stub(), req, &a7).ok());
    v1::TokenLogprob lying;
    lying.set_logprob(-0.1f);
    v1::TopLogprob* alternative = lying.add_top();
    alternative->set_token_id(100000);
    alternative->set_logprob(-0.1f);
    TestPrefill prefill;
    EXPECT_EQ(prefill.Run(server.stub(), 7, c.prompt_ids, a7, -1, &lying)
                  .error_code(),
              StatusCode::INVALID_ARGUMENT);
    Streamed s = ReadStream(server.stub(), 7);
    EXPECT_EQ(s.status.error_code(), StatusCode::INVALID_ARGUMENT);
    // More alternatives than a request may ask for: refused at admission.
    req = MakeAdmit(8, c.prompt_ids, 8);
    req.set_include_logprobs(true);
    req.set_top_logprobs(21);
    EXPECT_EQ(AdmitCode(server, req), StatusCode::INVALID_ARGUMENT);
  }
  {
    // Completion claimed but nothing was written: the sinks never get the
    // KV, completion fails after the service's bounded wait and frees it.
    v1::AdmitResponse a6;
    ASSERT_TRUE(Admit(server.stub(), MakeAdmit(6, c.prompt_ids, 8), &a6).ok());
    EXPECT_EQ(KvCompleteCode(server, 6, 5), StatusCode::DEADLINE_EXCEEDED);
    Streamed s = ReadStream(server.stub(), 6);
    EXPECT_EQ(s.status.error_code(), StatusCode::DEADLINE_EXCEEDED);
  }
  EXPECT_TRUE(server.WaitForBlocksUsed(baseline, absl::Seconds(15)));

  // Still serving.
  v1::AdmitResponse a5;
  ASSERT_TRUE(
      Admit(server.stub(), MakeAdmit(5, c.prompt_ids, c.max_new_tokens), &a5)
          .ok());
  TestPrefill prefill;
  ASSERT_TRUE(prefill.Run(server.stub(), 5, c.prompt_ids, a5).ok());
  Streamed s = ReadStream(server.stub(), 5);
  EXPECT_TRUE(s.status.ok());
  EXPECT_EQ(s.tokens, c.greedy_ids);
  EXPECT_TRUE(server.WaitForBlocksUsed(baseline, absl::Seconds(10)));
}

// KvComplete calls queue for one completer thread; each one's timeout runs
// from its arrival. Four completions whose KV never lands fail together
// after one timeout, not one timeout after another (which took 4 s here).
TEST(DecodeServiceBadInputTest, QueuedCompletionsShareOneTimeoutWindow) {
  Server server(/*tp=*/2, absl::Seconds(30), 128,
                /*kv_complete_timeout=*/absl::Seconds(1));
  const int64_t baseline = server.Load().kv_blocks_used();
  const auto c = AllGoldenCases().front();
  constexpr int kStuck = 4;
  for (int i = 0; i < kStuck; ++i) {
    v1::AdmitResponse admit;
    ASSERT_TRUE(
        Admit(server.stub(), MakeAdmit(20 + i, c.prompt_ids, 8), &admit).ok());
  }
  std::vector<grpc::StatusCode> codes(kStuck, grpc::StatusCode::OK);
  const absl::Time start = absl::Now();
  std::vector<std::thread> callers;
  for (int i = 0; i < kStuck; ++i) {
    callers.emplace_back(
        [&, i] { codes[i] = KvCompleteCode(server, 20 + i, 5); });
  }
  for (auto& t : callers) t.join();
  const absl::Duration took = absl::Now() - start;
  for (int i = 0; i < kStuck; ++i) {
    EXPECT_EQ(codes[i], grpc::StatusCode::DEADLINE_EXCEEDED) << i;
  }
  // One 1 s window for all (with room for a loaded machine), where waiting
  // in turn takes at least 4 s.
  EXPECT_LT(took, absl::Seconds(3)) << took;
  EXPECT_TRUE(server.WaitForBlocksUsed(baseline, absl::Seconds(15)));
}

}  // namespace
}  // namespace pdserve::decode_worker
