// Stage links over UCX messages: the wire encoding round-trips and rejects
// malformed blobs, and a 3-stage pipeline whose stages talk only through UCX
// (microbatches forward, events back to the coordinator) reproduces the
// engine's first tokens and KV.
#include <gtest/gtest.h>

#include "engine/engine_test_util.h"
#include "prefill/pipeline_stage.h"
#include "prefill/prefill_coordinator.h"
#include "prefill_worker/ucx_stage_link.h"
#include "testing/golden.h"

namespace pdserve::prefill {
namespace {

using engine::testing_util::MaxRelativeError;

StageMessage SampleMessage() {
  StageMessage m;
  m.microbatch_id = 42;
  ChunkHeader a;
  a.request_id = 7;
  a.token_begin = 16;
  a.token_end = 19;
  a.kv_begin = 0;
  a.final_chunk = true;
  a.tokens = {5, 6, 7};
  a.block_table = {3, 9};
  a.sampling.temperature = 0.7f;
  a.sampling.top_k = 5;
  a.sampling.top_p = 0.9f;
  a.sampling.seed = 99;
  a.sampling.min_p = 0.05f;
  a.sampling.presence_penalty = -0.5f;
  a.sampling.frequency_penalty = 1.5f;
  a.sampling.repetition_penalty = 1.2f;
  a.sampling.min_tokens = 3;
  a.sampling.logit_bias = {{2, -100.0f}, {17, 4.5f}};
  a.penalized_prompt_tokens = {1, 5, 9};
  a.sampling.structured_output.kind = engine::StructuredOutput::Kind::kChoice;
  a.sampling.structured_output.choices = {"yes", "no"};
  a.top_logprobs = 4;
  a.kv_grants = {"grant-a", std::string("\0b", 2)};
  ChunkHeader b;
  b.request_id = 8;
  b.sampling.structured_output.kind =
      engine::StructuredOutput::Kind::kJsonSchema;
  b.sampling.structured_output.text = R"({"type": "object"})";
  b.token_begin = 0;
  b.token_end = 1;
  b.block_table = {1};
  m.chunks = {a, b};
  m.hidden = {1, 2, 3, 4, 5, 6, 7, 8};  // 4 tokens x 2
  return m;
}

TEST(StageWireTest, MessagesAndEventsRoundTrip) {
  StageMessage m = SampleMessage();
  auto back = DecodeStageMessage(EncodeStageMessage(m));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->microbatch_id, 42u);
  ASSERT_EQ(back->chunks.size(), 2u);
  EXPECT_EQ(back->chunks[0].tokens, m.chunks[0].tokens);
  EXPECT_EQ(back->chunks[0].block_table, m.chunks[0].block_table);
  EXPECT_EQ(back->chunks[0].kv_grants, m.chunks[0].kv_grants);
  // Every sampling field crosses (the last stage samples with them).
  EXPECT_EQ(back->chunks[0].sampling, m.chunks[0].sampling);
  EXPECT_EQ(back->chunks[1].sampling, m.chunks[1].sampling);
  EXPECT_EQ(back->chunks[0].penalized_prompt_tokens,
            m.chunks[0].penalized_prompt_tokens);
  EXPECT_EQ(back->chunks[0].top_logprobs, 4);
  EXPECT_EQ(back->chunks[1].top_logprobs, 0);
  EXPECT_TRUE(back->chunks[0].final_chunk);
  EXPECT_FALSE(back->chunks[1].final_chunk);
  EXPECT_FALSE(back->chunks[0].prompt_logprobs);
  EXPECT_TRUE(back->chunks[0].write_kv);
  EXPECT_EQ(back->chunks[0].next_token, -1);
  EXPECT_EQ(back->hidden, m.hidden);

  StageMessage scored = SampleMessage();
  scored.chunks[1].prompt_logprobs = true;
  scored.chunks[1].write_kv = false;
  scored.chunks[1].next_token = 321;
  auto scored_back = DecodeStageMessage(EncodeStageMessage(scored));
  ASSERT_TRUE(scored_back.ok()) << scored_back.status();
  EXPECT_TRUE(scored_back->chunks[1].prompt_logprobs);
  EXPECT_FALSE(scored_back->chunks[1].write_kv);
  EXPECT_EQ(scored_back->chunks[1].next_token, 321);
  EXPECT_FALSE(scored_back->chunks[0].prompt_logprobs);

