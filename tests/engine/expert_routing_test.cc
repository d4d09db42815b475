// Top-k routing: the softmax, the choice, the tie rule (the lower expert
// index first, as torch.topk on the CPU) and the two weightings.
#include "engine/expert_routing.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace pdserve::engine {
namespace {

struct Route {
  std::vector<int32_t> experts;
  std::vector<float> weights;
};

Route RouteOf(const std::vector<float>& logits, int k, bool normalize) {
  Route r{std::vector<int32_t>(k), std::vector<float>(k)};
  RouteToken(logits.data(), static_cast<int>(logits.size()), k, normalize,
             r.experts.data(), r.weights.data());
  return r;
}

TEST(ExpertRoutingTest, PicksTheMostProbableExpertsMostProbableFirst) {
  const Route r = RouteOf({0.5f, 3.0f, -1.0f, 2.0f, 2.5f}, 3, false);
  EXPECT_EQ(r.experts, (std::vector<int32_t>{1, 4, 3}));
  // Unnormalised: the softmax over all five experts.
  double sum = 0;
  for (float l : {0.5f, 3.0f, -1.0f, 2.0f, 2.5f}) sum += std::exp(l);
  EXPECT_NEAR(r.weights[0], std::exp(3.0) / sum, 1e-7);
  EXPECT_NEAR(r.weights[1], std::exp(2.5) / sum, 1e-7);
  EXPECT_NEAR(r.weights[2], std::exp(2.0) / sum, 1e-7);
}

TEST(ExpertRoutingTest, NormalizedWeightsSumToOne) {
  const Route r = RouteOf({0.5f, 3.0f, -1.0f, 2.0f, 2.5f}, 2, true);
  EXPECT_EQ(r.experts, (std::vector<int32_t>{1, 4}));
  EXPECT_NEAR(r.weights[0] + r.weights[1], 1.0, 1e-7);
  EXPECT_NEAR(r.weights[0] / r.weights[1], std::exp(0.5), 1e-6);
}

TEST(ExpertRoutingTest, TiesGoToTheLowerExpertIndex) {
  // All equal: experts 0..k-1.
  EXPECT_EQ(RouteOf(std::vector<float>(8, 0.25f), 3, true).experts,
            (std::vector<int32_t>{0, 1, 2}));
  // A tie at the cut: 2 and 5 share the second place, 2 wins.
  EXPECT_EQ(RouteOf({0.0f, 4.0f, 1.0f, 0.0f, 0.0f, 1.0f}, 2, false).experts,
            (std::vector<int32_t>{1, 2}));
  // A tie at the top keeps index order inside the chosen set too.
  EXPECT_EQ(RouteOf({1.0f, 0.0f, 7.0f, 7.0f}, 3, false).experts,
            (std::vector<int32_t>{2, 3, 0}));
}

TEST(ExpertRoutingTest, AllExpertsChosenWhenKIsTheCount) {
  const Route r = RouteOf({1.0f, 2.0f, 3.0f}, 3, false);
  EXPECT_EQ(r.experts, (std::vector<int32_t>{2, 1, 0}));
  EXPECT_NEAR(r.weights[0] + r.weights[1] + r.weights[2], 1.0, 1e-7);
}

}  // namespace
}  // namespace pdserve::engine
