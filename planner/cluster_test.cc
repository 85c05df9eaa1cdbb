#include "planner/cluster.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::planner {
namespace {

using ::testing::HasSubstr;

// 1000 bytes at 100 B/s (10 s of bandwidth) and 1 s per message.
constexpr Link kLink{100, 1};

TEST(ClusterTest, RingAllReduceByHand) {
  // 2 (n-1)/n x 10 s + 2 (n-1) x 1 s.
  EXPECT_DOUBLE_EQ(AllReduceSeconds(AllReduceAlgorithm::kRing, 1000, 2, kLink), 10 + 2);
  EXPECT_DOUBLE_EQ(AllReduceSeconds(AllReduceAlgorithm::kRing, 1000, 4, kLink), 15 + 6);
  EXPECT_DOUBLE_EQ(AllReduceSeconds(AllReduceAlgorithm::kRing, 1000, 64, kLink), 19.6875 + 126);
  EXPECT_DOUBLE_EQ(RingReduceScatterSeconds(1000, 4, kLink), 7.5 + 3);
}

TEST(ClusterTest, TreeAllReduceByHand) {
  // 2 x 10 s + 2 ceil(log2 n) x 1 s.
  EXPECT_DOUBLE_EQ(AllReduceSeconds(AllReduceAlgorithm::kTree, 1000, 2, kLink), 20 + 2);
  EXPECT_DOUBLE_EQ(AllReduceSeconds(AllReduceAlgorithm::kTree, 1000, 4, kLink), 20 + 4);
  EXPECT_DOUBLE_EQ(AllReduceSeconds(AllReduceAlgorithm::kTree, 1000, 5, kLink), 20 + 6);
  EXPECT_DOUBLE_EQ(AllReduceSeconds(AllReduceAlgorithm::kTree, 1000, 64, kLink), 20 + 12);
  // Latency-bound at 64 ranks: the tree beats the ring (32 s vs 145.7 s); bandwidth-bound
  // (no latency) the ring wins.
  EXPECT_DOUBLE_EQ(AllReduceSeconds(AllReduceAlgorithm::kTree, 1000, 64, Link{100, 0}), 20);
  EXPECT_DOUBLE_EQ(AllReduceSeconds(AllReduceAlgorithm::kRing, 1000, 64, Link{100, 0}), 19.6875);
}

TEST(ClusterTest, OneRankOrNoBytesCostsNothing) {
  for (AllReduceAlgorithm a : {AllReduceAlgorithm::kRing, AllReduceAlgorithm::kTree}) {
    EXPECT_EQ(AllReduceSeconds(a, 1000, 1, kLink), 0);
    EXPECT_EQ(AllReduceSeconds(a, 0, 8, kLink), 0);
  }
  EXPECT_EQ(RingReduceScatterSeconds(1000, 1, kLink), 0);
}

TEST(ClusterTest, ParsesAlgorithms) {
  EXPECT_EQ(*ParseAllReduceAlgorithm("ring"), AllReduceAlgorithm::kRing);
  EXPECT_EQ(*ParseAllReduceAlgorithm("tree"), AllReduceAlgorithm::kTree);
  EXPECT_EQ(AllReduceAlgorithmName(AllReduceAlgorithm::kTree), "tree");
  absl::StatusOr<AllReduceAlgorithm> bad = ParseAllReduceAlgorithm("butterfly");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("use ring or tree"));
}

// Scale-up: 8 B/s and 0.5 s per message. Scale-out: 8 B/s (64e-9 Gb/s), 1 s per message.
HardwareModel Toy() {
  HardwareModel hw;
  hw.name = "toy";
  hw.hidden = 4;
  hw.expert_intermediate = 8;
  hw.gemm_flops_per_s = 192;
  hw.a2a_bytes_per_s = 8;
  hw.a2a_latency_s = 0.5;
  hw.fanout.egress_bytes_per_s = 8;
  hw.fanout.latency_s = 0.5;
  hw.fanout.chunk_bytes = 8;
  return hw;
}

