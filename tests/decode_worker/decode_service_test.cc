// The decode worker's gRPC service end to end over loopback: admit, a KV
// transfer by a test-side prefill into the worker's UCX sinks, completion,
// streamed tokens; abort, client cancel and lease expiry freeing the KV; and
// the real decode_worker binary answering health and load.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "decode_service_test_util.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace pdserve::decode_worker {
namespace {

using namespace testing_util;  // NOLINT

TEST(DecodeServiceTest, GoldenPromptsStreamGoldenTokensThroughTheTransport) {
  Server server(/*tp=*/2);
  TestPrefill prefill;
  const int64_t baseline = server.Load().kv_blocks_used();
  auto cases = AllGoldenCases();
  uint64_t id = 100;
  // Every case, then the first again (its full blocks may now come from the
  // prefix cache: the grant then covers only the suffix).
  cases.push_back(cases.front());
  for (const auto& c : cases) {
    SCOPED_TRACE(c.prompt);
    ++id;
    v1::AdmitResponse admit;
    auto s = Admit(server.stub(), MakeAdmit(id, c.prompt_ids, c.max_new_tokens),
                   &admit);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(admit.ranks_size(), 2);
    EXPECT_EQ(admit.cached_tokens() % 16, 0);
    ASSERT_TRUE(prefill.Run(server.stub(), id, c.prompt_ids, admit).ok());
    Streamed out = ReadStream(server.stub(), id);
    EXPECT_TRUE(out.status.ok()) << out.status.error_message();
    EXPECT_TRUE(out.finished);
    EXPECT_EQ(out.reason, v1::FINISH_REASON_LENGTH);
    EXPECT_EQ(out.tokens, c.greedy_ids);
    EXPECT_TRUE(out.text.empty());  // tokens only (no tokenizer)
  }
  EXPECT_TRUE(server.WaitForBlocksUsed(baseline, absl::Seconds(10)));
  EXPECT_EQ(server.service().channels(), 0);
}

TEST(DecodeServiceTest, LogprobsAskedAtAdmitStreamWithEveryToken) {
  Server server(/*tp=*/2);
  TestPrefill prefill;
  const auto c = AllGoldenCases()[1];
  auto req = MakeAdmit(9, c.prompt_ids, c.max_new_tokens);
  req.set_include_logprobs(true);
  req.set_top_logprobs(2);
  v1::AdmitResponse admit;
  ASSERT_TRUE(Admit(server.stub(), req, &admit).ok());
  // Token 0's numbers are whatever the prefill reports (here: made up, and
  // with one more alternative than asked, which the worker drops).
  v1::TokenLogprob first;
  first.set_logprob(-0.125f);
  for (int k = 0; k < 3; ++k) {
    v1::TopLogprob* t = first.add_top();
    t->set_token_id(c.greedy_ids[0] + k);
    t->set_logprob(-0.125f - k);
  }
  ASSERT_TRUE(
      prefill.Run(server.stub(), 9, c.prompt_ids, admit, -1, &first).ok());
  Streamed out = ReadStream(server.stub(), 9);
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  EXPECT_EQ(out.tokens, c.greedy_ids);
  ASSERT_EQ(out.logprobs.size(), out.tokens.size());
  EXPECT_EQ(out.logprobs[0].logprob(), -0.125f);
  ASSERT_EQ(out.logprobs[0].top_size(), 2);
  EXPECT_EQ(out.logprobs[0].top(1).token_id(), c.greedy_ids[0] + 1);
  for (size_t i = 1; i < out.logprobs.size(); ++i) {
    // Greedy: each later token is its row's most likely one.
    ASSERT_EQ(out.logprobs[i].top_size(), 2) << i;
    EXPECT_EQ(out.logprobs[i].top(0).token_id(), out.tokens[i]) << i;
    EXPECT_EQ(out.logprobs[i].top(0).logprob(), out.logprobs[i].logprob());
    EXPECT_LE(out.logprobs[i].top(1).logprob(), out.logprobs[i].logprob());
  }
  // A request that did not ask gets none.
  ASSERT_TRUE(
      Admit(server.stub(), MakeAdmit(10, c.prompt_ids, 4), &admit).ok());
  ASSERT_TRUE(prefill.Run(server.stub(), 10, c.prompt_ids, admit).ok());
  EXPECT_TRUE(ReadStream(server.stub(), 10).logprobs.empty());
}

TEST(DecodeServiceTest, StreamAttachedBeforeCompletionGetsEveryToken) {
  Server server(/*tp=*/1);
  TestPrefill prefill;
  const auto c = AllGoldenCases().front();
  v1::AdmitResponse admit;
  ASSERT_TRUE(
      Admit(server.stub(), MakeAdmit(7, c.prompt_ids, c.max_new_tokens), &admit)
          .ok());
  Streamed out;
  std::thread reader([&] { out = ReadStream(server.stub(), 7); });
  absl::SleepFor(absl::Milliseconds(100));  // the stream waits for the KV
  ASSERT_TRUE(prefill.Run(server.stub(), 7, c.prompt_ids, admit).ok());
  reader.join();
  EXPECT_TRUE(out.status.ok()) << out.status.error_message();
  EXPECT_EQ(out.tokens, c.greedy_ids);
}

TEST(DecodeServiceTest, AbortMidStreamReturnsKvToBaseline) {
  Server server(/*tp=*/2);
  TestPrefill prefill;
  const int64_t baseline = server.Load().kv_blocks_used();
  const auto c = AllGoldenCases().front();
  auto req = MakeAdmit(9, c.prompt_ids, 400);
  req.set_ignore_eos(true);
  v1::AdmitResponse admit;
  ASSERT_TRUE(Admit(server.stub(), req, &admit).ok());
  EXPECT_GT(server.Load().kv_blocks_used(), baseline);
  ASSERT_TRUE(prefill.Run(server.stub(), 9, c.prompt_ids, admit).ok());
  Streamed out = ReadStream(server.stub(), 9, [&](grpc::ClientContext&) {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(30));
    v1::AbortRequest a;
    a.set_request_id(9);
    v1::AbortResponse r;
    auto s = server.stub().Abort(&ctx, a, &r);
    EXPECT_TRUE(s.ok()) << s.error_message();
  });
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::CANCELLED)
      << out.status.error_message();
  EXPECT_TRUE(out.finished);
  EXPECT_EQ(out.reason, v1::FINISH_REASON_CANCELLED);
  EXPECT_LT(out.tokens.size(), 400u);
  EXPECT_TRUE(server.WaitForBlocksUsed(baseline, absl::Seconds(10)));
  auto load = server.Load();
  EXPECT_EQ(load.running(), 0);
  EXPECT_EQ(load.awaiting_kv(), 0);
}

