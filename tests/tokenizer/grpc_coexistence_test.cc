// A process that links gRPC's libprotobuf (every pdserve server) can still use
// the tokenizer: libsentencepiece's private protobuf copy stays inside the
// dlopen'ed shim (services/tokenizer/sentencepiece_backend.h).
#include <gtest/gtest.h>

#include "model/weight_source.h"
#include "pdserve/v1/generate.pb.h"
#include "testing/golden.h"
#include "tokenizer/tokenizer.h"

namespace pdserve::tokenizer {
namespace {

TEST(GrpcCoexistenceTest, ProtobufMessagesAndTokenizerInOneProcess) {
  pdserve::v1::GenerateRequest request;
  request.set_text("Once upon a time");
  request.set_max_tokens(8);
  std::string wire;
  ASSERT_TRUE(request.SerializeToString(&wire));
  pdserve::v1::GenerateRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(wire));

  for (bool gguf : {true, false}) {
    auto weights = gguf ? model::OpenModel(pdserve::testing::Stories260KGguf())
                        : model::OpenModel(pdserve::testing::Stories260KDir());
    ASSERT_TRUE(weights.ok()) << weights.status();
    auto tokenizer = LoadTokenizerForModel(**weights);
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    auto ids = (*tokenizer)->Encode(parsed.text());
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ(*ids, pdserve::testing::LoadGoldenCases()[0].prompt_ids);
  }
}

}  // namespace
}  // namespace pdserve::tokenizer
