// Quantized GGUF files — Q8_0, and Q4_K_M's mix of Q4_K and Q6_K — with a real
// tokenizer (stories260K's SentencePiece vocabulary, embedded by the GGUF
// writer) through `pdserve local` as real processes: prefill stages and
// tensor-parallel decode ranks read the quantized tensors in place (TP 2
// keeps each rank's o_proj and down_proj columns on whole 256-value blocks),
// and the greedy continuation of a text prompt — token ids over gRPC, text
// over the OpenAI HTTP endpoint — equals the single-process engine's on the
// same file.
#include <grpcpp/grpcpp.h>
#include <httplib.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "engine/backend_flags.h"
#include "engine/engine_test_util.h"
#include "gtest/gtest.h"
#include "model/gguf_writer.h"
#include "nlohmann/json.hpp"
#include "pdserve/v1/generate.grpc.pb.h"
#include "testing/golden.h"
#include "tokenizer/tokenizer.h"
#include "tools/local_cluster.h"

namespace pdserve {
namespace {

using model::TensorFormat;
using tools::LocalCluster;
using tools::LocalClusterOptions;

constexpr int kMaxNew = 24;
constexpr char kPrompt[] = "Once upon a time, a little girl named Lily";

// A llama shape whose Q4_K blocks (256 values) split under TP 2: each rank's
// o_proj columns (4 heads x 64) and down_proj columns (512) are whole blocks.
model::ModelConfig QuantConfig(const model::TokenizerSpec& vocabulary) {
  model::ModelConfig config;
  config.hidden_size = 512;
  config.intermediate_size = 1024;
  config.num_layers = 2;
  config.num_heads = 8;
  config.num_kv_heads = 4;
  config.head_dim = 64;
  config.vocab_size = static_cast<int>(vocabulary.tokens.size());
  config.max_position_embeddings = 256;
  config.rms_norm_eps = 1e-5f;
  config.rope_theta = 10000.0f;
  config.bos_token_id = vocabulary.bos_token_id;
  config.eos_token_id = vocabulary.eos_token_id;
  return config;
}

// Deterministic weights per tensor name: norms around 1, projections scaled
// so activations stay O(1), a confident lm_head (greedy picks far apart, so
// the TP ranks' other summation order cannot flip one).
std::vector<float> Values(const std::string& name,
                          const std::vector<int64_t>& shape) {
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  std::mt19937 rng(static_cast<uint32_t>(std::hash<std::string>()(name)));
  const bool norm = shape.size() == 1;
  std::normal_distribution<float> normal(
      norm ? 1.0f : 0.0f,
      norm ? 0.1f : 1.0f / std::sqrt(static_cast<float>(shape.back())));
  std::vector<float> values(count);
  for (float& v : values) v = normal(rng);
  if (name == "lm_head.weight") {
    for (float& v : values) v *= 8.0f;
  }
  return values;
}

struct QuantLayout {
  std::string name;
  TensorFormat kind;  // kQ8_0, or kQ4_K for the Q4_K_M mix
  int stages;
  std::string layer_split;
  int tp;
  std::string speculation;
  // --quantized-matmul of every worker and of the single-process engine.
  std::string quantized_matmul;
};

struct Continuation {
  std::vector<int32_t> ids;
  std::string text;
  std::vector<float> logprobs;  // of each generated token
};

// What the single-process engine (one shard, the file's own tokenizer)
// continues the prompt with.
Continuation SingleProcess(const std::string& path,
                           engine::QuantizedMatmul quantized_matmul) {
  Continuation out;
  auto weights = model::OpenModel(path);
  EXPECT_TRUE(weights.ok()) << weights.status();
  if (!weights.ok()) return out;
  auto spec = (*weights)->tokenizer_spec();
  EXPECT_TRUE(spec.ok()) << spec.status();
  if (!spec.ok()) return out;
  auto tokenizer = tokenizer::Tokenizer::Create(*spec);
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
  if (!tokenizer.ok()) return out;
  auto prompt = (*tokenizer)->Encode(kPrompt);
  EXPECT_TRUE(prompt.ok()) << prompt.status();
  if (!prompt.ok()) return out;
  auto engine = engine::testing_util::MakeEngine(**weights, {}, nullptr, 2,
                                                 quantized_matmul);
  if (engine == nullptr) return out;
  auto pool = engine::testing_util::MakePool(*engine, 16, 8);
  std::vector<std::vector<float>> step_logits;
  out.ids = engine::testing_util::GreedyGenerate(*engine, *pool, *prompt,
                                                 kMaxNew, 0, &step_logits);
  for (size_t i = 0; i < out.ids.size() && i < step_logits.size(); ++i) {
    const std::vector<float>& logits = step_logits[i];
    const double max = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (float v : logits) sum += std::exp(v - max);
    out.logprobs.push_back(
        static_cast<float>(logits[out.ids[i]] - max - std::log(sum)));
  }
  auto text = (*tokenizer)->Decode(out.ids);
  EXPECT_TRUE(text.ok()) << text.status();
  if (text.ok()) out.text = *text;
  return out;
}

class QuantClusterTest : public ::testing::TestWithParam<QuantLayout> {};

TEST_P(QuantClusterTest, GreedyTextAndIdsEqualTheSingleProcessEngine) {
  const QuantLayout& layout = GetParam();
  auto stories = model::OpenModel(testing::Stories260KGguf());
  ASSERT_TRUE(stories.ok()) << stories.status();
  auto vocabulary = (*stories)->tokenizer_spec();
  ASSERT_TRUE(vocabulary.ok()) << vocabulary.status();
  const model::ModelConfig config = QuantConfig(*vocabulary);

  const std::string dir = absl::StrCat(::testing::TempDir(), "/quant-cluster-",
                                       getpid(), "-", layout.name);
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/model.gguf";
  auto format_of = [&](const std::string& name) {
    if (name.find("norm") != std::string::npos) return TensorFormat::kF32;
    if (layout.kind == TensorFormat::kQ4_K) {
      return model::Q4KMFormatOf(config, name);
    }
    return layout.kind;
  };
  ASSERT_TRUE(
      model::WriteLlamaGguf(path, config, Values, format_of, &*vocabulary)
          .ok());

  auto quantized_matmul = engine::ParseQuantizedMatmul(layout.quantized_matmul);
  ASSERT_TRUE(quantized_matmul.ok()) << quantized_matmul.status();
  const Continuation want = SingleProcess(path, *quantized_matmul);
  ASSERT_FALSE(want.ids.empty());
  std::printf(
      "[ quant    ] %s: single process continues \"%s\" with %zu "
      "tokens: \"%s\"\n",
      layout.name.c_str(), kPrompt, want.ids.size(), want.text.c_str());

  LocalClusterOptions o;
  o.model_path = path;
  o.bin_dir = PDSERVE_BINARY_DIR;
  o.work_dir = dir + "/cluster";
  o.stages = layout.stages;
  o.layer_split = layout.layer_split;
  o.tp = layout.tp;
  o.speculation = layout.speculation;
  o.quantized_matmul = layout.quantized_matmul;
  o.draft_layers = 1;
  o.decode_blocks = 128;
  o.prefill_blocks = 64;
  o.refresh_ms = 100;
  absl::StatusOr<std::unique_ptr<LocalCluster>> cluster =
      LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();

  // gRPC with the prompt as text: the router's tokenizer (the file's
  // vocabulary), then token ids and text back.
  auto stub = v1::Generation::NewStub(grpc::CreateChannel(
      (*cluster)->grpc_address(), grpc::InsecureChannelCredentials()));
  v1::GenerateRequest request;
  request.set_text(kPrompt);
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
  EXPECT_EQ(ids, want.ids);
  EXPECT_EQ(text, want.text);
  if (layout.quantized_matmul == "exact") {
    // The workers honour --quantized-matmul: exact products across TP ranks
    // and stages differ from one process by f32 summation order (~1e-6),
    // while int8 activations would move these logprobs by ~1e-2.
    ASSERT_EQ(logprobs.size(), want.logprobs.size());
    for (size_t i = 0; i < logprobs.size(); ++i) {
      EXPECT_NEAR(logprobs[i], want.logprobs[i], 1e-3) << "token " << i;
    }
  }

  // The OpenAI completions endpoint, as a client would call it.
  const std::string http = (*cluster)->http_address();
  httplib::Client client(http.substr(0, http.rfind(':')),
                         std::stoi(http.substr(http.rfind(':') + 1)));
  client.set_read_timeout(120, 0);
  const nlohmann::json body = {
      {"prompt", kPrompt}, {"max_tokens", kMaxNew}, {"temperature", 0}};
  auto reply = client.Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(reply);
  ASSERT_EQ(reply->status, 200) << reply->body;
  EXPECT_EQ(nlohmann::json::parse(reply->body)["choices"][0]["text"],
            want.text);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, QuantClusterTest,
    ::testing::Values(
        // Q8_0: 2 prefill stages (1 + 1 layers), TP 2, n-gram speculation.
        QuantLayout{"q8_0", TensorFormat::kQ8_0, 2, "1,1", 2, "ngram", "int8"},
        // Q4_K_M: 2 stages, TP 2, draft-model speculation (the first
        // layer), exact products.
        QuantLayout{"q4_k_m", TensorFormat::kQ4_K, 2, "1,1", 2, "draft",
                    "exact"}),
    [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace pdserve