TEST(DecodeServiceTest, ClientCancellingTheStreamAbortsTheRequest) {
  Server server(/*tp=*/1);
  TestPrefill prefill;
  const int64_t baseline = server.Load().kv_blocks_used();
  const auto c = AllGoldenCases().front();
  auto req = MakeAdmit(11, c.prompt_ids, 400);
  req.set_ignore_eos(true);
  v1::AdmitResponse admit;
  ASSERT_TRUE(Admit(server.stub(), req, &admit).ok());
  ASSERT_TRUE(prefill.Run(server.stub(), 11, c.prompt_ids, admit).ok());
  Streamed out = ReadStream(server.stub(), 11,
                            [](grpc::ClientContext& ctx) { ctx.TryCancel(); });
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(server.WaitForBlocksUsed(baseline, absl::Seconds(10)));
  EXPECT_EQ(server.Load().running(), 0);
}

TEST(DecodeServiceTest, AdmittedRequestWhoseKvNeverArrivesIsFreedByItsLease) {
  Server server(/*tp=*/2, /*kv_lease=*/absl::Seconds(1));
  const int64_t baseline = server.Load().kv_blocks_used();
  const auto c = AllGoldenCases().front();
  v1::AdmitResponse admit;
  ASSERT_TRUE(
      Admit(server.stub(), MakeAdmit(13, c.prompt_ids, 8), &admit).ok());
  EXPECT_GT(server.Load().kv_blocks_used(), baseline);
  EXPECT_EQ(server.Load().awaiting_kv(), 1);
  Streamed out = ReadStream(server.stub(), 13);
  EXPECT_FALSE(out.status.ok());
  EXPECT_NE(out.status.error_code(), grpc::StatusCode::CANCELLED)
      << "the stream reports the sink's reason: " << out.status.error_message();
  EXPECT_TRUE(out.tokens.empty());
  EXPECT_TRUE(server.WaitForBlocksUsed(baseline, absl::Seconds(15)));
  EXPECT_EQ(server.Load().awaiting_kv(), 0);
}

TEST(DecodeServiceTest, AbortBeforeTheKvArrivedRevokesTheGrant) {
  Server server(/*tp=*/2);
  const int64_t baseline = server.Load().kv_blocks_used();
  const auto c = AllGoldenCases().front();
  v1::AdmitResponse admit;
  ASSERT_TRUE(
      Admit(server.stub(), MakeAdmit(15, c.prompt_ids, 8), &admit).ok());
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(30));
  v1::AbortRequest a;
  a.set_request_id(15);
  v1::AbortResponse r;
  ASSERT_TRUE(server.stub().Abort(&ctx, a, &r).ok());
  Streamed out = ReadStream(server.stub(), 15);
  EXPECT_FALSE(out.status.ok());
  EXPECT_TRUE(server.WaitForBlocksUsed(baseline, absl::Seconds(15)));
}

