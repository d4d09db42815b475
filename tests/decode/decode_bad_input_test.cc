// Bad requests and options get precise errors, and the worker keeps serving.
#include <gtest/gtest.h>

#include "decode_test_util.h"
#include "engine/sampler.h"

namespace pdserve::decode {
namespace {

using testing_util::AllGoldenCases;
using testing_util::ExpectNoLeak;
using testing_util::Greedy;
using testing_util::MakeWorker;
using testing_util::Options;
using testing_util::Stories;
using testing_util::Stream;

void ExpectError(const absl::Status& s, absl::StatusCode code,
                 const std::string& fragment) {
  EXPECT_EQ(s.code(), code) << s << " expected: " << fragment;
  EXPECT_NE(std::string(s.message()).find(fragment), std::string::npos) << s;
}

TEST(DecodeBadInputTest, BadRequestsGetPreciseErrors) {
  auto worker = MakeWorker(Options(2, SpeculationMode::kNgram));
  ASSERT_NE(worker, nullptr);
  auto prompt = AllGoldenCases()[0].prompt_ids;
  Stream unused;
  ExpectError(worker->Submit(1, {}, Greedy(4), unused.Callback()),
              absl::StatusCode::kInvalidArgument, "prompt is empty");
  ExpectError(worker->Submit(1, {1, 600, 3}, Greedy(4), unused.Callback()),
              absl::StatusCode::kInvalidArgument, "prompt token 1 is 600");
  ExpectError(worker->Submit(1, {1, -1}, Greedy(4), unused.Callback()),
              absl::StatusCode::kInvalidArgument, "prompt token 1 is -1");
  ExpectError(worker->Submit(1, prompt, Greedy(0), unused.Callback()),
              absl::StatusCode::kInvalidArgument, "max_new_tokens");
  const int context = Stories().weights->config().max_position_embeddings;
  ExpectError(worker->Submit(1, prompt, Greedy(context), unused.Callback()),
              absl::StatusCode::kInvalidArgument,
              absl::StrCat("exceeds the context of ", context));
  RequestParams bad_temp = Greedy(4);
  bad_temp.sampling.temperature = -1;
  ExpectError(worker->Submit(1, prompt, bad_temp, unused.Callback()),
              absl::StatusCode::kInvalidArgument, "temperature");
  RequestParams bad_top_p = Greedy(4);
  bad_top_p.sampling.top_p = 0;
  ExpectError(worker->Admit(1, prompt, bad_top_p, unused.Callback()).status(),
              absl::StatusCode::kInvalidArgument, "top_p");
  RequestParams empty_stop = Greedy(4);
  empty_stop.stop = {"ok", ""};
  ExpectError(worker->Submit(1, prompt, empty_stop, unused.Callback()),
              absl::StatusCode::kInvalidArgument, "stop string 1 is empty");
  ExpectError(worker->MarkKvComplete(42, 5), absl::StatusCode::kNotFound,
              "request 42");
  ExpectError(worker->Abort(42), absl::StatusCode::kNotFound, "request 42");
  EXPECT_FALSE(unused.finished());  // rejected requests never call back

  // Duplicate ids, on both paths.
  Stream live;
  ASSERT_TRUE(worker->Admit(7, prompt, Greedy(4), live.Callback()).ok());
  ExpectError(worker->Submit(7, prompt, Greedy(4), unused.Callback()),
              absl::StatusCode::kAlreadyExists, "request 7");
  ExpectError(worker->Admit(7, prompt, Greedy(4), unused.Callback()).status(),
              absl::StatusCode::kAlreadyExists, "request 7");
  ASSERT_TRUE(worker->Abort(7).ok());
  ASSERT_TRUE(live.Wait());

  // Still serving.
  auto golden = AllGoldenCases()[2];
  Stream good;
  ASSERT_TRUE(worker
                  ->Submit(8, golden.prompt_ids, Greedy(golden.max_new_tokens),
                           good.Callback())
                  .ok());
  ASSERT_TRUE(good.Wait());
  EXPECT_EQ(good.tokens(), golden.greedy_ids);
  ExpectNoLeak(*worker);
}

TEST(DecodeBadInputTest, KvCapacityErrors) {
  auto options = Options(1, SpeculationMode::kOff);
  options.num_blocks = 4;
  auto worker = MakeWorker(options);
  ASSERT_NE(worker, nullptr);
  auto long_prompt = AllGoldenCases()[4].prompt_ids;
  Stream s;
  ExpectError(worker->Submit(1, long_prompt, Greedy(4), s.Callback()),
              absl::StatusCode::kResourceExhausted, "the pool has 4");
  auto prompt = AllGoldenCases()[0].prompt_ids;  // 5 tokens: 1 block each
  std::vector<Stream> held(4);
  for (int i = 0; i < 4; ++i)
    ASSERT_TRUE(
        worker->Admit(10 + i, prompt, Greedy(4), held[i].Callback()).ok());
  Stream extra;
  EXPECT_EQ(
      worker->Admit(20, prompt, Greedy(4), extra.Callback()).status().code(),
      absl::StatusCode::kResourceExhausted);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(worker->Abort(10 + i).ok());
  for (auto& h : held) ASSERT_TRUE(h.Wait());
  ExpectNoLeak(*worker);
}

TEST(DecodeBadInputTest, ImpossibleOptionsAreRejected) {
  const auto& m = Stories();
  auto options = Options(3, SpeculationMode::kOff);
  ExpectError(
      DecodeWorker::Create(*m.weights, m.tokenizer.get(), options).status(),
      absl::StatusCode::kInvalidArgument, "tp_size 3");
  options = Options(1, SpeculationMode::kDraft);
  options.speculation.draft_weights = nullptr;
  ExpectError(
      DecodeWorker::Create(*m.weights, m.tokenizer.get(), options).status(),
      absl::StatusCode::kInvalidArgument, "draft_weights");
  options = Options(1, SpeculationMode::kNgram);
  options.max_step_tokens = 3;
  ExpectError(
      DecodeWorker::Create(*m.weights, m.tokenizer.get(), options).status(),
      absl::StatusCode::kInvalidArgument, "max_step_tokens 3");
  options = Options(1, SpeculationMode::kOff);
  options.num_blocks = 0;
  ExpectError(
      DecodeWorker::Create(*m.weights, m.tokenizer.get(), options).status(),
      absl::StatusCode::kInvalidArgument, "num_blocks");
}

TEST(DecodeBadInputTest, NoTokenizerMeansTokensOnlyAndNoStopStrings) {
  const auto& m = Stories();
  auto worker = DecodeWorker::Create(*m.weights, nullptr,
                                     Options(1, SpeculationMode::kOff));
  ASSERT_TRUE(worker.ok()) << worker.status();
  auto golden = AllGoldenCases()[0];
  RequestParams with_stop = Greedy(4);
  with_stop.stop = {"x"};
  Stream s;
  ExpectError((*worker)->Submit(1, golden.prompt_ids, with_stop, s.Callback()),
              absl::StatusCode::kInvalidArgument, "need a tokenizer");
  ASSERT_TRUE(
      (*worker)->Submit(2, golden.prompt_ids, Greedy(6), s.Callback()).ok());
  ASSERT_TRUE(s.Wait());
  EXPECT_EQ(s.tokens(), std::vector<int32_t>(golden.greedy_ids.begin(),
                                             golden.greedy_ids.begin() + 6));
  EXPECT_EQ(s.text(), "");
}

TEST(LogprobsBadInputTest, OutOfRangeRequestsAndReportsAreRefused) {
  auto worker = MakeWorker(Options(1, SpeculationMode::kOff));
  ASSERT_NE(worker, nullptr);
  const auto golden = AllGoldenCases()[0];
  RequestParams p = Greedy(4);
  p.logprobs = true;
  for (int top : {-1, engine::kMaxTopLogprobs + 1}) {
    p.top_logprobs = top;
    Stream s;
    absl::Status submitted =
        worker->Submit(1, golden.prompt_ids, p, s.Callback());
    EXPECT_EQ(submitted.code(), absl::StatusCode::kInvalidArgument) << top;
    EXPECT_NE(submitted.message().find("top_logprobs"), std::string::npos);
  }
  // A prefill's report naming an id outside the vocabulary fails the
  // request (and frees it); the worker keeps serving.
  p.top_logprobs = 1;
  Stream bad;
  auto admit = worker->Admit(2, golden.prompt_ids, p, bad.Callback());
  ASSERT_TRUE(admit.ok());
  engine::TokenLogprobs lying{-0.5f, {{512, -0.5f}}};
  EXPECT_EQ(worker->MarkKvComplete(2, 5, lying).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(bad.Wait());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  Stream too_many;
  admit = worker->Admit(3, golden.prompt_ids, p, too_many.Callback());
  ASSERT_TRUE(admit.ok());
  engine::TokenLogprobs crowded{-0.5f, {}};
  crowded.top.assign(engine::kMaxTopLogprobs + 1, {5, -0.5f});
  EXPECT_EQ(worker->MarkKvComplete(3, 5, crowded).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(too_many.Wait());
  ExpectNoLeak(*worker);
  Stream fine;
  ASSERT_TRUE(worker->Submit(4, golden.prompt_ids, p, fine.Callback()).ok());
  ASSERT_TRUE(fine.Wait());
  EXPECT_TRUE(fine.status().ok()) << fine.status();
  EXPECT_EQ(fine.logprobs().size(), 4u);
  ExpectNoLeak(*worker);
}

}  // namespace
}  // namespace pdserve::decode