  StageEvent e;
  e.kind = StageEvent::Kind::kMicrobatchDone;
  e.stage = 3;
  e.microbatch_id = 11;
  e.request_ids = {1, 2};
  e.status = absl::InternalError("boom");
  e.start = absl::FromUnixNanos(123456789);
  e.end = absl::FromUnixNanos(223456789);
  e.tokens = 17;
  auto event = DecodeStageEvent(EncodeStageEvent(e));
  ASSERT_TRUE(event.ok()) << event.status();
  EXPECT_EQ(event->stage, 3);
  EXPECT_EQ(event->request_ids, e.request_ids);
  EXPECT_EQ(event->status, e.status);
  EXPECT_EQ(event->start, e.start);
  EXPECT_EQ(event->tokens, 17);

  StageEvent token;
  token.kind = StageEvent::Kind::kFirstToken;
  token.request_id = 5;
  token.token = {7, -0.5f, {{7, -0.5f}, {3, -1.25f}}};
  auto token_back = DecodeStageEvent(EncodeStageEvent(token));
  ASSERT_TRUE(token_back.ok()) << token_back.status();
  EXPECT_EQ(token_back->token.token, 7);
  EXPECT_EQ(token_back->token.logprob, -0.5f);
  EXPECT_EQ(token_back->token.top, token.token.top);

