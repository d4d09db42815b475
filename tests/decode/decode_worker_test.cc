// DecodeWorker greedy correctness through every layout (TP 1/2/4, speculation
// off / n-gram / draft), continuous batching with joins and leaves,
// preemption, the remote-prefill admission path with prefix reuse, leases,
// aborts, stop strings, and no leaked KV blocks.
#include <gtest/gtest.h>

#include <atomic>
#include <fstream>
#include <thread>

#include "comm/communicator.h"
#include "decode_test_util.h"
#include "engine/llama_engine.h"
#include "engine/sampler.h"

namespace pdserve::decode {
namespace {

using testing_util::AllGoldenCases;
using testing_util::ExpectEveryGoldenCase;
using testing_util::ExpectNoLeak;
using testing_util::Greedy;
using testing_util::MakeWorker;
using testing_util::Options;
using testing_util::RemotePrefill;
using testing_util::Stories;
using testing_util::Stream;

const char* ModeName(SpeculationMode m) {
  switch (m) {
    case SpeculationMode::kOff:
      return "Off";
    case SpeculationMode::kNgram:
      return "Ngram";
    case SpeculationMode::kDraft:
      return "Draft";
    case SpeculationMode::kScripted:
      return "Scripted";
  }
  return "?";
}

class GoldenTest
    : public ::testing::TestWithParam<std::tuple<int, SpeculationMode>> {};

TEST_P(GoldenTest, EveryGoldenPromptGivesGoldenTokensAndText) {
  const auto [tp, mode] = GetParam();
  auto worker = MakeWorker(Options(tp, mode));
  ASSERT_NE(worker, nullptr);
  // CPU ranks reduce through host memory.
  EXPECT_EQ(worker->tp_communicator(), tp > 1 ? "host" : "none");
  ExpectEveryGoldenCase(*worker);
  LoadReport load = worker->Load();
  if (mode != SpeculationMode::kOff) {
    EXPECT_GT(load.spec_steps, 0);
    EXPECT_GT(load.accepted_tokens, 0);
    EXPECT_GT(load.mean_acceptance_length(), 1.0);
  }
  EXPECT_EQ(load.running, 0);
  ExpectNoLeak(*worker);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, GoldenTest,
    ::testing::Combine(::testing::Values(1, 2, 4),
                       ::testing::Values(SpeculationMode::kOff,
                                         SpeculationMode::kNgram,
                                         SpeculationMode::kDraft)),
    [](const auto& info) {
      return absl::StrCat("Tp", std::get<0>(info.param),
                          ModeName(std::get<1>(info.param)));
    });

bool WaitForTokens(Stream& s, size_t n) {
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (s.num_tokens() < n && !s.finished() && absl::Now() < deadline)
    absl::SleepFor(absl::Microseconds(200));
  return s.num_tokens() >= n;
}

class JoinLeaveTest : public ::testing::TestWithParam<SpeculationMode> {};

TEST_P(JoinLeaveTest, RequestsJoiningAndLeavingMidWayKeepGoldens) {
  auto worker = MakeWorker(Options(2, GetParam()));
  ASSERT_NE(worker, nullptr);
  auto cases = AllGoldenCases();
  Stream long_a, first, joiner, short_one, aborted;
  ASSERT_TRUE(worker
                  ->Submit(1, cases[4].prompt_ids,
                           Greedy(cases[4].max_new_tokens), long_a.Callback())
                  .ok());
  ASSERT_TRUE(worker
                  ->Submit(2, cases[0].prompt_ids,
                           Greedy(cases[0].max_new_tokens), first.Callback())
                  .ok());
  ASSERT_TRUE(WaitForTokens(first, 8));
  ASSERT_TRUE(worker
                  ->Submit(3, cases[1].prompt_ids,
                           Greedy(cases[1].max_new_tokens), joiner.Callback())
                  .ok());
  ASSERT_TRUE(
      worker->Submit(4, cases[2].prompt_ids, Greedy(5), short_one.Callback())
          .ok());
  ASSERT_TRUE(worker
                  ->Submit(5, cases[3].prompt_ids,
                           Greedy(cases[3].max_new_tokens), aborted.Callback())
                  .ok());
  ASSERT_TRUE(WaitForTokens(aborted, 3));
  ASSERT_TRUE(worker->Abort(5).ok());
  for (Stream* s : {&long_a, &first, &joiner, &short_one, &aborted})
    ASSERT_TRUE(s->Wait());
  EXPECT_EQ(long_a.tokens(), cases[4].greedy_ids);
  EXPECT_EQ(first.tokens(), cases[0].greedy_ids);
  EXPECT_EQ(joiner.tokens(), cases[1].greedy_ids);
  EXPECT_EQ(short_one.tokens(),
            std::vector<int32_t>(cases[2].greedy_ids.begin(),
                                 cases[2].greedy_ids.begin() + 5));
  EXPECT_EQ(aborted.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(aborted.reason(), FinishReason::kAborted);
  auto partial = aborted.tokens();
  EXPECT_TRUE(
      std::equal(partial.begin(), partial.end(), cases[3].greedy_ids.begin()));
  ExpectNoLeak(*worker);
}

INSTANTIATE_TEST_SUITE_P(Modes, JoinLeaveTest,
                         ::testing::Values(SpeculationMode::kNgram,
                                           SpeculationMode::kDraft),
                         [](const auto& info) { return ModeName(info.param); });

TEST(PreemptionTest, KvExhaustionPreemptsAndRecomputesExactly) {
  auto options = Options(1, SpeculationMode::kNgram);
  options.num_blocks = 8;  // four requests of up to 4 blocks each
  auto worker = MakeWorker(options);
  ASSERT_NE(worker, nullptr);
  auto cases = pdserve::testing::LoadGoldenCases();
  std::vector<Stream> streams(cases.size());
  for (size_t i = 0; i < cases.size(); ++i)
    ASSERT_TRUE(worker
                    ->Submit(i, cases[i].prompt_ids,
                             Greedy(cases[i].max_new_tokens),
                             streams[i].Callback())
                    .ok());
  for (size_t i = 0; i < cases.size(); ++i) {
    ASSERT_TRUE(streams[i].Wait());
    EXPECT_EQ(streams[i].tokens(), cases[i].greedy_ids) << "case " << i;
    EXPECT_EQ(streams[i].text(), cases[i].text) << "case " << i;
  }
  EXPECT_GT(worker->Load().preemptions, 0);
  ExpectNoLeak(*worker);
}

class RemoteAdmitTest : public ::testing::TestWithParam<int> {};

TEST_P(RemoteAdmitTest, PrefillWritesAdmittedBlocksAndPrefixIsReused) {
  auto worker = MakeWorker(Options(GetParam(), SpeculationMode::kNgram));
  ASSERT_NE(worker, nullptr);
  auto golden = AllGoldenCases()[4];
  for (int round = 0; round < 2; ++round) {
    Stream s;
    auto admit = worker->Admit(round, golden.prompt_ids,
                               Greedy(golden.max_new_tokens), s.Callback());
    ASSERT_TRUE(admit.ok()) << admit.status();
    EXPECT_EQ(admit->block_ids.size(), (golden.prompt_ids.size() + 15) / 16);
    if (round == 0) {
      EXPECT_EQ(admit->cached_tokens, 0);
    } else {
      // The first round published every full prompt block.
      EXPECT_EQ(admit->cached_tokens, (golden.prompt_ids.size() - 1) / 16 * 16);
    }
    EXPECT_EQ(worker->Load().awaiting_kv, 1);
    int32_t token =
        engine::ArgMax(RemotePrefill(*worker, golden.prompt_ids, *admit));
    EXPECT_EQ(token, golden.greedy_ids[0]);
    ASSERT_TRUE(worker->MarkKvComplete(round, token).ok());
    // A second completion is refused: FAILED_PRECONDITION while the request
    // runs, NOT_FOUND once it finished (a short greedy run may already have).
    const absl::StatusCode again = worker->MarkKvComplete(round, token).code();
    EXPECT_TRUE(again == absl::StatusCode::kFailedPrecondition ||
                again == absl::StatusCode::kNotFound)
        << again;
    ASSERT_TRUE(s.Wait());
    EXPECT_EQ(s.tokens(), golden.greedy_ids);
    EXPECT_EQ(s.text(), golden.text);
    ExpectNoLeak(*worker);
  }
}

INSTANTIATE_TEST_SUITE_P(Tp, RemoteAdmitTest, ::testing::Values(1, 2));

TEST(LifecycleTest, LeaseExpiryAbortAndErrorFreeEverything) {
  auto options = Options(1, SpeculationMode::kOff);
  options.kv_lease = absl::Milliseconds(50);
  auto worker = MakeWorker(options);
  ASSERT_NE(worker, nullptr);
  auto golden = AllGoldenCases()[5];
  // Lease expiry: KV never completes.
  Stream expired;
  ASSERT_TRUE(
      worker->Admit(1, golden.prompt_ids, Greedy(8), expired.Callback()).ok());
  EXPECT_GT(worker->block_manager().used_blocks(), 0);
  ASSERT_TRUE(expired.Wait());
  EXPECT_EQ(expired.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(worker->MarkKvComplete(1, 5).code(), absl::StatusCode::kNotFound);
  ExpectNoLeak(*worker);
  // Abort while awaiting KV.
  Stream awaiting;
  ASSERT_TRUE(
      worker->Admit(2, golden.prompt_ids, Greedy(8), awaiting.Callback()).ok());
  ASSERT_TRUE(worker->Abort(2).ok());
  ASSERT_TRUE(awaiting.Wait());
  EXPECT_EQ(awaiting.status().code(), absl::StatusCode::kCancelled);
  ExpectNoLeak(*worker);
  // Abort right after submit (waiting or prefilling) and mid-decode.
  Stream early, mid;
  ASSERT_TRUE(
      worker->Submit(3, golden.prompt_ids, Greedy(200), early.Callback()).ok());
  ASSERT_TRUE(worker->Abort(3).ok());
  ASSERT_TRUE(
      worker->Submit(4, golden.prompt_ids, Greedy(200), mid.Callback()).ok());
  ASSERT_TRUE(WaitForTokens(mid, 4));
  ASSERT_TRUE(worker->Abort(4).ok());
  ASSERT_TRUE(early.Wait() && mid.Wait());
  EXPECT_EQ(early.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(mid.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(worker->Abort(4).code(), absl::StatusCode::kNotFound);
  ExpectNoLeak(*worker);
  // Error: the prefill reports a token outside the vocabulary.
  Stream failed;
  ASSERT_TRUE(
      worker->Admit(5, golden.prompt_ids, Greedy(8), failed.Callback()).ok());
  EXPECT_EQ(worker->MarkKvComplete(5, 100000).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(failed.Wait());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(failed.reason(), FinishReason::kError);
  ExpectNoLeak(*worker);
  // Destroying the worker with a request in flight cancels it.
  Stream in_flight;
  ASSERT_TRUE(
      worker->Submit(6, golden.prompt_ids, Greedy(200), in_flight.Callback())
          .ok());
  worker.reset();
  ASSERT_TRUE(in_flight.finished());
  EXPECT_EQ(in_flight.status().code(), absl::StatusCode::kCancelled);
}

TEST(StopTest, StopStringEndsStreamAndNeverLeaks) {
  auto worker = MakeWorker(Options(1, SpeculationMode::kNgram));
  ASSERT_NE(worker, nullptr);
  auto golden = AllGoldenCases()[0];
  const std::string stop = "Lily";
  RequestParams params = Greedy(golden.max_new_tokens);
  params.stop = {stop, "zzz-never"};
  Stream s;
  ASSERT_TRUE(worker->Submit(1, golden.prompt_ids, params, s.Callback()).ok());
  ASSERT_TRUE(s.Wait());
  EXPECT_EQ(s.reason(), FinishReason::kStop);
  const size_t cut = golden.text.find(stop);
  ASSERT_NE(cut, std::string::npos);
  EXPECT_EQ(s.text(), golden.text.substr(0, cut));
  auto tokens = s.tokens();
  ASSERT_LT(tokens.size(), golden.greedy_ids.size());
  EXPECT_TRUE(
      std::equal(tokens.begin(), tokens.end(), golden.greedy_ids.begin()));
  ExpectNoLeak(*worker);
}

TEST(PrefixCacheTest, LocalPathReusesPublishedBlocks) {
  auto worker = MakeWorker(Options(1, SpeculationMode::kOff));
  ASSERT_NE(worker, nullptr);
  auto golden = AllGoldenCases()[4];
  for (int round = 0; round < 2; ++round) {
    Stream s;
    ASSERT_TRUE(worker
                    ->Submit(round, golden.prompt_ids,
                             Greedy(golden.max_new_tokens), s.Callback())
                    .ok());
    ASSERT_TRUE(s.Wait());
    EXPECT_EQ(s.tokens(), golden.greedy_ids);
  }
  EXPECT_GE(worker->block_manager().stats().prefix_hit_blocks,
            static_cast<int64_t>(golden.prompt_ids.size() / 16));
  ExpectNoLeak(*worker);
}

// Rank 0's logits at every sampled row, keyed by (request, output index).
std::map<std::pair<uint64_t, int64_t>, std::vector<float>> CollectLogits(
    int tp) {
  auto worker = MakeWorker(Options(tp, SpeculationMode::kOff));
  std::map<std::pair<uint64_t, int64_t>, std::vector<float>> out;
  absl::Mutex mu;
  worker->SetLogitsObserverForTest(
      [&](uint64_t id, int64_t index, std::span<const float> logits) {
        absl::MutexLock lock(&mu);
        out[{id, index}].assign(logits.begin(), logits.end());
      });
  auto cases = AllGoldenCases();
  std::vector<Stream> streams(2);
  for (int i = 0; i < 2; ++i) {
    const auto& c = cases[i == 0 ? 0 : 4];
    EXPECT_TRUE(worker
                    ->Submit(i, c.prompt_ids, Greedy(c.max_new_tokens),
                             streams[i].Callback())
                    .ok());
  }
  for (auto& s : streams) EXPECT_TRUE(s.Wait());
  worker.reset();
  return out;
}

TEST(TensorParallelTest, LogitsEqualSingleRankWithinTolerance) {
  auto reference = CollectLogits(1);
  ASSERT_EQ(reference.size(), 48u + 32u);
  for (int tp : {2, 4}) {
    auto logits = CollectLogits(tp);
    ASSERT_EQ(logits.size(), reference.size());
    for (const auto& [key, ref] : reference) {
      const auto& got = logits[key];
      ASSERT_EQ(got.size(), ref.size());
      double worst = 0, scale = 0;
      for (size_t v = 0; v < ref.size(); ++v) {
        worst = std::max(worst, std::abs(double{got[v]} - ref[v]));
        scale = std::max(scale, std::abs(double{ref[v]}));
      }
      EXPECT_LT(worst / scale, 1e-5)
          << "tp " << tp << " request " << key.first << " index " << key.second;
    }
  }
}

TEST(TensorParallelTest, RankShardsHoldAboutOneTthOfTheWeights) {
  auto one = MakeWorker(Options(1, SpeculationMode::kOff));
  auto four = MakeWorker(Options(4, SpeculationMode::kOff));
  const int64_t whole = one->rank_weight_bytes()[0];
  for (int64_t b : four->rank_weight_bytes())
    EXPECT_LT(static_cast<double>(b), whole / 4.0 * 1.15 + 8192);
}

// A model whose every layer windows (Mistral, window 8 < a 16-slot block):
// the worker gives back the blocks no query will read again, so a long
// generation holds a few blocks instead of one per 16 tokens, and its tokens
// are the single-process engine's (which keeps every block), with and
// without n-gram speculation (verify steps roll back rejected drafts).
TEST(SlidingWindowKvTest, BlocksOutsideTheWindowGoBackAndTokensStay) {
  const std::string config_path =
      ::testing::TempDir() + "/windowed-mistral-config.json";
  {
    std::ofstream config(config_path);
    config << R"({"model_type": "mistral", "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
      "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
      "sliding_window": 8})";
  }
  auto weights = model::OpenModel(config_path, model::LoadFormat::kDummy);
  ASSERT_TRUE(weights.ok()) << weights.status();
  ASSERT_TRUE((*weights)->config().EveryLayerWindowed());
  constexpr int kNew = 200;
  std::vector<int32_t> prompt;
  for (int i = 0; i < 24; ++i) prompt.push_back((i * 37 + 11) % 256);

  engine::EngineOptions eo;
  eo.num_threads = 1;
  auto engine = engine::LlamaEngine::Create(**weights, eo);
  ASSERT_TRUE(engine.ok()) << engine.status();
  constexpr int kBlocks = (24 + kNew) / 16 + 1;
  auto pool = kv::KvPool::Create((*engine)->KvLayout(16), kBlocks);
  ASSERT_TRUE(pool.ok());
  std::vector<int32_t> table(kBlocks);
  for (int b = 0; b < kBlocks; ++b) table[b] = b;
  // The single-process engine, every block kept.
  std::vector<int32_t> want;
  {
    std::vector<int32_t> feed = prompt;
    int position = 0;
    while (static_cast<int>(want.size()) < kNew) {
      engine::ForwardBatch batch;
      engine::SequenceStep step;
      step.tokens = feed;
      step.num_tokens = static_cast<int>(feed.size());
      step.start_position = position;
      step.block_table = table;
      step.logit_indices = {step.num_tokens - 1};
      batch.sequences.push_back(step);
      engine::ForwardResult result;
      ASSERT_TRUE((*engine)->Forward(batch, **pool, &result).ok());
      position += step.num_tokens;
      const int32_t next = static_cast<int32_t>(
          std::max_element(result.logits.begin(), result.logits.end()) -
          result.logits.begin());
      want.push_back(next);
      feed = {next};
    }
  }

  for (SpeculationMode mode :
       {SpeculationMode::kOff, SpeculationMode::kNgram}) {
    SCOPED_TRACE(mode == SpeculationMode::kOff ? "off" : "ngram");
    DecodeWorkerOptions o = Options(1, mode);
    o.num_blocks = 64;
    std::atomic<int64_t> most_used{0};
    std::atomic<const DecodeWorker*> observed{nullptr};
    o.step_observer = [&](const StepStats&) {
      if (const DecodeWorker* w = observed.load(); w != nullptr) {
        const int64_t used = w->block_manager().used_blocks();
        int64_t seen = most_used.load();
        while (used > seen && !most_used.compare_exchange_weak(seen, used)) {
        }
      }
    };
    auto worker = DecodeWorker::Create(**weights, nullptr, o);
    ASSERT_TRUE(worker.ok()) << worker.status();
    observed = worker->get();
    RequestParams params = Greedy(kNew);
    params.ignore_eos = true;
    Stream stream;
    ASSERT_TRUE((*worker)->Submit(1, prompt, params, stream.Callback()).ok());
    ASSERT_TRUE(stream.Wait());
    EXPECT_EQ(stream.tokens(), want);
    // Without giving blocks back the request would end holding 14 blocks;
    // the window needs the current block, the one before it and the last
    // published (the parent of the next), plus a verify's spill.
    std::printf("[ window   ] most blocks held at once: %lld of %d\n",
                static_cast<long long>(most_used.load()), kBlocks);
    EXPECT_LE(most_used.load(), 4);
    EXPECT_GT(most_used.load(), 0);
    ExpectNoLeak(**worker);
  }
}

}  // namespace
}  // namespace pdserve::decode