ClusterModel ToyCluster(int domains, AllReduceAlgorithm algorithm) {
  ClusterModel m;
  m.domains = domains;
  m.allreduce = algorithm;
  m.scaleout_gbps = 64e-9;
  m.scaleout_efficiency = 1;
  m.scaleout_latency_s = 1;
  m.dense_params = 64;    // 128 bytes
  m.expert_params = 128;  // 256 bytes, 64 per GPU at G = 4
  m.moe_layers = 4;
  m.microbatches_per_step = 2;
  m.gradient_bytes_per_param = 2;
  return m;
}

TEST(ClusterTest, GradientReduceByHand) {
  // Dense, 128 bytes inside a domain of 4: reduce-scatter 3/4 x 128 / 8 + 3 x 0.5 = 13.5 s,
  // and the all-gather as much: 27 s, whatever D is.
  const GradientReduce one = GradientReduceTime(ToyCluster(1, AllReduceAlgorithm::kRing), Toy(), 4);
  EXPECT_DOUBLE_EQ(one.dense_scaleup_s, 27);
  EXPECT_DOUBLE_EQ(one.dense_scaleout_s, 0);
  EXPECT_DOUBLE_EQ(one.expert_scaleout_s, 0);
  EXPECT_DOUBLE_EQ(one.total_s, 27);

  // D = 2, ring: the dense shard (32 bytes) 2 x (1/2 x 32/8 + 1) = 6 s; the expert shard
  // (64 bytes) 2 x (1/2 x 64/8 + 1) = 10 s.
  const GradientReduce ring =
      GradientReduceTime(ToyCluster(2, AllReduceAlgorithm::kRing), Toy(), 4);
  EXPECT_DOUBLE_EQ(ring.dense_scaleout_s, 6);
  EXPECT_DOUBLE_EQ(ring.expert_scaleout_s, 10);
  EXPECT_DOUBLE_EQ(ring.total_s, 27 + 6 + 10);

  // Tree: 2 x 32/8 + 2 x 1 = 10 s and 2 x 64/8 + 2 = 18 s.
  const GradientReduce tree =
      GradientReduceTime(ToyCluster(2, AllReduceAlgorithm::kTree), Toy(), 4);
  EXPECT_DOUBLE_EQ(tree.dense_scaleout_s, 10);
  EXPECT_DOUBLE_EQ(tree.expert_scaleout_s, 18);
  EXPECT_DOUBLE_EQ(tree.total_s, 27 + 10 + 18);
}

TEST(ClusterTest, DefaultScaleOutIs400GbAt80Percent) {
  const ClusterModel m;
  EXPECT_DOUBLE_EQ(m.scaleout().bytes_per_s, 40e9);
  EXPECT_TRUE(m.Validate().ok());
}

LayerTime ToyLayer() {
  LayerTime t;
  t.dispatch_s = 1;
  t.combine_s = 1;
  t.compute_s = 2;
  t.exposed_fanout_s = 0.5;
  t.replacement_s = 0.25;
  t.total_s = 4.75;
  return t;
}

TEST(ClusterTest, BackwardByHand) {
  // 1 + 1 all-to-all, 2 x 2 compute, 0.5 replica gradients back; no re-placement.
  EXPECT_DOUBLE_EQ(BackwardSeconds(ToyLayer()), 6.5);
}