// Every layer of the KV landed, but the stage that was to send KvComplete
// died first; the router aborts. The sinks have nothing left to release (no
// release callback follows), so the Abort itself must end the request, not
// the worker's lease a minute later.
TEST(DecodeServiceTest, AbortAfterTheKvLandedWithoutItsCompleteFreesAtOnce) {
  Server server(/*tp=*/2);
  const int64_t baseline = server.Load().kv_blocks_used();
  const auto c = AllGoldenCases().front();
  v1::AdmitResponse admit;
  ASSERT_TRUE(
      Admit(server.stub(), MakeAdmit(19, c.prompt_ids, 8), &admit).ok());
  TestPrefill prefill;
  ASSERT_TRUE(prefill
                  .Run(server.stub(), 19, c.prompt_ids, admit, -1, nullptr,
                       /*call_complete=*/false)
                  .ok());
  EXPECT_EQ(server.Load().awaiting_kv(), 1);
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(30));
  v1::AbortRequest a;
  a.set_request_id(19);
  v1::AbortResponse r;
  ASSERT_TRUE(server.stub().Abort(&ctx, a, &r).ok());
  EXPECT_TRUE(server.WaitForBlocksUsed(baseline, absl::Seconds(3)))
      << server.Load().kv_blocks_used() << " blocks used, "
      << server.Load().awaiting_kv() << " awaiting KV";
  EXPECT_EQ(server.Load().awaiting_kv(), 0);
}

// The router gives up on an Admit that takes too long and sends Abort; the
// Admit may reach the worker only after that Abort. It must be refused, not
// hold its blocks until the lease runs out (a minute of KV nobody uses).
TEST(DecodeServiceTest, AdmitArrivingAfterItsAbortIsRefusedAndHoldsNothing) {
  Server server(/*tp=*/2);
  const int64_t baseline = server.Load().kv_blocks_used();
  const auto c = AllGoldenCases().front();
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(30));
  v1::AbortRequest a;
  a.set_request_id(17);
  v1::AbortResponse r;
  const grpc::Status aborted = server.stub().Abort(&ctx, a, &r);
  EXPECT_EQ(aborted.error_code(), grpc::StatusCode::NOT_FOUND)
      << aborted.error_message();
  v1::AdmitResponse admit;
  const grpc::Status late =
      Admit(server.stub(), MakeAdmit(17, c.prompt_ids, 8), &admit);
  EXPECT_EQ(late.error_code(), grpc::StatusCode::ABORTED)
      << late.error_message();
  EXPECT_NE(late.error_message().find("aborted before its admit"),
            std::string::npos)
      << late.error_message();
  EXPECT_EQ(server.Load().kv_blocks_used(), baseline);
  EXPECT_EQ(server.Load().awaiting_kv(), 0);
  // Only that one Admit: the id is forgotten once refused.
  ASSERT_TRUE(
      Admit(server.stub(), MakeAdmit(17, c.prompt_ids, 8), &admit).ok());
  grpc::ClientContext again;
  again.set_deadline(Deadline(30));
  ASSERT_TRUE(server.stub().Abort(&again, a, &r).ok());
  EXPECT_TRUE(server.WaitForBlocksUsed(baseline, absl::Seconds(15)));
}

