// End-to-end on a GPU (label `gpu`; skips without one): the launcher of
// `pdserve local --backend cuda` starts a router, a prefill group whose
// stages compute on the GPU and a decode worker whose ranks do, as separate
// processes; every golden prompt through gRPC gives the golden greedy tokens
// or differs first where the bf16 criterion allows (top-5 logprobs over the
// API against the CPU engine's, engine/bf16_agreement.h).
// The KV crosses processes bf16 through the host mirrors on both sides
// (Debian's UCX has no CUDA transports).
//
// PDSERVE_BIN_DIR overrides where the worker binaries are (the device bundle
// carries them next to this test).
#include <grpcpp/grpcpp.h>

#include <cstdlib>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "engine/bf16_agreement.h"
#include "gtest/gtest.h"
#include "model/weight_source.h"
#include "pdserve/v1/generate.grpc.pb.h"
#include "testing/golden.h"
#include "testing/gpu.h"
#include "tools/local_cluster.h"

namespace pdserve {
namespace {

using ::pdserve::testing::GpuVisible;

struct Layout {
  int stages;
  int tp;
  std::string speculation;
};

void PrintTo(const Layout& l, std::ostream* os) {
  *os << "S" << l.stages << " T" << l.tp << " " << l.speculation;
}

class CudaClusterTest : public ::testing::TestWithParam<Layout> {};

TEST_P(CudaClusterTest, GoldenTokensThroughTheRouter) {
  if (!GpuVisible()) GTEST_SKIP() << "no GPU visible";
  const Layout layout = GetParam();
  tools::LocalClusterOptions o;
  o.model_path = testing::Stories260KDir();
  const char* bin_dir = std::getenv("PDSERVE_BIN_DIR");
  o.bin_dir = bin_dir != nullptr && *bin_dir ? bin_dir : PDSERVE_BINARY_DIR;
  o.model_name = "stories260K";
  o.decode_blocks = 512;
  o.prefill_blocks = 256;
  o.refresh_ms = 100;
  o.stages = layout.stages;
  o.tp = layout.tp;
  o.speculation = layout.speculation;
  o.backend = "cuda";
  o.cuda_devices = "0";
  auto cluster = tools::LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto stub = v1::Generation::NewStub(grpc::CreateChannel(
      (*cluster)->grpc_address(), grpc::InsecureChannelCredentials()));
  namespace tu = engine::testing_util;
  auto weights = model::OpenModel(testing::Stories260KDir());
  ASSERT_TRUE(weights.ok()) << weights.status();
  const double tolerance =
      tu::Bf16MarginTolerance(tu::MeasureCudaAbsLogitError(**weights));
  for (const testing::GoldenCase& c : testing::LoadGoldenCases()) {
    v1::GenerateRequest request;
    request.mutable_token_ids()->mutable_ids()->Add(c.prompt_ids.begin(),
                                                    c.prompt_ids.end());
    request.set_max_tokens(c.max_new_tokens);
    request.set_include_logprobs(true);
    request.set_top_logprobs(tu::kAgreementTopK);
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    v1::GenerateResponse reply;
    grpc::Status status = stub->GenerateUnary(&context, request, &reply);
    ASSERT_TRUE(status.ok()) << status.error_message() << "\n"
                             << (*cluster)->LogTail("router");
    const std::vector<int32_t> tokens(reply.token_ids().begin(),
                                      reply.token_ids().end());
    std::vector<engine::TokenLogprobs> scores(tokens.size());
    for (int i = 0;
         i < reply.logprobs_size() && i < static_cast<int>(tokens.size());
         ++i) {
      scores[i].logprob = reply.logprobs(i);
    }
    for (int i = 0;
         i < reply.top_logprobs_size() && i < static_cast<int>(tokens.size());
         ++i) {
      for (const auto& alternative : reply.top_logprobs(i).alternatives()) {
        scores[i].top.push_back(
            {alternative.token_id(), alternative.logprob()});
      }
    }
    const auto agreement = tu::CompareGreedyWithinBf16(
        c.greedy_ids,
        tu::ReferenceLogprobs(**weights, c.prompt_ids, c.greedy_ids,
                              tu::kAgreementTopK),
        tokens, scores, tolerance);
    if (!agreement.exact) {
      std::printf("[ cuda     ] \"%s\": %s\n", c.prompt.substr(0, 40).c_str(),
                  agreement.report.c_str());
    }
    EXPECT_TRUE(agreement.pass)
        << c.prompt.substr(0, 40) << ": " << agreement.report;
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, CudaClusterTest,
                         ::testing::Values(Layout{1, 1, "off"},
                                           Layout{2, 2, "ngram"}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return absl::StrCat("S", info.param.stages, "_T",
                                               info.param.tp, "_",
                                               info.param.speculation);
                         });

}  // namespace
}  // namespace pdserve