  StageEvent prompt;
  prompt.kind = StageEvent::Kind::kPromptLogprobs;
  prompt.request_id = 6;
  prompt.first_scored = 17;
  prompt.prompt_logprobs = {{-0.25f, {}}, {-2.5f, {{4, -0.5f}, {9, -1.0f}}}};
  auto prompt_back = DecodeStageEvent(EncodeStageEvent(prompt));
  ASSERT_TRUE(prompt_back.ok()) << prompt_back.status();
  EXPECT_EQ(prompt_back->kind, StageEvent::Kind::kPromptLogprobs);
  EXPECT_EQ(prompt_back->first_scored, 17);
  ASSERT_EQ(prompt_back->prompt_logprobs.size(), 2u);
  EXPECT_EQ(prompt_back->prompt_logprobs[0].logprob, -0.25f);
  EXPECT_EQ(prompt_back->prompt_logprobs[1].logprob, -2.5f);
  EXPECT_EQ(prompt_back->prompt_logprobs[1].top, prompt.prompt_logprobs[1].top);
}

TEST(StageWireTest, MalformedBlobsAreRejectedNeverCrash) {
  const std::string blob = EncodeStageMessage(SampleMessage());
  for (size_t n = 0; n < blob.size(); ++n) {
    EXPECT_EQ(DecodeStageMessage(blob.substr(0, n)).status().code(),
              absl::StatusCode::kInvalidArgument)
        << "truncated to " << n;
  }
  std::string corrupt = blob;
  corrupt[0] ^= 1;
  EXPECT_EQ(DecodeStageMessage(corrupt).status().code(),
            absl::StatusCode::kInvalidArgument);
  StageMessage bad = SampleMessage();
  bad.chunks[0].kv_begin = 17;  // after token_begin
  EXPECT_EQ(DecodeStageMessage(EncodeStageMessage(bad)).status().code(),
            absl::StatusCode::kInvalidArgument);
  bad = SampleMessage();
  bad.hidden.push_back(9);  // 9 floats for 4 tokens
  EXPECT_EQ(DecodeStageMessage(EncodeStageMessage(bad)).status().code(),
            absl::StatusCode::kInvalidArgument);
  bad = SampleMessage();
  bad.chunks[0].top_logprobs = engine::kMaxTopLogprobs + 1;
  EXPECT_EQ(DecodeStageMessage(EncodeStageMessage(bad)).status().code(),
            absl::StatusCode::kInvalidArgument);
  StageEvent crowded;
  crowded.token.top.resize(engine::kMaxTopLogprobs + 1);
  EXPECT_FALSE(DecodeStageEvent(EncodeStageEvent(crowded)).ok());
  StageEvent with_top;
  with_top.token.top = {{1, -0.1f}, {2, -3.0f}};
  const std::string top_event = EncodeStageEvent(with_top);
  for (size_t n = 0; n < top_event.size(); ++n) {
    EXPECT_FALSE(DecodeStageEvent(top_event.substr(0, n)).ok());
  }
  StageEvent scores;
  scores.kind = StageEvent::Kind::kPromptLogprobs;
  scores.prompt_logprobs = {{-1.0f, {{3, -1.0f}}}, {-2.0f, {}}};
  const std::string scores_event = EncodeStageEvent(scores);
  for (size_t n = 0; n < scores_event.size(); ++n) {
    EXPECT_FALSE(DecodeStageEvent(scores_event.substr(0, n)).ok());
  }
  scores.prompt_logprobs[0].top.resize(engine::kMaxTopLogprobs + 1);
  EXPECT_FALSE(DecodeStageEvent(EncodeStageEvent(scores)).ok());
  {
    // An unknown chunk flag bit is refused, not ignored: the flags byte
    // sits right before the next token, here a pattern found once.
    constexpr int32_t kPattern = 0x5a6b7c1d;
    StageMessage flagged = SampleMessage();
    flagged.chunks.resize(1);
    flagged.hidden.clear();
    flagged.chunks[0].prompt_logprobs = true;
    flagged.chunks[0].next_token = kPattern;
    std::string blob = EncodeStageMessage(flagged);
    ASSERT_TRUE(DecodeStageMessage(blob).ok());
    const std::string needle(reinterpret_cast<const char*>(&kPattern), 4);
    const size_t at = blob.find(needle);
    ASSERT_NE(at, std::string::npos);
    ASSERT_EQ(blob.find(needle, at + 1), std::string::npos);
    ASSERT_EQ(static_cast<uint8_t>(blob[at - 1]), 3);  // score + write KV
    blob[at - 1] = static_cast<char>(0x83);
    auto refused = DecodeStageMessage(blob);
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.status().message().find("unknown flags"),
              std::string::npos)
        << refused.status();
  }
  const std::string event = EncodeStageEvent(StageEvent{});
  for (size_t n = 0; n < event.size(); ++n) {
    EXPECT_FALSE(DecodeStageEvent(event.substr(0, n)).ok());
  }
  EXPECT_FALSE(DecodeStageEvent(event + "x").ok());
}