// A request's grant lives on every TP rank's sink, over the same block ids.
// When one rank's sink is done with a revoked grant (its source confirmed)
// while another's still waits out its quarantine (a stuck source), the
// blocks must not go to another request: a put of the revoked one could still
// land in them, and the other rank's sink would refuse the new grant ("block
// N is already granted to another request": the HTTP 500s of a stage death
// under load). They stay pinned until every rank is done; meanwhile a new
// request that needs them gets RESOURCE_EXHAUSTED, after it they are free.
TEST(DecodeServiceTest, RevokedGrantKeepsItsBlocksUntilEveryRankReleasedThem) {
  // 20 blocks of 16: each long golden prompt takes 17 of them.
  Server server(/*tp=*/2, absl::Seconds(30), /*num_blocks=*/20);
  const int64_t baseline = server.Load().kv_blocks_used();
  const auto longs = pdserve::testing::LoadGoldenCases("golden_long.jsonl");
  ASSERT_GE(longs.size(), 2u);
  v1::AdmitResponse first;
  ASSERT_TRUE(
      Admit(server.stub(), MakeAdmit(21, longs[0].prompt_ids, 8), &first).ok());
  ASSERT_EQ(first.ranks_size(), 2);
  // Rank 0's source confirms revokes at once; rank 1's never does.
  GrantHolder confirms(first, 0, /*stuck=*/false);
  GrantHolder stuck(first, 1, /*stuck=*/true);
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(30));
    v1::AbortRequest abort;
    abort.set_request_id(21);
    v1::AbortResponse ignored;
    ASSERT_TRUE(server.stub().Abort(&ctx, abort, &ignored).ok());
  }
  // Rank 0 released its grant; rank 1 waits out its quarantine (5 s).
  absl::SleepFor(absl::Milliseconds(500));
  v1::AdmitResponse second;
  const grpc::Status early =
      Admit(server.stub(), MakeAdmit(22, longs[1].prompt_ids, 8), &second);
  EXPECT_EQ(early.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << early.error_message();
  // Once rank 1's quarantine is over the blocks are free again.
  grpc::Status later = early;
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (!later.ok() && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(200));
    later =
        Admit(server.stub(), MakeAdmit(23, longs[1].prompt_ids, 8), &second);
    EXPECT_NE(later.error_code(), grpc::StatusCode::ALREADY_EXISTS)
        << later.error_message();
  }
  ASSERT_TRUE(later.ok()) << later.error_message();
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(30));
  v1::AbortRequest abort;
  abort.set_request_id(23);
  v1::AbortResponse ignored;
  ASSERT_TRUE(server.stub().Abort(&ctx, abort, &ignored).ok());
  EXPECT_TRUE(server.WaitForBlocksUsed(baseline, absl::Seconds(15)));
}

// ---- The real binary --------------------------------------------------------

TEST(DecodeWorkerBinaryTest, ServesHealthAndLoadThenStopsOnSigterm) {
  int out_pipe[2];
  ASSERT_EQ(pipe(out_pipe), 0);
  const std::string model = pdserve::testing::Stories260KGguf();
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    dup2(out_pipe[1], 1);
    close(out_pipe[0]);
    execl(PDSERVE_DECODE_WORKER_BIN, "decode_worker", "--model", model.c_str(),
          "--tp", "2", "--host", "127.0.0.1", "--port", "0", "--num-blocks",
          "64", "--speculation", "ngram", static_cast<char*>(nullptr));
    _exit(127);
  }
  close(out_pipe[1]);
  FILE* out = fdopen(out_pipe[0], "r");
  char line[256] = {};
  std::string address;
  // Bounded: the child exits (EOF) on any startup failure.
  while (std::fgets(line, sizeof(line), out) != nullptr) {
    std::string l(line);
    if (l.rfind("listening on ", 0) == 0) {
      address = l.substr(13);
      address.erase(address.find_last_not_of("\r\n") + 1);
      break;
    }
  }
  ASSERT_FALSE(address.empty()) << "decode_worker did not start";
  auto channel =
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  {
    auto health = grpc::health::v1::Health::NewStub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(30));
    grpc::health::v1::HealthCheckRequest req;
    grpc::health::v1::HealthCheckResponse resp;
    auto s = health->Check(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  }
  {
    auto stub = v1::DecodeWorker::NewStub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(30));
    v1::DecodeLoad load;
    ASSERT_TRUE(stub->GetLoad(&ctx, v1::GetLoadRequest(), &load).ok());
    EXPECT_EQ(load.kv_blocks_total(), 64);
    EXPECT_EQ(load.kv_blocks_used(), 0);
    // Admit + KV from a test prefill through the process boundary.
    TestPrefill prefill;
    const auto c = AllGoldenCases().front();
    v1::AdmitResponse admit;
    ASSERT_TRUE(
        Admit(*stub, MakeAdmit(1, c.prompt_ids, c.max_new_tokens), &admit)
            .ok());
    ASSERT_EQ(admit.ranks_size(), 2);
    ASSERT_TRUE(prefill.Run(*stub, 1, c.prompt_ids, admit).ok());
    Streamed s = ReadStream(*stub, 1);
    EXPECT_TRUE(s.status.ok()) << s.status.error_message();
    EXPECT_EQ(s.tokens, c.greedy_ids);
  }
  kill(pid, SIGTERM);
  int status = 0;
  // Bounded wait for the exit.
  for (int i = 0; i < 300 && waitpid(pid, &status, WNOHANG) == 0; ++i)
    absl::SleepFor(absl::Milliseconds(100));
  if (waitpid(pid, &status, WNOHANG) == 0 && !WIFEXITED(status)) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    ADD_FAILURE() << "decode_worker did not stop on SIGTERM";
  }
  fclose(out);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

}  // namespace
}  // namespace pdserve::decode_worker
