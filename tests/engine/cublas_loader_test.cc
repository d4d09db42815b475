// cuBLAS is loaded when the first CUDA engine starts, not at process start:
// this binary links the whole engine (CUDA backend included) and has no
// cuBLAS mapped until it asks for it. Needs no GPU: loading the library and
// resolving its entry points touch no device.
#include "engine_cuda/cublas_loader.h"

#include "gtest/gtest.h"

namespace pdserve::engine::cuda {
namespace {

TEST(CublasLoaderTest, LinkingTheEngineLoadsNoCublasUntilTheFirstCudaEngine) {
  EXPECT_FALSE(CublasMapped())
      << "cuBLAS was mapped before any CUDA engine asked for it: something "
         "links it again (its static initialisers then run in every "
         "process)";
  absl::StatusOr<const CublasApi*> api = LoadCublas();
  ASSERT_TRUE(api.ok()) << api.status();
  EXPECT_TRUE(CublasMapped());
  EXPECT_NE((*api)->create, nullptr);
  EXPECT_NE((*api)->destroy, nullptr);
  EXPECT_NE((*api)->set_stream, nullptr);
  EXPECT_NE((*api)->set_workspace, nullptr);
  EXPECT_NE((*api)->gemm_ex, nullptr);
  // Loaded once: the same table again.
  absl::StatusOr<const CublasApi*> again = LoadCublas();
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, *api);
}

}  // namespace
}  // namespace pdserve::engine::cuda