TEST(UcxStageLinkTest, ThreeStagesOverUcxMatchTheEngine) {
  auto weights = engine::testing_util::OpenStories(true);
  ASSERT_NE(weights, nullptr);
  const std::vector<std::pair<int, int>> ranges = {{0, 2}, {2, 4}, {4, 5}};
  const int stages = 3;
  std::vector<std::unique_ptr<transport::UcxWorker>> workers;
  for (int i = 0; i < stages; ++i) {
    auto w = transport::UcxWorker::Create();
    ASSERT_TRUE(w.ok()) << w.status();
    workers.push_back(std::move(*w));
  }
  SchedulerOptions scheduler;
  scheduler.block_size = 16;
  scheduler.num_blocks = 256;
  scheduler.microbatch_token_budget = 32;
  scheduler.chunk_policy = ChunkPolicy{ChunkPolicyKind::kEqualCost, 7};
  InProcessStageLink into_stage0;
  auto coordinator = PrefillCoordinator::Create(weights->config(), stages,
                                                scheduler, &into_stage0);
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  UcxEventReceiver event_receiver(workers[0].get(), coordinator->get());

  std::vector<std::unique_ptr<UcxStageReceiver>> receivers;
  std::vector<std::unique_ptr<UcxStageSender>> senders;
  std::vector<std::unique_ptr<UcxEventSender>> event_senders;
  for (int i = 1; i < stages; ++i) {
    receivers.push_back(std::make_unique<UcxStageReceiver>(workers[i].get()));
    auto forward = workers[i - 1]->Connect(workers[i]->address());
    ASSERT_TRUE(forward.ok()) << forward.status();
    senders.push_back(std::make_unique<UcxStageSender>(*forward));
    auto back = workers[i]->Connect(workers[0]->address());
    ASSERT_TRUE(back.ok()) << back.status();
    event_senders.push_back(std::make_unique<UcxEventSender>(*back));
  }
  CapturingKvOutput kv_out;
  std::vector<std::unique_ptr<PipelineStage>> pipeline;
  for (int i = 0; i < stages; ++i) {
    PipelineStageOptions o;
    o.stage_index = i;
    o.num_stages = stages;
    o.shard = engine::ShardSpec{ranges[i].first, ranges[i].second, 0, 1};
    o.block_size = scheduler.block_size;
    o.num_blocks = scheduler.num_blocks;
    StageReceiver* in = i == 0 ? static_cast<StageReceiver*>(&into_stage0)
                               : receivers[i - 1].get();
    StageSender* out = i + 1 < stages ? senders[i].get() : nullptr;
    StageEventSink* events =
        i == 0 ? static_cast<StageEventSink*>(coordinator->get())
               : event_senders[i - 1].get();
    auto stage = PipelineStage::Create(*weights, o, in, out, events, &kv_out);
    ASSERT_TRUE(stage.ok()) << stage.status();
    pipeline.push_back(std::move(*stage));
  }
  for (auto& s : pipeline) s->Start();

  std::vector<pdserve::testing::GoldenCase> cases =
      pdserve::testing::LoadGoldenCases();
  for (auto& c : pdserve::testing::LoadGoldenCases("golden_long.jsonl")) {
    cases.push_back(c);
  }
  std::vector<std::shared_ptr<PrefillTicket>> tickets;
  for (size_t i = 0; i < cases.size(); ++i) {
    PrefillRequest request;
    request.request_id = i + 1;
    request.prompt = cases[i].prompt_ids;
    auto ticket = (*coordinator)->Submit(request);
    ASSERT_TRUE(ticket.ok()) << ticket.status();
    tickets.push_back(*ticket);
  }
  auto full = engine::testing_util::MakeEngine(*weights, {}, nullptr, 1);
  for (size_t i = 0; i < cases.size(); ++i) {
    auto outcome = tickets[i]->Wait(absl::Seconds(60));
    ASSERT_TRUE(outcome.ok()) << outcome.status();
    EXPECT_EQ(outcome->first_token.token, cases[i].greedy_ids[0]);
    const auto& prompt = cases[i].prompt_ids;
    const int n = static_cast<int>(prompt.size());
    const int blocks = (n + 15) / 16;
    auto pool = engine::testing_util::MakePool(*full, 16, blocks);
    auto table = engine::testing_util::IdentityBlockTable(blocks);
    engine::testing_util::PrefillAllLogits(*full, *pool, prompt, table);
    const auto& l = pool->layout();
    std::vector<float> want;
    for (int layer = 0; layer < l.num_layers; ++layer) {
      for (int kv = 0; kv < 2; ++kv) {
        for (int head = 0; head < l.num_kv_heads; ++head) {
          for (int pos = 0; pos < n; ++pos) {
            const float* p =
                pool->f32() + l.Offset(pos / 16, layer, kv, head, pos % 16);
            want.insert(want.end(), p, p + l.head_dim);
          }
        }
      }
    }
    EXPECT_LE(MaxRelativeError(kv_out.Collected(i + 1, l.num_layers, n), want),
              1e-6)
        << "prompt " << i;
  }
  for (auto& r : receivers) EXPECT_EQ(r->malformed(), 0);
  EXPECT_EQ((*coordinator)->stats().used_blocks, 0);

  // Teardown: stop scheduling, end the stream at stage 0; each stage closes
  // its link after draining, which ends the next one.
  (*coordinator)->Shutdown();
  into_stage0.Close();
  for (auto& s : pipeline) s->Join();
  pipeline.clear();
}

}  // namespace
}  // namespace pdserve::prefill
