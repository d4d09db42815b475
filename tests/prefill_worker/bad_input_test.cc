// Bad requests to a real 2-stage prefill group get precise codes, and the
// group keeps serving good requests in between.
#include <gtest/gtest.h>

#include "tests/prefill_worker/worker_test_util.h"

namespace pdserve::prefill::testing {
namespace {

namespace v1 = ::pdserve::v1;

TEST(PrefillWorkerBadInputTest, PreciseCodesAndTheGroupKeepsServing) {
  auto weights = engine::testing_util::OpenStories(true);
  ASSERT_NE(weights, nullptr);
  const model::ModelConfig& config = weights->config();
  DecodeRanks ranks(config);
  WorkerGroup group(2, "auto");
  ASSERT_NE(group.stub(), nullptr);
  const auto cases = pdserve::testing::LoadGoldenCases();
  const auto& prompt = cases[0].prompt_ids;
  uint64_t next_id = 1;
  // One destination block per request id (5-token prompt): a failed
  // request's blocks stay quarantined at the sinks for a while.
  auto dst_of = [](uint64_t id) { return std::vector<int64_t>{int64_t(id)}; };

  auto expect = [&](const v1::PrefillSubmitRequest& r, grpc::StatusCode code,
                    const std::string& needle) {
    v1::PrefillSubmitResponse response;
    grpc::Status s = group.Prefill(r, &response);
    EXPECT_EQ(s.error_code(), code) << needle << ": " << s.error_message();
    EXPECT_NE(s.error_message().find(needle), std::string::npos)
        << s.error_message();
    for (auto& sink : ranks.sinks) (void)sink->Cancel(r.request_id());
  };
  auto good = [&] {
    const uint64_t id = next_id++;
    v1::PrefillSubmitResponse response;
    grpc::Status s = group.Prefill(
        MakeRequest(id, prompt, ranks, dst_of(id), 0, ""), &response);
    EXPECT_TRUE(s.ok()) << s.error_message() << group.Logs();
    EXPECT_EQ(response.first_token(), cases[0].greedy_ids[0]);
    for (auto& sink : ranks.sinks) {
      EXPECT_TRUE(sink->Wait(id, absl::Seconds(10)).ok());
    }
  };
  good();

  auto r = MakeRequest(next_id, prompt, ranks, dst_of(next_id), 0, "");
  ++next_id;
  r.clear_prompt_ids();
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "prompt is empty");

  r = MakeRequest(next_id, prompt, ranks, dst_of(next_id), 0, "");
  ++next_id;
  for (int i = 0; i < config.max_position_embeddings; ++i) r.add_prompt_ids(1);
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "context");

  r = MakeRequest(next_id, prompt, ranks, dst_of(next_id), 0, "");
  ++next_id;
  r.set_prompt_ids(1, config.vocab_size);
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "outside the vocabulary");

  r = MakeRequest(next_id, prompt, ranks, dst_of(next_id), 0, "");
  ++next_id;
  r.mutable_sampling()->set_temperature(-1);
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "sampling");

  r = MakeRequest(next_id, prompt, ranks, dst_of(next_id), 0, "");
  ++next_id;
  r.mutable_sampling()->set_top_p(1.5f);
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "sampling");

  r = MakeRequest(next_id, prompt, ranks, dst_of(next_id), 0, "");
  ++next_id;
  r.set_top_logprobs(21);
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "top_logprobs");

  r = MakeRequest(next_id, prompt, ranks, dst_of(next_id), 0, "");
  ++next_id;
  r.mutable_destination()->clear_ranks();
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "no decode rank");

  // Scoring without a destination: the same checks apply.
  r = v1::PrefillSubmitRequest();
  r.set_request_id(next_id++);
  for (int32_t t : prompt) r.add_prompt_ids(t);
  r.set_prompt_logprobs(true);
  r.set_top_logprobs(21);
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "top_logprobs");
  r.set_top_logprobs(2);
  r.set_prompt_ids(0, -3);
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "outside the vocabulary");
  {
    // ... and a valid one is answered in full, with nothing to release.
    r.set_prompt_ids(0, prompt[0]);
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    v1::PrefillSubmitResponse response;
    grpc::Status s = group.stub()->Prefill(&context, r, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(response.prompt_logprobs_size(),
              static_cast<int>(prompt.size()) - 1);
    EXPECT_FALSE(response.decode_notified());
  }

  r = MakeRequest(next_id, prompt, ranks, dst_of(next_id), 0, "");
  ++next_id;
  r.mutable_destination()->mutable_ranks(0)->set_sink_descriptor("garbage");
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "decode rank");

  r = MakeRequest(next_id, prompt, ranks, dst_of(next_id), 0, "");
  ++next_id;
  r.mutable_destination()->mutable_ranks(1)->set_grant("garbage");
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "KV grant");

  // A grant from a sink the request does not name as a destination.
  {
    DecodeRanks other(config);
    r = MakeRequest(next_id, prompt, other, dst_of(next_id), 0, "");
    ++next_id;
    for (int i = 0; i < kRanks; ++i) {
      r.mutable_destination()->mutable_ranks(i)->set_sink_descriptor(
          ranks.sinks[i]->descriptor());
    }
    expect(r, grpc::StatusCode::INVALID_ARGUMENT, "not connected");
  }

  std::vector<int32_t> long_prompt(40, 1);
  r = MakeRequest(next_id++, long_prompt, ranks, {100, 101, 102}, 5, "");
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "multiple of the block size");

  r = MakeRequest(next_id, prompt, ranks, dst_of(next_id), 0, "");
  ++next_id;
  r.mutable_destination()->set_cached_tokens(
      static_cast<int64_t>(prompt.size()));
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "outside the prompt");

  {
    grpc::ClientContext context;
    v1::PrefillCancelRequest cancel;
    cancel.set_request_id(424242);
    v1::PrefillCancelResponse ignored;
    EXPECT_EQ(group.stub()->Cancel(&context, cancel, &ignored).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  good();
  EXPECT_EQ(group.Health(), grpc::health::v1::HealthCheckResponse::SERVING);
  for (auto& sink : ranks.sinks) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (sink->active_requests() > 0 && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    EXPECT_EQ(sink->active_requests(), 0);
  }
}

}  // namespace
}  // namespace pdserve::prefill::testing
