// Runs the real `pdserve generate` binary the way README tells a person to.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "testing/golden.h"

namespace {

struct CommandResult {
  int exit_code = -1;
  std::string out;  // stdout and stderr
};

CommandResult RunPdserve(const std::string& args) {
  std::string command = std::string(PDSERVE_BINARY) + " " + args + " 2>&1";
  CommandResult result;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  std::array<char, 4096> buffer;
  size_t n;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0)
    result.out.append(buffer.data(), n);
  int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

std::string Quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

TEST(PdserveGenerateTest, StreamsGoldenTextForBothLayouts) {
  for (const std::string& model : {pdserve::testing::Stories260KDir(),
                                   pdserve::testing::Stories260KGguf()}) {
    for (const auto& golden : pdserve::testing::LoadGoldenCases()) {
      auto result =
          RunPdserve("generate --model " + Quote(model) + " --prompt " +
                     Quote(golden.prompt) + " --max-tokens " +
                     std::to_string(golden.max_new_tokens));
      ASSERT_EQ(result.exit_code, 0) << result.out;
      // The continuation follows the prompt; the golden text is the
      // continuation decoded on its own (no leading space).
      EXPECT_NE(result.out.find(golden.text), std::string::npos)
          << model << "\n"
          << result.out;
    }
  }
}

// For scripts: the generated ids alone, or one JSON object.
TEST(PdserveGenerateTest, IdsAndJsonOutputForScripts) {
  const auto golden = pdserve::testing::LoadGoldenCases().front();
  const std::string base =
      "generate --model " + Quote(pdserve::testing::Stories260KDir()) +
      " --prompt " + Quote(golden.prompt) + " --max-tokens " +
      std::to_string(golden.max_new_tokens);
  auto ids = RunPdserve(base + " --output ids 2>/dev/null");
  ASSERT_EQ(ids.exit_code, 0) << ids.out;
  std::vector<int32_t> parsed;
  std::istringstream in(ids.out);
  for (int32_t id; in >> id;) parsed.push_back(id);
  EXPECT_EQ(parsed, golden.greedy_ids) << ids.out;

  auto json_run = RunPdserve(base + " --output json 2>/dev/null");
  ASSERT_EQ(json_run.exit_code, 0) << json_run.out;
  const nlohmann::json out = nlohmann::json::parse(json_run.out);
  EXPECT_EQ(out["prompt_ids"].get<std::vector<int32_t>>(), golden.prompt_ids);
  EXPECT_EQ(out["ids"].get<std::vector<int32_t>>(), golden.greedy_ids);
  EXPECT_EQ(out["text"], golden.text);
  EXPECT_EQ(out["finish_reason"], "length");
  EXPECT_TRUE(out["tokens_per_second"].is_number());

  auto bad = RunPdserve(base + " --output yaml");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.out.find("--output must be text, ids or json"),
            std::string::npos)
      << bad.out;
}

TEST(PdserveGenerateTest, ClearErrorsForBadInput) {
  auto missing = RunPdserve("generate --model /nonexistent/model --prompt hi");
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.out.find("/nonexistent/model"), std::string::npos)
      << missing.out;

  std::string long_prompt;
  for (int i = 0; i < 600; ++i) long_prompt += "hello ";
  auto too_long = RunPdserve("generate --model " +
                             Quote(pdserve::testing::Stories260KDir()) +
                             " --prompt " + Quote(long_prompt));
  EXPECT_EQ(too_long.exit_code, 1);
  EXPECT_NE(too_long.out.find("context"), std::string::npos) << too_long.out;

  auto not_a_model =
      RunPdserve("generate --model " + Quote(pdserve::testing::ModelsDir()) +
                 " --prompt hi");
  EXPECT_EQ(not_a_model.exit_code, 1);

  auto bad_flag = RunPdserve("generate --model " +
                             Quote(pdserve::testing::Stories260KDir()) +
                             " --prompt hi --top-p 2");
  EXPECT_EQ(bad_flag.exit_code, 1);
  EXPECT_NE(bad_flag.out.find("top_p"), std::string::npos) << bad_flag.out;

  auto bad_matmul = RunPdserve("generate --model " +
                               Quote(pdserve::testing::Stories260KDir()) +
                               " --prompt hi --quantized-matmul f32");
  EXPECT_EQ(bad_matmul.exit_code, 1);
  EXPECT_NE(bad_matmul.out.find("unknown quantized matmul \"f32\" (expected "
                                "int8 or exact)"),
            std::string::npos)
      << bad_matmul.out;

  auto no_command = RunPdserve("frobnicate");
  EXPECT_EQ(no_command.exit_code, 2);
}

}  // namespace
