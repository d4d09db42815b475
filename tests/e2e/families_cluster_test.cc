// The families through whole clusters of real processes (router, prefill
// stages, decode worker with TP ranks, speculation), started by the same
// launcher as `pdserve local`, against the independent float64 reference:
// tiny random checkpoints with each family's real tokenizer.json, greedy
// token ids equal to the reference and their log-probabilities within 1e-4
// (bf16 KV: 1e-2 + 4e-3 |logprob|, see engine/families_test.cc), over gRPC
// with the prompt as token ids and over OpenAI HTTP as text.
#include <grpcpp/grpcpp.h>
#include <httplib.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "engine/family_reference.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "pdserve/v1/generate.grpc.pb.h"
#include "tools/local_cluster.h"

namespace pdserve {
namespace {

using engine::testing_util::FamilyReference;
using tools::LocalCluster;
using tools::LocalClusterOptions;

constexpr int kMaxNew = 16;

const std::map<std::string, FamilyReference>& Families() {
  static const auto* families = new std::map<std::string, FamilyReference>(
      engine::testing_util::GenerateFamilies(
          FAMILIES_DIR, kMaxNew,
          std::string(PDSERVE_BINARY_DIR) + "/tokenizer-refs/node_modules"));
  return *families;
}

struct ClusterLayout {
  std::string family;  // a text-* checkpoint
  int stages;
  std::string layer_split;
  int tp;
  std::string speculation;
  std::string kv_dtype = "auto";
  std::string moe_parallel = "tp";
};

std::string Name(const ClusterLayout& l) {
  std::string name = absl::StrCat(
      l.family.substr(5), "_S", l.stages, "_T", l.tp, "_", l.speculation,
      l.kv_dtype == "bf16" ? "_bf16" : "", l.moe_parallel == "ep" ? "_ep" : "");
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return name;
}

class FamiliesClusterTest : public ::testing::TestWithParam<ClusterLayout> {};

TEST_P(FamiliesClusterTest, GreedyIdsAndLogprobsMatchTheReference) {
  const ClusterLayout layout = GetParam();
  const auto& families = Families();
  auto it = families.find(layout.family);
  ASSERT_NE(it, families.end()) << "no checkpoint " << layout.family;
  const FamilyReference& f = it->second;
  ASSERT_GT(f.min_margin, 1e-3) << f.name << ": pick another seed";
  if (f.min_route_margin.has_value()) {
    ASSERT_GT(*f.min_route_margin, 1e-5) << f.name << ": pick another seed";
  }

  LocalClusterOptions o;
  o.model_path = f.dir;
  o.bin_dir = PDSERVE_BINARY_DIR;
  o.stages = layout.stages;
  o.layer_split = layout.layer_split;
  o.tp = layout.tp;
  o.speculation = layout.speculation;
  o.draft_layers = 1;  // the draft: the target's first layer
  o.kv_dtype = layout.kv_dtype;
  o.moe_parallel = layout.moe_parallel;
  o.metrics_port_base = 0;  // any free port; the MoE layouts scrape it
  o.decode_blocks = 256;
  o.prefill_blocks = 128;
  o.refresh_ms = 100;
  absl::StatusOr<std::unique_ptr<LocalCluster>> cluster =
      LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();

  // gRPC, the prompt as token ids.
  auto stub = v1::Generation::NewStub(grpc::CreateChannel(
      (*cluster)->grpc_address(), grpc::InsecureChannelCredentials()));
  v1::GenerateRequest request;
  for (int32_t id : f.prompt_ids) request.mutable_token_ids()->add_ids(id);
  request.set_max_tokens(kMaxNew);
  request.set_include_logprobs(true);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
  auto reader = stub->Generate(&context, request);
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
  std::string text;
  v1::GenerateResponse item;
  while (reader->Read(&item)) {
    ids.insert(ids.end(), item.token_ids().begin(), item.token_ids().end());
    logprobs.insert(logprobs.end(), item.logprobs().begin(),
                    item.logprobs().end());
    text += item.text();
  }
  const grpc::Status status = reader->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message() << "\n"
                           << (*cluster)->LogTail("decode-0", 4096);
  EXPECT_EQ(ids, f.greedy_ids);
  ASSERT_EQ(logprobs.size(), f.logprobs.size());
  for (size_t k = 0; k < logprobs.size(); ++k) {
    const double tolerance = layout.kv_dtype == "bf16"
                                 ? 1e-2 + 4e-3 * std::abs(f.logprobs[k])
                                 : 1e-4;
    EXPECT_NEAR(logprobs[k], f.logprobs[k], tolerance) << "token " << k;
  }

  // OpenAI completions with the same ids: the same continuation as text.
  const std::string http = (*cluster)->http_address();
  httplib::Client client(http.substr(0, http.rfind(':')),
                         std::stoi(http.substr(http.rfind(':') + 1)));
  client.set_read_timeout(120, 0);
  const nlohmann::json body = {
      {"prompt", f.prompt_ids}, {"max_tokens", kMaxNew}, {"temperature", 0}};
  auto reply = client.Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(reply);
  ASSERT_EQ(reply->status, 200) << reply->body;
  EXPECT_EQ(nlohmann::json::parse(reply->body)["choices"][0]["text"], text);

  // A mixture of experts reports its routing per sparse layer (Qwen3-MoE's
  // layer 1 is dense: no series).
  if (f.min_route_margin.has_value()) {
    const std::string metrics = (*cluster)->metrics_addresses().at("decode-0");
    httplib::Client scrape(metrics.substr(0, metrics.rfind(':')),
                           std::stoi(metrics.substr(metrics.rfind(':') + 1)));
    auto page = scrape.Get("/metrics");
    ASSERT_TRUE(page);
    EXPECT_THAT(page->body,
                ::testing::ContainsRegex(
                    "pdserve_decode_expert_routed_tokens_total\\{[^}]*"
                    "layer=\"2\"[^}]*\\} [1-9]"));
    EXPECT_THAT(page->body,
                ::testing::HasSubstr("pdserve_decode_expert_imbalance{"));
    EXPECT_THAT(page->body,
                ::testing::Not(::testing::HasSubstr("layer=\"1\"")));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, FamiliesClusterTest,
    ::testing::Values(
        // Qwen3: 2 stages split 1 + 2, TP 2 (= its KV heads), n-gram.
        ClusterLayout{"text-qwen3", 2, "1,2", 2, "ngram"},
        // Llama 3.1: 3 stages, TP 4 above its 2 KV heads, draft model.
        ClusterLayout{"text-llama31", 3, "1,1,1", 4, "draft"},
        // Mistral (window 8): 2 stages split 2 + 1, bf16 KV.
        ClusterLayout{"text-mistral", 2, "2,1", 1, "off", "bf16"},
        // Qwen2.5 (biases, tied embeddings): TP 2, n-gram.
        ClusterLayout{"text-qwen25", 1, "auto", 2, "ngram"},
        // Qwen2 with a window in layers 1-2 only: 3 stages (one layer
        // each, so a stage's local layer 0 is model layer 1 or 2), TP 2,
        // draft model (the first, unwindowed layer).
        ClusterLayout{"text-qwen_windowed", 3, "1,1,1", 2, "draft"},
        // Qwen3-MoE (a dense layer among sparse ones): 2 stages split
        // 2 + 1, experts whole per rank over TP 2, n-gram; then 3 stages,
        // experts' rows over TP 4, the draft model (the first
        // layer, sparse).
        ClusterLayout{"text-qwen3_moe", 2, "2,1", 2, "ngram", "auto", "ep"},
        ClusterLayout{"text-qwen3_moe", 3, "1,1,1", 4, "draft"}),
    [](const auto& info) { return Name(info.param); });

}  // namespace
}  // namespace pdserve