TEST(ClusterTest, StepOfDomainByHand) {
  // 2 simulated layers stand for the model's 4 (x2). Per microbatch: forward 2 x 4.75 x 2
  // = 19 s, backward 2 x 6.5 x 2 = 26 s, dense 6 x 16 params / 192 FLOP/s = 0.5 s per token
  // x 10 tokens = 5 s. Two microbatches.
  ClusterModel m = ToyCluster(1, AllReduceAlgorithm::kRing);
  m.dense_params = 16;
  const MicrobatchLayers mb{{ToyLayer(), ToyLayer()}, 10};
  const StepTime s = StepOfDomain({mb, mb}, m, Toy());
  EXPECT_DOUBLE_EQ(s.moe_forward_s, 38);
  EXPECT_DOUBLE_EQ(s.moe_backward_s, 52);
  EXPECT_DOUBLE_EQ(s.dense_s, 10);
  EXPECT_DOUBLE_EQ(s.compute_s, 100);
  EXPECT_DOUBLE_EQ(s.total_s, 100);
  EXPECT_DOUBLE_EQ(s.last_backward_s, 26 + 5 * 2.0 / 3.0);
  // The parts: compute 3 x 2 per layer, all-to-all 2 x 2, balancing 2 x 0.5 + 0.25; each
  // x 2 layers x 2 (scale) x 2 microbatches.
  EXPECT_DOUBLE_EQ(s.moe_compute_s, 48);
  EXPECT_DOUBLE_EQ(s.moe_a2a_s, 32);
  EXPECT_DOUBLE_EQ(s.balancing_s, 10);
  EXPECT_DOUBLE_EQ(s.moe_compute_s + s.moe_a2a_s + s.balancing_s + s.dense_s, s.compute_s);
}

TEST(ClusterTest, JobStepTakesTheSlowestDomainAndExposesTheAllReduceTail) {
  const ClusterModel m = ToyCluster(2, AllReduceAlgorithm::kRing);  // 4 MoE layers
  StepTime fast, slow;
  fast.compute_s = 90;
  fast.last_backward_s = 50;
  slow.compute_s = 100;
  slow.last_backward_s = 29;
  GradientReduce reduce;
  reduce.total_s = 43;
  // 43 s of all-reduce behind the slowest domain's 29 s last backward: 14 s exposed.
  StepTime s = JobStep({fast, slow}, reduce, m);
  EXPECT_DOUBLE_EQ(s.compute_s, 100);
  EXPECT_DOUBLE_EQ(s.allreduce_s, 43);
  EXPECT_DOUBLE_EQ(s.exposed_allreduce_s, 14);
  EXPECT_DOUBLE_EQ(s.total_s, 114);
  // Hidden but for the last layer's bucket: 20 / 4 = 5 s.
  reduce.total_s = 20;
  s = JobStep({fast, slow}, reduce, m);
  EXPECT_DOUBLE_EQ(s.exposed_allreduce_s, 5);
  EXPECT_DOUBLE_EQ(s.total_s, 105);
  // Nothing to reduce.
  reduce.total_s = 0;
  EXPECT_DOUBLE_EQ(JobStep({fast, slow}, reduce, m).total_s, 100);
}

TEST(ClusterTest, ValidateNamesTheField) {
  struct Case {
    void (*change)(ClusterModel&);
    std::string field;
  };
  const std::vector<Case> cases = {
      {[](ClusterModel& m) { m.domains = 0; }, "domains"},
      {[](ClusterModel& m) { m.scaleout_gbps = 0; }, "scaleout_gbps"},
      {[](ClusterModel& m) { m.scaleout_efficiency = 1.5; }, "scaleout_efficiency"},
      {[](ClusterModel& m) { m.scaleout_latency_s = -1; }, "scaleout_latency_s"},
      {[](ClusterModel& m) { m.dense_params = -1; }, "dense_params"},
      {[](ClusterModel& m) { m.expert_params = -1; }, "expert_params"},
      {[](ClusterModel& m) { m.moe_layers = 0; }, "moe_layers"},
      {[](ClusterModel& m) { m.microbatches_per_step = 0; }, "microbatches_per_step"},
  };
  for (const Case& c : cases) {
    ClusterModel m;
    c.change(m);
    absl::Status s = m.Validate();
    EXPECT_FALSE(s.ok()) << c.field;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.field));
  }
}

TEST(ClusterTest, DomainZeroKeepsTheSeed) {
  EXPECT_EQ(DomainSeed(7, 0), 7u);
  EXPECT_NE(DomainSeed(7, 1), 7u);
  EXPECT_NE(DomainSeed(7, 1), DomainSeed(7, 2));
  EXPECT_NE(DomainSeed(7, 1), DomainSeed(8, 1));
}

}  // namespace
}  // namespace rackrun::planner
